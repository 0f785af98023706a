//! A collective round of the shared-memory communicator: taking a slot buffer, posting into it,
//! reading the peers' round words and metadata (see *Protocol* in the parent module).

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use super::{first_blocker, reached, tag_name, ShmComm};
use crate::{Result, TransportError};

impl ShmComm {
    // ----- rounds -----

    /// Start a round in which this rank writes its slot: wait until every rank has consumed
    /// the round that last used the same buffer. Returns (round, buffer).
    pub(super) fn begin_round(&self, op: &'static str) -> Result<(u32, usize)> {
        let k = self.round;
        let nbuf = self.seg.layout.nbuf;
        let target = k.wrapping_add(1).wrapping_sub(nbuf as u32);
        self.wait(op, || {
            for j in 0..self.size {
                if !reached(self.consumed(j)?, target) {
                    return Ok(Some(j));
                }
            }
            Ok(None)
        })?;
        Ok((k, k as usize % nbuf))
    }

    pub(super) fn post(&self, k: u32, b: usize, meta: &[u64]) {
        for (w, &v) in meta.iter().enumerate() {
            self.seg.meta(self.rank, b, w).store(v, Relaxed);
        }
        self.seg
            .ctl(self.rank)
            .posted
            .word
            .store(k.wrapping_add(1), Release);
        self.notify_others();
    }

    pub(super) fn finish_round(&mut self, k: u32) {
        self.seg
            .ctl(self.rank)
            .consumed
            .word
            .store(k.wrapping_add(1), Release);
        self.notify_others();
        self.round = k.wrapping_add(1);
    }

    /// Rank `j`'s round counter `name` (`word`, written only by rank `j`), read from shared
    /// memory and checked against this rank's round: no rank gets more than `nbuf` rounds
    /// ahead of another (nor, by its `consumed` counter, behind), so a counter outside that
    /// window is an error naming rank `j`.
    pub(super) fn round_word(
        &self,
        j: usize,
        word: &AtomicU32,
        name: &str,
        lags: bool,
    ) -> Result<u32> {
        let v = word.load(Acquire);
        let ahead = i64::from(v.wrapping_sub(self.round) as i32);
        let nbuf = self.seg.layout.nbuf as i64;
        if ahead > nbuf || (!lags && ahead < -nbuf) {
            return Err(TransportError::Protocol {
                rank: j,
                detail: format!(
                    "rank {j}'s {name} round counter reads {v} while rank {} is in round {}, \
                     more than {nbuf} rounds apart: rank {j} corrupted its {name} counter (or \
                     the ranks' collective calls diverged) on shared-memory communicator '{}'",
                    self.rank, self.round, self.label
                ),
            });
        }
        Ok(v)
    }

    /// Rank `j`'s `consumed` counter, checked (see [`ShmComm::round_word`]).
    pub(super) fn consumed(&self, j: usize) -> Result<u32> {
        self.round_word(j, &self.seg.ctl(j).consumed.word, "consumed", false)
    }

    /// Whether rank `j` has published `word` (its `posted` or `reduced` counter, `name`) for
    /// round `k`. Ranks that publish a round do so before they consume it, so a rank that has
    /// consumed round `k` without publishing it corrupted a counter.
    pub(super) fn published(&self, j: usize, k: u32, word: &AtomicU32, name: &str) -> Result<bool> {
        // Read `consumed` first: if it shows round k, the (earlier) publication is visible.
        let consumed = self.consumed(j)?;
        // A rank that skips rounds of this counter (a broadcast's receivers do not post, a
        // direct allreduce does not reduce) lags by any number of rounds: no lower bound.
        if reached(self.round_word(j, word, name, true)?, k.wrapping_add(1)) {
            return Ok(true);
        }
        if reached(consumed, k.wrapping_add(1)) {
            return Err(TransportError::Protocol {
                rank: j,
                detail: format!(
                    "rank {j} consumed round {k} without advancing its {name} counter: rank {j} \
                     corrupted a round counter (or the ranks' collective calls diverged) on \
                     shared-memory communicator '{}'",
                    self.label
                ),
            });
        }
        Ok(false)
    }

    pub(super) fn is_posted(&self, j: usize, k: u32) -> Result<bool> {
        self.published(j, k, &self.seg.ctl(j).posted.word, "posted")
    }

    pub(super) fn is_reduced(&self, j: usize, k: u32) -> Result<bool> {
        self.published(j, k, &self.seg.ctl(j).reduced.word, "reduced")
    }

    /// Compare the first `meta.len()` metadata words of rank `j` (posted) with ours.
    pub(super) fn check_meta(&self, j: usize, b: usize, meta: &[u64]) -> Result<()> {
        for (w, &mine) in meta.iter().enumerate() {
            let theirs = self.seg.meta(j, b, w).load(Relaxed);
            if theirs != mine {
                let detail = if w == 0 {
                    format!(
                        "rank {j} entered {} while rank {} entered {} (or with another dtype or \
                         operator) on communicator '{}': collectives must be called in the same \
                         order with compatible arguments",
                        tag_name(theirs),
                        self.rank,
                        tag_name(mine),
                        self.label
                    )
                } else {
                    format!(
                        "rank {j} passed size word {w} = {theirs} to {} but rank {} passed {mine} \
                         on communicator '{}'",
                        tag_name(meta[0]),
                        self.rank,
                        self.label
                    )
                };
                return Err(TransportError::Protocol { rank: j, detail });
            }
        }
        Ok(())
    }

    /// Wait for every other rank's post of round `k`, calling `each(j)` for each as soon as it
    /// is there (in whatever order they arrive).
    pub(super) fn for_each_posted(
        &self,
        op: &'static str,
        k: u32,
        mut each: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let mut pending: Vec<usize> = (0..self.size).filter(|&j| j != self.rank).collect();
        loop {
            let mut i = 0;
            while i < pending.len() {
                if self.is_posted(pending[i], k)? {
                    each(pending.swap_remove(i))?;
                } else {
                    i += 1;
                }
            }
            if pending.is_empty() {
                return Ok(());
            }
            self.wait(op, || first_blocker(&pending, |j| self.is_posted(j, k)))?;
        }
    }
}
