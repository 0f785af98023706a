//! Allreduce: recursive doubling for small messages, ring for large ones.

use std::fmt;
use std::str::FromStr;

use fh_core::{kernels, DType, ReduceOp};

use super::{check_reduction, invalid, with_scratch};
use crate::{Communicator, Result, TransportError};

/// Messages of at least this many bytes use the ring algorithm under
/// [`AllreduceAlgorithm::Auto`]; smaller ones use recursive doubling.
///
/// Recursive doubling costs about `log2(n)` message latencies but moves the whole buffer in
/// every round (`log2(n) · M` bytes per rank); the ring costs `2(n-1)` latencies and moves
/// `2(n-1)/n · M`. With loopback-TCP latencies of tens of microseconds and a few GB/s per
/// link the two meet between a few hundred KiB and about 1 MiB for 2–8 ranks; this value
/// sits at the low end of that range because the ring's traffic is also spread evenly over
/// every link, which matters more on real networks.
pub const ALLREDUCE_RING_THRESHOLD_BYTES: usize = 256 * 1024;

/// The ring moves each block in pieces of at most this many bytes, so a rank reduces one
/// piece while its neighbour is already sending the next, and the scratch buffer (one piece)
/// stays cache resident.
pub const RING_CHUNK_BYTES: usize = 512 * 1024;

/// Which allreduce algorithm to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AllreduceAlgorithm {
    /// Choose by message size: ring from [`ALLREDUCE_RING_THRESHOLD_BYTES`] up (and when the
    /// buffer has at least one element per rank), recursive doubling below.
    #[default]
    Auto,
    /// Recursive doubling (latency-optimal; `log2(n)` rounds plus two for non-power-of-two
    /// worlds).
    RecursiveDoubling,
    /// Ring reduce-scatter followed by ring allgather (bandwidth-optimal).
    Ring,
}

impl AllreduceAlgorithm {
    /// The concrete algorithm `self` means for a buffer of `bytes` bytes holding `elements`
    /// elements on `size` ranks (never returns `Auto`).
    pub fn resolve(self, bytes: usize, elements: usize, size: usize) -> AllreduceAlgorithm {
        match self {
            AllreduceAlgorithm::Auto
                if bytes >= ALLREDUCE_RING_THRESHOLD_BYTES && elements >= size =>
            {
                AllreduceAlgorithm::Ring
            }
            AllreduceAlgorithm::Auto => AllreduceAlgorithm::RecursiveDoubling,
            other => other,
        }
    }

    /// Lower-case name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            AllreduceAlgorithm::Auto => "auto",
            AllreduceAlgorithm::RecursiveDoubling => "rd",
            AllreduceAlgorithm::Ring => "ring",
        }
    }
}

impl fmt::Display for AllreduceAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AllreduceAlgorithm {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(AllreduceAlgorithm::Auto),
            "rd" | "recursive-doubling" | "recursive_doubling" => {
                Ok(AllreduceAlgorithm::RecursiveDoubling)
            }
            "ring" => Ok(AllreduceAlgorithm::Ring),
            _ => Err(invalid(format!(
                "unknown allreduce algorithm '{s}'; expected auto, rd or ring"
            ))),
        }
    }
}

/// Reduce `buf` element-wise across all ranks; every rank ends with the same result.
/// The algorithm is chosen by size ([`AllreduceAlgorithm::Auto`]). `Average` sums and then
/// divides once by the number of ranks (integers truncate toward zero).
pub fn allreduce<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    allreduce_with(comm, buf, dtype, op, AllreduceAlgorithm::Auto)
}

/// [`allreduce`] with an explicit algorithm. Every rank must pass the same `algorithm`.
pub fn allreduce_with<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    algorithm: AllreduceAlgorithm,
) -> Result<()> {
    let elements = check_reduction("allreduce", dtype, op, buf.len())?;
    let size = comm.size();
    if size <= 1 || buf.is_empty() {
        return Ok(());
    }
    match algorithm.resolve(buf.len(), elements, size) {
        AllreduceAlgorithm::Ring => ring_allreduce(comm, buf, dtype, op, elements),
        _ => {
            recursive_doubling(comm, buf, dtype, op.combining())?;
            if op == ReduceOp::Average {
                kernels::divide(dtype, buf, size)?;
            }
            Ok(())
        }
    }
}

/// [`allreduce`] of `buf` that also ANDs one flag across the ranks: `Ok(true)` when every
/// rank passed `mine = true`, and only then is `buf` the reduction (a rank that cannot
/// contribute passes zeros of the same length and `false`; with `false` agreed, `buf` holds
/// nothing meaningful). Below the ring threshold it is one collective: the flag travels as
/// one more byte of every recursive-doubling message, so agreeing costs no extra message
/// latency. A ring-sized buffer agrees on the flag first (one byte) and is reduced only when
/// every rank can. Every rank must call it with the same length, dtype and op.
pub fn allreduce_agreeing<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    mine: bool,
) -> Result<bool> {
    let elements = check_reduction("allreduce", dtype, op, buf.len())?;
    let size = comm.size();
    if size <= 1 {
        return Ok(mine);
    }
    let n = buf.len();
    if AllreduceAlgorithm::Auto.resolve(n, elements, size) == AllreduceAlgorithm::Ring {
        let mut flag = [u8::from(mine)];
        recursive_doubling(comm, &mut flag, DType::U8, ReduceOp::BitAnd)?;
        if flag[0] != 1 {
            return Ok(false);
        }
        ring_allreduce(comm, buf, dtype, op, elements)?;
        return Ok(true);
    }
    let mut msg = Vec::with_capacity(n + 1);
    msg.extend_from_slice(buf);
    msg.push(u8::from(mine));
    let combining = op.combining();
    recursive_doubling_by(comm, &mut msg, &mut |acc, inc| {
        kernels::reduce(dtype, combining, &mut acc[..n], &inc[..n])?;
        acc[n] &= inc[n];
        Ok(())
    })?;
    let agreed = msg[n] == 1;
    buf.copy_from_slice(&msg[..n]);
    if agreed && op == ReduceOp::Average {
        kernels::divide(dtype, buf, size)?;
    }
    Ok(agreed)
}

/// One part of a buffer reduced by [`allreduce_parts`]: `len` bytes of `dtype`, combined with
/// `op` (`Average` sums, then divides by the number of ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReducePart {
    /// Bytes in the part (whole elements of `dtype`).
    pub len: usize,
    /// The part's element type.
    pub dtype: DType,
    /// How the part's elements combine.
    pub op: ReduceOp,
}

/// Check that `parts` tile a buffer of `len` bytes and that each is a valid reduction.
pub(crate) fn check_parts(len: usize, parts: &[ReducePart]) -> Result<()> {
    let mut total = 0usize;
    for p in parts {
        check_reduction("allreduce_parts", p.dtype, p.op, p.len)?;
        total = total
            .checked_add(p.len)
            .ok_or_else(|| invalid("allreduce_parts: part lengths overflow usize".into()))?;
    }
    if total != len {
        return Err(invalid(format!(
            "allreduce_parts: the parts cover {total} bytes but the buffer has {len}"
        )));
    }
    Ok(())
}

/// Allreduce `buf` as consecutive `parts`, each with its own dtype and op: below the ring
/// threshold in one recursive doubling whose messages carry every part (one collective's
/// latency for all of them), above it one [`Communicator::allreduce`] per part. Every rank must
/// pass the same parts.
pub fn allreduce_parts<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    parts: &[ReducePart],
) -> Result<()> {
    check_parts(buf.len(), parts)?;
    let size = comm.size();
    if size <= 1 || buf.is_empty() {
        return Ok(());
    }
    if buf.len() >= ALLREDUCE_RING_THRESHOLD_BYTES {
        return allreduce_each_part(comm, buf, parts);
    }
    recursive_doubling_by(comm, buf, &mut |acc, inc| fold_parts(parts, acc, &[inc]))?;
    divide_average_parts(parts, buf, size)
}

/// `acc = acc (op) src_j` for every `j` in order, part by part, each part with its own dtype
/// and combining op (an average sums).
pub(crate) fn fold_parts(parts: &[ReducePart], acc: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let mut at = 0;
    for p in parts {
        let r = at..at + p.len;
        for s in srcs {
            kernels::reduce(
                p.dtype,
                p.op.combining(),
                &mut acc[r.clone()],
                &s[r.clone()],
            )?;
        }
        at += p.len;
    }
    Ok(())
}

/// Divide the `Average` parts of a reduced `buf` by the `size` ranks that contributed.
pub(crate) fn divide_average_parts(
    parts: &[ReducePart],
    buf: &mut [u8],
    size: usize,
) -> Result<()> {
    let mut at = 0;
    for p in parts {
        if p.op == ReduceOp::Average {
            kernels::divide(p.dtype, &mut buf[at..at + p.len], size)?;
        }
        at += p.len;
    }
    Ok(())
}

/// [`allreduce_parts`] as one [`Communicator::allreduce`] per part (the default of backends
/// whose allreduce is not built on their own point-to-point messages).
pub fn allreduce_each_part<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    parts: &[ReducePart],
) -> Result<()> {
    check_parts(buf.len(), parts)?;
    let mut rest = buf;
    for p in parts {
        let (head, tail) = rest.split_at_mut(p.len);
        comm.allreduce(head, p.dtype, p.op)?;
        rest = tail;
    }
    Ok(())
}

/// Folds a partner's buffer (second) into this rank's (first).
type Fold<'a> = dyn FnMut(&mut [u8], &[u8]) -> Result<()> + 'a;

/// Recursive doubling with the reduction `op` of `dtype` ([`recursive_doubling_by`]).
fn recursive_doubling<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    recursive_doubling_by(comm, buf, &mut |acc, inc| {
        kernels::reduce(dtype, op, acc, inc)?;
        Ok(())
    })
}

/// Recursive doubling. With `p` the largest power of two `<= n` and `extra = n - p`, ranks
/// `0..2·extra` pair up first: each even one hands its buffer to the odd one above it and
/// sits out. The remaining `p` ranks exchange and reduce full buffers with partners at
/// distance 1, 2, 4, ... (in their compacted numbering), then the odd ranks hand the result
/// back to their even partners. `reduce(acc, incoming)` folds a partner's buffer into this
/// rank's; it must be commutative and associative, so that every rank ends with the same
/// bytes.
fn recursive_doubling_by<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    reduce: &mut Fold<'_>,
) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    with_scratch(buf.len(), |tmp| {
        let vrank = if rank < 2 * extra {
            if rank % 2 == 0 {
                comm.send(rank + 1, buf)?;
                None
            } else {
                comm.recv(rank - 1, tmp)?;
                reduce(buf, tmp)?;
                Some(rank / 2)
            }
        } else {
            Some(rank - extra)
        };
        if let Some(v) = vrank {
            let mut mask = 1;
            while mask < p {
                let pv = v ^ mask;
                let peer = if pv < extra { 2 * pv + 1 } else { pv + extra };
                comm.send_recv(peer, buf, peer, tmp)?;
                reduce(buf, tmp)?;
                mask <<= 1;
            }
        }
        if rank < 2 * extra {
            if rank % 2 == 1 {
                comm.send(rank - 1, buf)?;
            } else {
                comm.recv(rank + 1, buf)?;
            }
        }
        Ok(())
    })
}

/// Ring allreduce of one buffer: [`segmented::ring`](super::segmented) over it as its only
/// slice, `Average` divided on each block's owner (each element exactly once) before the
/// allgather copies it round.
fn ring_allreduce<C: Communicator + ?Sized>(
    comm: &mut C,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    elements: usize,
) -> Result<()> {
    let n = comm.size();
    super::segmented::ring(
        comm,
        &mut [buf],
        dtype,
        op.combining(),
        elements,
        &mut |b| {
            if op == ReduceOp::Average {
                kernels::divide(dtype, b, n)?;
            }
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_switches_to_ring_at_the_threshold() {
        let t = ALLREDUCE_RING_THRESHOLD_BYTES;
        let auto = AllreduceAlgorithm::Auto;
        assert_eq!(
            auto.resolve(t - 4, (t - 4) / 4, 4),
            AllreduceAlgorithm::RecursiveDoubling
        );
        assert_eq!(auto.resolve(t, t / 4, 4), AllreduceAlgorithm::Ring);
        // Fewer elements than ranks: the ring would leave blocks empty.
        assert_eq!(auto.resolve(t, 3, 4), AllreduceAlgorithm::RecursiveDoubling);
        for forced in [
            AllreduceAlgorithm::Ring,
            AllreduceAlgorithm::RecursiveDoubling,
        ] {
            assert_eq!(forced.resolve(0, 0, 8), forced);
            assert_eq!(forced.resolve(1 << 30, 1 << 28, 8), forced);
        }
    }

    #[test]
    fn names_round_trip() {
        for a in [
            AllreduceAlgorithm::Auto,
            AllreduceAlgorithm::RecursiveDoubling,
            AllreduceAlgorithm::Ring,
        ] {
            assert_eq!(a.to_string().parse::<AllreduceAlgorithm>().unwrap(), a);
        }
        let err = "tree"
            .parse::<AllreduceAlgorithm>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("tree") && err.contains("ring"), "{err}");
    }
}
