//! Collectives written once against point-to-point messaging.
//!
//! These are the default implementations behind [`Communicator`]'s collective methods. They
//! use only [`Communicator::send`], [`Communicator::recv`] and [`Communicator::send_recv`];
//! wherever two ranks exchange data in the same step they use `send_recv`, because a plain
//! `send` may block (on TCP, once the kernel's buffers are full) until the peer receives.
//!
//! | collective | algorithm |
//! |---|---|
//! | [`allreduce`] | recursive doubling below [`ALLREDUCE_RING_THRESHOLD_BYTES`] (extra ranks of a non-power-of-two world fold into a partner first), ring reduce-scatter + ring allgather above it, in pieces of at most [`RING_CHUNK_BYTES`]; [`allreduce_with`] forces one |
//! | [`allreduce_parts`] | one buffer of parts with their own dtype and op: one recursive doubling for all below the ring threshold, one allreduce per part above it |
//! | [`allreduce_segments`] | as [`allreduce`], over several slices in place (scatter-gather sends and receives); the result's finishing pass runs on this rank's block only |
//! | [`reduce_scatter`] | ring, uneven blocks, in pieces of at most [`RING_CHUNK_BYTES`] |
//! | [`allgatherv`] | ring, uneven and zero counts |
//! | [`broadcast`] | binomial tree below [`BROADCAST_SCATTER_THRESHOLD_BYTES`], binomial scatter + ring allgather above it |
//! | [`alltoallv`] | pairwise exchange |
//! | [`barrier`] | dissemination with empty messages |
//!
//! Every function validates its arguments before sending anything and returns
//! [`TransportError::InvalidArgument`] naming the problem rather than panicking. The choice of
//! algorithm depends only on arguments that must agree on every rank (lengths, counts, root),
//! so all ranks always run the same schedule. Every rank ends with bitwise identical results:
//! the ring reduces each block once, in one order, and then copies it; recursive doubling
//! relies on the operators being commutative, which holds bit for bit except for which NaN
//! `Min`/`Max` keep.

mod allreduce;
mod broadcast;
mod ring;
mod segmented;

use std::cell::RefCell;
use std::ops::Range;

use fh_core::{kernels, DType, ReduceOp};

use crate::{Communicator, Result, TransportError};

pub use allreduce::{
    allreduce, allreduce_agreeing, allreduce_each_part, allreduce_parts, allreduce_with,
    AllreduceAlgorithm, ReducePart, ALLREDUCE_RING_THRESHOLD_BYTES, RING_CHUNK_BYTES,
};
pub(crate) use allreduce::{check_parts, divide_average_parts, fold_parts};
pub use broadcast::{broadcast, BROADCAST_SCATTER_THRESHOLD_BYTES};
pub use ring::{allgatherv, reduce_scatter};
pub use segmented::{allreduce_segments, allreduce_segments_packed};

fn invalid(msg: String) -> TransportError {
    TransportError::InvalidArgument(msg)
}

/// Check that `root` names a rank of a communicator of `size` ranks (every backend's broadcast).
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(invalid(format!(
            "broadcast: root {root} is out of range; the communicator has ranks 0..{size}"
        )));
    }
    Ok(())
}

/// Check a per-rank count vector and return the offsets (prefix sums) and total.
pub(crate) fn offsets(counts: &[usize], size: usize, what: &str) -> Result<(Vec<usize>, usize)> {
    if counts.len() != size {
        return Err(invalid(format!(
            "{what}: {} counts given for {size} ranks; pass exactly one count per rank",
            counts.len()
        )));
    }
    let mut offs = Vec::with_capacity(size);
    let mut total = 0usize;
    for &c in counts {
        offs.push(total);
        total = total
            .checked_add(c)
            .ok_or_else(|| invalid(format!("{what}: counts {counts:?} overflow usize")))?;
    }
    Ok((offs, total))
}

/// Check that `op` applies to `dtype` and that `len` bytes are whole elements; returns the
/// number of elements. Every backend's allreduce checks its arguments with this.
pub(crate) fn check_reduction(what: &str, dtype: DType, op: ReduceOp, len: usize) -> Result<usize> {
    if !kernels::supports(dtype, op) {
        return Err(invalid(format!(
            "{what}: reduce op {op} is not defined for dtype {dtype}"
        )));
    }
    dtype
        .elements_in(len)
        .map_err(|e| invalid(format!("{what}: {e}")))
}

/// Check the arguments of an allgatherv on rank `rank` of `size` (byte counts); returns the
/// offsets and the total. Every backend's allgatherv checks its arguments with this.
pub(crate) fn check_allgatherv(
    send_len: usize,
    recv_len: usize,
    counts: &[usize],
    rank: usize,
    size: usize,
) -> Result<(Vec<usize>, usize)> {
    let (offs, total) = offsets(counts, size, "allgatherv")?;
    if recv_len != total || send_len != counts[rank] {
        return Err(invalid(format!(
            "allgatherv: rank {rank} sends {send_len} bytes (its count says {}) and recv has \
             {recv_len} bytes (counts sum to {total})",
            counts[rank]
        )));
    }
    Ok((offs, total))
}

/// Check the arguments of an alltoallv on rank `rank` of `size` (byte counts); returns the
/// send and receive offsets. Every backend's alltoallv checks its arguments with this.
pub(crate) fn check_alltoallv(
    send_len: usize,
    send_counts: &[usize],
    recv_len: usize,
    recv_counts: &[usize],
    rank: usize,
    size: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let (soffs, stotal) = offsets(send_counts, size, "alltoallv send_counts")?;
    let (roffs, rtotal) = offsets(recv_counts, size, "alltoallv recv_counts")?;
    if send_len != stotal || recv_len != rtotal {
        return Err(invalid(format!(
            "alltoallv: send has {send_len} bytes (send_counts sum to {stotal}), recv has \
             {recv_len} bytes (recv_counts sum to {rtotal})"
        )));
    }
    if send_counts[rank] != recv_counts[rank] {
        return Err(invalid(format!(
            "alltoallv: rank {rank} sends itself {} bytes but expects {}",
            send_counts[rank], recv_counts[rank]
        )));
    }
    Ok((soffs, roffs))
}

/// Check the arguments of a reduce-scatter on rank `rank` of `size` (counts in elements, with
/// every product checked for overflow); returns the element offsets and total. Every backend's
/// reduce-scatter checks its arguments with this.
pub(crate) fn check_reduce_scatter(
    send_len: usize,
    recv_len: usize,
    counts: &[usize],
    rank: usize,
    size: usize,
    dtype: DType,
    op: ReduceOp,
) -> Result<(Vec<usize>, usize)> {
    let (offs, total) = offsets(counts, size, "reduce_scatter")?;
    let elements = check_reduction("reduce_scatter", dtype, op, send_len)?;
    let expected_recv = counts[rank].checked_mul(dtype.size());
    if elements != total || expected_recv != Some(recv_len) {
        return Err(invalid(format!(
            "reduce_scatter: send holds {elements} {dtype} elements and counts sum to {total} \
             (they must be equal); recv has {recv_len} bytes and rank {rank}'s count of {} \
             elements needs {}",
            counts[rank],
            counts[rank].saturating_mul(dtype.size())
        )));
    }
    Ok((offs, total))
}

/// Element range of block `i` when `total` items are split into `n` nearly equal blocks
/// (the first `total % n` blocks get one more).
fn even_block(total: usize, n: usize, i: usize) -> Range<usize> {
    let (q, r) = (total / n, total % n);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

/// Piece `k` of `pieces` of the byte range `block`, split on `unit`-byte boundaries.
fn piece(block: &Range<usize>, pieces: usize, k: usize, unit: usize) -> Range<usize> {
    let units = even_block(block.len() / unit, pieces, k);
    block.start + units.start * unit..block.start + units.end * unit
}

/// Borrow `src` immutably and `dst` mutably from one buffer; the ranges must not overlap.
fn split_pair(buf: &mut [u8], src: Range<usize>, dst: Range<usize>) -> Result<(&[u8], &mut [u8])> {
    if src.end > buf.len() || dst.end > buf.len() {
        return Err(invalid(format!(
            "internal: ranges {src:?} and {dst:?} exceed a buffer of {} bytes",
            buf.len()
        )));
    }
    if src.is_empty() {
        return Ok((&[], &mut buf[dst]));
    }
    if dst.is_empty() {
        return Ok((&buf[src], &mut []));
    }
    if src.end <= dst.start {
        let (lo, hi) = buf.split_at_mut(dst.start);
        Ok((&lo[src], &mut hi[..dst.len()]))
    } else if dst.end <= src.start {
        let (lo, hi) = buf.split_at_mut(src.start);
        Ok((&hi[..src.len()], &mut lo[dst]))
    } else {
        Err(invalid(format!(
            "internal: overlapping ranges {src:?} and {dst:?}"
        )))
    }
}

/// Largest scratch buffer kept per thread between calls; larger requests allocate.
const SCRATCH_KEEP_BYTES: usize = 4 << 20;

thread_local! {
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` with an 8-byte aligned scratch buffer of `len` bytes (contents unspecified),
/// reusing a per-thread allocation when possible so hot paths do not allocate per call.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let words = len.div_ceil(8);
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) if len <= SCRATCH_KEEP_BYTES => {
            if v.len() < words {
                v.resize(words, 0);
            }
            f(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut v[..words])[..len])
        }
        _ => {
            let mut v = vec![0u64; words];
            f(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..len])
        }
    })
}

/// Alltoallv by pairwise exchange: in step `s` every rank sends to `rank + s` and receives
/// from `rank - s`, so each pair exchanges exactly once and no rank waits on two peers.
pub fn alltoallv<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    send_counts: &[usize],
    recv: &mut [u8],
    recv_counts: &[usize],
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let (soffs, roffs) =
        check_alltoallv(send.len(), send_counts, recv.len(), recv_counts, rank, size)?;
    recv[roffs[rank]..roffs[rank] + recv_counts[rank]]
        .copy_from_slice(&send[soffs[rank]..soffs[rank] + send_counts[rank]]);
    for step in 1..size {
        let to = (rank + step) % size;
        let from = (rank + size - step) % size;
        comm.send_recv(
            to,
            &send[soffs[to]..soffs[to] + send_counts[to]],
            from,
            &mut recv[roffs[from]..roffs[from] + recv_counts[from]],
        )?;
    }
    Ok(())
}

/// Dissemination barrier: in round `k` every rank signals `rank + 2^k` and waits for
/// `rank - 2^k` with an empty message; after `ceil(log2 size)` rounds every rank has
/// (transitively) heard from all others.
pub fn barrier<C: Communicator + ?Sized>(comm: &mut C) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut dist = 1;
    while dist < size {
        let to = (rank + dist) % size;
        let from = (rank + size - dist) % size;
        comm.send_recv(to, &[], from, &mut [])?;
        dist <<= 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_blocks_tile_the_range() {
        for total in [0usize, 1, 5, 17, 100] {
            for n in 1..9 {
                let mut next = 0;
                for i in 0..n {
                    let b = even_block(total, n, i);
                    assert_eq!(b.start, next);
                    assert!(b.len() == total / n || b.len() == total / n + 1);
                    next = b.end;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn pieces_respect_units() {
        let block = 8..8 + 4 * 11;
        let mut next = block.start;
        for k in 0..3 {
            let p = piece(&block, 3, k, 4);
            assert_eq!(p.start, next);
            assert_eq!(p.len() % 4, 0);
            next = p.end;
        }
        assert_eq!(next, block.end);
    }

    #[test]
    fn split_pair_rejects_overlap() {
        let mut buf = [0u8; 10];
        assert!(split_pair(&mut buf, 0..4, 2..6).is_err());
        assert!(split_pair(&mut buf, 0..4, 8..12).is_err());
        let (a, b) = split_pair(&mut buf, 6..10, 0..3).unwrap();
        assert_eq!((a.len(), b.len()), (4, 3));
    }

    #[test]
    fn scratch_is_reentrant() {
        let inner = with_scratch(16, |a| {
            a.fill(1);
            with_scratch(16, |b| {
                b.fill(2);
                b.len()
            }) + a.iter().map(|&x| x as usize).sum::<usize>()
        });
        assert_eq!(inner, 32);
    }
}
