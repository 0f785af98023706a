//! Variable-length byte lists between ranks, over the control communicator, and the bitwise
//! reductions of the negotiation's vectors.
//!
//! Every one of them carries the engine's incarnation (`config::agree_incarnation`): each
//! length word travels with it, each reduced vector with it and its complement. A message of
//! another engine of the same processes (an earlier `init()`) is refused on every rank that
//! receives it, with an error that says so, instead of being read as one of this engine's.

use fh_core::bytes::{DecodeError, Reader};
use fh_core::{DType, ReduceOp};
use fh_transport::algorithms::ReducePart;
use fh_transport::{CollectivesExt, Communicator, TransportError};

use crate::SchedulerError;

/// Most bytes a control-plane message may announce (a sanity bound on lengths from peers).
pub(crate) const MAX_CONTROL_BYTES: usize = 1 << 30;

/// The sum of message lengths announced by peers, refused when absurd.
pub(crate) fn checked_total(counts: &[usize]) -> Result<usize, SchedulerError> {
    counts
        .iter()
        .try_fold(0usize, |a, &c| a.checked_add(c))
        .filter(|&t| t <= MAX_CONTROL_BYTES)
        .ok_or_else(|| SchedulerError::Transport {
            lost_rank: None,
            message: format!("a peer announced control messages of {counts:?} bytes; refusing"),
            source: None,
        })
}

/// Control bytes (`what`) in a buffer this rank sized that could not be read: a broken
/// invariant, never a value made up.
fn unreadable(what: &str, len: usize, e: DecodeError) -> SchedulerError {
    SchedulerError::internal(format!("{what} ({len} bytes) cannot be read: {e}"))
}

/// Read all of `b` with `read`: bytes missing or left over are `what`'s [`unreadable`] error.
fn read_exactly<'a, T>(
    b: &'a [u8],
    what: impl FnOnce() -> String,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<T, SchedulerError> {
    let mut r = Reader::new(b);
    read(&mut r)
        .and_then(|v| r.end().map(|()| v))
        .map_err(|e| unreadable(&what(), b.len(), e))
}

/// The error for a control message of rank `from` that belongs to another engine.
fn stale(from: Option<usize>, theirs: u64, mine: u64) -> SchedulerError {
    let who = from.map_or_else(|| "a peer".to_string(), |r| format!("rank {r}"));
    SchedulerError::Transport {
        lost_rank: from,
        message: format!(
            "{who} sent a control message of another engine (incarnation {theirs:016x}, this \
             engine's is {mine:016x}): a message of an earlier init() reached this one; \
             refused"
        ),
        source: None,
    }
}

/// A length word with the engine's incarnation: 16 bytes.
fn header(tag: u64, len: usize) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&tag.to_le_bytes());
    h[8..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// The length in a header from rank `from`, once its incarnation is checked; a length past
/// [`MAX_CONTROL_BYTES`] is refused as that rank's protocol error.
fn read_header(h: &[u8], tag: u64, from: usize) -> Result<usize, SchedulerError> {
    let (theirs, len) = read_exactly(
        h,
        || format!("the control header from rank {from}"),
        |r| Ok((r.u64()?, r.u64()?)),
    )?;
    if theirs != tag {
        return Err(stale(Some(from), theirs, tag));
    }
    usize::try_from(len)
        .ok()
        .filter(|&n| n <= MAX_CONTROL_BYTES)
        .ok_or_else(|| {
            TransportError::Protocol {
                rank: from,
                detail: format!(
                    "announced a control message of {len} bytes, more than the \
                     {MAX_CONTROL_BYTES}-byte bound; refusing"
                ),
            }
            .into()
        })
}

/// The incarnation and its complement after the first `n` bytes of a reduced vector.
fn read_tag_words(bits: &[u8], n: usize) -> Result<(u64, u64), SchedulerError> {
    read_exactly(
        bits,
        || format!("a reduced control vector of {n} bytes and its incarnation"),
        |r| {
            r.bytes(n)?;
            Ok((r.u64()?, r.u64()?))
        },
    )
}

/// The allgathered control messages `all`, cut at the lengths `counts` announced.
fn split_blobs(all: &[u8], counts: &[usize]) -> Result<Vec<Vec<u8>>, SchedulerError> {
    read_exactly(
        all,
        || format!("control messages of {counts:?} bytes"),
        |r| counts.iter().map(|&n| Ok(r.bytes(n)?.to_vec())).collect(),
    )
}

/// Reduce `bits` bytewise with `op` (`BitAnd` or `BitOr`) over every rank, the engine's
/// incarnation `tag` and its complement appended: when every rank sent the same tag the
/// result carries it unchanged, and when any two differ, some bit is set in one and clear in
/// the other, so the reduced pair is no longer a tag and its complement, on every rank.
pub(crate) fn reduce_bits(
    comm: &mut dyn Communicator,
    bits: &mut Vec<u8>,
    op: ReduceOp,
    tag: u64,
) -> Result<(), SchedulerError> {
    let n = bits.len();
    bits.extend_from_slice(&tag.to_le_bytes());
    bits.extend_from_slice(&(!tag).to_le_bytes());
    comm.allreduce(bits, DType::U8, op)?;
    let (t, c) = read_tag_words(bits, n)?;
    bits.truncate(n);
    if t != tag || c != !tag {
        return Err(stale(None, t, tag));
    }
    Ok(())
}

/// [`reduce_bits`] with `extra` bytes reduced in the same collective as `extra_parts` (each
/// with its own dtype and op: the small allreduces that ride in a round), after the vector and
/// its incarnation words, padded to 8 bytes. With no extra bytes it is [`reduce_bits`].
pub(crate) fn reduce_bits_with(
    comm: &mut dyn Communicator,
    bits: &mut Vec<u8>,
    op: ReduceOp,
    tag: u64,
    extra: &mut [u8],
    extra_parts: &[ReducePart],
) -> Result<(), SchedulerError> {
    if extra.is_empty() {
        return reduce_bits(comm, bits, op, tag);
    }
    let n = bits.len();
    bits.extend_from_slice(&tag.to_le_bytes());
    bits.extend_from_slice(&(!tag).to_le_bytes());
    bits.resize(bits.len().div_ceil(8) * 8, 0);
    let head = bits.len();
    bits.extend_from_slice(extra);
    let mut parts = Vec::with_capacity(extra_parts.len() + 1);
    parts.push(ReducePart {
        len: head,
        dtype: DType::U8,
        op,
    });
    parts.extend_from_slice(extra_parts);
    comm.allreduce_parts(bits, &parts)?;
    extra.copy_from_slice(&bits[head..]);
    let (t, c) = read_tag_words(&bits[..n + 16], n)?;
    bits.truncate(n);
    if t != tag || c != !tag {
        return Err(stale(None, t, tag));
    }
    Ok(())
}

/// Every rank's `mine`, in rank order (an allgather of lengths, then of the bytes); `tag`:
/// the engine's incarnation.
pub(crate) fn allgather_blobs(
    comm: &mut dyn Communicator,
    mine: &[u8],
    tag: u64,
) -> Result<Vec<Vec<u8>>, SchedulerError> {
    let size = comm.size();
    let mut lens = vec![0u8; 16 * size];
    comm.allgather(&header(tag, mine.len()), &mut lens)?;
    let counts = lens
        .chunks_exact(16)
        .enumerate()
        .map(|(r, h)| read_header(h, tag, r))
        .collect::<Result<Vec<usize>, _>>()?;
    let mut all = vec![0u8; checked_total(&counts)?];
    comm.allgatherv(mine, &mut all, &counts)?;
    split_blobs(&all, &counts)
}

/// Gather every rank's `mine` to rank 0: rank 0 gets them in rank order, the others `None`.
/// Each rank sends a length and then (when not empty) its bytes, point to point: O(N) bytes
/// in all, where an allgather would move O(N²). `tag`: the engine's incarnation.
pub(crate) fn gather_to_root(
    comm: &mut dyn Communicator,
    mine: &[u8],
    tag: u64,
) -> Result<Option<Vec<Vec<u8>>>, SchedulerError> {
    if comm.rank() != 0 {
        comm.send(0, &header(tag, mine.len()))?;
        if !mine.is_empty() {
            comm.send(0, mine)?;
        }
        return Ok(None);
    }
    let size = comm.size();
    let mut lists = Vec::with_capacity(size);
    lists.push(mine.to_vec());
    let mut total = mine.len();
    for r in 1..size {
        let mut h = [0u8; 16];
        comm.recv(r, &mut h)?;
        let n = read_header(&h, tag, r)?;
        total = checked_total(&[total, n])?;
        let mut b = vec![0u8; n];
        if n > 0 {
            comm.recv(r, &mut b)?;
        }
        lists.push(b);
    }
    Ok(Some(lists))
}

/// Broadcast rank 0's `bytes` (of a length only rank 0 knows) to every rank; `tag`: the
/// engine's incarnation.
pub(crate) fn broadcast_blob(
    comm: &mut dyn Communicator,
    mut bytes: Vec<u8>,
    tag: u64,
) -> Result<Vec<u8>, SchedulerError> {
    let mut h = header(tag, bytes.len());
    comm.broadcast(&mut h, 0)?;
    let n = checked_total(&[read_header(&h, tag, 0)?])?;
    bytes.resize(n, 0);
    if n > 0 {
        comm.broadcast(&mut bytes, 0)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fh_transport::backend::local::LocalWorld;
    use fh_transport::Transport;

    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(&mut dyn Communicator) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let threads: Vec<_> = LocalWorld::with_timeout(n, std::time::Duration::from_secs(10))
            .into_iter()
            .map(|mut t| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut c = t.open("test").unwrap();
                    f(c.as_mut())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn gather_allgather_and_broadcast_blobs() {
        for n in [1, 2, 5] {
            let out = on_ranks(n, |c| {
                let mine = vec![c.rank() as u8; c.rank()];
                let g = gather_to_root(c, &mine, 9).unwrap();
                let a = allgather_blobs(c, &mine, 9).unwrap();
                let root = if c.rank() == 0 { vec![7; 3] } else { vec![] };
                let b = broadcast_blob(c, root, 9).unwrap();
                (g, a, b)
            });
            let want: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8; r]).collect();
            for (r, (g, a, b)) in out.into_iter().enumerate() {
                assert_eq!(g, (r == 0).then(|| want.clone()));
                assert_eq!(a, want);
                assert_eq!(b, [7, 7, 7]);
            }
        }
    }

    #[test]
    fn absurd_lengths_are_refused_before_allocating() {
        assert!(checked_total(&[1, 2]).is_ok());
        assert!(checked_total(&[usize::MAX, 1]).is_err());
        assert!(checked_total(&[MAX_CONTROL_BYTES, 1]).is_err());
        // A peer announcing an absurd length: rank 0 refuses it.
        let out = on_ranks(2, |c| {
            if c.rank() == 1 {
                c.send(0, &header(5, usize::MAX)).unwrap();
                None
            } else {
                Some(gather_to_root(c, &[], 5).unwrap_err().to_string())
            }
        });
        assert!(out[0].as_ref().unwrap().contains("refusing"), "{out:?}");
    }

    #[test]
    fn control_words_that_cannot_be_read_are_errors_never_values() {
        let internal = |e: SchedulerError, want: &[&str]| match &e {
            SchedulerError::Internal(m) if want.iter().all(|w| m.contains(w)) => {}
            _ => panic!("{want:?}: {e}"),
        };
        // A header: the incarnation, then the length.
        let h = header(5, 3);
        assert_eq!(read_header(&h, 5, 2), Ok(3));
        internal(
            read_header(&h[..15], 5, 2).unwrap_err(),
            &["the control header from rank 2 (15 bytes)", "truncated"],
        );
        internal(
            read_header(&[&h[..], &[0]].concat(), 5, 2).unwrap_err(),
            &["(17 bytes)", "1 trailing bytes"],
        );
        // A length past the bound is the announcing rank's protocol error.
        assert_eq!(
            read_header(&header(5, MAX_CONTROL_BYTES), 5, 2),
            Ok(MAX_CONTROL_BYTES)
        );
        let e = read_header(&header(5, MAX_CONTROL_BYTES + 1), 5, 2).unwrap_err();
        assert_eq!(e.lost_rank(), Some(2), "{e}");
        let m = e.to_string();
        assert!(
            m.contains("protocol error with rank 2") && m.contains("refusing"),
            "{m}"
        );
        // A reduced vector's incarnation and its complement.
        let v = [
            &[1u8, 2, 3][..],
            &7u64.to_le_bytes(),
            &(!7u64).to_le_bytes(),
        ]
        .concat();
        assert_eq!(read_tag_words(&v, 3), Ok((7, !7)));
        internal(
            read_tag_words(&v[..18], 3).unwrap_err(),
            &["a reduced control vector of 3 bytes", "truncated"],
        );
        internal(read_tag_words(&v, 2).unwrap_err(), &["1 trailing bytes"]);
        // Allgathered messages cut at their announced lengths.
        assert_eq!(
            split_blobs(b"abcd", &[1, 0, 3]),
            Ok(vec![b"a".to_vec(), vec![], b"bcd".to_vec()])
        );
        internal(
            split_blobs(b"abc", &[1, 3]).unwrap_err(),
            &["control messages of [1, 3] bytes (3 bytes)", "truncated"],
        );
        internal(
            split_blobs(b"abcd", &[1, 2]).unwrap_err(),
            &["1 trailing bytes"],
        );
    }

    /// Rank `r`'s incarnation in the stale-message tests: rank 1 still speaks for an earlier
    /// engine.
    fn tag_of(r: usize) -> u64 {
        if r == 1 {
            0x0123_4567_89ab_cdef
        } else {
            0xfeed_f00d_0000_0001
        }
    }

    #[test]
    fn a_message_of_another_incarnation_is_refused_on_every_rank_that_reads_it() {
        for n in [2, 3] {
            // Reduced vectors: every rank sees the mismatch, with AND and with OR, whatever
            // the bits of the two tags (one a subset of the other included).
            for (a, b) in [(tag_of(0), tag_of(1)), (0b1011, 0b0011), (0, u64::MAX)] {
                for op in [ReduceOp::BitAnd, ReduceOp::BitOr] {
                    let out = on_ranks(n, move |c| {
                        let tag = if c.rank() == 1 { b } else { a };
                        let mut v = vec![0b1010u8, 0xff];
                        reduce_bits(c, &mut v, op, tag).map_err(|e| e.to_string())
                    });
                    for (r, res) in out.iter().enumerate() {
                        let e = res.as_ref().unwrap_err();
                        assert!(e.contains("another engine"), "np {n} rank {r} {op:?}: {e}");
                    }
                }
            }
            // The same tag: the vector reduces as without it.
            let out = on_ranks(n, |c| {
                let mut v = vec![0b1010u8 | c.rank() as u8, 0xff];
                reduce_bits(c, &mut v, ReduceOp::BitAnd, 77).unwrap();
                v
            });
            for (r, v) in out.iter().enumerate() {
                let want = (0..n).fold(0xffu8, |a, x| a & (0b1010 | x as u8));
                assert_eq!(v, &vec![want, 0xff], "np {n} rank {r}");
            }
            // Gathers, allgathers and broadcasts name the rank whose message is stale.
            let out = on_ranks(n, |c| {
                let tag = tag_of(c.rank());
                gather_to_root(c, b"x", tag)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            let e = out[0].as_ref().unwrap_err();
            assert!(e.contains("rank 1") && e.contains("earlier init()"), "{e}");
            let out = on_ranks(n, |c| {
                let tag = tag_of(c.rank());
                allgather_blobs(c, b"y", tag)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            for (r, a) in out.iter().enumerate() {
                let e = a.as_ref().unwrap_err();
                if r == 1 {
                    // Rank 1 reads rank 0's message first: from its point of view rank 0 is
                    // the other engine.
                    assert!(e.contains("rank 0") && e.contains("another engine"), "{e}");
                } else {
                    assert!(e.contains("rank 1") && e.contains("another engine"), "{e}");
                }
            }
            let out = on_ranks(n, |c| {
                let tag = tag_of(c.rank());
                broadcast_blob(c, vec![1, 2], tag)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            assert!(out[0].is_ok(), "rank 0 sends only");
            let e = out[1].as_ref().unwrap_err();
            assert!(e.contains("rank 0") && e.contains("another engine"), "{e}");
        }
    }
}
