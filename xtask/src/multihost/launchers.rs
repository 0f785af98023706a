//! The launcher checks of `cargo xtask multihost`: mpirun and fhrun across the emulated hosts
//! through the cluster's rsh agent (placement, fail fast, signals, fhrun killed).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::collectives::check_placed;
use super::common::{bounded, tail};
use super::Bins;
use crate::cluster::{self, Cluster};
/// `mpirun --map-by node -H h0:2,h1:2` from h0 through the rsh agent: ranks 0 and 2 on h0,
/// 1 and 3 on h1.
pub(super) fn mpirun_map_by_node(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let agent = c.rsh_agent()?;
    let token = std::fs::read_to_string("/proc/sys/kernel/random/uuid")
        .map_err(|e| format!("cannot make a token: {e}"))?;
    let mut cmd = c.command(0, "mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["-np", "4", "-H", "h0:2,h1:2", "--map-by", "node"])
    .args(["--mca", "plm_rsh_agent"])
    .arg(&agent)
    .args([
        "-x",
        "FH_RENDEZVOUS_ADDR",
        "-x",
        "FH_JOB_TOKEN",
        "-x",
        "FH_TIMEOUT_SECONDS",
    ])
    .arg(&bins.selftest)
    .args(["--iters", "2", "--bytes", "1048576"])
    .env(
        "FH_RENDEZVOUS_ADDR",
        format!("h0:{}", cluster::RENDEZVOUS_PORT),
    )
    .env("FH_JOB_TOKEN", token.trim())
    .env("FH_TIMEOUT_SECONDS", "20");
    let (status, out) = bounded(cmd, &c.dir().join("mpirun.log"), Duration::from_secs(120))?;
    check_placed(status, &out, [0, 1, 0, 1])
}

/// `fhrun -np 4 -H h0:2,h1:2 --mpi` from h0, Open MPI pointed at the rsh agent: ranks 0 and 1
/// on h0, 2 and 3 on h1.
pub(super) fn fhrun_mpi(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let agent = c.rsh_agent()?;
    let mut cmd = c.command(0, &bins.fhrun);
    cmd.args([
        "-np",
        "4",
        "-H",
        "h0:2,h1:2",
        "--mpi",
        "-x",
        "FH_TIMEOUT_SECONDS",
    ])
    .arg(&bins.selftest)
    .args(["--iters", "2", "--bytes", "1048576"])
    .env("OMPI_MCA_plm_rsh_agent", &agent)
    .env("FH_TIMEOUT_SECONDS", "20");
    let (status, out) = bounded(cmd, &c.dir().join("fhrun.log"), Duration::from_secs(120))?;
    check_placed(status, &out, [0, 0, 1, 1])
}

/// An rsh agent that records its arguments (one per line, in `args.log` beside it) and runs
/// the cluster's agent in a session of its own, as ssh would: the remote side is then in no
/// process group of this host, and learns of fhrun's end only from its stdin, as over ssh.
pub(super) fn recording_agent(c: &Cluster) -> Result<(PathBuf, PathBuf), String> {
    let agent = c.rsh_agent()?;
    let path = c.dir().join("recording-agent");
    let log = c.dir().join("args.log");
    let text = format!(
        "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done >> '{}'\nexec setsid -w '{}' \"$@\"\n",
        log.display(),
        agent.display()
    );
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Command::new("chmod")
        .arg("+x")
        .arg(&path)
        .status()
        .map_err(|e| format!("chmod: {e}"))?;
    Ok((path, log))
}

/// `fhrun -np 4 -H h0:2,h1:2` from h0, no MPI: ranks 2 and 3 through the rsh agent, whose
/// command line carries nothing but the host, fhrun's path and the remote part's flag.
pub(super) fn fhrun_remote(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let (agent, args) = recording_agent(c)?;
    let mut cmd = c.command(0, &bins.fhrun);
    cmd.args(["-np", "4", "-H", "h0:2,h1:2", "-x", "FH_TIMEOUT_SECONDS"])
        .arg(&bins.selftest)
        .args(["--iters", "2", "--bytes", "1048576"])
        .env("FH_RSH_AGENT", &agent)
        .env("FH_TIMEOUT_SECONDS", "20");
    let (status, out) = bounded(cmd, &c.dir().join("fhrun.log"), Duration::from_secs(120))?;
    let placed = check_placed(status, &out, [0, 0, 1, 1])?;
    let seen = std::fs::read_to_string(&args).unwrap_or_default();
    let want = format!("h1\n{}\n--internal-fhrun-remote\n", bins.fhrun.display());
    if seen != want {
        return Err(format!(
            "the agent was called with {seen:?}, expected only {want:?} (nothing else may be on \
             a command line)"
        ));
    }
    Ok(format!(
        "{placed}; agent arguments: {:?}",
        seen.lines().collect::<Vec<_>>()
    ))
}

/// A shell command for every rank: rank 3 (on h1) fails with status 7 after a moment, the
/// others sleep.
pub(super) const FAR_RANK_FAILS: &str =
    "if [ \"$FH_RANK\" = 3 ]; then sleep 1; exit 7; fi; exec sleep 300";

/// A far rank fails: fhrun stops every rank on both hosts and exits with its status.
pub(super) fn fhrun_remote_fails_fast(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let (agent, _) = recording_agent(c)?;
    let mut cmd = c.command(0, &bins.fhrun);
    cmd.args(["-np", "4", "-H", "h0:2,h1:2", "sh", "-c", FAR_RANK_FAILS])
        .env("FH_RSH_AGENT", &agent);
    let (status, out) = bounded(cmd, &c.dir().join("fhrun.log"), Duration::from_secs(60))?;
    if status.and_then(|s| s.code()) != Some(7) {
        return Err(format!(
            "fhrun ended with {status:?}, expected exit status 7 (rank 3's); output:\n{}",
            tail(&out)
        ));
    }
    if !out.contains("rank 3") {
        return Err(format!(
            "fhrun did not name rank 3; output:\n{}",
            tail(&out)
        ));
    }
    let left: Vec<u32> = [0, 1].iter().flat_map(|&h| c.processes(h)).collect();
    if !left.is_empty() {
        return Err(format!(
            "processes left on the hosts after fhrun ended: {left:?}"
        ));
    }
    let said: Vec<&str> = out.lines().filter(|l| l.contains("fhrun")).collect();
    Ok(said.join(" | "))
}

/// Waits (bounded) until host `h` runs at least `n` processes.
pub(super) fn wait_processes(c: &Cluster, h: usize, n: usize) -> bool {
    let t = Instant::now();
    while c.processes(h).len() < n {
        if t.elapsed() > Duration::from_secs(60) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// SIGINT to fhrun reaches the ranks of the far host, which say so and exit.
pub(super) fn fhrun_remote_signal(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let (agent, _) = recording_agent(c)?;
    let log = c.dir().join("fhrun.log");
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    // Each rank says it is ready once its trap is set (a file in the cluster's directory,
    // which every host sees): a SIGINT before that would end a shell without a word.
    let ready = c.dir().join("sigint-ready");
    std::fs::create_dir_all(&ready).map_err(|e| format!("{}: {e}", ready.display()))?;
    let script = "trap 'echo \"rank $FH_RANK got SIGINT\"; exit 3' INT; \
                  sleep 300 & touch \"$READY/$FH_RANK\"; wait";
    // SIGINT at its default action in fhrun and so in its ranks, as a terminal's user has it
    // (a suite started in the background of a script has SIGINT ignored, and a shell cannot
    // trap a signal ignored when it started).
    let mut fhrun = c
        .command(0, "env")
        .arg("--default-signal=INT,QUIT,TERM,HUP")
        .arg(&bins.fhrun)
        .args([
            "-np",
            "4",
            "-H",
            "h0:2,h1:2",
            "-x",
            "READY",
            "sh",
            "-c",
            script,
        ])
        .env("FH_RSH_AGENT", &agent)
        .env("READY", &ready)
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start fhrun: {e}"))?;
    let t = Instant::now();
    while !(0..4).all(|r| ready.join(r.to_string()).exists()) {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = fhrun.kill();
            return Err(format!(
                "the ranks did not all start within 60 s (processes on h0 {:?}, h1 {:?})",
                c.processes(0),
                c.processes(1)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = Command::new("kill")
        .args(["-INT", &fhrun.id().to_string()])
        .status();
    let t = Instant::now();
    let status = loop {
        if let Ok(Some(s)) = fhrun.try_wait() {
            break Some(s);
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = fhrun.kill();
            let _ = fhrun.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    if status.and_then(|s| s.code()) != Some(130) {
        return Err(format!(
            "fhrun ended with {status:?}, expected 130 (SIGINT); output:\n{}",
            tail(&out)
        ));
    }
    for r in 0..4 {
        if !out.contains(&format!("rank {r} got SIGINT")) {
            return Err(format!(
                "rank {r} did not get SIGINT; output:\n{}",
                tail(&out)
            ));
        }
    }
    let left: Vec<u32> = [0, 1].iter().flat_map(|&h| c.processes(h)).collect();
    if !left.is_empty() {
        return Err(format!(
            "processes left on the hosts after fhrun ended: {left:?}"
        ));
    }
    Ok("every rank, on both hosts, got SIGINT; fhrun exited 130".into())
}

/// fhrun SIGKILLed: its guardian and the remote part clean up the far host.
pub(super) fn fhrun_remote_killed(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let (agent, _) = recording_agent(c)?;
    let mut fhrun = c
        .command(0, &bins.fhrun)
        .args(["-np", "4", "-H", "h0:2,h1:2", "sleep", "300"])
        .env("FH_RSH_AGENT", &agent)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start fhrun: {e}"))?;
    // h1: the remote part, its guardian and two sleeps.
    if !wait_processes(c, 1, 4) {
        let _ = fhrun.kill();
        return Err(format!("the far ranks did not start: {:?}", c.processes(1)));
    }
    let _ = fhrun.kill();
    let _ = fhrun.wait();
    let t = Instant::now();
    while !(c.processes(0).is_empty() && c.processes(1).is_empty()) {
        if t.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "30 s after fhrun was killed, processes remain: h0 {:?}, h1 {:?}",
                c.processes(0),
                c.processes(1)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(format!(
        "both hosts empty {:.1} s after the SIGKILL",
        t.elapsed().as_secs_f64()
    ))
}
