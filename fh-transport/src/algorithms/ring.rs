//! Ring allgather(v) and ring reduce-scatter.

use std::ops::Range;

use fh_core::{kernels, DType, ReduceOp};

use super::{
    check_allgatherv, check_reduce_scatter, piece, split_pair, with_scratch, RING_CHUNK_BYTES,
};
use crate::{Communicator, Result};

/// Ring allgather inside one buffer. Ring position `me` (this rank's index in a ring whose
/// successor is `rank + 1`) already holds block `me`, and `block(i)` is the byte range of
/// position `i`'s block. At step `s` position `me` sends block `me - s` right and receives
/// block `me - s - 1` from the left, in `pieces` pieces split on `unit`-byte boundaries.
pub(super) fn allgather_in_place<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    me: usize,
    pieces: usize,
    unit: usize,
    block: impl Fn(usize) -> Range<usize>,
) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    for s in 0..n.saturating_sub(1) {
        let sb = block((me + n - s) % n);
        let rb = block((me + 2 * n - s - 1) % n);
        for k in 0..pieces {
            let (src, dst) = split_pair(
                buf,
                piece(&sb, pieces, k, unit),
                piece(&rb, pieces, k, unit),
            )?;
            comm.send_recv(right, src, left, dst)?;
        }
    }
    Ok(())
}

/// Allgatherv by ring: `n - 1` steps, in each of which every rank forwards to its right
/// neighbour the block it received in the previous step. Handles uneven and zero counts
/// (zero-length blocks travel as empty messages so every rank runs the same schedule).
pub fn allgatherv<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    recv: &mut [u8],
    counts: &[usize],
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let (offs, total) = check_allgatherv(send.len(), recv.len(), counts, rank, size)?;
    recv[offs[rank]..offs[rank] + counts[rank]].copy_from_slice(send);
    if total == 0 {
        return Ok(());
    }
    allgather_in_place(comm, recv, rank, 1, 1, |i| offs[i]..offs[i] + counts[i])
}

/// Reduce-scatter by ring with uneven blocks: `counts[r]` elements of the reduction end on
/// rank `r`. At step `s` rank `r` sends its partial sum of block `r-s-1` to `r+1`, receives
/// the partial sum of block `r-s-2` from `r-1` and adds its own contribution; the last step
/// receives straight into `recv`. Blocks travel in pieces of at most [`RING_CHUNK_BYTES`],
/// each piece going all the way round before the next starts, so scratch space is two pieces.
/// `Average` divides the final block by the number of ranks.
pub fn reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    recv: &mut [u8],
    counts: &[usize],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let (offs, total) = check_reduce_scatter(send.len(), recv.len(), counts, rank, n, dtype, op)?;
    let esz = dtype.size();
    let block = |i: usize| offs[i] * esz..(offs[i] + counts[i]) * esz;
    if n == 1 {
        recv.copy_from_slice(send);
        return Ok(());
    }
    if total == 0 {
        return Ok(());
    }
    let combining = op.combining();
    let largest = counts.iter().copied().max().unwrap_or(0) * esz;
    let pieces = largest.div_ceil(RING_CHUNK_BYTES).max(1);
    let piece_cap = piece(&(0..largest), pieces, 0, esz).len();
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    with_scratch(2 * piece_cap, |scratch| -> Result<()> {
        let (mut cur, mut next) = scratch.split_at_mut(piece_cap);
        for k in 0..pieces {
            for s in 0..n - 1 {
                let sp = piece(&block((rank + 2 * n - s - 1) % n), pieces, k, esz);
                let rb = (rank + 2 * n - s - 2) % n;
                let rp = piece(&block(rb), pieces, k, esz);
                let outgoing: &[u8] = if s == 0 { &send[sp] } else { &cur[..sp.len()] };
                let target: &mut [u8] = if s == n - 2 {
                    let local = rp.start - block(rank).start;
                    &mut recv[local..local + rp.len()]
                } else {
                    &mut next[..rp.len()]
                };
                comm.send_recv(right, outgoing, left, target)?;
                kernels::reduce(dtype, combining, target, &send[rp])?;
                std::mem::swap(&mut cur, &mut next);
            }
        }
        Ok(())
    })?;
    if op == ReduceOp::Average {
        kernels::divide(dtype, recv, n)?;
    }
    Ok(())
}
