//! One process re-forms its world any number of times (elastic training, issue 28): after a
//! failure the engine shuts down completely — every thread it and its transport started is
//! joined, no descriptor (socket) stays open, no shared-memory segment stays mapped or in
//! `/dev/shm` — and the process forms a new world with new ranks, a new rendezvous port and the
//! token of a new incarnation.
//!
//! Two long-lived rank processes live through every cycle; each cycle a newcomer joins them
//! in a 3-rank world (its rank rotating, so the rendezvous root and coordinator is killed too)
//! and kills itself with SIGKILL in the middle of a round. The survivors see the error, close
//! their engines, check that `/proc/self/task` and `/proc/self/fd` hold exactly what they held
//! before the first world (and that nothing of `/dev/shm` is mapped), form a 2-rank world, run
//! collectives with checked results, and end it with one rank closing (its reason reaches the
//! other) — checked again — before the next cycle. In a last cycle the newcomer, rank 0, dies
//! between the rendezvous and the engine's start, so that the survivors' world fails to form:
//! that failed start must leave nothing either. Rank 0's engine writes a timeline (its
//! writer thread is joined too). Over `tcp`, `shm` and `hier` (two simulated hosts through
//! `FH_HOST_ID`).
//!
//! The test binary re-runs itself as the ranks (the ignored test `reform_child`); a guard kills
//! and reaps every child, also when an assertion fails, and every wait is bounded.
#![cfg(target_os = "linux")]

use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fh_job::{
    launch::{LaunchInfo, Launcher},
    token::JobToken,
};
use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, SchedulerError, Tensor};

/// The child's schedule: `world,rank,size,how;...` (the worlds this process joins, in order;
/// how each ends: `r` a victim killed in a round, `s` a victim killed as the engine starts,
/// `c` a peer that closes).
const WORLDS: &str = "FH_REFORM_WORLDS";
/// `long` (lives through every cycle) or `victim` (kills itself in its world's round).
const ROLE: &str = "FH_REFORM_ROLE";
const BACKEND: &str = "FH_REFORM_BACKEND";
const TOKEN: &str = "FH_REFORM_TOKEN";
/// This process's simulated host (hier).
const HOST: &str = "FH_REFORM_HOST";
/// A directory of the parent's where rank 0 of world `w` leaves its rendezvous port in
/// `w.port` (picked just before the world forms, as an elastic worker picks its candidate).
const DIR: &str = "FH_REFORM_DIR";
/// Cycles whose victim dies in a round (its rank rotating); one more follows whose victim
/// dies between the rendezvous and the engine's start.
const CYCLES: usize = 3;
const WAIT: Duration = Duration::from_secs(30);
const LIMIT: Duration = Duration::from_secs(150);
/// The incarnations of this test's worlds start here (as an elastic job's do).
const INCARNATION_BASE: u64 = 1 << 32;

/// Children killed and reaped when dropped.
struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A directory removed when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spawn(role: &str, backend: &str, token: &str, host: &str, worlds: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "reform_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(BACKEND, backend)
        .env(TOKEN, token)
        .env(HOST, host)
        .env(WORLDS, worlds)
        .env(DIR, dir)
        .env_remove("FH_RANK")
        .env_remove("FH_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a rank")
}

fn wait_exit(c: &mut Child, deadline: Instant, what: &str) -> std::process::ExitStatus {
    loop {
        if let Some(s) = c.try_wait().expect("try_wait") {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what} still runs after {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn output(c: &mut Child) -> String {
    let mut out = String::new();
    if let Some(mut s) = c.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = c.stderr.take() {
        let _ = s.read_to_string(&mut out);
    }
    out
}

/// The token of world `w` of the job with `token`.
fn world_token(token: &str, w: usize) -> JobToken {
    JobToken::new(token).for_incarnation(INCARNATION_BASE + w as u64)
}

/// Run the cycles over `backend`; panics with the ranks' output when anything fails.
fn reform(backend: &str) {
    let token = format!(
        "tok-reform-{backend}-{:016x}{:08x}",
        std::process::id(),
        Instant::now().elapsed().subsec_nanos() ^ 0x5eed
    );
    let dir = TempDir(std::env::temp_dir().join(format!("fh-reform-{}", token)));
    std::fs::create_dir_all(&dir.0).expect("a temporary directory");
    // Cycle c: world 2c = {long 0, long 1, victim c} with the victim at rank c % 3, killed in
    // a round (the last cycle: at rank 0, as the engine starts, so that the world fails to
    // form); world 2c+1 = {long 0, long 1}, long 0 at rank c % 2, ended by a peer that closes.
    let mut long = [String::new(), String::new()];
    let mut victims = Vec::new();
    for c in 0..=CYCLES {
        let (v, how) = if c < CYCLES { (c % 3, 'r') } else { (0, 's') };
        let others: Vec<usize> = (0..3).filter(|&r| r != v).collect();
        for (l, s) in long.iter_mut().enumerate() {
            s.push_str(&format!("{},{},3,{how};", 2 * c, others[l]));
            let r2 = (c + l) % 2;
            s.push_str(&format!("{},{r2},2,c;", 2 * c + 1));
        }
        victims.push(format!("{},{v},3,{how}", 2 * c));
    }
    // Simulated hosts (hier): long 0 and the victims on "a", long 1 on "b".
    let deadline = Instant::now() + LIMIT;
    let mut kids = Kids(vec![
        spawn("long", backend, &token, "a", &long[0], &dir.0),
        spawn("long", backend, &token, "b", &long[1], &dir.0),
    ]);
    let mut failure = None;
    for (c, worlds) in victims.iter().enumerate() {
        kids.0
            .push(spawn("victim", backend, &token, "a", worlds, &dir.0));
        let k = kids.0.len() - 1;
        let status = wait_exit(&mut kids.0[k], deadline, "a victim");
        if status.signal() != Some(9) {
            failure = Some(format!(
                "the victim of cycle {c} should die by SIGKILL, but it ended with {status}"
            ));
            break;
        }
    }
    let mut ok = failure.is_none();
    for l in 0..2 {
        if failure.is_some() {
            // Stop waiting: the long-lived ranks' output says what went wrong first.
            let _ = kids.0[l].kill();
        }
        let status = wait_exit(&mut kids.0[l], deadline, "a long-lived rank");
        ok &= status.success();
    }
    let outs: Vec<String> = kids.0.iter_mut().map(output).collect();
    let all = |outs: &[String]| {
        outs.iter()
            .enumerate()
            .map(|(i, o)| {
                let who = if i < 2 { "long-lived" } else { "victim" };
                format!("--- process {i} ({who}):\n{o}")
            })
            .collect::<String>()
    };
    assert!(
        ok && outs[..2].iter().all(|o| o.contains("RESULT ok")),
        "{backend}: {}\n{}",
        failure.unwrap_or_else(|| "a long-lived rank failed".into()),
        all(&outs)
    );
    // Nothing of any world in /dev/shm.
    for w in 0..2 * (CYCLES + 1) {
        let t = world_token(&token, w);
        let mut prefixes = vec![fh_transport::backend::shm::segment_prefix(t.expose())];
        for h in 0..3 {
            let host = fh_transport::compose::hier::host_token(&t, h);
            prefixes.push(fh_transport::backend::shm::segment_prefix(host.expose()));
        }
        for p in prefixes {
            let left: Vec<String> = std::fs::read_dir("/dev/shm")
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.file_name().to_str().map(str::to_string))
                        .filter(|n| n.starts_with(&p))
                        .collect()
                })
                .unwrap_or_default();
            assert!(left.is_empty(), "{backend}: world {w} left {left:?}");
        }
    }
}

#[test]
fn reform_after_sigkill_over_tcp() {
    reform("tcp");
}

#[test]
fn reform_after_sigkill_over_shm() {
    reform("shm");
}

#[test]
fn reform_after_sigkill_over_hier() {
    reform("hier");
}

/// What a process holds: threads, open descriptors (with their targets), `/dev/shm` mappings.
#[derive(Debug, PartialEq)]
struct Held {
    threads: usize,
    fds: Vec<String>,
    shm_maps: Vec<String>,
}

fn held() -> Held {
    let threads = std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count();
    let mut fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .map(|e| {
            let target = std::fs::read_link(e.path())
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            format!("{} -> {target}", e.file_name().to_string_lossy())
        })
        .collect();
    // The directory listing's own descriptor differs from call to call.
    fds.retain(|f| !f.contains("/proc/") || !f.ends_with("/fd"));
    fds.sort();
    let shm_maps = std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .filter(|l| l.contains("/dev/shm/"))
        .map(str::to_string)
        .collect();
    Held {
        threads,
        fds,
        shm_maps,
    }
}

/// Check that the process holds what it held at `base`. A joined thread leaves
/// `/proc/self/task` a moment after `join` returns (the kernel clears the thread id before it
/// releases the task), so look again for up to 200 ms before failing; a thread that nobody
/// joined and that keeps running is still caught.
fn check_released(base: &Held, when: &str) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        let now = held();
        if now == *base {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_millis(200) {
            return Err(format!(
                "{when}: the process holds more than before its first world: before {base:?}, \
                 now {now:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct World {
    w: usize,
    rank: usize,
    size: usize,
    /// How the world ends (see [`WORLDS`]).
    how: char,
}

fn parse_worlds(s: &str) -> Vec<World> {
    s.split(';')
        .filter(|e| !e.is_empty())
        .map(|e| {
            let v: Vec<&str> = e.split(',').collect();
            let n = |i: usize| v[i].parse::<usize>().expect("number");
            World {
                w: n(0),
                rank: n(1),
                size: n(2),
                how: v[3].chars().next().expect("how the world ends"),
            }
        })
        .collect()
}

/// World `w`'s rendezvous port: rank 0 finds a free one and leaves it in the directory; the
/// others wait for it (at most [`WAIT`]).
fn rendezvous_port(world: &World) -> Result<u16, String> {
    let dir = std::path::PathBuf::from(std::env::var(DIR).map_err(|_| "no FH_REFORM_DIR")?);
    let file = dir.join(format!("{}.port", world.w));
    if world.rank == 0 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free port: {e}"))?;
        let tmp = dir.join(format!("{}.port.tmp", world.w));
        std::fs::write(&tmp, port.to_string())
            .and_then(|()| std::fs::rename(&tmp, &file))
            .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
        return Ok(port);
    }
    let t0 = Instant::now();
    loop {
        if let Some(p) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Ok(p);
        }
        if t0.elapsed() > WAIT {
            return Err(format!(
                "no rendezvous port for world {} in {WAIT:?}",
                world.w
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn launch(world: &World, backend: &str, token: &str, host: &str) -> Result<LaunchInfo, String> {
    let port = rendezvous_port(world)?;
    Ok(LaunchInfo {
        rank: world.rank,
        size: world.size,
        local_rank: world.rank,
        local_size: world.size,
        cross_rank: 0,
        cross_size: 1,
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(world_token(token, world.w)),
        launcher: Launcher::Fhrun,
        // A world whose rank 0 dies as it forms is given up when the heartbeats name it, long
        // before this timeout (checked in `run_long`).
        timeout: Duration::from_secs(if world.how == 's' { 60 } else { 20 }),
        // Two simulated hosts for the hierarchical backend; the others run on one host.
        host_id: (backend == "hier").then(|| format!("reform-host-{host}")),
        ..LaunchInfo::single()
    })
}

/// The engine's configuration: two channels, and a timeline written by rank 0 (its writer
/// thread must be joined too); the file is removed when the world ends.
fn config(world: &World) -> (Config, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!(
        "fh-reform-{}-world{}.json",
        std::process::id(),
        world.w
    ));
    (Config::default().channels(2).timeline(&path), path)
}

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

/// Allreduce, allgather and broadcast with results checked against what every rank sent.
fn collectives(engine: &Engine, names: &str, tag: &str) -> Result<(), String> {
    let (rank, size) = (engine.rank(), engine.size());
    for len in [3usize, 70_001] {
        let v: Vec<f32> = (0..len).map(|i| (rank * 7 + i % 13) as f32).collect();
        let got = engine
            .allreduce(&format!("{names}-ar{len}"), Tensor::from_slice(&v), sum())
            .and_then(|mut h| h.wait_timeout(WAIT))
            .and_then(|t| t.to_vec::<f32>())
            .map_err(|e| format!("{tag}: allreduce: {e}"))?;
        let ok = got.len() == len
            && got
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (0..size).map(|r| (r * 7 + i % 13) as f32).sum::<f32>());
        if !ok {
            return Err(format!("{tag}: wrong allreduce result of {len}"));
        }
    }
    let g = engine
        .allgather(
            &format!("{names}-ag"),
            Tensor::from_slice(&vec![rank as i64; rank + 1]),
        )
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<i64>())
        .map_err(|e| format!("{tag}: allgather: {e}"))?;
    let want: Vec<i64> = (0..size).flat_map(|r| vec![r as i64; r + 1]).collect();
    if g != want {
        return Err(format!("{tag}: allgather gave {g:?}, want {want:?}"));
    }
    let b = engine
        .broadcast(
            &format!("{names}-bc"),
            Tensor::from_slice(&[rank as i32; 5]),
            size - 1,
        )
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<i32>())
        .map_err(|e| format!("{tag}: broadcast: {e}"))?;
    if b != [size as i32 - 1; 5] {
        return Err(format!("{tag}: broadcast gave {b:?}"));
    }
    Ok(())
}

/// Allreduces of a large tensor until one fails; the error (or a note that none did).
fn until_failure(engine: &Engine, names: &str, tag: &str) -> Result<SchedulerError, String> {
    let big = vec![1.0f32; 1 << 20];
    for i in 0..8 {
        let r = engine
            .allreduce(&format!("{names}-big{i}"), Tensor::from_slice(&big), sum())
            .and_then(|mut h| h.wait_timeout(WAIT));
        if let Err(e) = r {
            return Ok(e);
        }
    }
    Err(format!("{tag}: no round failed after the victim's death"))
}

fn run_long(backend: &str, token: &str, host: &str, worlds: &[World]) -> Result<(), String> {
    let base = held();
    for world in worlds {
        let tag = format!("world {} (rank {} of {})", world.w, world.rank, world.size);
        let info = launch(world, backend, token, host)?;
        let (config, timeline) = config(world);
        if world.how == 's' {
            // The victim (rank 0) dies as the engine starts: the world or the engine fails to
            // form, naming it, long before the timeout of 60 s (the heartbeats that start at
            // the rendezvous name it within seconds, also where no connection to it is
            // refused: shared memory waits for rank 0's segment).
            let t0 = Instant::now();
            let started = fh_transport::world_for(&info, Some(backend))
                .map_err(SchedulerError::from)
                .and_then(|t| Engine::start(t, config));
            match started {
                Ok(engine) => return Err(format!("{tag}: started without the victim: {engine:?}")),
                Err(e) if e.lost_rank() != Some(0) => {
                    return Err(format!("{tag}: the failed start does not name rank 0: {e}"))
                }
                Err(e) if t0.elapsed() > WAIT => {
                    return Err(format!(
                        "{tag}: the lost rank was named only after {:?} (timeout 60 s): {e}",
                        t0.elapsed()
                    ))
                }
                Err(e) => println!("{tag}: failed to form after {:?}: {e}", t0.elapsed()),
            }
            let _ = std::fs::remove_file(&timeline);
            check_released(&base, &format!("after {tag} failed to start"))?;
            continue;
        }
        let transport = fh_transport::world_for(&info, Some(backend))
            .map_err(|e| format!("{tag}: world: {e}"))?;
        let engine = Engine::start(transport, config).map_err(|e| format!("{tag}: engine: {e}"))?;
        if engine.topology().rank != world.rank || engine.size() != world.size {
            return Err(format!("{tag}: got topology {:?}", engine.topology()));
        }
        let names = format!("w{}", world.w);
        collectives(&engine, &names, &tag)?;
        if world.size == 3 {
            // The victim kills itself in this round.
            let err = until_failure(&engine, &names, &tag)?;
            if err.lost_rank().is_none() {
                return Err(format!("{tag}: the failure names no lost rank: {err}"));
            }
            // The engine stopped with that error; closing reports it again.
            let closed = engine.close();
            if closed.is_ok() {
                return Err(format!("{tag}: close after the failure reported no error"));
            }
        } else if world.rank == 1 {
            // A peer that closes: rank 1 leaves, naming why; rank 0's pending round fails
            // with that reason.
            engine
                .close_with_reason("reform test: rank 1 leaves")
                .map_err(|e| format!("{tag}: close_with_reason: {e}"))?;
        } else {
            let err = engine
                .allreduce(
                    &format!("{names}-left"),
                    Tensor::from_slice(&[1.0f32]),
                    sum(),
                )
                .and_then(|mut h| h.wait_timeout(WAIT))
                .err()
                .ok_or_else(|| format!("{tag}: an allreduce succeeded without rank 1"))?;
            if !err.to_string().contains("reform test: rank 1 leaves") {
                return Err(format!("{tag}: the error does not carry the reason: {err}"));
            }
            let _ = engine.close();
        }
        drop(engine);
        let _ = std::fs::remove_file(&timeline);
        check_released(&base, &format!("after {tag}"))?;
    }
    Ok(())
}

fn run_victim(backend: &str, token: &str, host: &str, world: &World) -> Result<(), String> {
    let tag = format!("victim world {} (rank {})", world.w, world.rank);
    let info = launch(world, backend, token, host)?;
    let transport =
        fh_transport::world_for(&info, Some(backend)).map_err(|e| format!("{tag}: world: {e}"))?;
    if world.how == 's' {
        // Die between the rendezvous and the engine's start.
        kill_self();
    }
    let (config, timeline) = config(world);
    let engine = Engine::start(transport, config).map_err(|e| format!("{tag}: engine: {e}"))?;
    // The file's name stays open in the writer; unlinked now, nothing is left when it dies.
    let _ = std::fs::remove_file(&timeline);
    let names = format!("w{}", world.w);
    collectives(&engine, &names, &tag)?;
    // Submit the round's first tensor and die while it runs.
    let _h = engine
        .allreduce(
            &format!("{names}-big0"),
            Tensor::from_slice(&vec![1.0f32; 1 << 20]),
            sum(),
        )
        .map_err(|e| format!("{tag}: submit: {e}"))?;
    kill_self();
}

/// SIGKILL this process.
fn kill_self() -> ! {
    let _ = Command::new("kill")
        .args(["-KILL", &std::process::id().to_string()])
        .status();
    std::thread::sleep(Duration::from_secs(30));
    println!("RESULT still alive after SIGKILL");
    std::process::exit(1);
}

/// The body of one rank process (run only by the tests above).
#[test]
#[ignore = "run by the reform tests as a child rank"]
fn reform_child() {
    let (Ok(role), Ok(backend), Ok(token), Ok(host), Ok(worlds)) = (
        std::env::var(ROLE),
        std::env::var(BACKEND),
        std::env::var(TOKEN),
        std::env::var(HOST),
        std::env::var(WORLDS),
    ) else {
        return;
    };
    let worlds = parse_worlds(&worlds);
    let result = match role.as_str() {
        "long" => run_long(&backend, &token, &host, &worlds),
        _ => run_victim(&backend, &token, &host, &worlds[0]),
    };
    match result {
        Ok(()) => println!("RESULT ok"),
        Err(e) => {
            println!("RESULT {e}");
            std::process::exit(1);
        }
    }
}
