//! Shared-memory backend with one thread per rank in this process (each rank maps its own view
//! of the segments, as separate processes would).
#![cfg(target_os = "linux")]

mod shm_common;

use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_job::launch::{LaunchInfo, Launcher};
use fh_transport::backend::shm::{self, ShmOptions, ShmTransport};
use fh_transport::{CollectivesExt, Communicator, Topology, Transport, TransportError};
use proptest::prelude::*;
use shm_common::*;

/// Run `f(rank, transport)` on `n` threads joined to a fresh world; return the results by rank
/// and check that no segment is left in /dev/shm.
fn world<T: Send + 'static>(
    n: usize,
    opts: ShmOptions,
    f: impl Fn(usize, ShmTransport) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let tok = token();
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (tok, opts, f) = (tok.clone(), opts.clone(), f.clone());
            std::thread::spawn(move || f(r, ShmTransport::join(&tok, r, n, opts).unwrap()))
        })
        .collect();
    let out: Vec<T> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
    out
}

#[test]
fn suite_on_threads_np1_to_4() {
    for n in 1..=4 {
        world(n, small_opts(), move |_, mut t| {
            let mut c = t.open("suite").unwrap();
            suite(&mut *c, 42 + n as u64);
        });
    }
}

#[test]
fn suite_with_default_options() {
    world(3, ShmOptions::default(), |_, mut t| {
        let mut c = t.open("suite").unwrap();
        suite(&mut *c, 7);
    });
}

#[test]
fn channels_run_concurrently_and_independently() {
    world(3, small_opts(), |r, mut t| {
        let comms: Vec<Box<dyn Communicator>> =
            (0..3).map(|i| t.open(&format!("ch{i}")).unwrap()).collect();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                std::thread::spawn(move || {
                    for rep in 0..20u64 {
                        let len = 3000 + 100 * i;
                        let inputs: Vec<_> = (0..3)
                            .map(|q| values(DType::F32, i as u64, rep, q, len))
                            .collect();
                        let mut buf = inputs[r].clone();
                        c.allreduce(&mut buf, DType::F32, ReduceOp::Sum).unwrap();
                        assert_eq!(buf, reference(DType::F32, ReduceOp::Sum, &inputs));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn mismatched_calls_are_reported_not_hung() {
    let out = world(2, small_opts(), |r, mut t| {
        let mut c = t.open("bad").unwrap();
        let mut buf = vec![0u8; 64 * (r + 1)];
        let start = Instant::now();
        let res = c.allreduce(&mut buf, DType::F32, ReduceOp::Sum);
        (res.map_err(|e| e.to_string()), start.elapsed())
    });
    for (r, (res, took)) in out.into_iter().enumerate() {
        assert!(
            res.is_err(),
            "rank {r} accepted mismatched allreduce lengths"
        );
        assert!(took < Duration::from_secs(10), "rank {r} waited {took:?}");
    }
}

#[test]
fn ranks_with_different_algorithm_thresholds_fail_cleanly() {
    let tok = token();
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let tok = tok.clone();
            std::thread::spawn(move || {
                let opts = ShmOptions {
                    small_allreduce_bytes: if r == 0 { 0 } else { 1 << 20 },
                    ..small_opts()
                };
                let mut c = ShmTransport::join(&tok, r, 2, opts)
                    .unwrap()
                    .open_shm("x")
                    .unwrap();
                let mut buf = vec![1u8; 4096];
                c.allreduce(&mut buf, DType::U8, ReduceOp::Sum)
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap().is_err());
    }
}

#[test]
fn a_message_of_the_wrong_length_is_a_protocol_error() {
    let out = world(2, small_opts(), |r, mut t| {
        let mut c = t.open("p2p").unwrap();
        if r == 0 {
            c.send(1, &[7u8; 5000]).map_err(|e| e.to_string())
        } else {
            let mut buf = [0u8; 4000];
            let first = c.recv(0, &mut buf).unwrap_err();
            assert!(
                matches!(first, TransportError::Protocol { rank: 0, .. }),
                "{first}"
            );
            // The stream is out of step now: the communicator refuses further use.
            let again = c.recv(0, &mut buf).unwrap_err();
            assert!(matches!(again, TransportError::Closed(_)), "{again}");
            Ok(())
        }
    });
    // The sender either finished (the message fit) or learnt that rank 1 gave up.
    if let Err(e) = &out[0] {
        assert!(e.contains("rank 1"), "{e}");
    }
}

#[test]
fn dropped_peer_is_reported_by_rank() {
    let out = world(3, small_opts(), |r, mut t| {
        let mut c = t.open("drop").unwrap();
        c.barrier().unwrap();
        if r == 2 {
            return None;
        }
        let mut buf = vec![1u8; 16];
        Some(c.allreduce(&mut buf, DType::U8, ReduceOp::Sum).unwrap_err())
    });
    for e in out.into_iter().flatten() {
        assert!(
            matches!(e, TransportError::PeerLost { rank: 2, .. }),
            "expected PeerLost for rank 2, got {e}"
        );
    }
}

#[test]
fn a_silent_peer_times_out_by_name() {
    let opts = ShmOptions {
        timeout: Duration::from_millis(400),
        ..small_opts()
    };
    let out = world(3, opts, |r, mut t| {
        let mut c = t.open("silent").unwrap();
        c.barrier().unwrap();
        if r == 1 {
            // Alive but absent: never enters the collective, stays until the others gave up.
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut buf = vec![0u8; 100_000];
        Some(c.allreduce(&mut buf, DType::U8, ReduceOp::Max).unwrap_err())
    });
    for e in out.into_iter().flatten() {
        assert!(
            matches!(e, TransportError::Timeout { rank: 1, .. }),
            "expected a timeout naming rank 1, got {e}"
        );
    }
}

#[test]
fn ranks_disagreeing_on_the_world_size_are_refused() {
    let tok = token();
    let opts = ShmOptions::with_timeout(Duration::from_secs(1));
    let h = std::thread::spawn({
        let (tok, opts) = (tok.clone(), opts.clone());
        move || {
            ShmTransport::join(&tok, 0, 2, opts)
                .unwrap()
                .open_shm("x")
                .map(|_| ())
        }
    });
    let res = ShmTransport::join(&tok, 1, 3, opts).unwrap().open_shm("x");
    match res {
        Err(TransportError::Handshake { reason, .. }) => {
            assert!(reason.contains("same world size"), "{reason}")
        }
        other => panic!("expected a handshake error, got {:?}", other.map(|_| ())),
    }
    assert!(h.join().unwrap().is_err(), "rank 0 must not complete alone");
}

#[test]
fn open_fails_after_timeout_and_leaves_nothing() {
    let tok = token();
    let opts = ShmOptions::with_timeout(Duration::from_millis(300));
    let mut t = ShmTransport::join(&tok, 0, 2, opts.clone()).unwrap();
    match t.open_shm("lonely") {
        Err(TransportError::Timeout { rank: 1, .. }) => {}
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
    let mut t1 = ShmTransport::join(&tok, 1, 2, opts).unwrap();
    let late = t1.open_shm("late");
    assert!(
        matches!(late, Err(TransportError::Timeout { rank: 0, .. })),
        "a late rank 1 must time out waiting for rank 0"
    );
}

#[test]
fn live_segments_are_not_cleaned_up() {
    let tok = token();
    let prefix = shm::segment_prefix(&tok);
    let opts = ShmOptions::with_timeout(Duration::from_secs(5));
    let t0 = std::thread::spawn({
        let (tok, opts) = (tok.clone(), opts.clone());
        move || {
            let mut t = ShmTransport::join(&tok, 0, 2, opts).unwrap();
            t.open("x").map(|_| ())
        }
    });
    let start = Instant::now();
    while leftovers(&prefix).is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        leftovers(&prefix).len(),
        1,
        "rank 0 should have created the segment"
    );
    let name = leftovers(&prefix).remove(0);
    assert!(!name.contains(&tok), "the job token leaks into {name}");
    let mode = std::fs::metadata(format!("/dev/shm/{name}"))
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600, "segment {name} has mode {mode:o}");
    let removed = shm::cleanup_stale_segments();
    assert!(
        !removed.iter().any(|n| n.starts_with(&prefix)),
        "cleanup removed a live segment: {removed:?}"
    );
    let mut t1 = ShmTransport::join(&tok, 1, 2, opts).unwrap();
    let mut c1 = t1.open("x").unwrap();
    t0.join().unwrap().unwrap();
    // Rank 0 dropped its communicator right after opening: rank 1 cannot use it any more.
    assert!(c1.barrier().is_err());
    assert_eq!(leftovers(&prefix), Vec::<String>::new());
}

#[test]
fn debug_output_never_shows_the_token() {
    let secret = format!("KNOWN-SHM-SECRET-{}", token());
    let mut t = ShmTransport::join(&secret, 0, 1, small_opts()).unwrap();
    let c = t.open_shm("debug").unwrap();
    for text in [format!("{t:?}"), format!("{t:#?}"), format!("{c:?}")] {
        assert!(!text.contains("KNOWN-SHM-SECRET"), "{text}");
    }
}

#[test]
fn bad_arguments_are_rejected() {
    assert!(ShmTransport::join("", 0, 1, ShmOptions::default()).is_err());
    assert!(ShmTransport::join("t", 2, 2, ShmOptions::default()).is_err());
    let bad = ShmOptions {
        ring_bytes: 1000,
        ..ShmOptions::default()
    };
    assert!(ShmTransport::join("t", 0, 1, bad).is_err());
    world(2, small_opts(), |r, mut t| {
        let mut c = t.open("args").unwrap();
        let mut odd = vec![0u8; 6];
        // The same check, and error, as every other backend's.
        assert!(matches!(
            c.allreduce(&mut odd, DType::F32, ReduceOp::Sum),
            Err(TransportError::InvalidArgument(_))
        ));
        let mut recv = vec![0u8; 8];
        assert!(matches!(
            c.reduce_scatter(&odd, &mut recv, &[usize::MAX, 2], DType::F32, ReduceOp::Sum),
            Err(TransportError::InvalidArgument(_))
        ));
        assert!(c.allreduce(&mut odd, DType::F32, ReduceOp::BitOr).is_err());
        assert!(c.broadcast(&mut odd, 5).is_err());
        assert!(c.send(9, &odd).is_err());
        // Still usable after rejected arguments.
        let mut v = vec![r as u8; 4];
        c.allreduce(&mut v, DType::U8, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![1; 4]);
    });
}

#[test]
fn options_from_environment() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let o = ShmOptions::from_lookup(env(&[
        ("FH_TIMEOUT_SECONDS", "2.5"),
        ("FH_SHM_SLOT_BYTES", "65536"),
    ]))
    .unwrap();
    assert_eq!(o.timeout, Duration::from_millis(2500));
    assert_eq!(o.slot_bytes, 65536);
    assert_eq!(
        ShmOptions::from_lookup(env(&[])).unwrap(),
        ShmOptions::default()
    );
    for bad in [
        &[("FH_TIMEOUT_SECONDS", "soon")][..],
        &[("FH_TIMEOUT_SECONDS", "-1")][..],
        &[("FH_SHM_SLOT_BYTES", "big")][..],
    ] {
        let err = ShmOptions::from_lookup(env(bad)).unwrap_err();
        assert!(matches!(err, TransportError::Config { .. }), "{err}");
    }
}

fn launch(rank: usize, size: usize, hosts: usize, token: &str) -> LaunchInfo {
    let mut info = LaunchInfo::single();
    info.rank = rank;
    info.size = size;
    info.local_rank = rank % (size / hosts);
    info.local_size = size / hosts;
    info.cross_rank = rank / (size / hosts);
    info.cross_size = hosts;
    info.rendezvous = Some("127.0.0.1:9".into());
    info.token = Some(token.into());
    info.launcher = Launcher::Fhrun;
    info.timeout = Duration::from_secs(20);
    info
}

#[test]
fn fh_transport_shm_builds_a_shm_world_on_one_host() {
    {
        let choice = "shm";
        let tok = token();
        // The ranks meet at a rendezvous first, where the facts confirm one host.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let tok = tok.clone();
                std::thread::spawn(move || {
                    let mut info = launch(r, 3, 1, &tok);
                    info.rendezvous = Some(format!("127.0.0.1:{port}"));
                    let mut t = fh_transport::world_for(&info, Some(choice)).unwrap();
                    assert_eq!(t.backend(), "shm", "FH_TRANSPORT={choice}");
                    assert_eq!(t.topology(), Topology::single_host(r, 3));
                    let mut c = t.open("env").unwrap();
                    let mut v = [r as i64; 3];
                    c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
                    v
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), [3; 3]);
        }
    }
    assert!(shm::suits(&launch(0, 3, 1, "t")));
    // A job spread over two hosts cannot use shared memory alone.
    let two_hosts = launch(0, 4, 2, &token());
    assert!(!shm::suits(&two_hosts));
    match fh_transport::world_for(&two_hosts, Some("shm")) {
        Err(TransportError::Config { var, reason }) => {
            assert_eq!(var, "FH_TRANSPORT");
            assert!(reason.contains("2 hosts"), "{reason}");
        }
        other => panic!("{:?}", other.map(|t| t.backend())),
    }
}

fn dtype_op() -> impl Strategy<Value = (DType, ReduceOp)> {
    proptest::sample::select(pairs())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn allreduce_matches_reference(
        n in 1usize..=4,
        (d, o) in dtype_op(),
        len in 0usize..6000,
        slot in prop_oneof![Just(4096usize), Just(8192), Just(65536)],
        small in prop_oneof![Just(0usize), Just(1024), Just(1 << 20)],
        seed in any::<u64>(),
    ) {
        let opts = ShmOptions { slot_bytes: slot, small_allreduce_bytes: small, ..small_opts() };
        let out = world(n, opts, move |r, mut t| {
            let mut c = t.open("p").unwrap();
            let inputs: Vec<_> = (0..n).map(|q| values(d, seed, 0, q, len)).collect();
            let mut buf = inputs[r].clone();
            c.allreduce(&mut buf, d, o).unwrap();
            buf == reference(d, o, &inputs)
        });
        prop_assert!(out.into_iter().all(|ok| ok));
    }

    #[test]
    fn allreduce_segments_match_reference_and_finish_each_byte_once(
        n in 1usize..=4,
        (d, o) in dtype_op(),
        len in 0usize..6000,
        slot in prop_oneof![Just(4096usize), Just(8192), Just(65536)],
        small in prop_oneof![Just(0usize), Just(1024), Just(1 << 20)],
        cuts in proptest::collection::vec(0usize..1000, 0..6),
        seed in any::<u64>(),
    ) {
        // The native in-place allreduce over slices (a fused group where its tensors lie) gives
        // the contiguous allreduce's bits for any cut of the buffer, finishes every byte
        // exactly once (the average's division there, on the share's owner), and leaves the
        // communicator in step for an ordinary allreduce after it.
        let opts = ShmOptions { slot_bytes: slot, small_allreduce_bytes: small, ..small_opts() };
        let out = world(n, opts, move |r, mut t| {
            let mut c = t.open("p").unwrap();
            let inputs: Vec<_> = (0..n).map(|q| values(d, seed, 2, q, len)).collect();
            let want = reference(d, o, &inputs);
            let esz = d.size();
            let mut at: Vec<usize> = cuts.iter().map(|x| x * len / 1000 * esz).collect();
            at.sort_unstable();
            let mut buf = inputs[r].clone();
            let mut finished = 0usize;
            {
                let mut segs: Vec<&mut [u8]> = Vec::new();
                let (mut rest, mut prev) = (&mut buf[..], 0);
                for x in at {
                    let (a, b) = rest.split_at_mut(x - prev);
                    segs.push(a);
                    rest = b;
                    prev = x;
                }
                segs.push(rest);
                c.allreduce_segments(&mut segs, d, o, &mut |b| {
                    finished += b.len();
                    if o == ReduceOp::Average {
                        fh_core::kernels::divide(d, b, n)?;
                    }
                    Ok(())
                })
                .unwrap();
            }
            // Still in step: an ordinary allreduce after it.
            let mut after = values(d, seed, 3, r, 3);
            let others: Vec<_> = (0..n).map(|q| values(d, seed, 3, q, 3)).collect();
            let after_want = reference(d, o, &others);
            c.allreduce(&mut after, d, o).unwrap();
            (buf == want && after == after_want, finished)
        });
        prop_assert!(out.iter().all(|(ok, _)| *ok));
        let finished: usize = out.iter().map(|(_, f)| f).sum();
        let total = len * d.size();
        // Below the direct threshold (and on one rank) every rank finishes the whole buffer
        // itself; above it the shares split the buffer between the ranks.
        let whole = n == 1 || total <= small;
        prop_assert_eq!(finished, if whole { total * n } else { total });
    }

    #[test]
    fn reduce_scatter_and_alltoallv_match_reference(
        n in 1usize..=4,
        counts in proptest::collection::vec(0usize..3000, 4),
        seed in any::<u64>(),
    ) {
        let out = world(n, small_opts(), move |r, mut t| {
            let mut c = t.open("p").unwrap();
            let counts = &counts[..n];
            let total: usize = counts.iter().sum();
            let inputs: Vec<_> = (0..n).map(|q| values(DType::I32, seed, 1, q, total)).collect();
            let full = reference(DType::I32, ReduceOp::Sum, &inputs);
            let off: usize = counts[..r].iter().sum();
            let mut recv = vec![0u8; counts[r] * 4];
            c.reduce_scatter(&inputs[r], &mut recv, counts, DType::I32, ReduceOp::Sum).unwrap();
            let rs_ok = recv == full[off * 4..(off + counts[r]) * 4];
            // alltoallv with matrix[i][j] = counts[(i + j) % n] bytes.
            let m = |i: usize, j: usize| counts[(i + j) % n];
            let block = |i: usize, j: usize| values(DType::U8, seed, 2 + j as u64, i, m(i, j));
            let send: Vec<u8> = (0..n).flat_map(|j| block(r, j)).collect();
            let sc: Vec<usize> = (0..n).map(|j| m(r, j)).collect();
            let rc: Vec<usize> = (0..n).map(|i| m(i, r)).collect();
            let want: Vec<u8> = (0..n).flat_map(|i| block(i, r)).collect();
            let mut got = vec![0u8; want.len()];
            c.alltoallv(&send, &sc, &mut got, &rc).unwrap();
            rs_ok && got == want
        });
        prop_assert!(out.into_iter().all(|ok| ok));
    }
}
