//! Rank 0's coordinator table: uncached requests, counted per name until every rank that has
//! not joined asked, then validated into a response (or an error response naming what
//! differed and which ranks sent what). Pure: the same calls give the same responses.
//!
//! The engine of a process set numbers its members `0..n`; its table knows their world ranks
//! and names those in errors, so a user reads the ranks they launched.

use std::collections::HashMap;
use std::sync::Arc;

use fh_core::message::{validate, CollectiveKind, NegotiationError, Request, Response, Signature};
use fh_core::ReduceOp;

/// Rank 0's table of uncached requests.
#[derive(Default)]
pub(crate) struct Table {
    order: Vec<Arc<str>>,
    reqs: HashMap<Arc<str>, Vec<Request>>,
    /// The world rank of each rank of this engine (a process set's members), if it is not
    /// the world's own engine.
    world_ranks: Option<Arc<[usize]>>,
}

impl Table {
    /// A table whose errors name rank `r` as `world_ranks[r]` (none: as `r`).
    pub(crate) fn with_world_ranks(world_ranks: Option<Arc<[usize]>>) -> Self {
        Table {
            world_ranks,
            ..Table::default()
        }
    }

    /// How errors name this engine's rank `r`.
    fn world_rank(&self, r: usize) -> usize {
        self.world_ranks
            .as_ref()
            .and_then(|w| w.get(r).copied())
            .unwrap_or(r)
    }

    pub(crate) fn add(&mut self, r: Request) {
        let v = self.reqs.entry(r.name.clone()).or_default();
        if v.is_empty() {
            self.order.push(r.name.clone());
        }
        if !v.iter().any(|x| x.rank == r.rank) {
            v.push(r);
        }
    }

    /// Responses for every name all non-joined ranks have requested, in first-seen order.
    pub(crate) fn take_ready(&mut self, joined: &[bool]) -> Vec<Response> {
        let needed = joined.iter().filter(|j| !**j).count();
        let joined_ranks: Vec<usize> = (0..joined.len())
            .filter(|&r| joined[r])
            .map(|r| self.world_rank(r))
            .collect();
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for name in std::mem::take(&mut self.order) {
            // With every rank joined nobody would run the collective: keep waiting.
            let complete = needed > 0
                && self.reqs.get(&name).is_some_and(|v| {
                    v.iter()
                        .filter(|r| !joined.get(r.rank as usize).copied().unwrap_or(false))
                        .count()
                        >= needed
                });
            if !complete {
                keep.push(name);
                continue;
            }
            let Some(reqs) = self.reqs.remove(&name) else {
                continue;
            };
            if let Some(mut resp) = validate(&reqs) {
                if self.world_ranks.is_some() {
                    resp.error = resp.error.map(|e| {
                        e.map_ranks(|r| u32::try_from(self.world_rank(r as usize)).unwrap_or(r))
                    });
                }
                if resp.error.is_none() {
                    resp.error = refused_while_joined(&resp.sig, &joined_ranks);
                }
                out.push(resp);
            }
        }
        self.order = keep;
        out
    }
}

/// Whether a joined rank's zeros give the right result for `op` (Sum, and Average, which
/// divides by every rank, joined ones included, as Horovod does).
fn joins_with_zeros(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Sum | ReduceOp::Average)
}

/// Why a collective of signature `sig` cannot run while the ranks `joined_ranks` (as errors
/// name them) have joined, or `None` when it can (or nobody has joined).
///
/// Horovod's rules: an allreduce goes on, each joined rank contributing zeros (an average
/// divides by every rank); broadcast, allgather, alltoall and reducescatter are refused. Where
/// Horovod would let a joined rank's zeros take part in a Min, Max or Product (a zero would
/// silently win or annul the result), the collective is refused too. A barrier waits for every
/// rank, so it cannot complete while one has joined: refused as well.
pub(crate) fn refused_while_joined(
    sig: &Signature,
    joined_ranks: &[usize],
) -> Option<NegotiationError> {
    if joined_ranks.is_empty() {
        return None;
    }
    if sig.kind != CollectiveKind::Allreduce {
        return Some(NegotiationError::Other(format!(
            "{} is not supported while ranks {joined_ranks:?} have joined (as in Horovod, only \
             allreduce goes on after a join, the joined ranks contributing zeros): run it \
             before hvd.join()",
            sig.kind
        )));
    }
    if !joins_with_zeros(sig.op) {
        return Some(NegotiationError::Other(format!(
            "allreduce with op {} is not supported while ranks {joined_ranks:?} have joined: \
             joined ranks contribute zeros, which only Sum and Average allow (a zero would take \
             part in the {}); reduce before hvd.join()",
            sig.op, sig.op
        )));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use fh_core::message::Device;
    use fh_core::DType;

    fn req(name: &str, rank: u32, len: u64, op: ReduceOp) -> Request {
        Request {
            name: name.into(),
            rank,
            sig: Signature {
                kind: CollectiveKind::Allreduce,
                dtype: DType::F32,
                shape: vec![len],
                device: Device::Cpu,
                op,
                root: 0,
                prescale: 1.0,
                postscale: 1.0,
            },
            priority: 0,
            group: None,
        }
    }

    #[test]
    fn a_name_is_ready_once_every_active_rank_asked_in_first_seen_order() {
        let mut t = Table::default();
        t.add(req("b", 1, 4, ReduceOp::Sum));
        t.add(req("a", 0, 4, ReduceOp::Sum));
        t.add(req("b", 1, 4, ReduceOp::Sum)); // repeated: counted once
        assert!(t.take_ready(&[false; 2]).is_empty());
        t.add(req("a", 1, 4, ReduceOp::Sum));
        t.add(req("b", 0, 5, ReduceOp::Sum));
        let r = t.take_ready(&[false; 2]);
        let names: Vec<&str> = r.iter().map(|r| &*r.name).collect();
        assert_eq!(names, ["b", "a"]);
        assert!(r[0]
            .error
            .as_ref()
            .unwrap()
            .to_string()
            .contains("tensor shapes"));
        assert!(r[1].error.is_none());
        assert!(t.take_ready(&[false; 2]).is_empty());
    }

    #[test]
    fn a_process_sets_table_names_world_ranks() {
        let mut t = Table::with_world_ranks(Some(Arc::from([1usize, 4, 6].as_slice())));
        t.add(req("w", 0, 4, ReduceOp::Sum));
        t.add(req("w", 1, 5, ReduceOp::Sum));
        t.add(req("w", 2, 4, ReduceOp::Sum));
        let r = t.take_ready(&[false; 3]);
        assert_eq!(
            r[0].error.as_ref().unwrap().to_string(),
            "Mismatched allreduce tensor shapes: rank 4 sent [5]; ranks 1 and 6 sent [4]"
        );
        t.add(req("m", 0, 4, ReduceOp::Max));
        t.add(req("m", 1, 4, ReduceOp::Max));
        let r = t.take_ready(&[false, false, true]);
        assert!(
            r[0].error
                .as_ref()
                .unwrap()
                .to_string()
                .contains("ranks [6]"),
            "{:?}",
            r[0].error
        );
    }

    #[test]
    fn joined_ranks_are_not_waited_for_but_restrict_the_ops() {
        let mut t = Table::default();
        t.add(req("s", 0, 4, ReduceOp::Sum));
        t.add(req("m", 0, 4, ReduceOp::Max));
        let r = t.take_ready(&[false, true]);
        assert_eq!(r.len(), 2);
        assert!(r[0].error.is_none());
        assert!(r[1]
            .error
            .as_ref()
            .unwrap()
            .to_string()
            .contains("only Sum and Average"));
        // Everybody joined: nobody would run it, keep waiting.
        t.add(req("x", 0, 4, ReduceOp::Sum));
        assert!(t.take_ready(&[true, true]).is_empty());
    }
}
