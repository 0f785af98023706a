//! The collective helpers a channel's executor runs on its communicator: in-place reductions
//! over one or several slices, the average's divisor, and the layout of what peers send.

use fh_core::bytes::{DecodeError, Reader};
use fh_core::kernels;
use fh_core::message::Signature;
use fh_core::ReduceOp;
use fh_transport::{Communicator, TransportError};

use crate::Tensor;

/// Allreduce `buf` where it lies and finish it (the average's division, the postscale):
/// on this rank's block of the ring when `own_block`, else after the whole allreduce.
/// `agree`: `Some(mine)` when the allreduce also agrees whether every rank can run it
/// ([`reduce_unfinished`]); `Ok(false)` when one cannot (`buf` then holds nothing meaningful).
pub(super) fn reduce_in_place(
    comm: &mut dyn Communicator,
    buf: &mut [u8],
    sig: &Signature,
    divisor: usize,
    own_block: bool,
    agree: Option<bool>,
) -> Result<bool, TransportError> {
    if own_block && agree.is_none() {
        reduce_segments(comm, &mut [buf], sig, divisor)?;
        return Ok(true);
    }
    if !reduce_unfinished(comm, buf, sig, agree)? {
        return Ok(false);
    }
    // The average's division (if any) and the postscale in one pass.
    kernels::divide_and_scale(sig.dtype, buf, finish_divisor(sig, divisor), sig.postscale)?;
    Ok(true)
}

/// Prescale and allreduce the concatenation of `segs` where it lies, on the ring; the
/// average's division and the postscale run on this rank's block only, before the ring's
/// allgather copies it round ([`Communicator::allreduce_segments`]).
pub(super) fn reduce_segments(
    comm: &mut dyn Communicator,
    segs: &mut [&mut [u8]],
    sig: &Signature,
    divisor: usize,
) -> Result<(), TransportError> {
    let (dtype, n, post) = (sig.dtype, finish_divisor(sig, divisor), sig.postscale);
    for s in segs.iter_mut() {
        kernels::scale(dtype, s, sig.prescale)?;
    }
    comm.allreduce_segments(segs, dtype, sig.op.combining(), &mut |b| {
        Ok(kernels::divide_and_scale(dtype, b, n, post)?)
    })
}

/// Prescale and allreduce `buf`, leaving the average's division and the postscale to the
/// caller ([`finish_divisor`]). With `agree: Some(mine)` the same collective also ANDs
/// whether every rank can run the group ([`Communicator::allreduce_agreeing`]); the answer
/// is returned (`true` when no agreement was asked).
pub(super) fn reduce_unfinished(
    comm: &mut dyn Communicator,
    buf: &mut [u8],
    sig: &Signature,
    agree: Option<bool>,
) -> Result<bool, TransportError> {
    kernels::scale(sig.dtype, buf, sig.prescale)?;
    match agree {
        None => {
            comm.allreduce(buf, sig.dtype, sig.op.combining())?;
            Ok(true)
        }
        Some(mine) => comm.allreduce_agreeing(buf, sig.dtype, sig.op.combining(), mine),
    }
}

/// The divisor the finalisation applies with the postscale: the engine's ranks for an average
/// (joined ones included, see [`Job::divisor`]), 1 otherwise.
pub(super) fn finish_divisor(sig: &Signature, divisor: usize) -> usize {
    if sig.op == ReduceOp::Average {
        divisor.max(1)
    } else {
        1
    }
}

/// Most bytes one allgather or alltoall may receive (a sanity bound on sizes announced by
/// peers, checked before anything is multiplied out or allocated).
pub(super) const MAX_RECV_BYTES: usize = 1 << 40;

/// Byte counts for the row counts `rows` peers announced (`rows[r]` from rank `r`), each row
/// `row` bytes, and a zeroed buffer for their sum. Overflow or an absurd size is an error
/// blaming the rank that announced it; an allocation that fails is an error, not an abort.
pub(super) fn recv_layout(
    rows: &[usize],
    row: usize,
) -> Result<(Vec<usize>, Vec<u8>), TransportError> {
    let mut counts = Vec::with_capacity(rows.len());
    let mut total = 0usize;
    for (r, &n) in rows.iter().enumerate() {
        let c = n
            .checked_mul(row)
            .filter(|&c| c <= MAX_RECV_BYTES)
            .ok_or_else(|| TransportError::Protocol {
                rank: r,
                detail: format!(
                    "announced {n} rows of {row} bytes, more than the {MAX_RECV_BYTES}-byte bound"
                ),
            })?;
        total = total
            .checked_add(c)
            .filter(|&t| t <= MAX_RECV_BYTES)
            .ok_or_else(|| TransportError::Protocol {
                rank: r,
                detail: format!(
                    "announced {n} rows of {row} bytes, taking the total past the \
                     {MAX_RECV_BYTES}-byte bound"
                ),
            })?;
        counts.push(c);
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(total).map_err(|e| {
        TransportError::InvalidArgument(format!("cannot allocate {total} bytes to receive: {e}"))
    })?;
    buf.resize(total, 0);
    Ok((counts, buf))
}

pub(super) fn u64s(v: &[usize]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as u64).to_le_bytes()).collect()
}

/// The count each of `ranks` ranks sent (`what`, a little-endian `u64` each, in rank order),
/// as [`u64s`] wrote them. The buffer is this rank's, sized for exactly those, so bytes missing
/// or left over are a broken invariant; a count this machine cannot address is the sending
/// rank's protocol error.
pub(super) fn from_u64s(b: &[u8], ranks: usize, what: &str) -> Result<Vec<usize>, TransportError> {
    let unreadable = |e: DecodeError| {
        TransportError::Internal(format!(
            "{what} from {ranks} ranks ({} bytes) cannot be read: {e}",
            b.len()
        ))
    };
    let mut r = Reader::new(b);
    let mut out = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let v = r.u64().map_err(unreadable)?;
        out.push(usize::try_from(v).map_err(|_| TransportError::Protocol {
            rank,
            detail: format!("announced {v} {what}, more than this machine can address"),
        })?);
    }
    r.end().map_err(unreadable)?;
    Ok(out)
}

/// Bytes per first-dimension row.
pub(super) fn row_bytes(t: &Tensor) -> usize {
    let rest: usize = t.shape().iter().skip(1).product();
    rest * t.dtype().size()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_peers_are_bounded_before_allocating() {
        let (counts, buf) = recv_layout(&[2, 0, 3], 4).unwrap();
        assert_eq!(counts, [8, 0, 12]);
        assert_eq!(buf.len(), 20);
        // A product that overflows, and one past the bound, blame the rank that sent it.
        let e = recv_layout(&[1, usize::MAX / 2], 4).unwrap_err();
        assert_eq!(e.blamed_rank(), Some(1), "{e}");
        let e = recv_layout(&[MAX_RECV_BYTES, 1, 0], 1).unwrap_err();
        assert_eq!(e.blamed_rank(), Some(1), "{e}");
        assert!(e.to_string().contains("bound"), "{e}");
    }

    #[test]
    fn counts_from_peers_are_read_exactly() {
        let b = u64s(&[2, 0, usize::MAX]);
        assert_eq!(from_u64s(&b, 3, "rows").unwrap(), [2, 0, usize::MAX]);
        // A buffer of another size than the ranks' counts is a bug, named, never a count.
        for (bytes, ranks, want) in [
            (
                &b[..23],
                3,
                "rows from 3 ranks (23 bytes) cannot be read: truncated",
            ),
            (
                &b[..],
                2,
                "rows from 2 ranks (24 bytes) cannot be read: 8 trailing bytes",
            ),
        ] {
            let e = from_u64s(bytes, ranks, "rows").unwrap_err();
            assert!(
                matches!(&e, TransportError::Internal(m) if m.starts_with(want)),
                "{want}: {e}"
            );
        }
    }
}
