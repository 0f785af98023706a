//! The shared-memory communicator: waiting, point-to-point rings and native collectives.
//!
//! # Protocol
//!
//! Every rank `r` owns, per buffer `b` (`nbuf` of them, used round-robin), a *slot* of
//! `slot_bytes` that only `r` writes, a few metadata words, and three round counters:
//! `posted[r]` (its slot holds the data of round `k` when `posted >= k + 1`), `reduced[r]`
//! (its share of round `k` is reduced) and `consumed[r]` (it has finished reading round `k`).
//! Every collective is cut into rounds that each fit a slot; all ranks number rounds alike.
//! Before writing buffer `b` again in round `k`, a rank waits until every rank has consumed
//! round `k - nbuf`, so with two buffers a fast rank may run one round ahead. Hence no honest
//! rank's counter is more than `nbuf` rounds ahead of this rank's round (nor its `consumed`
//! counter as far behind), and a rank posts a round (where it posts) before consuming it: every
//! counter read from a peer is checked against that, and a violation is a protocol error naming
//! the peer (the counter's only writer), never a wrap or a wait until the timeout.
//!
//! Allreduce of up to `small_allreduce_bytes`: every rank publishes its input, then folds all
//! slots in rank order (one synchronisation; identical bits everywhere). Larger: each round is
//! split into `n` shares; rank `r` publishes its input except share `r`, reduces share `r` from
//! its private buffer and the peers' slots (in cache-sized blocks), publishes the result in its
//! slot and bumps `reduced`; every rank copies the other shares out as each becomes ready. Per
//! input byte a rank thus copies `(n-1)/n` in, reduces `1/n` from `n` sources, publishes `1/n`
//! and copies `(n-1)/n` out. Each share is computed once, so all ranks get identical bits.
//!
//! Counters are published with release stores and read with acquire loads, which orders the
//! plain copies into and out of the slots. Waiting is a short poll (yielding the core between
//! checks), then `FUTEX_WAIT` on the
//! waiter's *doorbell* in slices of at most the liveness interval; whoever publishes something
//! increments the doorbells of the ranks that may wait for it and `FUTEX_WAKE`s those that
//! flagged themselves as sleeping. Between slices the waiter checks its peers (state words,
//! then process liveness) and its deadline, so no wait is unbounded. At the deadline it blames
//! a stopped peer if there is one; else, when a live peer says it waits *outside* the
//! communicator (in an enclosing communicator's step, [`ShmComm::waiting_outside`]), it waits
//! once more, for a bounded grace, for that peer's verdict (its `give_up`), and without one
//! records the rank that peer waits for, for the enclosing communicator to name
//! ([`ShmComm::outside_blame`]); otherwise it blames the rank it waits for.
//!
//! Reduce-scatter and allgatherv run in rounds of a slot each: a rank publishes what the others
//! need (the input outside its own block; its own block), and reduces its block from the peers'
//! slots (copies the peers' blocks out). Their in-place forms, for the hierarchical allreduce,
//! run the same rounds on a buffer cut around the rank's block, so its block is never copied
//! locally.
//!
//! Point-to-point messages go through one single-producer single-consumer ring per directed
//! pair, each message framed by its 8-byte length.

use std::cell::Cell;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::time::{Duration, Instant};

use fh_core::{kernels, CoreError, DType, ReduceOp};

use super::segment::{Segment, SharedWord, ST_ABORTED, ST_ATTACHED, ST_CLOSED};
use super::sys;
use super::ShmOptions;
use crate::algorithms;
use crate::{Communicator, Interrupt, Result, TransportError};

mod collectives;
mod ring;

/// Reduction block: the accumulator stays in cache while every peer's block is folded in.
const BLOCK: usize = 64 * 1024;

const TAG_ALLREDUCE: u64 = 1;
const TAG_BROADCAST: u64 = 2;
const TAG_ALLGATHER: u64 = 3;
const TAG_ALLTOALL: u64 = 4;
const TAG_REDUCE_SCATTER: u64 = 5;
const TAG_BARRIER: u64 = 6;

/// Low bits of a rank's `blame` word: 1 + the rank it blamed.
const BLAME_RANK: u32 = 0x00ff_ffff;
/// Flag in a rank's `blame` word: it gave up on a timeout.
const BLAME_TIMEOUT: u32 = 1 << 24;
/// Flag in a rank's `blame` word: the blamed rank is not a rank of this communicator but a
/// rank of an enclosing world (see [`ShmComm::give_up`]); peers then blame the aborted rank
/// itself and an enclosing communicator reads the rank with [`ShmComm::external_blame`].
const BLAME_EXTERNAL: u32 = 1 << 25;

/// A rank's `outside` word: set while it waits outside this communicator (see
/// [`ShmComm::waiting_outside`]); the low bits are then 1 + the enclosing-world rank it waits
/// for on another host, or 0 when that is not known (or the rank is on this host).
const OUTSIDE: u32 = 1 << 31;

fn tag_name(tag: u64) -> &'static str {
    match tag & 0xff {
        TAG_ALLREDUCE => "allreduce",
        TAG_BROADCAST => "broadcast",
        TAG_ALLGATHER => "allgatherv",
        TAG_ALLTOALL => "alltoallv",
        TAG_REDUCE_SCATTER => "reduce_scatter",
        TAG_BARRIER => "barrier",
        _ => "an unknown operation",
    }
}

fn reduce_tag(base: u64, dtype: DType, op: ReduceOp) -> u64 {
    base | (u64::from(dtype.code()) << 8) | (u64::from(op.code()) << 16)
}

/// The first of `ranks` for which `done` is false, or the first error.
fn first_blocker(ranks: &[usize], done: impl Fn(usize) -> Result<bool>) -> Result<Option<usize>> {
    for &r in ranks {
        if !done(r)? {
            return Ok(Some(r));
        }
    }
    Ok(None)
}

/// `v` has reached `target` (wrapping 32-bit counters).
fn reached(v: u32, target: u32) -> bool {
    (v.wrapping_sub(target) as i32) >= 0
}

/// Total length of a list of slices.
fn pieces_len<S: AsRef<[u8]>>(pieces: &[S]) -> usize {
    pieces.iter().map(|s| s.as_ref().len()).sum()
}

fn invalid(msg: String) -> TransportError {
    TransportError::InvalidArgument(msg)
}

/// Part of `[0, total)` in round `k` of `chunk`-sized rounds: `(start, len)`.
fn piece(total: usize, k: usize, chunk: usize) -> (usize, usize) {
    let start = (k * chunk).min(total);
    (start, (total - start).min(chunk))
}

/// Copy `src` to `dst` in shared memory.
///
/// # Safety
/// `dst..dst + src.len()` must lie in the mapping and be written by no one else, and read by no
/// one else until published, per the protocol.
unsafe fn put(dst: *mut u8, src: &[u8]) {
    // SAFETY: guaranteed by the caller; the regions cannot overlap (one is private memory).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

/// Copy shared memory at `src` into `dst`.
///
/// # Safety
/// `src..src + dst.len()` must lie in the mapping and not be written by anyone during the call.
unsafe fn get(dst: &mut [u8], src: *const u8) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}

/// A read-only view of shared memory.
///
/// # Safety
/// As for [`get`], for as long as the slice lives.
unsafe fn view<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// `acc = acc (op) src_j` for every `j` in order, block by block.
fn reduce_blocked(dtype: DType, op: ReduceOp, acc: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let blk = BLOCK / dtype.size() * dtype.size();
    let mut off = 0;
    while off < acc.len() {
        let end = (off + blk).min(acc.len());
        for s in srcs {
            kernels::reduce(dtype, op, &mut acc[off..end], &s[off..end])?;
        }
        off = end;
    }
    Ok(())
}

/// A rank's `outside` word in its communicator's segment (see [`ShmComm::waiting_outside`]),
/// held with the segment's mapping: it may be written from another thread while the
/// communicator is in use (the hierarchical backend's pipelined allreduce does).
#[derive(Debug, Clone)]
pub(crate) struct OutsideWord(SharedWord);

impl OutsideWord {
    /// As [`ShmComm::waiting_outside`].
    pub(crate) fn set(&self, far: Option<Option<usize>>) {
        self.0.get().store(outside_value(far), Relaxed);
    }
}

/// The `outside` word's value for [`ShmComm::waiting_outside`]'s argument.
fn outside_value(far: Option<Option<usize>>) -> u32 {
    match far {
        None => 0,
        Some(Some(r)) if (r as u32) < BLAME_RANK => OUTSIDE | (r as u32 + 1),
        Some(_) => OUTSIDE,
    }
}

/// A communicator of the shared-memory backend. Created by
/// [`ShmTransport::open`](super::ShmTransport); see the [module documentation](super).
#[derive(Debug)]
pub struct ShmComm {
    seg: Segment,
    rank: usize,
    size: usize,
    label: String,
    timeout: Duration,
    spin: Duration,
    liveness: Duration,
    small: usize,
    /// Number of collective rounds done (identical on every rank between collectives).
    round: u32,
    /// Set after a failure that left the shared state inconsistent.
    broken: Option<String>,
    last_check: Cell<Instant>,
    /// Set by a wait that timed out on a local peer while another waited outside this
    /// communicator for this enclosing-world rank on another host: the rank to blame instead
    /// (see [`ShmComm::outside_blame`]).
    blame_outside: Cell<Option<usize>>,
    /// How much longer a wait that timed out on a peer waiting outside this communicator
    /// waits, once, for that peer's verdict (see [`ShmComm::set_outside_grace`]).
    outside_grace: Duration,
    /// Raised from another thread, it ends every wait ([`crate::interrupt`]); its cause names a
    /// rank of [`ShmComm::world_ranks`]' world.
    interrupt: Interrupt,
    /// The rank of the enclosing world each rank of this communicator is (`world_ranks[r]`):
    /// the world's own ranks, a process set's members, or a host's ranks in the hierarchical
    /// backend.
    world_ranks: Vec<usize>,
    /// Set by an interrupt naming a rank outside this communicator: published as an external
    /// blame when the operation fails (see [`ShmComm::external_blame`]).
    blame_external: Cell<Option<usize>>,
    /// The world's heartbeats: a wait for a rank they declare lost ends at once.
    watch: Option<crate::liveness::Watch>,
}

impl ShmComm {
    pub(super) fn new(
        seg: Segment,
        rank: usize,
        label: &str,
        opts: &ShmOptions,
        stops: (Interrupt, Vec<usize>, Option<crate::liveness::Watch>),
    ) -> ShmComm {
        let (interrupt, world_ranks, watch) = stops;
        ShmComm {
            size: seg.layout.size,
            seg,
            rank,
            label: label.to_string(),
            timeout: opts.timeout,
            spin: opts.spin,
            liveness: opts.liveness_interval,
            small: opts.small_allreduce_bytes,
            round: 0,
            broken: None,
            last_check: Cell::new(Instant::now()),
            blame_outside: Cell::new(None),
            outside_grace: opts.timeout,
            interrupt,
            world_ranks,
            blame_external: Cell::new(None),
            watch,
        }
    }

    /// The heartbeats' verdict as this wait's error, when it names `who` (the rank waited for)
    /// or this rank itself.
    fn declared(&self, who: usize) -> Option<TransportError> {
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
    fn interrupted(&self, cause: crate::interrupt::Cause) -> TransportError {
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

    /// Announce this rank in the freshly mapped segment and wait until every rank has.
    pub(super) fn opened(&self, name: &str) -> Result<()> {
        self.notify_others();
        let res = self.wait(
            "shm open (waiting for every rank to map the segment)",
            || Ok((0..self.size).find(|&r| self.seg.info(r).pid.load(Acquire) == 0)),
        );
        if let Err(e) = &res {
            tracing::warn!(segment = name, error = %e, "opening shm communicator failed");
            let info = self.seg.info(self.rank);
            // Whom this rank blames goes with its mark, as on every other failure path, so
            // that the ranks that waited on it name the rank that never mapped the segment,
            // not this one.
            if let Some(r) = e
                .blamed_rank()
                .filter(|&r| r != self.rank && (r as u32) < BLAME_RANK)
            {
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
        res
    }

    /// The communicator's label, as given to `open`.
    pub fn label(&self) -> &str {
        &self.label
    }

    // ----- waiting and waking -----

    fn notify(&self, r: usize) {
        let bell = &self.seg.ctl(r).bell;
        bell.word.fetch_add(1, SeqCst);
        if bell.aux.load(SeqCst) != 0 {
            sys::futex_wake_all(&bell.word);
        }
    }

    fn notify_others(&self) {
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.notify(r);
        }
    }

    /// Wait until `blocker()` returns `None`. While it returns `Some(rank)`, that rank is the
    /// one being waited for (blamed on timeout or if it is gone). An error from `blocker` (a
    /// corrupted counter) ends the wait at once.
    pub(super) fn wait(
        &self,
        op: &'static str,
        mut blocker: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        if blocker()?.is_none() {
            return Ok(());
        }
        let start = Instant::now();
        // Spin briefly (the peer is usually about to publish), yielding the core between
        // checks so that a peer waiting for a CPU can run.
        let mut spins = 0u32;
        while !self.spin.is_zero() {
            std::hint::spin_loop();
            spins += 1;
            if spins % 64 == 0 {
                if blocker()?.is_none() {
                    return Ok(());
                }
                if start.elapsed() >= self.spin {
                    break;
                }
                // On a busy machine the peer may be waiting for our core.
                std::thread::yield_now();
            }
        }
        let bell = &self.seg.ctl(self.rank).bell;
        let mut deadline = start + self.timeout;
        // Whether the deadline was extended once for a peer waiting outside this communicator.
        let mut extended = false;
        loop {
            if let Some(cause) = self.interrupt.cause() {
                return Err(self.interrupted(cause));
            }
            let seen = bell.word.load(SeqCst);
            bell.aux.store(1, SeqCst);
            let Some(who) = blocker().inspect_err(|_| bell.aux.store(0, Relaxed))? else {
                bell.aux.store(0, Relaxed);
                return Ok(());
            };
            if let Some(e) = self.declared(who) {
                bell.aux.store(0, Relaxed);
                return Err(e);
            }
            let checked = self.check_peers(who);
            let now = Instant::now();
            if checked.is_err() || now >= deadline {
                bell.aux.store(0, Relaxed);
                checked?;
                // Waiting for `who`, which may itself wait for a stopped process: name that.
                if let Some(stopped) = self.stopped_peer() {
                    return Err(TransportError::Timeout {
                        rank: stopped,
                        op,
                        after: self.timeout,
                    });
                }
                match self.peer_waiting_outside() {
                    // A live peer waits outside this communicator (another host, for the
                    // hierarchical backend): its own wait there is bounded, and when it fails
                    // the peer publishes whom it blames (`give_up`), which `check_peers`
                    // reports. Give it that time, once, rather than blame a live peer.
                    Some((peer, _)) if !extended => {
                        tracing::debug!(
                            communicator = %self.label,
                            rank = self.rank,
                            waiting_for = who,
                            peer,
                            op,
                            "timed out while a peer waits outside this communicator; waiting \
                             once more for its verdict"
                        );
                        extended = true;
                        deadline = now + self.outside_grace;
                        continue;
                    }
                    // Still no verdict: blame the rank that peer waits for, when known.
                    Some((_, Some(far))) => self.blame_outside.set(Some(far)),
                    _ => {}
                }
                return Err(TransportError::Timeout {
                    rank: who,
                    op,
                    after: self.timeout,
                });
            }
            sys::futex_wait(&bell.word, seen, self.liveness.min(deadline - now));
            bell.aux.store(0, Relaxed);
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

    /// Reduce-scatter in place (the hierarchical allreduce's first step): the concatenation of
    /// `before`, `own` and `after` (each in slices) is this rank's input, `own` its block
    /// (`counts[rank]` elements, after the blocks of the ranks below it); on return `own` holds
    /// the reduction of that block over every rank. The same rounds as
    /// [`Communicator::reduce_scatter`] (ranks may mix the two), but the block is reduced where
    /// it lies: no copy of it to a separate output.
    pub(crate) fn reduce_scatter_in_place(
        &mut self,
        before: &[&[u8]],
        own: &mut [&mut [u8]],
        after: &[&[u8]],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let (lens, own_len) = (pieces_len(before), pieces_len(own));
        let len = lens + own_len + pieces_len(after);
        let (offs, _) = algorithms::check_reduce_scatter(len, own_len, counts, me, n, dtype, op)?;
        if lens != offs[me] * dtype.size() {
            return Err(invalid(format!(
                "reduce_scatter: rank {me}'s block starts at byte {} but {lens} bytes precede it",
                offs[me] * dtype.size(),
            )));
        }
        if n == 1 || len == 0 {
            return Ok(());
        }
        self.guarded(|c| c.reduce_scatter_parts((before, None, after), own, counts, dtype, op))
    }

    /// Allgatherv in place (the hierarchical allreduce's last step): `own` is this rank's
    /// block (`counts[rank]` bytes, in slices), the concatenations of `before` and `after`
    /// receive the blocks of the ranks below and above it. The same rounds as
    /// [`Communicator::allgatherv`] (ranks may mix the two), without the copy of this rank's
    /// block into the output.
    pub(crate) fn allgatherv_in_place(
        &mut self,
        before: &mut [&mut [u8]],
        own: &[&[u8]],
        after: &mut [&mut [u8]],
        counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let lens = pieces_len(before);
        let len = lens + pieces_len(own) + pieces_len(after);
        let (offs, _) = algorithms::check_allgatherv(pieces_len(own), len, counts, me, n)?;
        if lens != offs[me] {
            return Err(invalid(format!(
                "allgatherv: rank {me}'s block starts at byte {} but {lens} bytes precede it",
                offs[me],
            )));
        }
        self.guarded(|c| c.allgatherv_parts(before, own, after, counts))
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
    fn peer_waiting_outside(&self) -> Option<(usize, Option<usize>)> {
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
    fn stopped_peer(&self) -> Option<usize> {
        (0..self.size).filter(|&r| r != self.rank).find(|&r| {
            let info = self.seg.info(r);
            let pid = info.pid.load(Acquire);
            pid != 0 && sys::process_stopped(pid, info.start_time.load(Relaxed))
        })
    }

    /// Fail if a peer aborted, if `who` (the rank waited for) closed its communicator, or (at
    /// most once per liveness interval) if a peer's process is gone.
    fn check_peers(&self, who: usize) -> Result<()> {
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
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
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

    // ----- rounds -----

    /// Start a round in which this rank writes its slot: wait until every rank has consumed
    /// the round that last used the same buffer. Returns (round, buffer).
    fn begin_round(&self, op: &'static str) -> Result<(u32, usize)> {
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

    fn post(&self, k: u32, b: usize, meta: &[u64]) {
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

    fn finish_round(&mut self, k: u32) {
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
    fn round_word(&self, j: usize, word: &AtomicU32, name: &str, lags: bool) -> Result<u32> {
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
    fn consumed(&self, j: usize) -> Result<u32> {
        self.round_word(j, &self.seg.ctl(j).consumed.word, "consumed", false)
    }

    /// Whether rank `j` has published `word` (its `posted` or `reduced` counter, `name`) for
    /// round `k`. Ranks that publish a round do so before they consume it, so a rank that has
    /// consumed round `k` without publishing it corrupted a counter.
    fn published(&self, j: usize, k: u32, word: &AtomicU32, name: &str) -> Result<bool> {
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

    fn is_posted(&self, j: usize, k: u32) -> Result<bool> {
        self.published(j, k, &self.seg.ctl(j).posted.word, "posted")
    }

    fn is_reduced(&self, j: usize, k: u32) -> Result<bool> {
        self.published(j, k, &self.seg.ctl(j).reduced.word, "reduced")
    }

    /// Compare the first `meta.len()` metadata words of rank `j` (posted) with ours.
    fn check_meta(&self, j: usize, b: usize, meta: &[u64]) -> Result<()> {
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
    fn for_each_posted(
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

    // ----- point to point -----

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(invalid(format!(
                "peer {peer} out of range 0..{} on shared-memory communicator '{}'",
                self.size, self.label
            )));
        }
        Ok(())
    }
}

impl Drop for ShmComm {
    fn drop(&mut self) {
        let info = self.seg.info(self.rank);
        if info.state.load(Relaxed) != ST_ABORTED {
            info.state.store(ST_CLOSED, Release);
        }
        self.notify_others();
    }
}

impl Communicator for ShmComm {
    fn backend(&self) -> &'static str {
        "shm"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.guarded(|c| c.send_inner(peer, data))
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.guarded(|c| c.recv_inner(peer, buf))
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.check_peer(to)?;
        self.check_peer(from)?;
        self.guarded(|c| c.send_recv_inner(to, send, from, recv))
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        algorithms::check_reduction("allreduce", dtype, op, buf.len())?;
        if self.size == 1 || buf.is_empty() {
            return Ok(()); // Average over one rank is the identity.
        }
        self.guarded(|c| c.allreduce_inner(buf, dtype, op))
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        algorithms::check_allgatherv(send.len(), recv.len(), counts, self.rank, self.size)?;
        self.guarded(|c| c.allgatherv_inner(send, recv, counts))
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        crate::algorithms::check_root(root, self.size)?;
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.broadcast_inner(buf, root))
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        algorithms::check_alltoallv(send.len(), send_counts, recv.len(), recv_counts, me, n)?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.guarded(|c| c.alltoallv_inner(send, send_counts, recv, recv_counts))
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        algorithms::check_reduce_scatter(send.len(), recv.len(), counts, me, n, dtype, op)?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        if send.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.reduce_scatter_inner(send, recv, counts, dtype, op))
    }

    fn barrier(&mut self) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        self.guarded(|c| c.barrier_inner())
    }

    fn abort(&mut self, lost: usize) {
        if self.broken.is_some() {
            return;
        }
        self.broken = Some(format!("this rank gave up after losing rank {lost}"));
        let info = self.seg.info(self.rank);
        info.outside.store(0, Relaxed);
        if lost != self.rank && (lost as u32) < BLAME_RANK {
            info.blame.store(lost as u32 + 1, Relaxed);
        }
        info.state.store(ST_ABORTED, Release);
        self.notify_others();
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}

#[cfg(test)]
mod tests;
