//! What this rank submitted and the control thread has not dispatched yet, in one owner with one
//! exit path ([`Waiting::fail_all`]): pending entries, join waiters, grouped members held until
//! their group is ready and the groups that failed. Work taken out of it for a round is held by
//! [`crate::shared::Resolver`]s, which resolve their handles on every path of their own. ("In
//! flight", in this crate, means only a name submitted and not completed:
//! `shared::Inner::in_flight`.)

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use fh_core::message::Response;

use crate::shared::{Entry, Resolver};
use crate::SchedulerError;

/// Where a pending entry stands in negotiation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Announce {
    /// Not yet sent to the coordinator.
    New,
    /// Sent to the coordinator; waiting for the response.
    Sent,
    /// Ready everywhere, held until the rest of its group is ready.
    Held,
}

/// A submission waiting to be negotiated and run.
pub(super) struct Pending {
    pub(super) entry: Entry,
    pub(super) state: Announce,
    /// Already in a readiness report to rank 0 (timeline).
    pub(super) reported: bool,
}

/// The control thread's undispatched work (see the module).
#[derive(Default)]
pub(super) struct Waiting {
    /// Submissions not yet dispatched, by arrival.
    pub(super) pending: BTreeMap<u64, Pending>,
    pub(super) by_name: HashMap<Arc<str>, u64>,
    pub(super) seq: u64,
    /// Waiting for every rank to join.
    pub(super) join_cells: Vec<Resolver>,
    /// Members of grouped submissions ready everywhere, waiting for the rest of their group.
    pub(super) held: BTreeMap<String, Vec<Arc<Response>>>,
    /// Groups with a failed member: the error and the members still to come.
    pub(super) failed_groups: HashMap<String, (SchedulerError, u32)>,
}

impl Waiting {
    /// Accept a submission.
    pub(super) fn add(&mut self, entry: Entry) {
        self.seq += 1;
        self.by_name.insert(Arc::clone(&entry.req.name), self.seq);
        self.pending.insert(
            self.seq,
            Pending {
                entry,
                state: Announce::New,
                reported: false,
            },
        );
    }

    /// The exit path: every submission and join waiter still here fails with `err`.
    pub(super) fn fail_all(&mut self, err: &SchedulerError) {
        for (_, p) in std::mem::take(&mut self.pending) {
            p.entry.cell.resolve(Err(err.clone()));
        }
        for c in self.join_cells.drain(..) {
            c.resolve(Err(err.clone()));
        }
        self.by_name.clear();
        self.held.clear();
        self.failed_groups.clear();
    }
}
