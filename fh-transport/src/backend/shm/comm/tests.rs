use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::super::{ShmOptions, ShmTransport};
use crate::{Communicator, TransportError};

fn token(tag: &str) -> String {
    format!("shm-comm-unit-{tag}-{}-0123456789", std::process::id())
}

fn opts() -> ShmOptions {
    ShmOptions {
        ring_bytes: 4096,
        ..ShmOptions::with_timeout(Duration::from_secs(10))
    }
}

/// Two ranks as threads; `f` runs on rank 1's communicator, then rank 0 runs `g`, which
/// must fail.
fn corrupt_then(
    tag: &str,
    f: fn(&super::ShmComm),
    g: fn(&mut super::ShmComm) -> crate::Result<()>,
) -> TransportError {
    let tok = token(tag);
    let tok1 = tok.clone();
    let h = std::thread::spawn(move || {
        let mut t = ShmTransport::join(&tok1, 1, 2, opts()).unwrap();
        let c = t.open_shm("c").unwrap();
        f(&c);
        // Keep the communicator alive while rank 0 looks.
        std::thread::sleep(Duration::from_millis(500));
        drop(c);
    });
    let mut t = ShmTransport::join(&tok, 0, 2, opts()).unwrap();
    let mut c = t.open_shm("c").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let err = g(&mut c).unwrap_err();
    h.join().unwrap();
    err
}

#[test]
fn a_rank_that_never_maps_the_segment_is_named_by_every_rank() {
    // Rank 1 joins but never opens the communicator: rank 0 times out waiting for it to
    // map the segment, and rank 2, which waited on rank 0, must name rank 1 too (rank 0's
    // mark carries whom it blames), not rank 0.
    let tok = token("never-maps");
    let opts = || ShmOptions {
        ring_bytes: 4096,
        ..ShmOptions::with_timeout(Duration::from_millis(500))
    };
    let (tok1, tok2) = (tok.clone(), tok.clone());
    let idle = std::thread::spawn(move || {
        let _t = ShmTransport::join(&tok1, 1, 3, opts()).unwrap();
        std::thread::sleep(Duration::from_secs(3));
    });
    let other = std::thread::spawn(move || {
        let mut t = ShmTransport::join(&tok2, 2, 3, opts()).unwrap();
        t.open_shm("c").map(|_| ()).unwrap_err()
    });
    let mut t = ShmTransport::join(&tok, 0, 3, opts()).unwrap();
    let root = t.open_shm("c").map(|_| ()).unwrap_err();
    let err = other.join().unwrap();
    idle.join().unwrap();
    assert_eq!(root.blamed_rank(), Some(1), "rank 0: {root}");
    assert_eq!(err.blamed_rank(), Some(1), "rank 2: {err}");
}

/// As [`corrupt_then`], rank 0 receiving from rank 1.
fn corrupt_then_recv(tag: &str, f: fn(&super::ShmComm)) -> TransportError {
    corrupt_then(tag, f, |c| c.recv(1, &mut [0u8; 16]))
}

fn assert_names_rank_1(err: &TransportError, what: &str) {
    assert!(
        matches!(err, TransportError::Protocol { rank: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(what), "{err}");
}

/// Rank 1 (a thread) marks itself as waiting outside the communicator for enclosing-world
/// rank 7 and keeps rank 0 waiting in a barrier well past rank 0's timeout; `verdict`
/// then decides whether rank 1 gives up blaming rank 7 or stays silent. Returns rank 0's
/// error and its communicator (for what it recorded), after rank 1 has finished.
fn wait_on_a_peer_waiting_outside(tag: &str, verdict: bool) -> (TransportError, super::ShmComm) {
    let timeout = Duration::from_millis(300);
    let opts = move || ShmOptions {
        ring_bytes: 4096,
        ..ShmOptions::with_timeout(timeout)
    };
    let tok = token(tag);
    let tok1 = tok.clone();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let mut t = ShmTransport::join(&tok1, 1, 2, opts()).unwrap();
        let mut c = t.open_shm("c").unwrap();
        c.waiting_outside(Some(Some(7)));
        if verdict {
            // Its own wait outside fails after rank 0's timeout has passed.
            std::thread::sleep(timeout * 3);
            c.give_up(Some(7), true, "rank 7 timed out");
        }
        // Stay attached (and, without a verdict, waiting outside) until rank 0 is done.
        let _ = done_rx.recv_timeout(Duration::from_secs(60));
    });
    let mut t = ShmTransport::join(&tok, 0, 2, opts()).unwrap();
    let mut c = t.open_shm("c").unwrap();
    let grace = if verdict {
        Duration::from_secs(30)
    } else {
        timeout
    };
    c.set_outside_grace(grace);
    let err = c.barrier().unwrap_err();
    done_tx.send(()).unwrap();
    h.join().unwrap();
    (err, c)
}

#[test]
fn a_wait_on_a_peer_waiting_outside_ends_with_that_peers_verdict() {
    let (err, c) = wait_on_a_peer_waiting_outside("verdict", true);
    // Rank 0 waited past its timeout for rank 1's verdict: it reports rank 1's giving up
    // (not a timeout on rank 1), and the rank rank 1 blamed is there for the enclosing
    // communicator to name.
    assert!(
        matches!(&err, TransportError::PeerLost { rank: 1, detail } if detail.contains("gave up")),
        "{err}"
    );
    assert_eq!(c.external_blame(), Some((7, true)));
    assert_eq!(c.outside_blame(), None);
}

#[test]
fn without_a_verdict_the_rank_waited_for_outside_is_blamed() {
    let (err, c) = wait_on_a_peer_waiting_outside("no-verdict", false);
    // The shared-memory error names the local rank waited for; the rank recorded for the
    // enclosing communicator is the one rank 1 waits for outside.
    assert!(
        matches!(err, TransportError::Timeout { rank: 1, .. }),
        "{err}"
    );
    assert_eq!(c.external_blame(), None);
    assert_eq!(c.outside_blame(), Some(7));
    // A peer reading this rank's slot sees the outside rank, as after a `give_up`.
    let word = c.seg.info(0).blame.load(SeqCst);
    assert_eq!(word & super::BLAME_RANK, 8);
    assert_ne!(word & super::BLAME_EXTERNAL, 0);
}

#[test]
fn a_posted_counter_too_far_ahead_is_an_error_naming_its_writer() {
    let err = corrupt_then(
        "posted",
        |c| c.seg.ctl(1).posted.word.store(1 << 30, SeqCst),
        |c| c.barrier(),
    );
    assert_names_rank_1(&err, "rank 1 corrupted its posted counter");
}

#[test]
fn a_consumed_counter_too_far_behind_is_an_error_naming_its_writer() {
    let err = corrupt_then(
        "consumed",
        |c| c.seg.ctl(1).consumed.word.store(u32::MAX - 100, SeqCst),
        |c| c.barrier(),
    );
    assert_names_rank_1(&err, "rank 1 corrupted its consumed counter");
}

#[test]
fn a_round_consumed_but_never_posted_is_an_error_naming_the_peer() {
    let err = corrupt_then(
        "unposted",
        |c| c.seg.ctl(1).consumed.word.store(1, SeqCst),
        |c| c.allgatherv(&[1, 2], &mut [0u8; 4], &[2, 2]),
    );
    assert_names_rank_1(&err, "rank 1 consumed round 0 without advancing its posted");
}

#[test]
fn a_corrupted_ring_head_is_an_error_naming_the_writer() {
    let err = corrupt_then_recv("head", |c| {
        // Rank 1 writes the head of ring 1 -> 0: claim more bytes than the ring holds.
        c.seg.ring_ctl(1, 0).head.word.store(1 << 30, SeqCst);
    });
    assert!(
        matches!(err, TransportError::Protocol { rank: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("corrupted the head counter"),
        "{err}"
    );
}

#[test]
fn a_corrupted_ring_tail_is_an_error_naming_the_reader() {
    let tok = token("tail");
    let tok1 = tok.clone();
    let h = std::thread::spawn(move || {
        let mut t = ShmTransport::join(&tok1, 1, 2, opts()).unwrap();
        let c = t.open_shm("c").unwrap();
        // Rank 1 reads ring 0 -> 1 and so writes its tail: move it past the head.
        c.seg.ring_ctl(0, 1).tail.word.store(7, SeqCst);
        c.seg.ring_ctl(0, 1).head.word.store(0, SeqCst);
        std::thread::sleep(Duration::from_millis(500));
        drop(c);
    });
    let mut t = ShmTransport::join(&tok, 0, 2, opts()).unwrap();
    let mut c = t.open_shm("c").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let err = c.send(1, &[1, 2, 3]).unwrap_err();
    h.join().unwrap();
    assert!(
        matches!(err, TransportError::Protocol { rank: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("corrupted the tail counter"),
        "{err}"
    );
}

/// `buf` in slices of `piece` bytes (the last shorter), cut at bytes `lo` and `hi`: the slices
/// before `lo`, from `lo` to `hi`, and after `hi`.
fn sliced(buf: &mut [u8], piece: usize, lo: usize, hi: usize) -> [Vec<&mut [u8]>; 3] {
    let mut out: [Vec<&mut [u8]>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut off = 0;
    for s in buf.chunks_mut(piece) {
        let end = off + s.len();
        let (s, rest) = s.split_at_mut(lo.clamp(off, end) - off);
        let (m, t) = rest.split_at_mut(hi.clamp(off, end) - lo.clamp(off, end));
        for (i, part) in [s, m, t].into_iter().enumerate() {
            if !part.is_empty() {
                out[i].push(part);
            }
        }
        off = end;
    }
    out
}

/// The in-place reduce-scatter and allgatherv (the hierarchical allreduce's steps, on a
/// buffer in slices) give what the ordinary ones give, with blocks and slices cut by the
/// slot's rounds at odd places (one block empty), and run the same rounds: rank 0 calls the
/// ordinary collectives while the others call the in-place ones.
#[test]
fn in_place_steps_match_the_ordinary_ones_and_mix_with_them() {
    use fh_core::{DType, ReduceOp};
    let n = 3;
    let tok = token("in-place");
    let opts = || ShmOptions {
        slot_bytes: 4096,
        ..opts()
    };
    // Elements of 4 bytes; a slot round holds 1024 of them.
    let cases: [[usize; 3]; 3] = [[1001, 3333, 7], [0, 2049, 4097], [1500, 1, 1500]];
    let value = |r: usize, i: usize| (r * 7919 + i * 31) as i32 % 1000 - 500;
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let tok = tok.clone();
            std::thread::spawn(move || {
                let mut t = ShmTransport::join(&tok, r, n, opts()).unwrap();
                let mut c = t.open_shm("c").unwrap();
                for (case, counts) in cases.into_iter().enumerate() {
                    // Slices of 1 element, of 700 (not a divisor of a round) or whole.
                    let piece = [4, 2800, usize::MAX][case];
                    let total: usize = counts.iter().sum();
                    let lo: usize = counts[..r].iter().sum();
                    let hi = lo + counts[r];
                    let bytes = |v: &[i32]| bytemuck::cast_slice::<i32, u8>(v).to_vec();
                    let input: Vec<i32> = (0..total).map(|i| value(r, i)).collect();
                    let sum: Vec<i32> = (0..total)
                        .map(|i| (0..n).map(|q| value(q, i)).sum())
                        .collect();
                    // Reduce-scatter.
                    let mut buf = bytes(&input);
                    if r == 0 {
                        let mut recv = vec![0u8; counts[r] * 4];
                        c.reduce_scatter(&buf, &mut recv, &counts, DType::I32, ReduceOp::Sum)
                            .unwrap();
                        buf[lo * 4..hi * 4].copy_from_slice(&recv);
                    } else {
                        let [before, mut own, after] = sliced(&mut buf, piece, lo * 4, hi * 4);
                        let (b, a): (Vec<&[u8]>, Vec<&[u8]>) = (
                            before.iter().map(|s| &**s).collect(),
                            after.iter().map(|s| &**s).collect(),
                        );
                        c.reduce_scatter_in_place(
                            &b,
                            &mut own,
                            &a,
                            &counts,
                            DType::I32,
                            ReduceOp::Sum,
                        )
                        .unwrap();
                        // The rest of the input is left as it was.
                        assert_eq!(before.concat(), bytes(&input[..lo]));
                        assert_eq!(after.concat(), bytes(&input[hi..]));
                    }
                    assert_eq!(&buf[lo * 4..hi * 4], &bytes(&sum[lo..hi])[..], "{counts:?}");
                    // Allgather of the reduced blocks into a buffer holding garbage elsewhere.
                    let block = buf[lo * 4..hi * 4].to_vec();
                    let mut out = vec![0xa5u8; total * 4];
                    let byte_counts: Vec<usize> = counts.iter().map(|c| c * 4).collect();
                    if r == 0 {
                        c.allgatherv(&block, &mut out, &byte_counts).unwrap();
                    } else {
                        out[lo * 4..hi * 4].copy_from_slice(&block);
                        let [mut before, own, mut after] = sliced(&mut out, piece, lo * 4, hi * 4);
                        let own: Vec<&[u8]> = own.iter().map(|s| &**s).collect();
                        c.allgatherv_in_place(&mut before, &own, &mut after, &byte_counts)
                            .unwrap();
                    }
                    assert_eq!(out, bytes(&sum), "{counts:?}");
                }
            })
        })
        .collect();
    for h in ranks {
        h.join().unwrap();
    }
}

#[test]
fn in_place_steps_reject_a_block_out_of_place() {
    use fh_core::{DType, ReduceOp};
    let tok = token("in-place-args");
    let tok1 = tok.clone();
    // Rank 1 never calls a collective: the arguments are refused before any round starts.
    let h = std::thread::spawn(move || {
        let mut t = ShmTransport::join(&tok1, 1, 2, opts()).unwrap();
        let _c = t.open_shm("c").unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    let mut t = ShmTransport::join(&tok, 0, 2, opts()).unwrap();
    let mut c = t.open_shm("c").unwrap();
    // Rank 0's block comes first: nothing may precede it.
    let err = c
        .reduce_scatter_in_place(
            &[&[0; 4]],
            &mut [&mut [0; 8]],
            &[&[0; 4]],
            &[2, 2],
            DType::F32,
            ReduceOp::Sum,
        )
        .unwrap_err();
    assert!(matches!(err, TransportError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("precede"), "{err}");
    let err = c
        .allgatherv_in_place(&mut [&mut [0; 4]], &[&[0; 4]], &mut [], &[4, 4])
        .unwrap_err();
    assert!(err.to_string().contains("precede"), "{err}");
    h.join().unwrap();
}
