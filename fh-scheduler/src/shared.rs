//! State shared by the public API (engine), the control thread (control) and the channel
//! workers (exec): submissions on their way in, the gate that closes on shutdown, counters,
//! reports and the timeline. It imports none of those modules, so they form no cycle.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use crossbeam_channel::Sender;
use fh_core::message::Request;

use crate::handle::{Completion, OpResult};
use crate::stats::{Counters, GroupRecord, StallReport};
use crate::timeline::Timeline;
use crate::{Config, SchedulerError, Tensor};

/// A submitted operation before negotiation.
pub(crate) struct Entry {
    pub req: Request,
    pub tensor: Tensor,
    pub splits: Option<Vec<usize>>,
    pub cell: Arc<Completion>,
    pub submitted: Instant,
}

pub(crate) enum Msg {
    Submit(Box<Entry>),
    Join(Arc<Completion>),
    Shutdown,
    Wake,
}

pub(crate) struct Gate {
    pub(crate) closed: Option<SchedulerError>,
    pub(crate) tx: Sender<Msg>,
}

/// State shared by the public API, the control thread and the channel workers.
pub(crate) struct Inner {
    pub rank: usize,
    pub size: usize,
    /// Each rank's world rank, for an engine over a process set (errors name world ranks).
    pub world_ranks: Option<Arc<[usize]>>,
    /// The pacing policy (back-pressure) this world runs under, resolved once at start-up
    /// from the configuration, the world size and the data channels' wire (agreed).
    pub pacing: fh_core::fusion::Pacing,
    pub config: Config,
    pub(crate) gate: Mutex<Gate>,
    /// Names submitted and not yet finished (shared with their requests: no copies).
    pub(crate) in_flight: Mutex<HashSet<Arc<str>>>,
    pub counters: Counters,
    pub(crate) stalls: Mutex<Vec<StallReport>>,
    pub(crate) barrier_seq: AtomicU64,
    pub(crate) groups: Mutex<Vec<GroupRecord>>,
    pub(crate) timeline: RwLock<Option<Arc<Timeline>>>,
    /// The GPU path: the device the channels drive, or why there is none.
    pub(crate) gpu: crate::gpu::GpuState,
    /// The control thread is deferring a round under back-pressure: a channel that drains
    /// wakes it ([`Inner::channel_drained`]).
    pub(crate) pacing_wait: AtomicBool,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    /// The timeline being written, if any (rank 0 only).
    pub(crate) fn timeline(&self) -> Option<Arc<Timeline>> {
        self.timeline
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Put `t` in place of the timeline being written and return the one it replaces (for
    /// the caller to [`Timeline::finish`]).
    pub(crate) fn replace_timeline(&self, t: Option<Arc<Timeline>>) -> Option<Arc<Timeline>> {
        std::mem::replace(
            &mut *self.timeline.write().unwrap_or_else(|p| p.into_inner()),
            t,
        )
    }

    /// Drop the timeline `t` if it is still the one being written (it ended on a write
    /// error); a timeline started meanwhile stays.
    pub(crate) fn clear_timeline_if(&self, t: &Arc<Timeline>) {
        let mut cur = self.timeline.write().unwrap_or_else(|p| p.into_inner());
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, t)) {
            *cur = None;
        }
    }

    /// Stop writing the timeline, if one is written: drain its queue, close the file and
    /// join its writer (bounded by [`crate::timeline::STOP_WAIT`]).
    pub(crate) fn finish_timeline(&self) {
        if let Some(t) = self.replace_timeline(None) {
            t.finish(crate::timeline::STOP_WAIT);
        }
    }

    /// The reason the engine stopped, if it has.
    pub(crate) fn failure(&self) -> Option<SchedulerError> {
        lock(&self.gate).closed.clone()
    }

    /// Stop the engine with `err` (first reason wins) and wake the control thread.
    pub(crate) fn fail(&self, err: SchedulerError) {
        let mut g = lock(&self.gate);
        if g.closed.is_none() {
            g.closed = Some(err);
        }
        let _ = g.tx.send(Msg::Wake);
    }

    /// A channel has just finished all its queued work: wake the control thread if it defers
    /// a round until a channel is free.
    pub(crate) fn channel_drained(&self) {
        // Pairs with the fence in the control thread's pacing wait: either it sees this
        // channel's drained counter, or this sees its announcement and wakes it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.pacing_wait.swap(false, Ordering::SeqCst) {
            let _ = lock(&self.gate).tx.send(Msg::Wake);
        }
    }

    /// Deliver a result: the name leaves the in-flight set first, so that it can be submitted
    /// again as soon as the caller has the result.
    pub(crate) fn finish(&self, name: &str, cell: &Completion, result: OpResult) {
        lock(&self.in_flight).remove(name);
        Counters::add(&self.counters.completed, 1);
        cell.complete(result);
    }

    pub(crate) fn record_stall(&self, r: StallReport) {
        Counters::add(&self.counters.stall_warnings, 1);
        lock(&self.stalls).push(r);
    }

    pub(crate) fn record_group(&self, g: GroupRecord) {
        lock(&self.groups).push(g);
    }

    /// Submit entries atomically: either every one is accepted (in order) or none is, so that
    /// a refused member of a grouped submission leaves no other member in flight.
    pub(crate) fn submit(&self, entries: Vec<Entry>) -> Result<(), SchedulerError> {
        let g = lock(&self.gate);
        if let Some(e) = &g.closed {
            return Err(e.clone());
        }
        let mut in_flight = lock(&self.in_flight);
        for (i, e) in entries.iter().enumerate() {
            let name = &e.req.name;
            if in_flight.contains(name) || entries[..i].iter().any(|o| &o.req.name == name) {
                return Err(SchedulerError::DuplicateName {
                    name: name.to_string(),
                });
            }
        }
        for e in &entries {
            in_flight.insert(Arc::clone(&e.req.name));
        }
        drop(in_flight);
        // The names to withdraw should the control thread be gone (kept aside only for a
        // grouped submission: a single entry comes back with the failed send).
        let names: Vec<Arc<str>> = if entries.len() > 1 {
            entries.iter().map(|e| Arc::clone(&e.req.name)).collect()
        } else {
            Vec::new()
        };
        for e in entries {
            if let Err(failed) = g.tx.send(Msg::Submit(Box::new(e))) {
                // The control thread is gone: nothing sent will ever run.
                let mut in_flight = lock(&self.in_flight);
                if let Msg::Submit(e) = failed.0 {
                    in_flight.remove(&*e.req.name);
                }
                for n in &names {
                    in_flight.remove(&**n);
                }
                return Err(SchedulerError::ShutDown {
                    reason: "the control thread is gone".into(),
                });
            }
        }
        Ok(())
    }

    pub(crate) fn send(&self, msg: Msg) -> Result<(), SchedulerError> {
        let g = lock(&self.gate);
        if let Some(e) = &g.closed {
            return Err(e.clone());
        }
        g.tx.send(msg).map_err(|_| SchedulerError::ShutDown {
            reason: "the control thread is gone".into(),
        })
    }

    /// Close the gate (no more submissions) and return whether it was open.
    pub(crate) fn close(&self, err: SchedulerError) {
        let mut g = lock(&self.gate);
        if g.closed.is_none() {
            g.closed = Some(err);
        }
    }
}
