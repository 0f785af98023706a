//! Multi-process tests of the TCP backend on 127.0.0.1.
//!
//! Each test spawns this very test binary once per rank, running only the ignored test
//! `child_rank` with the `FH_*` environment `fhrun` would set and `FH_TEST_SCENARIO` naming what
//! to do. A guard kills and reaps every child when the test ends, also on failure, and every
//! wait is bounded.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver};
use fh_core::{kernels, DType, ReduceOp};
use fh_job::heartbeat::Settings as HeartbeatSettings;
use fh_job::launch::LaunchInfo;
use fh_transport::backend::tcp::{wire, TcpOptions, TcpTransport};
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};
use support::{free_port, launch_at, rank_command, Children, Place};

const SCENARIO: &str = "FH_TEST_SCENARIO";
/// An `extra` value that removes the variable from a child's environment.
const UNSET: &str = "\u{0}unset";
/// Upper bound for a whole world to finish (generous: the machine may be busy compiling).
const WORLD_DEADLINE: Duration = Duration::from_secs(180);

// ---------------------------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------------------------

/// The children of one test; killed and reaped on drop.
struct World {
    children: Children,
    stdout: Vec<Arc<Mutex<String>>>,
    stderr: Vec<Arc<Mutex<String>>>,
    lines: Receiver<(usize, String)>,
    lines_tx: crossbeam_channel::Sender<(usize, String)>,
    /// The threads reading each child's stdout and stderr.
    readers: Vec<Vec<std::thread::JoinHandle<()>>>,
}

struct Job {
    size: usize,
    port: u16,
    token: String,
    scenario: &'static str,
    timeout_s: u32,
    /// The heartbeats' settings given to every rank (`None`: turned off).
    liveness: Option<HeartbeatSettings>,
}

impl Job {
    fn new(size: usize, scenario: &'static str) -> Self {
        Job {
            size,
            port: free_port(),
            token: format!(
                "tok-5f1d0c3a-{:032x}",
                u128::from(std::process::id()) << 64 | u128::from(free_port())
            ),
            scenario,
            timeout_s: 30,
            liveness: Some(HeartbeatSettings::default()),
        }
    }
    fn rdv(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl World {
    fn new() -> Self {
        let (lines_tx, lines) = unbounded();
        World {
            children: Children(Vec::new()),
            stdout: Vec::new(),
            stderr: Vec::new(),
            lines,
            lines_tx,
            readers: Vec::new(),
        }
    }

    /// Start rank `rank` of `job`, with `extra` environment on top.
    fn spawn(&mut self, job: &Job, rank: usize, extra: &[(&str, String)]) {
        let place = Place {
            rank,
            size: job.size,
            local_rank: rank,
            local_size: job.size,
            cross_rank: 0,
            cross_size: 1,
        };
        let mut launch = launch_at(&place, &job.rdv(), &job.token, job.timeout_s);
        launch.liveness = job.liveness;
        let mut cmd = rank_command("child_rank", true);
        cmd.env(SCENARIO, job.scenario)
            .env("FH_TRANSPORT", "tcp")
            .envs(launch.to_vars());
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in extra {
            if v == UNSET {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let mut child = cmd.spawn().expect("spawn a child rank");
        let out = Arc::new(Mutex::new(String::new()));
        let err = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (out2, tx) = (Arc::clone(&out), self.lines_tx.clone());
        let r_out = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                out2.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = tx.send((rank, line));
            }
        });
        let err2 = Arc::clone(&err);
        let r_err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = BufReader::new(stderr).read_to_string(&mut s);
            err2.lock().unwrap().push_str(&s);
        });
        self.readers.push(vec![r_out, r_err]);
        self.children.0.push(child);
        self.stdout.push(out);
        self.stderr.push(err);
    }

    fn spawn_all(&mut self, job: &Job) {
        for r in 0..job.size {
            self.spawn(job, r, &[]);
        }
    }

    fn output(&self, i: usize) -> String {
        format!(
            "--- child {i} stdout ---\n{}--- child {i} stderr ---\n{}",
            self.stdout[i].lock().unwrap(),
            self.stderr[i].lock().unwrap()
        )
    }

    fn all_output(&self) -> String {
        (0..self.children.0.len()).map(|i| self.output(i)).collect()
    }

    /// Wait (bounded) for the children in `which` to exit; returns their success flags.
    fn wait(&mut self, which: &[usize], within: Duration) -> Vec<bool> {
        match self
            .children
            .wait_for(which, within, Duration::from_millis(20))
        {
            Ok(status) => {
                // Let the reader threads drain the pipes (bounded: a grandchild could hold
                // a pipe open).
                let drained = Instant::now() + Duration::from_secs(10);
                while Instant::now() < drained
                    && !which
                        .iter()
                        .all(|&i| self.readers[i].iter().all(|r| r.is_finished()))
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                status.iter().map(|s| s.success()).collect()
            }
            Err(_) => panic!(
                "children {which:?} did not finish within {within:?}\n{}",
                self.all_output()
            ),
        }
    }

    fn wait_all_ok(&mut self) {
        let all: Vec<usize> = (0..self.children.0.len()).collect();
        let ok = self.wait(&all, WORLD_DEADLINE);
        assert!(
            ok.iter().all(|&b| b),
            "a child failed: {ok:?}\n{}",
            self.all_output()
        );
        // A child that skipped its work would still pass: insist on its report.
        for i in all {
            assert!(
                self.stdout[i].lock().unwrap().contains("CHILD DONE"),
                "child {i} did not report completion\n{}",
                self.all_output()
            );
        }
    }

    /// Wait (bounded) until every rank in `ranks` has printed a line starting with `prefix`.
    fn wait_lines(&self, ranks: &[usize], prefix: &str, within: Duration) {
        let deadline = Instant::now() + within;
        let mut seen = vec![false; self.children.0.len()];
        while !ranks.iter().all(|&r| seen[r]) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((r, line)) if line.contains(prefix) => seen[r] = true,
                Ok(_) => {}
                Err(_) => panic!(
                    "ranks {ranks:?} did not print {prefix:?} within {within:?}\n{}",
                    self.all_output()
                ),
            }
        }
    }
}

fn run_world(size: usize, scenario: &'static str) {
    let job = Job::new(size, scenario);
    let mut world = World::new();
    world.spawn_all(&job);
    world.wait_all_ok();
}

#[test]
fn collectives_np2() {
    run_world(2, "collectives");
}

#[test]
fn collectives_np3() {
    run_world(3, "collectives");
}

#[test]
fn collectives_np4() {
    run_world(4, "collectives");
}

#[test]
fn channels_in_flight_at_once_np3() {
    run_world(3, "channels");
}

#[test]
fn channels_in_flight_at_once_np4() {
    run_world(4, "channels");
}

#[test]
fn wrong_token_is_refused_with_a_clear_error_on_both_sides() {
    let mut job = Job::new(2, "wrong_token");
    job.timeout_s = 4;
    let mut world = World::new();
    world.spawn(&job, 0, &[]);
    world.spawn(&job, 1, &[("FH_JOB_TOKEN", "not-the-job-token".into())]);
    world.wait_all_ok();
    for r in 0..2 {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains("SETUP FAILED") && out.contains("wrong job token"),
            "rank {r} should fail naming the wrong token\n{}",
            world.all_output()
        );
    }
    // The refused side learned it from the refusal; the accepting side names what it refused.
    assert!(world.stdout[1].lock().unwrap().contains("refused"));
    assert!(world.stdout[0].lock().unwrap().contains("rank(s) [1]"));
    // Shown with --nocapture.
    eprintln!("{}", world.all_output());
}

#[test]
fn a_derived_token_is_announced_once_by_rank_0() {
    let job = Job::new(2, "collectives");
    let mut world = World::new();
    for r in 0..2 {
        // Without FH_JOB_TOKEN the token is derived.
        world.spawn(&job, r, &[("FH_JOB_TOKEN", UNSET.into())]);
    }
    world.wait_all_ok();
    let err0 = world.stderr[0].lock().unwrap().clone();
    let err1 = world.stderr[1].lock().unwrap().clone();
    assert_eq!(
        err0.matches("FH_JOB_TOKEN is not set").count(),
        1,
        "{}",
        world.all_output()
    );
    assert!(err0.contains("FH_REQUIRE_TOKEN=1") && err0.contains("export FH_JOB_TOKEN"));
    assert!(!err1.contains("FH_JOB_TOKEN is not set"), "{err1}");
    // With FH_REQUIRE_TOKEN=1 the same launch refuses to start, on every rank.
    let job = Job::new(2, "fd_limit");
    let mut world = World::new();
    for r in 0..2 {
        world.spawn(
            &job,
            r,
            &[
                ("FH_JOB_TOKEN", UNSET.into()),
                ("FH_REQUIRE_TOKEN", "1".into()),
                ("FH_TEST_NOFILE", "4096:4096".into()),
            ],
        );
    }
    world.wait_all_ok();
    for r in 0..2 {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains("SETUP FAILED") && out.contains("FH_REQUIRE_TOKEN"),
            "rank {r}\n{}",
            world.all_output()
        );
    }
    // A set but empty (or blank) FH_JOB_TOKEN is never taken for a missing one: every rank
    // refuses to start, with the fix, and nothing is derived.
    for empty in ["", "  "] {
        let job = Job::new(2, "fd_limit");
        let mut world = World::new();
        for r in 0..2 {
            world.spawn(
                &job,
                r,
                &[
                    ("FH_JOB_TOKEN", empty.into()),
                    ("FH_TEST_NOFILE", "4096:4096".into()),
                ],
            );
        }
        world.wait_all_ok();
        for r in 0..2 {
            let out = world.stdout[r].lock().unwrap().clone();
            let err = world.stderr[r].lock().unwrap().clone();
            assert!(
                out.contains("SETUP FAILED")
                    && out.contains("set but empty")
                    && out.contains("openssl rand -hex 32"),
                "rank {r}\n{}",
                world.all_output()
            );
            assert!(!err.contains("FH_JOB_TOKEN is not set"), "{err}");
        }
    }
}

#[test]
fn the_descriptor_limit_is_raised_or_named() {
    // A hard limit too low for the job: a clear error naming the limit and the fix.
    let mut job = Job::new(2, "fd_limit");
    job.timeout_s = 10;
    let mut world = World::new();
    for r in 0..2 {
        world.spawn(&job, r, &[("FH_TEST_NOFILE", "40:40".into())]);
    }
    world.wait_all_ok();
    for r in 0..2 {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains("SETUP FAILED")
                && out.contains("RLIMIT_NOFILE")
                && out.contains("hard limit is 40")
                && out.contains("ulimit"),
            "rank {r}\n{}",
            world.all_output()
        );
    }
    // A low soft limit under a roomy hard limit: raised, and the job runs.
    let job = Job::new(2, "fd_limit");
    let mut world = World::new();
    for r in 0..2 {
        world.spawn(&job, r, &[("FH_TEST_NOFILE", "40:4096".into())]);
    }
    world.wait_all_ok();
    for r in 0..2 {
        let out = world.stdout[r].lock().unwrap().clone();
        let soft: u64 = out
            .lines()
            .find_map(|l| l.split("FD OK soft=").nth(1))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("rank {r}\n{}", world.all_output()));
        assert!(soft > 40 && soft <= 4096, "soft limit {soft}");
    }
}

fn killed_peer(size: usize, victim: usize) {
    let mut job = Job::new(size, "killed_peer");
    // Far longer than the test waits: survivors must notice the loss, not time out.
    job.timeout_s = 600;
    let mut world = World::new();
    for r in 0..size {
        world.spawn(&job, r, &[("FH_TEST_VICTIM", victim.to_string())]);
    }
    let all: Vec<usize> = (0..size).collect();
    world.wait_lines(&all, "ITER", WORLD_DEADLINE);
    world.children.0[victim].kill().expect("SIGKILL the victim");
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let ok = world.wait(&survivors, Duration::from_secs(60));
    assert!(
        ok.iter().all(|&b| b),
        "survivors must report the lost rank {victim}: {ok:?}\n{}",
        world.all_output()
    );
    for &r in &survivors {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains(&format!("LOST rank={victim} ")),
            "rank {r} did not name rank {victim}\n{}",
            world.all_output()
        );
    }
    // Shown with --nocapture.
    eprintln!("{}", world.all_output());
}

#[test]
fn killed_peer_is_reported_by_rank_np2() {
    killed_peer(2, 1);
}

#[test]
fn killed_peer_is_reported_by_rank_np3() {
    killed_peer(3, 1);
}

#[test]
fn killed_peer_is_reported_by_rank_np4() {
    killed_peer(4, 3);
}

/// A stopped rank (SIGSTOP: alive, silent) in a ring: the survivors time out on whoever
/// they wait for, but a survivor whose process still answers the liveness probe gets one
/// more timeout and gives up first naming the stopped rank; so every survivor names it.
#[test]
fn stopped_peer_is_named_by_every_survivor() {
    let (size, victim) = (4, 2);
    let mut job = Job::new(size, "killed_peer");
    job.timeout_s = 2;
    let mut world = World::new();
    for r in 0..size {
        world.spawn(&job, r, &[("FH_TEST_VICTIM", victim.to_string())]);
    }
    let all: Vec<usize> = (0..size).collect();
    world.wait_lines(&all, "ITER", WORLD_DEADLINE);
    let pid = world.children.0[victim].id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .expect("run kill");
    assert!(stopped.success(), "SIGSTOP the victim");
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let ok = world.wait(&survivors, Duration::from_secs(60));
    let _ = world.children.0[victim].kill();
    assert!(
        ok.iter().all(|&b| b),
        "survivors must report the stopped rank {victim}: {ok:?}\n{}",
        world.all_output()
    );
    for &r in &survivors {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains(&format!("LOST rank={victim} ")),
            "rank {r} did not name rank {victim}\n{}",
            world.all_output()
        );
    }
}

/// With a timeout of 60 s, a stopped rank is named by every survivor through the heartbeats,
/// far sooner than the timeout: the promise is 2 s, the bound here (30 s) leaves room for a
/// loaded machine and still fails whenever the survivors wait for the timeout.
#[test]
fn a_stopped_peer_is_named_long_before_the_timeout() {
    let (size, victim) = (3, 1);
    let mut job = Job::new(size, "killed_peer");
    job.timeout_s = 60;
    let mut world = World::new();
    for r in 0..size {
        world.spawn(&job, r, &[("FH_TEST_VICTIM", victim.to_string())]);
    }
    let all: Vec<usize> = (0..size).collect();
    world.wait_lines(&all, "ITER", WORLD_DEADLINE);
    // SAFETY: a signal to a child process of this test.
    let rc = unsafe { libc::kill(world.children.0[victim].id() as libc::pid_t, libc::SIGSTOP) };
    assert_eq!(rc, 0, "SIGSTOP the victim");
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let ok = world.wait(&survivors, Duration::from_secs(30));
    let _ = world.children.0[victim].kill();
    assert!(ok.iter().all(|&b| b), "{ok:?}\n{}", world.all_output());
    for &r in &survivors {
        let out = world.stdout[r].lock().unwrap().clone();
        assert!(
            out.contains(&format!("LOST rank={victim} ")),
            "rank {r} did not name rank {victim}\n{}",
            world.all_output()
        );
    }
}

/// A rank whose caller leaves the world alone for many times the heartbeats' silence (a
/// training step that computes for minutes, scaled down) is never blamed: its heartbeats come
/// from the transport's own thread. Every rank then finishes its collectives.
#[test]
fn a_rank_that_computes_between_collectives_is_never_blamed() {
    let mut job = Job::new(3, "computes");
    job.liveness = Some(HeartbeatSettings {
        interval: Duration::from_millis(100),
        silence: Duration::from_millis(600),
    });
    let mut world = World::new();
    world.spawn_all(&job);
    world.wait_all_ok();
}

#[test]
fn strangers_at_the_rendezvous_do_not_disturb_the_job() {
    let job = Job::new(3, "strangers");
    let mut world = World::new();
    world.spawn(&job, 0, &[]);
    // Wait (bounded) for rank 0 to listen, then misbehave at its door.
    let deadline = Instant::now() + WORLD_DEADLINE;
    let connect = || loop {
        match TcpStream::connect(job.rdv()) {
            Ok(s) => return s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("rank 0 never listened: {e}\n{}", world.all_output()),
        }
    };
    let mut garbage = connect();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send garbage");
    let mut impostor = connect();
    let hello = wire::Hello {
        version: wire::PROTOCOL_VERSION,
        kind: wire::ConnKind::Rendezvous,
        size: 3,
        rank: 1,
        seq: 0,
        port: 1,
        lost: 0,
        world: [0; wire::WORLD_ID_LEN],
        nonce: [3; wire::NONCE_LEN],
    };
    let hello_bytes = hello.encode();
    impostor.write_all(&hello_bytes).expect("send hello");
    let half_open = connect();
    // The impostor answers the challenge with a guess and is told why it is refused.
    impostor
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut challenge = [0u8; wire::CHALLENGE_LEN];
    impostor.read_exact(&mut challenge).expect("a challenge");
    let Ok((wire::Answer::Challenge { nonce, .. }, _)) = wire::Answer::decode(&challenge) else {
        panic!("expected a challenge");
    };
    let guess = wire::connector_proof(
        &fh_job::Key::new(b"guessed-token-0123"),
        &hello_bytes,
        &nonce,
    );
    impostor
        .write_all(&wire::encode_proof(&guess))
        .expect("send proof");
    let mut reply = Vec::new();
    let _ = impostor.read_to_end(&mut reply);
    let (r, _) = wire::Reply::decode(&reply).expect("a reply");
    assert!(
        matches!(&r, wire::Reply::Refuse(why) if why.contains("wrong job token")),
        "{r:?}"
    );
    world.spawn(&job, 1, &[]);
    world.spawn(&job, 2, &[]);
    world.wait_all_ok();
    drop(half_open);
}

// ---------------------------------------------------------------------------------------------
// Child side
// ---------------------------------------------------------------------------------------------

/// One rank of a multi-process test; does nothing unless started by a parent test.
#[test]
#[ignore = "a child rank of the multi-process tests; started by them"]
fn child_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    match scenario.as_str() {
        "collectives" => child_collectives(),
        "channels" => child_channels(),
        "wrong_token" => child_wrong_token(),
        "killed_peer" => child_killed_peer(),
        "strangers" => child_strangers(),
        "fd_limit" => child_fd_limit(),
        "computes" => child_computes(),
        other => panic!("unknown scenario {other}"),
    }
    println!("CHILD DONE");
}

fn world() -> Box<dyn Transport> {
    fh_transport::from_env().unwrap_or_else(|e| panic!("setting up the world failed: {e}"))
}

/// Encode small integers as elements of `dtype`.
fn encode(dtype: DType, vals: impl Iterator<Item = i64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match dtype {
            DType::U8 => out.push(v as u8),
            DType::I8 => out.push(v as i8 as u8),
            DType::I16 => out.extend_from_slice(&(v as i16).to_ne_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&v.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v as f64).to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v as f64).to_ne_bytes()),
            DType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&(v as f64).to_ne_bytes()),
            DType::Bool => out.push(u8::from(v != 0)),
        }
    }
    out
}

fn decode_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F16 => half::f16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => half::bf16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::F32 => f64::from(f32::from_ne_bytes(c.try_into().unwrap())),
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            _ => unreachable!("floats only"),
        })
        .collect()
}

/// Rank `rank`'s input: small values whose sums and products are exact in every dtype.
fn input(dtype: DType, op: ReduceOp, rank: usize, len: usize) -> Vec<u8> {
    let vals = (0..len).map(move |i| {
        if op == ReduceOp::Product {
            1 + ((rank + i) % 2) as i64
        } else {
            ((rank * 7 + i * 3) % 5) as i64
        }
    });
    encode(dtype, vals)
}

fn child_collectives() {
    let mut t = world();
    let (rank, size) = (t.rank(), t.size());
    let mut c = t.open("collectives").expect("open");
    assert_eq!((c.rank(), c.size()), (rank, size));

    // Allreduce: every dtype, every supported op, several lengths, against a sequential
    // reference built from every rank's (deterministic) input.
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            if !kernels::supports(dtype, op) {
                continue;
            }
            for len in [0usize, 1, 7, 1000, 65_537] {
                let mut buf = input(dtype, op, rank, len);
                let mut want = input(dtype, op, 0, len);
                for r in 1..size {
                    kernels::reduce(dtype, op.combining(), &mut want, &input(dtype, op, r, len))
                        .unwrap();
                }
                if op == ReduceOp::Average {
                    kernels::divide(dtype, &mut want, size).unwrap();
                }
                c.allreduce(&mut buf, dtype, op)
                    .unwrap_or_else(|e| panic!("allreduce {dtype:?} {op:?} len {len}: {e}"));
                if op == ReduceOp::Average && dtype.is_float() {
                    let (got, exp) = (decode_f64(dtype, &buf), decode_f64(dtype, &want));
                    for (g, e) in got.iter().zip(&exp) {
                        assert!(
                            (g - e).abs() <= 1e-2 * e.abs().max(1.0),
                            "{dtype:?} {op:?} len {len}: {g} vs {e}"
                        );
                    }
                } else {
                    assert!(buf == want, "allreduce {dtype:?} {op:?} len {len} differs");
                }
            }
        }
    }
    println!("allreduce of every dtype and op ok");

    // allgatherv with uneven (and zero) counts.
    let counts: Vec<usize> = (0..size).map(|r| (r * 37) % 101).collect();
    let mine: Vec<u8> = (0..counts[rank]).map(|i| (rank * 31 + i) as u8).collect();
    let mut all = vec![0u8; counts.iter().sum()];
    c.allgatherv(&mine, &mut all, &counts).expect("allgatherv");
    let want: Vec<u8> = (0..size)
        .flat_map(|r| (0..counts[r]).map(move |i| (r * 31 + i) as u8))
        .collect();
    assert_eq!(all, want, "allgatherv");

    // broadcast from the last rank, 1 MiB.
    let root = size - 1;
    let mut b: Vec<u8> = if rank == root {
        (0..1 << 20).map(|i| (i % 251) as u8).collect()
    } else {
        vec![0; 1 << 20]
    };
    c.broadcast(&mut b, root).expect("broadcast");
    assert!(
        b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
        "broadcast"
    );

    // alltoallv: rank r sends (r + d) % 5 * 1000 bytes to rank d, valued r * 16 + d.
    let send_counts: Vec<usize> = (0..size).map(|d| (rank + d) % 5 * 1000).collect();
    let recv_counts: Vec<usize> = (0..size).map(|s| (s + rank) % 5 * 1000).collect();
    let send: Vec<u8> = (0..size)
        .flat_map(|d| std::iter::repeat_n((rank * 16 + d) as u8, send_counts[d]))
        .collect();
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    c.alltoallv(&send, &send_counts, &mut recv, &recv_counts)
        .expect("alltoallv");
    let want: Vec<u8> = (0..size)
        .flat_map(|s| std::iter::repeat_n((s * 16 + rank) as u8, recv_counts[s]))
        .collect();
    assert_eq!(recv, want, "alltoallv");

    // Big messages in both directions at once around a ring: must not deadlock.
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let big: Vec<u8> = (0..16 << 20)
        .map(|i| (i as usize * 7 + rank) as u8)
        .collect();
    let mut got = vec![0u8; 16 << 20];
    c.send_recv(next, &big, prev, &mut got).expect("send_recv");
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, &x)| x == (i * 7 + prev) as u8));

    // Zero-length messages and messages to oneself.
    c.send_recv(next, &[], prev, &mut []).expect("zero-length");
    let mut me = [0u8; 3];
    c.send_recv(rank, &[1, 2, 3], rank, &mut me).expect("self");
    assert_eq!(me, [1, 2, 3]);

    // A receive of the wrong length is a protocol error, not a truncation or an allocation.
    if rank == 0 {
        c.send(1, &[9u8; 64]).expect("send 64");
    } else if rank == 1 {
        let mut small = [0u8; 8];
        let err = c.recv(0, &mut small).expect_err("a length mismatch");
        assert!(
            matches!(err, TransportError::Protocol { rank: 0, .. }),
            "{err}"
        );
    }
    println!("collectives ok");
    // The mismatch above broke that communicator on rank 1; a fresh one works.
    let mut c2 = t.open("after").expect("open again");
    c2.barrier().expect("barrier");
    let mut v = [rank as f64 + 1.0; 3];
    c2.allreduce_typed(&mut v, ReduceOp::Sum)
        .expect("allreduce");
    let s = (size * (size + 1) / 2) as f64;
    assert_eq!(v, [s; 3]);
}

fn child_channels() {
    let mut t = world();
    let (rank, size) = (t.rank(), t.size());
    let comms: Vec<Box<dyn Communicator>> = (0..4)
        .map(|ch| t.open(&format!("channel-{ch}")).expect("open"))
        .collect();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(ch, mut c)| {
            std::thread::spawn(move || {
                for it in 0..20usize {
                    let len = 1000 * (ch + 1) * (1 + it % 3) + it;
                    let mut v: Vec<f64> = (0..len)
                        .map(|i| ((rank + 1) * (ch + 1) + i % 7 + it) as f64)
                        .collect();
                    c.allreduce_typed(&mut v, ReduceOp::Sum)
                        .unwrap_or_else(|e| panic!("channel {ch} iteration {it}: {e}"));
                    for (i, x) in v.iter().enumerate() {
                        let want: usize = (0..size).map(|r| (r + 1) * (ch + 1) + i % 7 + it).sum();
                        assert_eq!(*x, want as f64, "channel {ch} iteration {it} element {i}");
                    }
                    // Interleave another collective on the same channel.
                    let mut b = vec![(rank * 10 + ch) as u8; 100 + it];
                    c.broadcast(&mut b, it % size).expect("broadcast");
                    assert!(b.iter().all(|&x| x == ((it % size) * 10 + ch) as u8));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a channel thread panicked");
    }
    println!("four channels in parallel ok");
}

/// Set this process's RLIMIT_NOFILE from `FH_TEST_NOFILE=soft:hard`, join, open a few
/// communicators and report the soft limit.
fn child_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let spec = std::env::var("FH_TEST_NOFILE").expect("FH_TEST_NOFILE");
    let (soft, hard) = spec.split_once(':').expect("soft:hard");
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft.parse().unwrap()),
            maximum: Some(hard.parse().unwrap()),
        },
    )
    .expect("setrlimit");
    let mut t = match fh_transport::from_env() {
        Ok(t) => t,
        Err(e) => {
            println!("SETUP FAILED: {e}");
            return;
        }
    };
    let comms: Vec<_> = (0..3)
        .map(|i| t.open(&format!("c{i}")).expect("open"))
        .collect();
    drop(comms);
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    println!("FD OK soft={soft}");
}

fn child_wrong_token() {
    match fh_transport::from_env() {
        Ok(_) => panic!("the job must not form with a wrong token"),
        Err(e) => println!("SETUP FAILED: {e}"),
    }
}

fn child_killed_peer() {
    let victim: usize = std::env::var("FH_TEST_VICTIM").unwrap().parse().unwrap();
    let mut t = world();
    let rank = t.rank();
    let mut c = t.open("data").expect("open");
    let mut buf = vec![1.0f32; 1 << 20];
    let started = Instant::now();
    for it in 0.. {
        match c.allreduce_typed(&mut buf, ReduceOp::Average) {
            Ok(()) => {
                if it == 0 {
                    println!("ITER {it}");
                }
            }
            Err(e) => {
                assert_ne!(rank, victim, "the victim itself failed: {e}");
                assert!(e.is_peer_failure(), "unexpected error kind: {e}");
                let blamed = e.blamed_rank().map_or("none".into(), |r| r.to_string());
                println!("LOST rank={blamed} after {:?}: {e}", started.elapsed());
                return;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no failure observed"
        );
    }
}

/// Allreduces, with rank 1 away (computing) for 4 s — several times the heartbeats' silence —
/// before each of the later ones, while the others wait in the collective.
fn child_computes() {
    let mut t = world();
    let rank = t.rank();
    let mut c = t.open("data").expect("open");
    let mut watch = t.liveness().expect("heartbeats run over TCP");
    for step in 0..3 {
        if rank == 1 && step > 0 {
            std::thread::sleep(Duration::from_secs(4));
        }
        let mut buf = vec![1.0f32; 1000];
        c.allreduce_typed(&mut buf, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(buf[0], 3.0);
        assert!(watch.verdict().is_none(), "{:?}", watch.verdict());
    }
    watch = t.liveness().expect("still");
    assert!(watch.verdict().is_none());
}

fn child_strangers() {
    let info = LaunchInfo::from_env().expect("environment");
    let mut t = TcpTransport::connect(&info, TcpOptions::from_info(&info)).expect("connect");
    let (rank, size) = (t.rank(), t.size());
    if rank == 0 {
        // Knock on rank 1's data listener too: garbage, and a connection that never speaks
        // (kept open while the job runs).
        let rank1 = t.peer_addresses()[1];
        let mut g = TcpStream::connect(rank1).expect("connect to rank 1");
        g.write_all(&[0xff; 100]).expect("garbage");
        let _silent = TcpStream::connect(rank1).expect("connect to rank 1");
        let mut c = t.open("data").expect("open despite strangers");
        check_strangers_allreduce(&mut *c, rank, size);
    } else {
        let mut c = t.open("data").expect("open despite strangers");
        check_strangers_allreduce(&mut *c, rank, size);
    }
    println!("job unaffected by strangers");
}

fn check_strangers_allreduce(c: &mut dyn Communicator, rank: usize, size: usize) {
    let mut v = vec![rank as i64; 1000];
    c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
    assert!(v.iter().all(|&x| x == (size * (size - 1) / 2) as i64));
}
