//! Broadcast: binomial tree for small messages, scatter + ring allgather for large ones.

use super::{even_block, ring};
use crate::{Communicator, Result};

/// Broadcasts of at least this many bytes (on three or more ranks) use a binomial scatter
/// followed by a ring allgather, which moves about `2·M` bytes through the root instead of
/// the tree's `log2(n)·M`; smaller ones use the binomial tree, which needs only
/// `ceil(log2 n)` message latencies.
pub const BROADCAST_SCATTER_THRESHOLD_BYTES: usize = 256 * 1024;

/// Copy `root`'s `buf` into every rank's `buf`. All ranks must pass buffers of the same
/// length.
pub fn broadcast<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    root: usize,
) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    super::check_root(root, n)?;
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    // Work in ranks relative to the root: the root is 0 and rank + 1 stays the successor.
    let v = (rank + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    if buf.len() < BROADCAST_SCATTER_THRESHOLD_BYTES || n <= 2 {
        binomial_tree(comm, buf, v, real)
    } else {
        scatter_allgather(comm, buf, v, real)
    }
}

/// Binomial tree: relative rank `v` receives from `v - lowbit(v)`, then sends to `v + m` for
/// every power of two `m < lowbit(v)` (the root: every power of two below `n`), largest first.
fn binomial_tree<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    v: usize,
    real: impl Fn(usize) -> usize,
) -> Result<()> {
    let n = comm.size();
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            comm.recv(real(v - mask), buf)?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            comm.send(real(v + mask), buf)?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Binomial scatter of `n` nearly equal blocks (relative rank `v` gets block `v`; each
/// subtree's blocks are contiguous, so every tree edge is one message), then a ring allgather.
fn scatter_allgather<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    v: usize,
    real: impl Fn(usize) -> usize,
) -> Result<()> {
    let n = comm.size();
    let len = buf.len();
    // Byte range of the blocks of relative ranks lo..hi.
    let span = |lo: usize, hi: usize| even_block(len, n, lo).start..even_block(len, n, hi - 1).end;
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            comm.recv(real(v - mask), &mut buf[span(v, (v + mask).min(n))])?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        let child = v + mask;
        if child < n {
            comm.send(real(child), &buf[span(child, (child + mask).min(n))])?;
        }
        mask >>= 1;
    }
    ring::allgather_in_place(comm, buf, v, 1, 1, |i| even_block(len, n, i))
}
