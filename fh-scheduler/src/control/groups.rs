//! Grouped submissions: members wait until the whole group is agreed ready, and fail
//! together.

use std::sync::Arc;

use fh_core::message::{GroupTag, Response};

use crate::SchedulerError;

use super::waiting::Announce;
use super::Control;

impl Control {
    pub(super) fn fail_name(&mut self, name: &str, err: SchedulerError) {
        if let Some(p) = self
            .work
            .by_name
            .remove(name)
            .and_then(|seq| self.work.pending.remove(&seq))
        {
            p.entry.cell.resolve(Err(err));
        }
    }

    /// A member of `g` failed: fail the members already held, and remember the group so that
    /// the members still to come fail too.
    pub(super) fn fail_group(&mut self, g: &GroupTag, err: SchedulerError) {
        let held = self.work.held.remove(&g.name).unwrap_or_default();
        let seen = match self.work.failed_groups.get(&g.name) {
            Some(_) => 0,
            None => 1 + held.len() as u32,
        };
        let reason = format!("another member of group '{}' failed: {err}", g.name);
        for r in held {
            self.fail_name(
                &r.name,
                SchedulerError::Negotiation {
                    name: r.name.to_string(),
                    reason: reason.clone(),
                },
            );
        }
        let entry = self
            .work
            .failed_groups
            .entry(g.name.clone())
            .or_insert((err, g.size));
        entry.1 = entry.1.saturating_sub(seen.max(1));
        if entry.1 == 0 {
            self.work.failed_groups.remove(&g.name);
        }
    }

    /// Hold grouped members until their whole group is ready; release complete groups in
    /// member order. Deterministic: the same on every rank.
    pub(super) fn release_groups(&mut self, ready: Vec<Arc<Response>>) -> Vec<Arc<Response>> {
        let mut out = Vec::with_capacity(ready.len());
        for r in ready {
            let Some(g) = r.group.clone() else {
                out.push(r);
                continue;
            };
            if let Some((err, left)) = self.work.failed_groups.get_mut(&g.name) {
                let reason = format!("another member of group '{}' failed: {err}", g.name);
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.work.failed_groups.remove(&g.name);
                }
                self.fail_name(
                    &r.name,
                    SchedulerError::Negotiation {
                        name: r.name.to_string(),
                        reason,
                    },
                );
                continue;
            }
            if let Some(p) = self
                .work
                .by_name
                .get(&*r.name)
                .and_then(|s| self.work.pending.get_mut(s))
            {
                p.state = Announce::Held;
            }
            let members = self.work.held.entry(g.name.clone()).or_default();
            if members.iter().any(|m| m.name == r.name) {
                continue;
            }
            members.push(r);
            if members.len() as u32 >= g.size {
                let mut members = self.work.held.remove(&g.name).unwrap_or_default();
                members.sort_by_key(|m| m.group.as_ref().map_or(0, |t| t.index));
                out.extend(members);
            }
        }
        out
    }
}
