//! The shared-memory communicator's native collectives, in rounds through the ranks' slots
//! (see *Protocol* in the parent module).

use std::ops::Range;
use std::sync::atomic::Ordering::{Relaxed, Release};

use fh_core::{kernels, DType, ReduceOp};

use super::{
    first_blocker, get, invalid, piece, pieces_len, put, reduce_blocked, reduce_tag, view, ShmComm,
    TAG_ALLGATHER, TAG_ALLREDUCE, TAG_ALLTOALL, TAG_BARRIER, TAG_BROADCAST, TAG_REDUCE_SCATTER,
};
use crate::algorithms::{self, offsets};
use crate::{Result, TransportError};

/// A reduce-scatter's input around this rank's block: the slices before it, the block (`None`:
/// it is the output, reduced in place) and the slices after it.
pub(super) type Input<'a> = (&'a [&'a [u8]], Option<&'a [u8]>, &'a [&'a [u8]]);

/// Calls `f(at, part)` for every part of the bytes `r` of the concatenation of `segs`, `at`
/// being the part's offset from `r.start`.
fn each_in<S: AsRef<[u8]>>(segs: &[S], r: Range<usize>, mut f: impl FnMut(usize, &[u8])) {
    let mut off = 0;
    for s in segs.iter().map(AsRef::as_ref) {
        let (a, z) = (r.start.max(off), r.end.min(off + s.len()));
        if a < z {
            f(a - r.start, &s[a - off..z - off]);
        }
        off += s.len();
        if off >= r.end {
            break;
        }
    }
}

/// As [`each_in`], mutable, stopping at the first error.
fn each_in_mut(
    segs: &mut [&mut [u8]],
    r: Range<usize>,
    mut f: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut off = 0;
    for s in segs.iter_mut() {
        let len = s.len();
        let (a, z) = (r.start.max(off), r.end.min(off + len));
        if a < z {
            f(a - r.start, &mut s[a - off..z - off])?;
        }
        off += len;
        if off >= r.end {
            break;
        }
    }
    Ok(())
}

impl ShmComm {
    pub(super) fn allreduce_inner(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size;
        let combine = op.combining();
        let average = op == ReduceOp::Average;
        // The algorithm is part of the tag: ranks configured with different thresholds must
        // fail, not read each other's half-reduced slots.
        let tag = reduce_tag(TAG_ALLREDUCE, dtype, op);
        if buf.len() > self.small {
            // The average divided on each share's owner, before the others copy it.
            return self.allreduce_shares(&mut [&mut *buf], dtype, combine, tag, &mut |b| {
                if average {
                    kernels::divide(dtype, b, n)?;
                }
                Ok(())
            });
        }
        self.allreduce_direct(buf, tag | (1 << 24), |acc, srcs| {
            reduce_blocked(dtype, combine, acc, srcs)
        })?;
        if average {
            kernels::divide(dtype, buf, n)?;
        }
        Ok(())
    }

    /// The allreduce of the concatenation of `segs` where they lie (the caller checked that
    /// every slice holds whole elements and that the total is above the direct threshold): the
    /// slices are published from and the reduced shares copied straight back into them, so a
    /// fused group needs no packing; `finish` (the caller's division and postscale) runs on
    /// this rank's shares only ([`Self::allreduce_shares`]). `combine` is `op.combining()`:
    /// nothing here divides.
    pub(super) fn allreduce_segments_inner(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        combine: ReduceOp,
        finish: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        // Its own kind of allreduce: a rank that finishes the whole buffer after an ordinary
        // allreduce must not mix with ranks that finish shares.
        let tag = reduce_tag(TAG_ALLREDUCE, dtype, combine) | (2 << 24);
        self.allreduce_shares(segs, dtype, combine, tag, finish)
    }

    /// The reduce-scatter mode of the allreduce (see *Protocol* in the parent module) over the
    /// concatenation of `segs`, one slot-sized chunk a round: share r of each chunk is reduced
    /// by rank r from its own slices and the peers' slots, then `finish`ed there (once per
    /// byte over all ranks) and published; every rank copies the other shares straight into
    /// its slices as each becomes ready.
    fn allreduce_shares(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        combine: ReduceOp,
        tag: u64,
        finish: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let total: usize = segs.iter().map(|s| s.len()).sum();
        let e = dtype.size();
        let mut c0 = 0usize;
        while c0 < total {
            let s = self.seg.layout.slot_bytes.min(total - c0);
            // Share r of the chunk is reduced by rank r.
            let share = ((s / e).div_ceil(n) * e).div_ceil(64) * 64;
            let range = |r: usize| ((r * share).min(s), ((r + 1) * share).min(s));
            let (lo, hi) = range(me);
            let (k, b) = self.begin_round("allreduce")?;
            let slot = self.seg.slot(me, b);
            // SAFETY: our own slot, not read by anyone before we post round k (begin_round
            // ensured everyone finished with this buffer); every part lies within [0, s) of it
            // and `s <= slot_bytes`.
            each_in(segs, c0..c0 + lo, |at, part| unsafe {
                put(slot.add(at), part)
            });
            each_in(segs, c0 + hi..c0 + s, |at, part| unsafe {
                put(slot.add(hi + at), part)
            });
            let meta = [tag, total as u64, s as u64];
            self.post(k, b, &meta);
            self.for_each_posted("allreduce", k, |j| self.check_meta(j, b, &meta))?;
            if hi > lo {
                let peers: Vec<*mut u8> = (0..n)
                    .filter(|&j| j != me)
                    .map(|j| self.seg.slot(j, b))
                    .collect();
                each_in_mut(segs, c0 + lo..c0 + hi, |at, acc| {
                    let srcs: Vec<&[u8]> = peers
                        .iter()
                        // SAFETY: peers' slots are posted; nobody writes [lo, hi) of them in
                        // round k (each rank writes only its own share of its own slot).
                        .map(|&p| unsafe { view(p.add(lo + at), acc.len()) })
                        .collect();
                    reduce_blocked(dtype, combine, acc, &srcs)?;
                    finish(acc)?;
                    // SAFETY: [lo, hi) of our own slot is written only by us, and read by
                    // peers only after we publish `reduced`.
                    unsafe { put(slot.add(lo + at), acc) };
                    Ok(())
                })?;
            }
            self.seg
                .ctl(me)
                .reduced
                .word
                .store(k.wrapping_add(1), Release);
            self.notify_others();
            // Gather the reduced shares, each as soon as it is ready.
            let mut pending: Vec<usize> = (0..n)
                .filter(|&r| r != me && range(r).1 > range(r).0)
                .collect();
            loop {
                let mut i = 0;
                while i < pending.len() {
                    let r = pending[i];
                    if self.is_reduced(r, k)? {
                        let (a, z) = range(r);
                        let from = self.seg.slot(r, b);
                        each_in_mut(segs, c0 + a..c0 + z, |at, part| {
                            // SAFETY: share r of rank r's slot is final for round k.
                            unsafe { get(part, from.add(a + at)) };
                            Ok(())
                        })?;
                        pending.swap_remove(i);
                    } else {
                        i += 1;
                    }
                }
                if pending.is_empty() {
                    break;
                }
                self.wait("allreduce", || {
                    first_blocker(&pending, |r| self.is_reduced(r, k))
                })?;
            }
            self.finish_round(k);
            c0 += s;
        }
        Ok(())
    }

    /// The small allreduce of parts with their own dtype and op (the caller checked that
    /// `buf` fits one slot and the direct threshold): one synchronisation, as a small
    /// allreduce. The parts' shape is in the tag, so that ranks passing other parts fail.
    pub(super) fn allreduce_parts_inner(
        &mut self,
        buf: &mut [u8],
        parts: &[algorithms::ReducePart],
    ) -> Result<()> {
        let shape: Vec<u8> = parts
            .iter()
            .flat_map(|p| {
                let mut b = (p.len as u64).to_le_bytes().to_vec();
                b.extend_from_slice(&[p.dtype.code(), p.op.code()]);
                b
            })
            .collect();
        let tag =
            TAG_ALLREDUCE | (3 << 24) | ((fh_core::hash::fnv1a(0, &shape) & 0xffff_ffff) << 32);
        self.allreduce_direct(buf, tag, |acc, srcs| {
            algorithms::fold_parts(parts, acc, srcs)
        })?;
        algorithms::divide_average_parts(parts, buf, self.size)
    }

    /// Every rank publishes its input and folds all slots in rank order with `fold(acc,
    /// peers)` (`acc` starts as rank 0's input): one synchronisation per slot-sized chunk,
    /// identical bits everywhere.
    fn allreduce_direct(
        &mut self,
        buf: &mut [u8],
        tag: u64,
        fold: impl Fn(&mut [u8], &[&[u8]]) -> Result<()>,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let total = buf.len();
        for chunk in buf.chunks_mut(self.seg.layout.slot_bytes) {
            let s = chunk.len();
            let (k, b) = self.begin_round("allreduce")?;
            // SAFETY: our own slot, not read by anyone before we post round k (begin_round
            // ensured everyone finished with this buffer); `s <= slot_bytes`.
            unsafe { put(self.seg.slot(me, b), chunk) };
            let meta = [tag, total as u64, s as u64];
            self.post(k, b, &meta);
            self.for_each_posted("allreduce", k, |j| self.check_meta(j, b, &meta))?;
            if me != 0 {
                // SAFETY: all slots of round k are posted and nobody writes them until
                // everyone (including us) has consumed round k.
                unsafe { get(chunk, self.seg.slot(0, b)) };
            }
            let srcs: Vec<&[u8]> = (1..n)
                // SAFETY: as above.
                .map(|j| unsafe { view(self.seg.slot(j, b), s) })
                .collect();
            fold(chunk, &srcs)?;
            self.finish_round(k);
        }
        Ok(())
    }

    pub(super) fn broadcast_inner(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        let total = buf.len() as u64;
        for chunk in buf.chunks_mut(self.seg.layout.slot_bytes) {
            let meta = [
                TAG_BROADCAST | ((root as u64) << 8),
                total,
                chunk.len() as u64,
            ];
            if self.rank == root {
                let (k, b) = self.begin_round("broadcast")?;
                // SAFETY: our own slot, free for round k (begin_round).
                unsafe { put(self.seg.slot(root, b), chunk) };
                self.post(k, b, &meta);
                self.finish_round(k);
            } else {
                let k = self.round;
                let b = k as usize % self.seg.layout.nbuf;
                self.wait("broadcast", || {
                    first_blocker(&[root], |r| self.is_posted(r, k))
                })?;
                self.check_meta(root, b, &meta)?;
                // SAFETY: the root posted round k and will not rewrite it before we consume it.
                unsafe { get(chunk, self.seg.slot(root, b)) };
                self.finish_round(k);
            }
        }
        Ok(())
    }

    pub(super) fn allgatherv_inner(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<()> {
        let (offs, _) = offsets(counts, self.size, "allgatherv")?;
        let me = self.rank;
        let (before, rest) = recv.split_at_mut(offs[me]);
        let (mine, after) = rest.split_at_mut(counts[me]);
        mine.copy_from_slice(send);
        self.allgatherv_parts(&mut [before], &[send], &mut [after], counts)
    }

    /// The allgatherv's rounds, the received blocks written straight where they belong: the
    /// concatenation of `before` receives the blocks of the ranks below this one, that of
    /// `after` those above it, and `own` (this rank's block, in slices) is published, never
    /// copied locally. The caller has checked the lengths against `counts`.
    pub(super) fn allgatherv_parts(
        &mut self,
        before: &mut [&mut [u8]],
        own: &[&[u8]],
        after: &mut [&mut [u8]],
        counts: &[usize],
    ) -> Result<()> {
        let (offs, total) = offsets(counts, self.size, "allgatherv")?;
        let me = self.rank;
        let hi = offs[me] + counts[me];
        let c = self.seg.layout.slot_bytes;
        let rounds = counts.iter().map(|&x| x.div_ceil(c)).max().unwrap_or(0);
        for i in 0..rounds {
            let (k, b) = self.begin_round("allgatherv")?;
            let (a, len) = piece(counts[me], i, c);
            let slot = self.seg.slot(me, b);
            // SAFETY: our own slot, free for round k; the parts lie at offsets within `len`.
            each_in(own, a..a + len, |q, part| unsafe { put(slot.add(q), part) });
            self.post(k, b, &[TAG_ALLGATHER, total as u64, len as u64]);
            self.for_each_posted("allgatherv", k, |j| {
                let (a, len) = piece(counts[j], i, c);
                self.check_meta(j, b, &[TAG_ALLGATHER, total as u64, len as u64])?;
                let at = offs[j] + a;
                let src = self.seg.slot(j, b);
                let take = |q: usize, part: &mut [u8]| {
                    // SAFETY: rank j posted round k; its slot is stable until we consume it, and
                    // the parts lie at offsets within `len`.
                    unsafe { get(part, src.add(q)) };
                    Ok(())
                };
                if j < me {
                    each_in_mut(before, at..at + len, take)
                } else {
                    each_in_mut(after, at - hi..at - hi + len, take)
                }
            })?;
            self.finish_round(k);
        }
        Ok(())
    }

    pub(super) fn alltoallv_inner(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let (soffs, _) = offsets(send_counts, n, "alltoallv send")?;
        let (roffs, _) = offsets(recv_counts, n, "alltoallv recv")?;
        recv[roffs[me]..roffs[me] + recv_counts[me]]
            .copy_from_slice(&send[soffs[me]..soffs[me] + send_counts[me]]);
        // Each round carries up to `part` bytes from every rank to every other rank.
        let part = self.seg.layout.slot_bytes / n / 64 * 64;
        let mut i = 0usize;
        loop {
            let (k, b) = self.begin_round("alltoallv")?;
            let mut meta = vec![0u64; 2 + n];
            meta[0] = TAG_ALLTOALL;
            let mut more = false;
            for j in (0..n).filter(|&j| j != me) {
                let (a, len) = piece(send_counts[j], i, part);
                let at = soffs[j] + a;
                // SAFETY: our own slot, free for round k; `j * part + len <= slot_bytes`.
                unsafe { put(self.seg.slot(me, b).add(j * part), &send[at..at + len]) };
                meta[2 + j] = len as u64;
                more |= send_counts[j] > (i + 1) * part || recv_counts[j] > (i + 1) * part;
            }
            meta[1] = u64::from(more);
            self.post(k, b, &meta);
            self.for_each_posted("alltoallv", k, |j| {
                self.check_meta(j, b, &[TAG_ALLTOALL])?;
                more |= self.seg.meta(j, b, 1).load(Relaxed) != 0;
                let (a, len) = piece(recv_counts[j], i, part);
                let sent = self.seg.meta(j, b, 2 + me).load(Relaxed);
                if sent != len as u64 {
                    return Err(TransportError::Protocol {
                        rank: j,
                        detail: format!(
                            "alltoallv: rank {j} sends {sent} bytes in round {i} but rank {me} \
                             expects {len} (send and receive counts disagree) on communicator \
                             '{}'",
                            self.label
                        ),
                    });
                }
                let at = roffs[j] + a;
                // SAFETY: rank j posted round k; its slot is stable until we consume it.
                unsafe { get(&mut recv[at..at + len], self.seg.slot(j, b).add(me * part)) };
                Ok(())
            })?;
            self.finish_round(k);
            i += 1;
            if !more {
                return Ok(());
            }
        }
    }

    pub(super) fn reduce_scatter_inner(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (offs, _) = offsets(counts, self.size, "reduce_scatter")?;
        let e = dtype.size();
        let me = self.rank;
        let (lo, hi) = (offs[me] * e, (offs[me] + counts[me]) * e);
        let parts = (&[&send[..lo]][..], Some(&send[lo..hi]), &[&send[hi..]][..]);
        self.reduce_scatter_parts(parts, &mut [recv], counts, dtype, op)
    }

    /// The reduce-scatter's rounds over the input `before ++ block ++ after` (`before` and
    /// `after` in slices), where `block` is this rank's block (`counts[rank]` elements after
    /// the blocks of the ranks below it): its reduction is written to the slices of `own`,
    /// read from `block` when given (each round's piece copied into `own` as it is reduced,
    /// while it is in cache) or else from `own` itself (in place: the block is never copied).
    /// Only `before` and `after` are published. The caller has checked the lengths against
    /// `counts`.
    pub(super) fn reduce_scatter_parts(
        &mut self,
        (before, block, after): Input<'_>,
        own: &mut [&mut [u8]],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let (offs, total) = offsets(counts, n, "reduce_scatter")?;
        let e = dtype.size();
        let (lo, hi, total) = (offs[me] * e, (offs[me] + counts[me]) * e, total * e);
        let c = self.seg.layout.slot_bytes;
        let tag = reduce_tag(TAG_REDUCE_SCATTER, dtype, op);
        for i in 0..total.div_ceil(c) {
            let (k, b) = self.begin_round("reduce_scatter")?;
            let (a, len) = piece(total, i, c);
            let z = a + len;
            let slot = self.seg.slot(me, b);
            // Our own block is reduced from private memory; publish only the rest, each part
            // at its offset in the round.
            if a < lo {
                // SAFETY: our own slot, free for round k; the parts lie in `a..z`, at offsets
                // within `len <= slot_bytes`.
                each_in(before, a..z.min(lo), |q, part| unsafe {
                    put(slot.add(q), part)
                });
            }
            if z > hi {
                let from = a.max(hi);
                // SAFETY: as above.
                each_in(after, from - hi..z - hi, |q, part| unsafe {
                    put(slot.add(from - a + q), part)
                });
            }
            let meta = [tag, total as u64, len as u64];
            self.post(k, b, &meta);
            let (mlo, mhi) = (lo.clamp(a, z), hi.clamp(a, z));
            if mhi > mlo {
                self.for_each_posted("reduce_scatter", k, |j| self.check_meta(j, b, &meta))?;
                each_in_mut(own, mlo - lo..mhi - lo, |q, dst| {
                    if let Some(src) = block {
                        dst.copy_from_slice(&src[mlo - lo + q..][..dst.len()]);
                    }
                    let srcs: Vec<&[u8]> = (0..n)
                        .filter(|&j| j != me)
                        // SAFETY: posted; [mlo, mhi) of peers' slots is not written in round k.
                        .map(|j| unsafe { view(self.seg.slot(j, b).add(mlo - a + q), dst.len()) })
                        .collect();
                    reduce_blocked(dtype, op.combining(), dst, &srcs)
                })?;
            }
            self.finish_round(k);
        }
        if op == ReduceOp::Average {
            for part in own.iter_mut() {
                kernels::divide(dtype, part, n)?;
            }
        }
        Ok(())
    }

    pub(super) fn barrier_inner(&mut self) -> Result<()> {
        let (k, b) = self.begin_round("barrier")?;
        self.post(k, b, &[TAG_BARRIER]);
        self.for_each_posted("barrier", k, |j| self.check_meta(j, b, &[TAG_BARRIER]))?;
        self.finish_round(k);
        Ok(())
    }
}

impl ShmComm {
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
}
