//! The TCP backend with every rank as a thread of this process (on 127.0.0.1): the door's
//! refusals as the stranger sees them, timeouts, and peers that go away.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::{wire, TcpOptions, TcpTransport};
use fh_transport::{CollectivesExt, Transport, TransportError};

fn info(rank: usize, size: usize, port: u16, timeout_s: u64) -> LaunchInfo {
    LaunchInfo {
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(JobToken::new("in-process-test-token")),
        timeout: Duration::from_secs(timeout_s),
        ..LaunchInfo::bare(rank, size)
    }
}

/// A world of `size` TCP transports, one per thread, joined here.
fn world(size: usize, timeout_s: u64, handshake: Duration) -> Vec<TcpTransport> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let info = info(rank, size, port, timeout_s);
            std::thread::spawn(move || {
                let mut opts = TcpOptions::from_info(&info);
                opts.handshake_timeout = handshake;
                TcpTransport::connect(&info, opts)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("thread").expect("connect"))
        .collect()
}

/// Run `f` on every rank of `w`, one thread each, and return the results by rank (a panic on
/// any rank fails the test).
fn on_every_rank<R, F>(w: Vec<TcpTransport>, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(TcpTransport) -> R + Send + Sync + 'static,
{
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = w
        .into_iter()
        .map(|t| {
            let f = std::sync::Arc::clone(&f);
            std::thread::spawn(move || f(t))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Send raw bytes and return the refusal they earn (before any challenge).
fn refusal(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    match wire::Reply::decode(&reply) {
        Ok((wire::Reply::Refuse(why), _)) => why,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn hello(version: u16, size: u32, rank: u32) -> wire::Hello {
    wire::Hello {
        version,
        kind: wire::ConnKind::Data,
        size,
        rank,
        seq: 0,
        port: 0,
        lost: 0,
        world: [0; wire::WORLD_ID_LEN],
        nonce: [9; wire::NONCE_LEN],
    }
}

/// Do a whole handshake as a connector that knows `token` (answering the challenge whether
/// or not the listener's proof checks out) and return the final refusal reason, or `None` when
/// accepted.
fn knock(addr: std::net::SocketAddr, h: &wire::Hello, token: &[u8]) -> Option<String> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let hb = h.encode();
    s.write_all(&hb).unwrap();
    let mut ch = [0u8; wire::CHALLENGE_LEN];
    s.read_exact(&mut ch).unwrap();
    let Ok((wire::Answer::Challenge { nonce, .. }, _)) = wire::Answer::decode(&ch) else {
        panic!("expected a challenge")
    };
    s.write_all(&wire::encode_proof(&wire::connector_proof(
        &fh_job::Key::new(token),
        &hb,
        &nonce,
    )))
    .unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    match wire::Reply::decode(&reply) {
        Ok((wire::Reply::Refuse(why), _)) => Some(why),
        Ok((wire::Reply::Accept, _)) => None,
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[test]
fn the_door_says_why_it_refuses() {
    let w = world(2, 30, Duration::from_secs(5));
    let rank0 = w[0].peer_addresses()[0];
    let token = b"in-process-test-token";

    let mut other_version = hello(wire::PROTOCOL_VERSION, 2, 1).encode();
    let other = wire::PROTOCOL_VERSION + 1;
    other_version[4..6].copy_from_slice(&other.to_le_bytes());
    let why = refusal(rank0, &other_version);
    assert!(why.contains(&format!("wire protocol {other}")), "{why}");

    // The same protocol from another release: refused before the challenge, naming both.
    let mut other_release = hello(wire::PROTOCOL_VERSION, 2, 1).encode();
    other_release[6..wire::PREAMBLE_LEN].fill(0);
    other_release[6..11].copy_from_slice(b"0.0.1");
    let why = refusal(rank0, &other_release);
    assert!(
        why.contains("the connecting rank runs FastHorovod 0.0.1"),
        "{why}"
    );
    assert!(
        why.contains(&format!(
            "the listening rank runs FastHorovod {}",
            fh_core::RELEASE
        )),
        "{why}"
    );

    let why = knock(rank0, &hello(wire::PROTOCOL_VERSION, 3, 1), token).unwrap();
    assert!(why.contains("world size mismatch"), "{why}");

    let why = knock(
        rank0,
        &hello(wire::PROTOCOL_VERSION, 2, 1),
        b"not-the-job-token-at-all",
    )
    .unwrap();
    assert!(why.contains("wrong job token"), "{why}");

    let why = knock(rank0, &hello(wire::PROTOCOL_VERSION, 2, 0), token).unwrap();
    assert!(why.contains("may not connect"), "{why}");

    let why = refusal(rank0, b"SSH-2.0-OpenSSH_9.6\r\n");
    assert!(why.contains("bad magic"), "{why}");

    // After all that, the world still works.
    let results = on_every_rank(w, move |mut t| {
        let mut c = t.open("after strangers").unwrap();
        let mut v = [t.rank() as i32 + 1; 5];
        c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
        v
    });
    for r in results {
        assert_eq!(r, [3; 5]);
    }
}

#[test]
fn a_slow_or_silent_stranger_is_cut_off() {
    let w = world(2, 30, Duration::from_millis(500));
    let rank1 = w[1].peer_addresses()[1];
    let mut drip = TcpStream::connect(rank1).unwrap();
    drip.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let start = Instant::now();
    // A well-formed handshake, one byte at a time: with a per-read timeout only, this would be
    // served for as long as the stranger likes.
    let bytes = hello(wire::PROTOCOL_VERSION, 2, 1).encode();
    let mut closed = false;
    let mut sent = 0;
    for b in &bytes {
        if drip.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        let mut one = [0u8; 1];
        match drip.read(&mut one) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed, "a dripping connection was never cut off");
    assert!(
        sent < bytes.len(),
        "the whole handshake got through ({sent} bytes)"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let mut w = world(2, 1, Duration::from_secs(1));
    let mut t1 = w.pop().unwrap();
    let mut t0 = w.pop().unwrap();
    let h = std::thread::spawn(move || {
        let c = t0.open("c").unwrap();
        // Hold the communicator open without sending anything, longer than the timeout and
        // the one extension a peer that still answers the liveness probe gets (1 s + 2.5 s).
        std::thread::sleep(Duration::from_secs(6));
        drop(c);
    });
    let mut c1 = t1.open("c").unwrap();
    let mut buf = [0u8; 16];
    let err = c1.recv(0, &mut buf).unwrap_err();
    assert!(
        matches!(err, TransportError::Timeout { rank: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("FH_TIMEOUT_SECONDS"), "{err}");
    // The communicator is unusable afterwards, and says so.
    assert!(c1.recv(0, &mut buf).is_err());
    h.join().unwrap();
}

#[test]
fn a_departed_peer_is_reported_at_once() {
    // A long timeout: the loss must be noticed from the closed connection, not by waiting.
    let mut w = world(3, 600, Duration::from_secs(5));
    let mut t2 = w.pop().unwrap();
    let mut t1 = w.pop().unwrap();
    let mut t0 = w.pop().unwrap();
    let h0 = std::thread::spawn(move || {
        let c = t0.open("c").unwrap();
        drop(c); // rank 0 leaves
    });
    let h2 = std::thread::spawn(move || {
        let mut c = t2.open("c").unwrap();
        let mut big = vec![0u8; 32 << 20];
        // Rank 1 waits for this, then for rank 0, which is gone.
        c.send(1, &big[..1024]).unwrap();
        let err = c.recv(0, &mut big).unwrap_err();
        (err.blamed_rank(), err.to_string())
    });
    let start = Instant::now();
    let mut c1 = t1.open("c").unwrap();
    let mut small = [0u8; 1024];
    c1.recv(2, &mut small).unwrap();
    let err = c1.recv(0, &mut small).unwrap_err();
    assert_eq!(err.blamed_rank(), Some(0), "{err}");
    assert!(matches!(err, TransportError::PeerLost { .. }), "{err}");
    let (blamed, text) = h2.join().unwrap();
    assert_eq!(blamed, Some(0), "{text}");
    assert!(start.elapsed() < Duration::from_secs(60));
    h0.join().unwrap();
}

#[test]
fn messages_of_every_shape() {
    let w = world(2, 30, Duration::from_secs(5));
    on_every_rank(w, move |mut t| {
        let r = t.rank();
        let other = 1 - r;
        let mut c = t.open("shapes").unwrap();
        // Zero-length messages.
        c.send(other, &[]).unwrap();
        c.recv(other, &mut []).unwrap();
        // Many small messages in a row, then big ones both ways at once.
        for i in 0..100u32 {
            c.send(other, &i.to_le_bytes()).unwrap();
        }
        for i in 0..100u32 {
            let mut b = [0u8; 4];
            c.recv(other, &mut b).unwrap();
            assert_eq!(u32::from_le_bytes(b), i);
        }
        let out: Vec<u8> = (0..24 << 20).map(|i| (i % 253) as u8 ^ r as u8).collect();
        let mut inp = vec![0u8; 24 << 20];
        c.send_recv(other, &out, other, &mut inp).unwrap();
        assert!(inp
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 253) as u8 ^ other as u8));
        // Out-of-range peers and oversized lengths are argument errors, not I/O.
        assert!(matches!(
            c.send(5, &[1]),
            Err(TransportError::InvalidArgument(_))
        ));
        c.barrier().unwrap();
    });
}

#[test]
fn opening_with_a_departed_rank_fails_naming_it() {
    // A long timeout: the refused connection must be recognised, not waited out.
    let mut w = world(2, 600, Duration::from_secs(5));
    let mut t1 = w.pop().unwrap();
    drop(w); // rank 0's process "exits": its listener closes
    let Err(err) = t1.open("late") else {
        panic!("opening with a departed rank must fail")
    };
    assert!(
        matches!(err, TransportError::PeerLost { rank: 0, .. }),
        "{err}"
    );
}

/// Cut `data` into slices at `cuts` (positions in order; repeats give empty slices).
fn cut<'a>(data: &'a mut [u8], cuts: &[usize]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    let mut at = 0;
    for &c in cuts {
        let (a, b) = rest.split_at_mut(c - at);
        out.push(a);
        rest = b;
        at = c;
    }
    out.push(rest);
    out
}

#[test]
fn vectored_frames_match_contiguous_ones() {
    // A frame sent from many slices arrives whole in one buffer and vice versa, in pieces of
    // every size (empty slices included), both ways at once, and large enough to fill the
    // socket buffers so that partial sends and receives resume mid-slice.
    let w = world(2, 30, Duration::from_secs(5));
    on_every_rank(w, move |mut t| {
        let r = t.rank();
        let other = 1 - r;
        let mut c = t.open("vectored").unwrap();
        assert!(c.vectored_io());
        let len = 9 << 20;
        let pattern = |who: usize| -> Vec<u8> {
            (0..len)
                .map(|i| (i % 251) as u8 ^ (who as u8 * 7))
                .collect()
        };
        let cuts = [0, 0, 1, 7, 4096, 4096, 70_000, 3 << 20, len - 1, len];
        let mut out = pattern(r);
        let mut inp = vec![0u8; len];
        if r == 0 {
            let send = cut(&mut out, &cuts);
            let send: Vec<&[u8]> = send.into_iter().map(|s| &*s).collect();
            c.send_recv_vectored(other, &send, other, &mut [&mut inp[..]])
                .unwrap();
        } else {
            let mut recv = cut(&mut inp, &cuts);
            c.send_recv_vectored(other, &[&out[..]], other, &mut recv)
                .unwrap();
        }
        assert!(inp == pattern(other), "rank {r} received the wrong bytes");
        // A length that does not match is a protocol error naming the sender.
        if r == 0 {
            c.send(other, &[1, 2, 3]).unwrap();
        } else {
            let mut a = [0u8; 2];
            let mut b = [0u8; 2];
            let e = c
                .send_recv_vectored(other, &[], other, &mut [&mut a[..], &mut b[..]])
                .unwrap_err();
            assert!(matches!(e, TransportError::Protocol { rank: 0, .. }), "{e}");
        }
    });
}

#[test]
fn allreduce_segments_over_tcp_matches_the_contiguous_allreduce() {
    use fh_core::DType;
    use fh_transport::algorithms::allreduce_segments;
    for n in [2usize, 3, 4] {
        let w = world(n, 30, Duration::from_secs(5));
        let results = on_every_rank(w, move |mut t| {
            let r = t.rank();
            let mut c = t.open("segments").unwrap();
            // 3 MiB of f32 in slices of every size, empty ones among them; each rank
            // cuts differently (only the total must agree).
            let elems = 3 << 18;
            let vals = |who: usize| -> Vec<f32> {
                (0..elems)
                    .map(|i| ((i * 31 + who * 7) % 17) as f32 - 8.0)
                    .collect()
            };
            let mut mine: Vec<u8> = vals(r).iter().flat_map(|v| v.to_ne_bytes()).collect();
            let cuts = [0, 4, 4, 4096 * (r + 1), 1 << 20, (2 << 20) + 4 * r];
            let mut finished = 0usize;
            {
                let mut segs = cut(&mut mine, &cuts);
                allreduce_segments(
                    &mut *c,
                    &mut segs,
                    DType::F32,
                    ReduceOp::Average,
                    &mut |b| {
                        finished += b.len();
                        fh_core::kernels::divide_and_scale(DType::F32, b, n, 2.0)?;
                        Ok(())
                    },
                )
                .unwrap();
            }
            let all: Vec<Vec<f32>> = (0..n).map(vals).collect();
            let want: Vec<u8> = (0..elems)
                .map(|i| {
                    let s: f32 = all.iter().map(|v| v[i]).sum();
                    s / n as f32 * 2.0
                })
                .flat_map(|v| v.to_ne_bytes())
                .collect();
            assert!(mine == want, "n={n} rank {r}: wrong result");
            // The finishing pass ran on this rank's block only.
            assert!(finished < mine.len() / n + 64, "finished {finished} bytes");
            finished
        });
        let total: usize = results.into_iter().sum();
        assert_eq!(
            total,
            (3 << 18) * 4,
            "n={n}: every byte finished exactly once"
        );
    }
}

/// A rank that never joins the rendezvous (killed or stopped before it started): rank 0 gives
/// up at its timeout and tells the ranks that joined whom to blame, so that every rank names
/// the absent one, not rank 0.
#[test]
fn a_rank_absent_from_the_rendezvous_is_named_by_every_rank() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let handles: Vec<_> = [0usize, 1, 3]
        .into_iter()
        .map(|rank| {
            let info = info(rank, 4, port, 2);
            std::thread::spawn(move || {
                TcpTransport::connect(&info, TcpOptions::from_info(&info))
                    .err()
                    .map(|e| e.to_string())
            })
        })
        .collect();
    for (rank, h) in [0, 1, 3].into_iter().zip(handles) {
        let err = h
            .join()
            .unwrap()
            .expect("the rendezvous succeeded without rank 2");
        assert!(err.contains("rank(s) [2]"), "rank {rank}: {err}");
        if rank != 0 {
            assert!(
                err.contains("rank 2 is gone") && err.contains("rank 0 ended the rendezvous"),
                "rank {rank}: {err}"
            );
        }
    }
}
