//! Whom a failed wait of the shared-memory communicator blames: the heartbeats' verdicts, an
//! interrupt, peers that stopped or wait across hosts (the `outside` word), and giving up so
//! that peers blame the right rank.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::{Duration, Instant};

use fh_core::CoreError;

use super::super::segment::{ST_ABORTED, ST_ATTACHED, ST_CLOSED};
use super::super::sys;
use super::{
    outside_value, OutsideWord, ShmComm, BLAME_EXTERNAL, BLAME_RANK, BLAME_TIMEOUT, OUTSIDE,
};
use crate::{Result, TransportError};

impl ShmComm {
    /// The heartbeats' verdict as this wait's error, when it names `who` (the rank waited for)
    /// or this rank itself.
    pub(super) fn declared(&self, who: usize) -> Option<TransportError> {
        let v = self
            .watch
            .as_ref()?
            .verdict_on(*self.world_ranks.get(who)?)?;
        // Named in this communicator's numbering when it is one of its ranks; else the rank
        // waited for, silent too, stands for it here (an enclosing communicator names the
        // verdict's rank from its own interrupt or the peers' external blame).
        let local = self
            .world_ranks
            .iter()
            .position(|&g| g == v.lost)
            .unwrap_or(who);
        Some(TransportError::PeerLost {
            rank: local,
            detail: v.detail,
        })
    }

    /// The error an interrupted wait ends with, in this communicator's numbering: the lost
    /// rank when it is one of this communicator's; otherwise the communicator closes, and the
    /// rank (of the enclosing world) is published for the peers as an external blame.
    pub(super) fn interrupted(&self, cause: crate::interrupt::Cause) -> TransportError {
        let local = cause
            .lost
            .and_then(|g| self.world_ranks.iter().position(|&w| w == g));
        match (local, cause.lost) {
            (Some(r), _) => TransportError::PeerLost {
                rank: r,
                detail: cause.why,
            },
            (None, Some(g)) => {
                self.blame_external.set(Some(g));
                TransportError::Closed(format!(
                    "shared-memory communicator '{}' stopped: rank {g} was lost ({})",
                    self.label, cause.why
                ))
            }
            (None, None) => TransportError::Closed(cause.why),
        }
    }

    /// Mark this rank as waiting outside this communicator (`Some`: in a step of an
    /// enclosing communicator, waiting for that communicator's rank `far` on another host when
    /// known) or no longer (`None`). A local peer that times out waiting for this rank
    /// meanwhile gives it a bounded grace ([`ShmComm::set_outside_grace`]) to publish whom it
    /// blames ([`ShmComm::give_up`]) instead of blaming it, and blames `far` if nothing comes.
    pub(crate) fn waiting_outside(&self, far: Option<Option<usize>>) {
        self.seg
            .info(self.rank)
            .outside
            .store(outside_value(far), Relaxed);
    }

    /// This rank's `outside` word, to set while the communicator is borrowed elsewhere (see
    /// [`ShmComm::waiting_outside`]).
    pub(crate) fn outside_word(&self) -> OutsideWord {
        OutsideWord(self.seg.outside_word(self.rank))
    }

    /// How much longer (default: one more timeout) a wait that timed out on a local peer waits
    /// once for a verdict when some live peer waits outside this communicator (see
    /// [`ShmComm::waiting_outside`]): an enclosing communicator sets the longest its own waits
    /// can take to fail and publish whom they blame.
    pub(crate) fn set_outside_grace(&mut self, grace: Duration) {
        self.outside_grace = grace;
    }

    /// A peer that is attached, alive and waiting outside this communicator (see
    /// [`ShmComm::waiting_outside`]), with the enclosing-world rank it waits for when known.
    pub(super) fn peer_waiting_outside(&self) -> Option<(usize, Option<usize>)> {
        (0..self.size).filter(|&r| r != self.rank).find_map(|r| {
            let info = self.seg.info(r);
            let word = info.outside.load(Relaxed);
            let pid = info.pid.load(Acquire);
            (word & OUTSIDE != 0
                && info.state.load(Acquire) == ST_ATTACHED
                && pid != 0
                && sys::process_alive(pid, info.start_time.load(Relaxed)))
            .then(|| (r, (word & BLAME_RANK).checked_sub(1).map(|f| f as usize)))
        })
    }

    /// A peer whose process is stopped (alive, but making no progress), if any.
    pub(super) fn stopped_peer(&self) -> Option<usize> {
        (0..self.size).filter(|&r| r != self.rank).find(|&r| {
            let info = self.seg.info(r);
            let pid = info.pid.load(Acquire);
            pid != 0 && sys::process_stopped(pid, info.start_time.load(Relaxed))
        })
    }

    /// Fail if a peer aborted, if `who` (the rank waited for) closed its communicator, or (at
    /// most once per liveness interval) if a peer's process is gone.
    pub(super) fn check_peers(&self, who: usize) -> Result<()> {
        if who != self.rank && self.seg.info(who).state.load(Acquire) == ST_CLOSED {
            return Err(TransportError::PeerLost {
                rank: who,
                detail: format!(
                    "it closed shared-memory communicator '{}' while this rank waited for it",
                    self.label
                ),
            });
        }
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let info = self.seg.info(r);
            if info.state.load(Acquire) == ST_ABORTED {
                // Report the root cause: the rank the aborted one blamed, if any, with the
                // same kind of error (a timeout stays a timeout).
                let word = info.blame.load(Relaxed);
                let blamed = if word & BLAME_EXTERNAL != 0 {
                    0
                } else {
                    (word & BLAME_RANK) as usize
                };
                let rank = if blamed == 0 || blamed - 1 == self.rank {
                    r
                } else {
                    blamed - 1
                };
                if rank != r && word & BLAME_TIMEOUT != 0 {
                    return Err(TransportError::Timeout {
                        rank,
                        op: "a collective (another rank gave up waiting for it first)",
                        after: self.timeout,
                    });
                }
                return Err(TransportError::PeerLost {
                    rank,
                    detail: format!(
                        "rank {r} gave up on shared-memory communicator '{}' after an error{}",
                        self.label,
                        if rank == r {
                            String::new()
                        } else {
                            format!(" caused by rank {rank}")
                        }
                    ),
                });
            }
        }
        let now = Instant::now();
        if now.duration_since(self.last_check.get()) < self.liveness {
            return Ok(());
        }
        self.last_check.set(now);
        let me = sys::pid();
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let info = self.seg.info(r);
            let pid = info.pid.load(Acquire);
            // pid 0: not attached yet (only while opening; bounded by the deadline).
            if pid == 0 || pid == me || info.state.load(Acquire) == ST_CLOSED {
                continue;
            }
            if !sys::process_alive(pid, info.start_time.load(Relaxed)) {
                return Err(TransportError::PeerLost {
                    rank: r,
                    detail: format!(
                        "its process {pid} died (shared-memory communicator '{}')",
                        self.label
                    ),
                });
            }
        }
        Ok(())
    }

    /// Give up on this communicator because of a failure found outside it (by an enclosing
    /// communicator that uses this one): mark this rank aborted so that peers waiting for it
    /// fail at once, blaming `external` — a rank numbered in the enclosing world, if any —
    /// which they can read back with [`ShmComm::external_blame`]. Does nothing if the
    /// communicator is unusable already.
    pub(crate) fn give_up(&mut self, external: Option<usize>, timeout: bool, why: &str) {
        if self.broken.is_some() {
            return;
        }
        self.broken = Some(why.to_owned());
        let info = self.seg.info(self.rank);
        info.outside.store(0, Relaxed);
        if let Some(r) = external.filter(|&r| (r as u32) < BLAME_RANK) {
            let kind = if timeout { BLAME_TIMEOUT } else { 0 };
            info.blame
                .store((r as u32 + 1) | BLAME_EXTERNAL | kind, Relaxed);
        }
        info.state.store(ST_ABORTED, Release);
        self.notify_others();
    }

    /// The enclosing-world rank blamed by a peer that gave up through [`ShmComm::give_up`],
    /// and whether it gave up on a timeout; `None` if no peer did.
    pub(crate) fn external_blame(&self) -> Option<(usize, bool)> {
        (0..self.size).filter(|&r| r != self.rank).find_map(|r| {
            let info = self.seg.info(r);
            let word = info.blame.load(Relaxed);
            (info.state.load(Acquire) == ST_ABORTED
                && word & BLAME_EXTERNAL != 0
                && word & BLAME_RANK != 0)
                .then(|| {
                    (
                        ((word & BLAME_RANK) - 1) as usize,
                        word & BLAME_TIMEOUT != 0,
                    )
                })
        })
    }

    /// The enclosing-world rank this rank blamed when its wait for a local peer timed out while
    /// a peer waited outside this communicator for that rank and published no verdict (see
    /// [`ShmComm::waiting_outside`]); `None` otherwise.
    pub(crate) fn outside_blame(&self) -> Option<usize> {
        let info = self.seg.info(self.rank);
        let word = info.blame.load(Relaxed);
        (self.broken.is_some()
            && info.state.load(Acquire) == ST_ABORTED
            && word & BLAME_EXTERNAL != 0
            && word & BLAME_RANK != 0)
            .then(|| ((word & BLAME_RANK) - 1) as usize)
    }

    /// Run `f`; on failure (other than a rejected argument, which is detected before any shared
    /// state changes) mark this communicator and this rank's slot as unusable so that the peers
    /// stop waiting for it.
    pub(super) fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Closed(format!(
                "shared-memory communicator '{}' is unusable after an earlier error: {why}",
                self.label
            )));
        }
        // An interrupt raised between operations fails the next one too.
        let res = match self.interrupt.cause() {
            Some(cause) => Err(self.interrupted(cause)),
            None => f(self),
        };
        if let Err(e) = &res {
            if !matches!(
                e,
                TransportError::InvalidArgument(_)
                    | TransportError::Core(CoreError::UnsupportedOp { .. })
            ) {
                self.broken = Some(e.to_string());
                let info = self.seg.info(self.rank);
                info.outside.store(0, Relaxed);
                if let Some(g) = self
                    .blame_external
                    .take()
                    .filter(|&g| (g as u32) < BLAME_RANK)
                {
                    // Interrupted by the loss of a rank of the enclosing world.
                    info.blame.store((g as u32 + 1) | BLAME_EXTERNAL, Relaxed);
                } else if let Some(far) = self.blame_outside.take() {
                    // A rank outside this communicator, numbered in the enclosing world.
                    info.blame
                        .store((far as u32 + 1) | BLAME_EXTERNAL | BLAME_TIMEOUT, Relaxed);
                } else if let Some(r) = e.blamed_rank() {
                    let kind = if matches!(e, TransportError::Timeout { .. }) {
                        BLAME_TIMEOUT
                    } else {
                        0
                    };
                    info.blame.store((r as u32 + 1) | kind, Relaxed);
                }
                info.state.store(ST_ABORTED, Release);
                self.notify_others();
            }
        }
        res
    }
}
