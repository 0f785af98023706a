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
//! its private buffer and the peers' slots (in cache-sized blocks), finishes it (an average's
//! division), publishes the result in its slot and bumps `reduced`; every rank copies the other
//! shares out as each becomes ready. Per input byte a rank thus copies `(n-1)/n` in, reduces
//! `1/n` from `n` sources, finishes and publishes `1/n` and copies `(n-1)/n` out. Each share is
//! computed once, so all ranks get identical bits. The same over slices
//! ([`crate::Communicator::allreduce_segments`]: a fused group where its tensors lie) publishes
//! from and copies out into the slices, and finishes each share with the caller's division and
//! postscale: no packing, and a finishing pass over `1/n` of the buffer instead of all of it.
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
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::time::{Duration, Instant};

use fh_core::{kernels, DType, ReduceOp};

use super::segment::{Segment, SharedWord, ST_ABORTED, ST_CLOSED};
use super::sys;
use super::ShmOptions;
use crate::{Interrupt, Result, TransportError};

mod api;
mod blame;
mod collectives;
mod ring;
mod rounds;

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

#[cfg(test)]
mod tests;
