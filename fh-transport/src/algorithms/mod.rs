//! Collectives written once against point-to-point messaging.
//!
//! These are the default implementations behind [`Communicator`]'s collective methods.
//! Every function validates its arguments first and returns
//! [`TransportError::InvalidArgument`] rather than panicking.

use fh_core::{kernels, DType, ReduceOp};

use crate::{Communicator, Result, TransportError};

fn invalid(msg: String) -> TransportError {
    TransportError::InvalidArgument(msg)
}

/// Check a per-rank count vector and return the offsets (prefix sums) and total.
pub(crate) fn offsets(counts: &[usize], size: usize, what: &str) -> Result<(Vec<usize>, usize)> {
    if counts.len() != size {
        return Err(invalid(format!(
            "{what}: {} counts given for {size} ranks",
            counts.len()
        )));
    }
    let mut offs = Vec::with_capacity(size);
    let mut total = 0usize;
    for &c in counts {
        offs.push(total);
        total = total
            .checked_add(c)
            .ok_or_else(|| invalid(format!("{what}: counts overflow")))?;
    }
    Ok((offs, total))
}

/// Allreduce: reduce to rank 0, then broadcast. Correct for every size; replaced by faster
/// algorithms where they apply.
pub fn allreduce<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    dtype.elements_in(buf.len())?;
    if !kernels::supports(dtype, op) {
        return Err(fh_core::CoreError::UnsupportedOp { op, dtype }.into());
    }
    let (rank, size) = (comm.rank(), comm.size());
    if size > 1 {
        if rank == 0 {
            let mut tmp = vec![0u8; buf.len()];
            for peer in 1..size {
                comm.recv(peer, &mut tmp)?;
                kernels::reduce(dtype, op.combining(), buf, &tmp)?;
            }
        } else {
            comm.send(0, buf)?;
        }
        broadcast(comm, buf, 0)?;
    }
    if op == ReduceOp::Average {
        kernels::divide(dtype, buf, size)?;
    }
    Ok(())
}

/// Broadcast from `root` by direct sends.
pub fn broadcast<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    root: usize,
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    if root >= size {
        return Err(invalid(format!(
            "broadcast root {root} out of range 0..{size}"
        )));
    }
    if rank == root {
        for peer in (0..size).filter(|&p| p != root) {
            comm.send(peer, buf)?;
        }
    } else {
        comm.recv(root, buf)?;
    }
    Ok(())
}

/// Allgatherv by pairwise exchange.
pub fn allgatherv<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    recv: &mut [u8],
    counts: &[usize],
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let (offs, total) = offsets(counts, size, "allgatherv")?;
    if recv.len() != total || send.len() != counts[rank] {
        return Err(invalid(format!(
            "allgatherv: send has {} bytes (count says {}), recv has {} bytes (counts sum to {total})",
            send.len(),
            counts[rank],
            recv.len()
        )));
    }
    recv[offs[rank]..offs[rank] + counts[rank]].copy_from_slice(send);
    for step in 1..size {
        let to = (rank + step) % size;
        let from = (rank + size - step) % size;
        let dst = &mut recv[offs[from]..offs[from] + counts[from]];
        comm.send_recv(to, send, from, dst)?;
    }
    Ok(())
}

/// Alltoallv by pairwise exchange.
pub fn alltoallv<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    send_counts: &[usize],
    recv: &mut [u8],
    recv_counts: &[usize],
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let (soffs, stotal) = offsets(send_counts, size, "alltoallv send")?;
    let (roffs, rtotal) = offsets(recv_counts, size, "alltoallv recv")?;
    if send.len() != stotal || recv.len() != rtotal {
        return Err(invalid(format!(
            "alltoallv: send has {} bytes (counts sum to {stotal}), recv has {} bytes (counts sum to {rtotal})",
            send.len(),
            recv.len()
        )));
    }
    if send_counts[rank] != recv_counts[rank] {
        return Err(invalid(format!(
            "alltoallv: rank {rank} sends itself {} bytes but expects {}",
            send_counts[rank], recv_counts[rank]
        )));
    }
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

/// Reduce-scatter: allreduce of a copy, then keep this rank's block.
pub fn reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    send: &[u8],
    recv: &mut [u8],
    counts: &[usize],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let (offs, total) = offsets(counts, size, "reduce_scatter")?;
    let esz = dtype.size();
    if send.len() != total * esz || recv.len() != counts[rank] * esz {
        return Err(invalid(format!(
            "reduce_scatter: send has {} bytes (counts sum to {total} {dtype} elements), recv has {} bytes (expected {} elements)",
            send.len(),
            recv.len(),
            counts[rank]
        )));
    }
    let mut tmp = send.to_vec();
    allreduce(comm, &mut tmp, dtype, op)?;
    recv.copy_from_slice(&tmp[offs[rank] * esz..(offs[rank] + counts[rank]) * esz]);
    Ok(())
}

/// Barrier: a one-byte allreduce.
pub fn barrier<C: Communicator + ?Sized>(comm: &mut C) -> Result<()> {
    let mut b = [0u8; 1];
    allreduce(comm, &mut b, DType::U8, ReduceOp::BitOr)
}
