//! Allreduce of a buffer made of several slices, in place: a fused group's tensors reduced
//! where they lie, with no fusion buffer to pack them into and unpack them from.

use std::ops::Range;

use fh_core::{kernels, DType, ReduceOp};

use super::RING_CHUNK_BYTES;
use super::{check_reduction, even_block, piece, with_scratch, AllreduceAlgorithm};
use crate::{Communicator, Result};

/// The part of `r` that falls in `lo..hi`, relative to `lo`; `None` when empty.
fn within(r: &Range<usize>, lo: usize, hi: usize) -> Option<Range<usize>> {
    let (a, z) = (r.start.max(lo), r.end.min(hi));
    (a < z).then(|| a - lo..z - lo)
}

/// The byte range `r` of the concatenation of `segs`, as the slices that hold it, in order.
fn slices<'a>(segs: &'a [&mut [u8]], r: &Range<usize>) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut off = 0;
    for seg in segs {
        let len = seg.len();
        if let Some(x) = within(r, off, off + len) {
            out.push(&seg[x]);
        }
        off += len;
    }
    out
}

/// As [`slices`], mutable.
fn slices_mut<'a>(segs: &'a mut [&mut [u8]], r: &Range<usize>) -> Vec<&'a mut [u8]> {
    let mut out = Vec::new();
    let mut off = 0;
    for seg in segs.iter_mut() {
        let seg: &'a mut [u8] = seg;
        let len = seg.len();
        if let Some(x) = within(r, off, off + len) {
            out.push(&mut seg[x]);
        }
        off += len;
    }
    out
}

/// The slices of `src` (shared) and of `dst` (mutable) at once; the ranges must not overlap.
fn split_ranges<'a>(
    segs: &'a mut [&mut [u8]],
    src: &Range<usize>,
    dst: &Range<usize>,
) -> (Vec<&'a [u8]>, Vec<&'a mut [u8]>) {
    debug_assert!(src.end <= dst.start || dst.end <= src.start || src.is_empty() || dst.is_empty());
    let (mut out_s, mut out_d) = (Vec::new(), Vec::new());
    let mut off = 0;
    for seg in segs.iter_mut() {
        let seg: &'a mut [u8] = seg;
        let len = seg.len();
        match (within(src, off, off + len), within(dst, off, off + len)) {
            (None, None) => {}
            (Some(a), None) => {
                let seg: &'a [u8] = seg;
                out_s.push(&seg[a]);
            }
            (None, Some(b)) => out_d.push(&mut seg[b]),
            (Some(a), Some(b)) if a.end <= b.start => {
                let (l, r) = seg.split_at_mut(b.start);
                let l: &'a [u8] = l;
                out_s.push(&l[a]);
                out_d.push(&mut r[..b.len()]);
            }
            (Some(a), Some(b)) => {
                let (l, r) = seg.split_at_mut(a.start);
                let r: &'a [u8] = r;
                out_d.push(&mut l[b]);
                out_s.push(&r[..a.len()]);
            }
        }
        off += len;
    }
    (out_s, out_d)
}

/// Allreduce the concatenation of `segs` in place, as if it were one buffer: every rank ends
/// with the same result in its slices. `op` says how elements combine; `Average` combines as
/// `Sum` and nothing here divides: `finish` is applied exactly once to every byte of the result
/// (in element-aligned slices), so the caller's division (by whichever count it needs) and
/// postscale go there.
///
/// Large buffers run the ring (as [`allreduce`](super::allreduce) picks it by size): the ring
/// sends straight from the slices and receives the allgather straight into them
/// ([`Communicator::send_recv_vectored`]), reduces received pieces into them, and `finish` runs
/// on this rank's block only, before the allgather copies it round: a fused group costs no
/// packing, no unpacking and a finishing pass over 1/n of it. Small buffers are packed and
/// allreduced by recursive doubling. Only the total length must agree across ranks; how each
/// rank cuts it into slices is its own business.
pub fn allreduce_segments<C: Communicator + ?Sized>(
    comm: &mut C,
    segs: &mut [&mut [u8]],
    dtype: DType,
    op: ReduceOp,
    finish: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut total = 0usize;
    for s in segs.iter() {
        check_reduction("allreduce", dtype, op, s.len())?;
        total += s.len();
    }
    let esz = dtype.size();
    let elements = total / esz;
    let n = comm.size();
    let combining = op.combining();
    if n <= 1 || total == 0 {
        for s in segs.iter_mut() {
            finish(s)?;
        }
        return Ok(());
    }
    if AllreduceAlgorithm::Auto.resolve(total, elements, n) != AllreduceAlgorithm::Ring {
        return allreduce_segments_packed(comm, segs, dtype, op, finish);
    }
    ring(comm, segs, dtype, combining, elements, finish)
}

/// [`allreduce_segments`] through one packed buffer: the slices copied into it, allreduced
/// ([`Communicator::allreduce`], combining with `op.combining()`), finished whole and copied
/// back. For where reducing in place does not pay: a buffer small enough for one collective,
/// or a world whose in-place form does not apply.
pub fn allreduce_segments_packed<C: Communicator + ?Sized>(
    comm: &mut C,
    segs: &mut [&mut [u8]],
    dtype: DType,
    op: ReduceOp,
    finish: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = segs.concat();
    comm.allreduce(&mut buf, dtype, op.combining())?;
    finish(&mut buf)?;
    let mut at = 0;
    for s in segs.iter_mut() {
        s.copy_from_slice(&buf[at..at + s.len()]);
        at += s.len();
    }
    Ok(())
}

/// The ring allreduce over the concatenation of `segs` (`elements` of `dtype` in all, at least
/// one per rank, on more than one rank), combining with `combining` (`Sum`, not `Average`:
/// nothing here divides). The buffer is cut into `n` nearly equal blocks of whole elements. In the
/// reduce-scatter phase, at step `s` rank `r` sends block `r-s-1` to `r+1` and reduces block
/// `r-s-2` received from `r-1`; after `n-1` steps rank `r` holds the full reduction of block
/// `r`, which `finish` then finishes (each byte exactly once, by its owner). The ring
/// allgather circulates the finished blocks. Each step moves its block in pieces of at most
/// [`RING_CHUNK_BYTES`], sent straight from the slices and received straight into them
/// ([`Communicator::send_recv_vectored`]) or, for the reduction, into a scratch piece.
pub(super) fn ring<C: Communicator + ?Sized>(
    comm: &mut C,
    segs: &mut [&mut [u8]],
    dtype: DType,
    combining: ReduceOp,
    elements: usize,
    finish: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let esz = dtype.size();
    let block = |i: usize| {
        let e = even_block(elements, n, i);
        e.start * esz..e.end * esz
    };
    let pieces = block(0).len().div_ceil(RING_CHUNK_BYTES).max(1);
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    // Reduce-scatter: at step s send block r-s-1 right, reduce block r-s-2 from the left.
    let scratch_len = piece(&block(0), pieces, 0, esz).len();
    with_scratch(scratch_len, |tmp| -> Result<()> {
        for s in 0..n - 1 {
            let sb = block((rank + 2 * n - s - 1) % n);
            let rb = block((rank + 2 * n - s - 2) % n);
            for k in 0..pieces {
                let sp = piece(&sb, pieces, k, esz);
                let rp = piece(&rb, pieces, k, esz);
                let t = &mut tmp[..rp.len()];
                {
                    let out = slices(segs, &sp);
                    comm.send_recv_vectored(right, &out, left, &mut [&mut *t])?;
                }
                let mut at = 0;
                for d in slices_mut(segs, &rp) {
                    let l = d.len();
                    kernels::reduce(dtype, combining, d, &t[at..at + l])?;
                    at += l;
                }
            }
        }
        Ok(())
    })?;
    for d in slices_mut(segs, &block(rank)) {
        finish(d)?;
    }
    // Allgather: at step s send block r-s right, receive block r-s-1 from the left.
    for s in 0..n - 1 {
        let sb = block((rank + n - s) % n);
        let rb = block((rank + 2 * n - s - 1) % n);
        for k in 0..pieces {
            let (out, mut inc) = split_ranges(
                segs,
                &piece(&sb, pieces, k, esz),
                &piece(&rb, pieces, k, esz),
            );
            comm.send_recv_vectored(right, &out, left, &mut inc)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs_of(buf: &mut [u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&buf.len())) {
            out.push(buf[at..c].to_vec());
            at = c;
        }
        out
    }

    #[test]
    fn ranges_map_onto_slices() {
        let mut whole: Vec<u8> = (0..40).collect();
        let mut parts = segs_of(&mut whole, &[3, 3, 17, 30]);
        let mut segs: Vec<&mut [u8]> = parts.iter_mut().map(|p| &mut p[..]).collect();
        let got: Vec<u8> = slices(&segs, &(2..20)).concat();
        assert_eq!(got, (2..20).collect::<Vec<u8>>());
        let (a, b) = split_ranges(&mut segs, &(25..35), &(5..18));
        assert_eq!(a.concat(), (25..35).collect::<Vec<u8>>());
        assert_eq!(b.concat(), (5..18).collect::<Vec<u8>>());
        let (a, b) = split_ranges(&mut segs, &(0..16), &(16..40));
        assert_eq!(a.concat(), (0..16).collect::<Vec<u8>>());
        for d in b {
            d.fill(0);
        }
        assert_eq!(slices(&segs, &(16..40)).concat(), vec![0u8; 24]);
        assert!(slices(&segs, &(7..7)).is_empty());
    }
}
