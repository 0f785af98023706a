//! fh-selftest under fhrun over the TCP backend: a job that passes, a rank SIGKILLed in the
//! middle of an allreduce loop, and strangers knocking on the rendezvous port during startup.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fh_transport::backend::tcp::wire::{self, Answer, ConnKind, Hello, Reply, PROTOCOL_VERSION};

const SELFTEST: &str = env!("CARGO_BIN_EXE_fh-selftest");
const LIMIT: Duration = Duration::from_secs(60);

fn lines_of<'a>(text: &'a str, rank: usize, stream: &str) -> Vec<&'a str> {
    let prefix = format!("[{rank}]<{stream}>:");
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .collect()
}

#[test]
fn selftest_passes_under_fhrun_with_2_to_4_ranks() {
    // `auto` must pick shared memory for a job on one host; `tcp` is forced explicitly.
    for (transport, backend) in [("auto", "shm"), ("tcp", "tcp")] {
        selftest_passes(transport, backend);
    }
}

fn selftest_passes(transport: &str, backend: &str) {
    for np in 2..=4usize {
        let nps = np.to_string();
        let out = fhrun(
            &[
                "-np",
                &nps,
                "--transport",
                transport,
                "--timeout-seconds",
                "20",
                SELFTEST,
                "--iters",
                "2",
                "--bytes",
                "65536",
            ],
            LIMIT,
        );
        assert_eq!(out.code(), Some(0), "np={np}: {out:?}");
        for r in 0..np {
            let lines = lines_of(&out.stdout, r, "stdout");
            let header = format!("fh-selftest: rank {r} of {np} (local {r}/{np}, cross 0/1)");
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(&header) && l.contains(&format!("backend {backend},"))),
                "np={np} rank {r} ({transport} -> {backend}): {out:?}"
            );
            assert!(
                lines.contains(&format!("fh-selftest: rank {r}: PASSED").as_str()),
                "np={np} rank {r}: {out:?}"
            );
        }
        assert!(
            lines_of(&out.stdout, 0, "stdout")
                .iter()
                .any(|l| l.contains("allreduce 65536 bytes x 2 iters") && l.contains("GB/s")),
            "{out:?}"
        );
    }
}

/// The pid fhrun reports (with --verbose) for `rank`.
fn rank_pid(stderr: &str, rank: usize) -> Option<i32> {
    let prefix = format!("fhrun: started rank {rank} (pid ");
    stderr
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.trim_end_matches(')').parse().ok())
}

#[test]
fn a_rank_sigkilled_mid_allreduce_loop_is_named_by_fhrun_and_the_survivors() {
    let np = 3;
    // Over TCP the survivors see the connection reset at once, before fhrun's SIGTERM reaches
    // them. (Over shared memory a survivor may finish the collective the victim had already
    // contributed to and then be stopped by fhrun before it notices; the shm tests cover
    // naming a killed peer without a launcher in between.)
    let mut job = Running::start(&[
        "-np",
        "3",
        "--verbose",
        "--transport",
        "tcp",
        "--timeout-seconds",
        "20",
        SELFTEST,
        "--iters",
        "1",
        "--bytes",
        "262144",
        "--loop",
    ]);
    job.wait_for(LIMIT, |out, err| {
        (0..np).all(|r| {
            lines_of(out, r, "stdout").contains(&format!("fh-selftest: rank {r}: looping").as_str())
                && rank_pid(err, r).is_some()
        })
    });
    let err = job.stderr_now();
    let pids: Vec<i32> = (0..np).filter_map(|r| rank_pid(&err, r)).collect();
    let victim = pids[1];
    // SAFETY: plain kill(2) on a rank this test started through fhrun.
    unsafe {
        libc::kill(victim, libc::SIGKILL);
    }
    let out = job.wait(LIMIT);
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);

    assert_eq!(out.code(), Some(137), "{out:?}");
    let want = format!("fhrun: rank 1 (pid {victim}) was killed by signal 9 (SIGKILL)");
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    // The survivors' runtime reports the lost peer by rank.
    let named_by = [0usize, 2]
        .into_iter()
        .filter(|&r| {
            lines_of(&out.stderr, r, "stderr")
                .iter()
                .any(|l| l.contains("FAILED") && l.contains("rank 1 is gone"))
        })
        .count();
    assert!(named_by >= 1, "no survivor named rank 1:\n{}", out.stderr);
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

fn free_port() -> u16 {
    fh_job::launch::free_local_port().expect("an ephemeral port")
}

/// A port on 127.0.0.1, free a moment ago, below the kernel's ephemeral range
/// (`ip_local_port_range`): the stranger below connects before rank 0 listens, and each of its
/// connections takes a source port from the ephemeral range; one landing on the rendezvous
/// port would connect to itself (TCP's self-connect) and hold the port, and so would any
/// other test's connection in the meantime, failing rank 0's bind ("Address already in use").
fn free_port_below_ephemeral() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let start = 10_000u16;
    if low <= start + 100 {
        return free_port(); // An unusual range: take what the kernel gives.
    }
    let span = low - start;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let seed = std::process::id() as u16 ^ nanos as u16;
    (0..span)
        .map(|i| start + seed.wrapping_add(i) % span)
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .unwrap_or_else(free_port)
}

#[test]
fn strangers_on_the_rendezvous_port_do_not_break_the_job() {
    let port = free_port_below_ephemeral();
    let addr = format!("127.0.0.1:{port}");
    let stop = Arc::new(AtomicBool::new(false));
    let garbage_sent = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));

    // The stranger: while the job starts, keep connecting to rank 0's rendezvous port with
    // garbage, a handshake with a wrong token that claims rank 1, and silent connections.
    let stranger = {
        let (stop, garbage_sent, refused, addr) = (
            stop.clone(),
            garbage_sent.clone(),
            refused.clone(),
            addr.clone(),
        );
        std::thread::spawn(move || {
            let mut silent = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                let Ok(mut s) = TcpStream::connect(&addr) else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\xff\xfe\x00garbage");
                garbage_sent.fetch_add(1, Ordering::SeqCst);

                if let Ok(mut s) = TcpStream::connect(&addr) {
                    let hello = Hello {
                        version: PROTOCOL_VERSION,
                        kind: ConnKind::Rendezvous,
                        size: 3,
                        rank: 1,
                        seq: 0,
                        port: 1,
                        lost: 0,
                        world: [0; wire::WORLD_ID_LEN],
                        nonce: [1; wire::NONCE_LEN],
                    };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    let hb = hello.encode();
                    let mut ch = [0u8; wire::CHALLENGE_LEN];
                    // Answer the challenge with a proof made from a guessed token.
                    if s.write_all(&hb).is_ok() && s.read_exact(&mut ch).is_ok() {
                        if let Ok((Answer::Challenge { nonce, .. }, _)) = Answer::decode(&ch) {
                            let guess =
                                wire::connector_proof(&fh_job::Key::new(&[b'0'; 64]), &hb, &nonce);
                            let _ = s.write_all(&wire::encode_proof(&guess));
                        }
                        let mut reply = Vec::new();
                        let _ = s.read_to_end(&mut reply);
                        if let Ok((Reply::Refuse(_), _)) = Reply::decode(&reply) {
                            refused.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                if silent.len() < 4 {
                    if let Ok(s) = TcpStream::connect(&addr) {
                        silent.push(s);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    // Ranks other than 0 start late, so that the strangers arrive while rank 0 is waiting.
    let script = format!(
        "if [ \"$FH_RANK\" != 0 ]; then sleep 1.5; fi; exec {SELFTEST} --iters 2 --bytes 65536"
    );
    let out = fhrun(
        &[
            "-np",
            "3",
            "--rendezvous-addr",
            &addr,
            // The strangers knock on the TCP rendezvous: force TCP (auto would pick shm).
            "--transport",
            "tcp",
            "--timeout-seconds",
            "20",
            "sh",
            "-c",
            &script,
        ],
        LIMIT,
    );
    stop.store(true, Ordering::SeqCst);
    stranger.join().unwrap();

    assert_eq!(out.code(), Some(0), "{out:?}");
    for r in 0..3 {
        assert!(
            lines_of(&out.stdout, r, "stdout")
                .contains(&format!("fh-selftest: rank {r}: PASSED").as_str()),
            "rank {r}: {out:?}"
        );
    }
    assert!(
        garbage_sent.load(Ordering::SeqCst) >= 1,
        "the stranger never reached the rendezvous port; the test proved nothing"
    );
    assert!(
        refused.load(Ordering::SeqCst) >= 1,
        "a wrong-token handshake was never refused: {out:?}"
    );
}
