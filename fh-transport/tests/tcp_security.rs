//! The TCP backend's door under attack, every rank a thread of this process (127.0.0.1): a
//! listener that does not know the token, a replayed handshake, the token in `Debug` output,
//! a flood of silent and garbage connections during start-up, and a world of 64 ranks.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::{wire, TcpOptions, TcpTransport};
use fh_transport::{CollectivesExt, Transport, TransportError};

const TOKEN: &str = "KNOWN-TEST-TOKEN-5f1d0c3a9e8b7a6d";

fn info(rank: usize, size: usize, port: u16, timeout_s: u64) -> LaunchInfo {
    LaunchInfo {
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(JobToken::new(TOKEN)),
        timeout: Duration::from_secs(timeout_s),
        ..LaunchInfo::bare(rank, size)
    }
}

fn free_port() -> u16 {
    fh_job::launch::free_local_port().expect("an ephemeral port")
}

fn spawn_world(
    size: usize,
    port: u16,
    timeout_s: u64,
) -> Vec<std::thread::JoinHandle<Result<TcpTransport, TransportError>>> {
    (0..size)
        .map(|rank| {
            let info = info(rank, size, port, timeout_s);
            std::thread::spawn(move || TcpTransport::connect(&info, TcpOptions::from_info(&info)))
        })
        .collect()
}

fn world(size: usize) -> Vec<TcpTransport> {
    spawn_world(size, free_port(), 60)
        .into_iter()
        .map(|h| h.join().expect("thread").expect("connect"))
        .collect()
}

/// Every rank opens a communicator and allreduces; checks the sum.
fn allreduce_everywhere(w: Vec<TcpTransport>, label: &'static str) -> Vec<TcpTransport> {
    let size = w.len();
    let handles: Vec<_> = w
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let mut c = t.open(label).expect("open");
                let mut v = vec![t.rank() as f64 + 1.0; 1000];
                c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
                let want = (size * (size + 1) / 2) as f64;
                assert!(v.iter().all(|&x| x == want), "rank {}: {}", t.rank(), v[0]);
                drop(c);
                t
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_listener_that_cannot_prove_the_token_is_refused_and_learns_nothing() {
    // A squatter holds the rendezvous port before rank 0.
    let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let member = {
        let info = info(1, 2, port, 20);
        std::thread::spawn(move || TcpTransport::connect(&info, TcpOptions::from_info(&info)))
    };
    let (mut s, _) = squatter.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; wire::HELLO_LEN];
    s.read_exact(&mut hello).unwrap();
    let (h, _) = wire::Hello::decode(&hello).expect("a hello");
    assert_eq!((h.rank, h.size), (1, 2));
    // Answer with a challenge whose proof is made with a guessed token.
    let nonce = [5u8; wire::NONCE_LEN];
    let proof = wire::acceptor_proof(&fh_job::Key::new(b"guessed-token-0123456"), &hello, &nonce);
    s.write_all(&wire::Answer::encode_challenge(&nonce, &proof))
        .unwrap();
    // The member hangs up without proving anything.
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the member sent {} more bytes", rest.len());
    let mut seen = hello.to_vec();
    seen.extend_from_slice(&rest);
    assert!(
        !seen
            .windows(8)
            .any(|w| TOKEN.as_bytes().windows(8).any(|t| t == w)),
        "the token crossed the wire"
    );
    let err = member.join().unwrap().unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TransportError::Handshake { .. }), "{text}");
    assert!(text.contains("could not prove"), "{text}");
    assert!(!text.contains(TOKEN), "{text}");
}

#[test]
fn a_replayed_handshake_is_refused() {
    let w = world(2);
    let rank0 = w[0].peer_addresses()[0];
    // A genuine handshake (a rank 1 connection of a future communicator), recorded.
    let hello = wire::Hello {
        version: wire::PROTOCOL_VERSION,
        kind: wire::ConnKind::Data,
        size: 2,
        rank: 1,
        seq: 1000,
        port: 0,
        lost: 0,
        world: w[0].world_id(),
        nonce: wire::fresh_nonce().unwrap(),
    };
    let hello_bytes = hello.encode();
    let challenge = |s: &mut TcpStream| {
        let mut ch = [0u8; wire::CHALLENGE_LEN];
        s.read_exact(&mut ch).unwrap();
        match wire::Answer::decode(&ch) {
            Ok((wire::Answer::Challenge { nonce, proof }, _)) => (nonce, proof),
            other => panic!("expected a challenge, got {other:?}"),
        }
    };
    let reply = |s: &mut TcpStream| {
        let mut r = [0u8; wire::REPLY_FIXED_LEN];
        s.read_exact(&mut r[..]).unwrap();
        let mut all = r.to_vec();
        let _ = s.read_to_end(&mut all);
        wire::Reply::decode(&all).unwrap().0
    };
    let mut s = TcpStream::connect(rank0).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&hello_bytes).unwrap();
    let (nonce, proof) = challenge(&mut s);
    assert!(wire::verify_acceptor_proof(
        &fh_job::Key::new(TOKEN.as_bytes()),
        &hello_bytes,
        &nonce,
        &proof
    ));
    let recorded_proof = wire::encode_proof(&wire::connector_proof(
        &fh_job::Key::new(TOKEN.as_bytes()),
        &hello_bytes,
        &nonce,
    ));
    s.write_all(&recorded_proof).unwrap();
    let mut r = [0u8; wire::REPLY_FIXED_LEN];
    s.read_exact(&mut r).unwrap();
    assert_eq!(wire::Reply::decode(&r).unwrap().0, wire::Reply::Accept);
    drop(s);

    // Replayed byte for byte by someone without the token: the challenge is fresh, so the
    // recorded proof no longer fits.
    let mut s = TcpStream::connect(rank0).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&hello_bytes).unwrap();
    let (nonce2, _) = challenge(&mut s);
    assert_ne!(nonce, nonce2, "the acceptor's nonce must be fresh");
    s.write_all(&recorded_proof).unwrap();
    match reply(&mut s) {
        wire::Reply::Refuse(why) => assert!(why.contains("replayed"), "{why}"),
        wire::Reply::Accept => panic!("a replayed handshake was accepted"),
    }
    // The world is undisturbed.
    allreduce_everywhere(w, "after the replay");
}

#[test]
fn debug_output_never_shows_the_token() {
    let w = world(2);
    let handles: Vec<_> = w
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let c = t.open_tcp("debug").expect("open");
                let texts = [format!("{t:?}"), format!("{t:#?}"), format!("{c:?}")];
                for text in texts {
                    assert!(!text.contains(TOKEN), "{text}");
                    assert!(!text.contains("KNOWN-TEST"), "{text}");
                    // Nor its bytes, as a Debug of a Vec<u8> would print them.
                    assert!(!text.contains("75, 78, 79, 87, 78"), "{text}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Connections that never say anything, held open until dropped.
fn silent_connections(addr: SocketAddr, n: usize, deadline: Instant) -> Vec<TcpStream> {
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => out.push(s),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    out
}

/// A stream of garbage connections to `addrs` until `stop`.
fn garbage(addrs: Vec<SocketAddr>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut sent = 0usize;
        let junk: Vec<u8> = (0..300u32).map(|i| (i * 131 % 251) as u8).collect();
        while !stop.load(Ordering::Relaxed) {
            for a in &addrs {
                if let Ok(mut s) = TcpStream::connect_timeout(a, Duration::from_millis(200)) {
                    let _ = s.write_all(b"FHTP");
                    let _ = s.write_all(&junk);
                    sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        sent
    })
}

#[test]
fn silent_and_garbage_connections_do_not_stop_a_job() {
    let size = 4;
    let port = free_port();
    let rdv: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // Rank 0 first, so that the strangers can get in before the members.
    let gate = Arc::new(Barrier::new(size + 1));
    // The members start once the strangers hold rank 0's rendezvous port.
    let flooded = Arc::new(Barrier::new(size));
    let (book_tx, book_rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let info = info(rank, size, port, 60);
            let (gate, book_tx) = (Arc::clone(&gate), book_tx.clone());
            let flooded = Arc::clone(&flooded);
            std::thread::spawn(move || {
                if rank != 0 {
                    flooded.wait();
                }
                let mut t = TcpTransport::connect(&info, TcpOptions::from_info(&info))
                    .expect("connect under a flood");
                if rank == 0 {
                    book_tx.send(t.peer_addresses().to_vec()).unwrap();
                }
                // Wait until the data listeners are flooded too.
                gate.wait();
                let mut sums = Vec::new();
                for label in ["control", "data"] {
                    let mut c = t.open(label).expect("open under a flood");
                    let mut v = vec![rank as i64 + 1; 4097];
                    c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
                    sums.push(v[0]);
                    assert!(v.iter().all(|&x| x == v[0]));
                }
                (t, sums)
            })
        })
        .collect();
    let flood_deadline = Instant::now() + Duration::from_secs(20);
    let garbage_rdv = garbage(vec![rdv], Arc::clone(&stop));
    let silent_rdv = silent_connections(rdv, 200, flood_deadline);
    assert_eq!(silent_rdv.len(), 200, "rank 0 never listened");
    flooded.wait();
    let book = book_rx
        .recv_timeout(Duration::from_secs(90))
        .expect("the rendezvous completed");
    let mut silent_data = Vec::new();
    for a in &book {
        silent_data.extend(silent_connections(*a, 200, flood_deadline));
    }
    let garbage_data = garbage(book.clone(), Arc::clone(&stop));
    gate.wait();
    let worlds: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (_, sums) in &worlds {
        assert_eq!(sums, &vec![10, 10]);
    }
    // Shutting down under the flood does not hang (the acceptors honour stop).
    let started = Instant::now();
    drop(worlds);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "dropping the transports took {:?}",
        started.elapsed()
    );
    stop.store(true, Ordering::Relaxed);
    let sent = garbage_rdv.join().unwrap() + garbage_data.join().unwrap();
    assert!(sent > 0);
    drop((silent_rdv, silent_data));
}

#[test]
fn a_world_of_64_ranks_starts_and_reduces() {
    let w = world(64);
    let w = allreduce_everywhere(w, "sixty-four");
    assert_eq!(w.len(), 64);
}
