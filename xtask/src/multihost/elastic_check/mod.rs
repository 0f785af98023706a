//! The elastic check of `cargo xtask multihost`: `fh-torch/examples/elastic_train.py` under
//! `fhrun --host-discovery-script` on an emulated cluster of five hosts, with a host lost and a
//! host added while it trains. fhrun (the driver) runs on h0, which runs no worker.
//!
//! 1. The discovery script lists h1, h2 and h3 (one slot each): the job starts on 3 ranks,
//!    rank 0 on h1.
//! 2. After two commits in that world, every process on h1 is killed with SIGKILL: the host of
//!    rank 0 — the rendezvous root and the coordinator — is lost. The survivors must restore
//!    their last commit and train on as 2 ranks; the time from the kill to their first step
//!    in the new world is the *recovery time*.
//! 3. h4 is then added to the discovery script; it must join at the next commit (a world of
//!    3 ranks with a rank on h4); the time from the edit to the first step there is the
//!    *growth time*.
//! 4. After two commits in that world the check creates the stop file: the ranks end at their
//!    next commit, and fhrun must exit 0 naming the lost host.
//! 5. The example replays, in one process, the committed steps of the sequence of worlds from
//!    the workers' logs: every rank's final parameters must be bit-identical, and equal (to
//!    float tolerance) to the replay's.
//!
//! The example (with `ELASTIC_LOG=DIR`) logs each worker's steps, commits and final parameters
//! in `DIR/<worker>.jsonl`, and its progress as text lines in `DIR/<worker>.progress`:
//! `step|commit UNIX_TIME GENERATION RANK SIZE HOST`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::process::ExitCode;

use super::{link_shaping, median_and_worst, torch_python};
use crate::cargo;
use crate::cluster::{self, Cluster};

mod random_kills;

pub(crate) use random_kills::{random_kills, RANDOM_KILL_RUNS};

/// The most any phase of the check may wait.
const PHASE_LIMIT: Duration = Duration::from_secs(240);

/// The example's arguments (the replay takes the same): epochs enough to outlast the check,
/// which ends the run with the stop file; a short pause after each step.
const TRAIN_ARGS: [&str; 4] = ["--epochs", "100000", "--step-delay", "0.05"];

/// Commits to see in a world before moving on.
const COMMITS: usize = 2;

/// One progress line of a worker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Progress {
    /// `step` or `commit`.
    pub kind: String,
    /// Seconds since the Unix epoch.
    pub time: f64,
    pub generation: u64,
    pub rank: usize,
    pub size: usize,
    pub host: String,
}

/// Parses one progress line; `None` for anything else (a line being written, say).
pub(crate) fn parse_progress(line: &str) -> Option<Progress> {
    let mut it = line.split_whitespace();
    let kind = it.next()?;
    if kind != "step" && kind != "commit" {
        return None;
    }
    let p = Progress {
        kind: kind.to_string(),
        time: it.next()?.parse().ok()?,
        generation: it.next()?.parse().ok()?,
        rank: it.next()?.parse().ok()?,
        size: it.next()?.parse().ok()?,
        host: it.next()?.to_string(),
    };
    it.next().is_none().then_some(p)
}

/// Every progress line of every worker under `dir`.
fn read_progress(dir: &Path) -> Vec<Progress> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut all = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "progress") {
            if let Ok(text) = std::fs::read_to_string(&p) {
                all.extend(text.lines().filter_map(parse_progress));
            }
        }
    }
    all
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What one run of the check measured.
pub(crate) struct ElasticRun {
    /// Seconds from the SIGKILL of h1 to the first step of the smaller world.
    pub recovery: f64,
    /// Seconds from h4's addition to the first step of the world with h4.
    pub growth: f64,
    /// What the check saw (worlds, the replay's verdict).
    pub summary: String,
}

/// The job under test, stopped (SIGKILL to fhrun, whose guardian stops its ranks) when dropped
/// before it ended.
struct Running {
    child: Child,
    log: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Running {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `done` holds of the progress so far (or the job ends, or the limit).
    fn wait_for(
        &mut self,
        logs: &Path,
        what: &str,
        done: impl Fn(&[Progress]) -> Option<f64>,
    ) -> Result<f64, String> {
        let start = Instant::now();
        loop {
            if let Some(t) = done(&read_progress(logs)) {
                return Ok(t);
            }
            if let Ok(Some(s)) = self.child.try_wait() {
                return Err(format!(
                    "fhrun ended ({s}) before {what}; its output:\n{}",
                    tail(&self.output())
                ));
            }
            if start.elapsed() > PHASE_LIMIT {
                return Err(format!(
                    "no {what} within {PHASE_LIMIT:?}; fhrun's output:\n{}",
                    tail(&self.output())
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn tail(s: &str) -> String {
    super::common::last_lines(s, 40)
}

/// The generations in `p` of `size` ranks, one of them on `host` when given, after `after`.
fn worlds(p: &[Progress], size: usize, host: Option<&str>, after: f64) -> Vec<u64> {
    let mut g: Vec<u64> = p
        .iter()
        .filter(|x| x.size == size && x.time > after)
        .filter(|x| {
            host.is_none_or(|h| {
                p.iter()
                    .any(|y| y.generation == x.generation && y.host == h)
            })
        })
        .map(|x| x.generation)
        .collect();
    g.sort_unstable();
    g.dedup();
    g
}

/// Commits of generation `g` by its rank 0.
fn commits(p: &[Progress], g: u64) -> usize {
    p.iter()
        .filter(|x| x.kind == "commit" && x.generation == g && x.rank == 0)
        .count()
}

/// The files of one elastic job on the cluster: its discovery script's host list, the
/// workers' logs, the stop file.
struct JobFiles {
    logs: PathBuf,
    hosts: PathBuf,
    stop: PathBuf,
}

impl JobFiles {
    fn write_hosts(&self, hosts: &[&str]) -> Result<(), String> {
        let text: String = hosts.iter().map(|h| format!("{h}\n")).collect();
        std::fs::write(&self.hosts, text).map_err(|e| format!("{}: {e}", self.hosts.display()))
    }
}

/// Starts `fhrun` on h0 (which runs no worker) with the example under
/// `--host-discovery-script`, the script listing `hosts` (one slot each), in `dir`.
fn start_job(
    c: &Cluster,
    fhrun: &Path,
    root: &Path,
    py: &Path,
    dir: &Path,
    hosts: &[&str],
    np: (usize, usize, usize),
) -> Result<(Running, JobFiles), String> {
    let files = JobFiles {
        logs: dir.join("logs"),
        hosts: dir.join("hosts"),
        stop: dir.join("stop"),
    };
    std::fs::create_dir_all(&files.logs).map_err(|e| format!("{}: {e}", files.logs.display()))?;
    files.write_hosts(hosts)?;
    let script = dir.join("discover.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\ncat '{}'\n", files.hosts.display()),
    )
    .map_err(|e| format!("{}: {e}", script.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", script.display()))?;
    }
    let example = root
        .join("fh-torch")
        .join("examples")
        .join("elastic_train.py");
    let agent = c.rsh_agent()?;
    let log = dir.join("fhrun.log");
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let (np, min_np, max_np) = np;
    let mut cmd: Command = c.command(0, fhrun);
    cmd.arg("-np")
        .arg(np.to_string())
        .arg("--min-np")
        .arg(min_np.to_string())
        .arg("--max-np")
        .arg(max_np.to_string())
        .args(["--slots", "1"])
        .arg("--host-discovery-script")
        .arg(&script)
        .args(["--elastic-timeout", "120"])
        .args([
            "-x",
            "FH_TIMEOUT_SECONDS",
            "-x",
            "OMP_NUM_THREADS",
            "-x",
            "ELASTIC_LOG",
        ])
        .arg(py)
        .arg(&example)
        .args(TRAIN_ARGS)
        .arg("--stop-file")
        .arg(&files.stop)
        .env("ELASTIC_LOG", &files.logs)
        .env("FH_RSH_AGENT", &agent)
        .env("FH_TIMEOUT_SECONDS", "10")
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start fhrun: {e}"))?;
    Ok((Running { child, log }, files))
}

/// One run of the check on `c` (at least 5 hosts): see the module's docs.
pub(crate) fn run_once(
    c: &Cluster,
    fhrun: &Path,
    root: &Path,
    py: &Path,
    n: usize,
) -> Result<ElasticRun, String> {
    let dir = c.dir().join(format!("elastic{n}"));
    let (mut job, files) = start_job(c, fhrun, root, py, &dir, &["h1", "h2", "h3"], (3, 2, 4))?;
    let logs = files.logs.clone();

    // 1. Three ranks, two commits.
    let first = job.wait_for(&logs, "two commits in a world of 3 ranks", |p| {
        worlds(p, 3, Some("h1"), 0.0)
            .into_iter()
            .find(|&g| commits(p, g) >= COMMITS)
            .map(|g| g as f64)
    })? as u64;

    // 2. h1 lost, with rank 0.
    let rank0 = read_progress(&logs)
        .iter()
        .find(|x| x.generation == first && x.rank == 0)
        .map(|x| x.host.clone());
    if rank0.as_deref() != Some("h1") {
        return Err(format!(
            "rank 0 of the first world ran on {rank0:?}, not on h1"
        ));
    }
    let killed = now();
    let pids = c.processes(1);
    if pids.is_empty() {
        return Err("no process runs on h1 to kill".into());
    }
    for pid in &pids {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    let smaller = job.wait_for(&logs, "a step in a world of 2 ranks after h1's loss", |p| {
        p.iter()
            .filter(|x| x.kind == "step" && x.size == 2 && x.generation > first && x.time > killed)
            .map(|x| x.time)
            .reduce(f64::min)
    })?;
    let recovery = smaller - killed;
    let two = job.wait_for(&logs, "two commits in the world of 2 ranks", |p| {
        worlds(p, 2, None, killed)
            .into_iter()
            .find(|&g| commits(p, g) >= COMMITS)
            .map(|g| g as f64)
    })? as u64;

    // 3. h4 added (h1 stays listed: it is blacklisted, and must not come back).
    files.write_hosts(&["h1", "h2", "h3", "h4"])?;
    let added = now();
    let bigger = job.wait_for(&logs, "a step in a world with h4", |p| {
        p.iter()
            .filter(|x| x.kind == "step" && x.host == "h4" && x.generation > two)
            .map(|x| x.time)
            .reduce(f64::min)
    })?;
    let growth = bigger - added;
    let three = job.wait_for(&logs, "two commits in the world with h4", |p| {
        worlds(p, 3, Some("h4"), added)
            .into_iter()
            .find(|&g| commits(p, g) >= COMMITS)
            .map(|g| g as f64)
    })? as u64;

    // 4. The end.
    let (out, replayed) = finish(job, c, root, py, &files)?;
    if !out.contains("lost h1 (rank 0 gone") {
        return Err(format!(
            "fhrun's output does not name the lost host h1 and its rank 0:\n{}",
            tail(&out)
        ));
    }
    if read_progress(&logs)
        .iter()
        .any(|x| x.host == "h1" && x.generation > first)
    {
        return Err("h1 trained again after its loss (it is blacklisted)".into());
    }

    Ok(ElasticRun {
        recovery,
        growth,
        summary: format!(
            "worlds: generation {first} (3 ranks), h1 (rank 0) SIGKILLed, generation {two} (2 \
             ranks), h4 added, generation {three} (3 ranks with h4); recovery {recovery:.2} s, \
             growth {growth:.2} s; {replayed}"
        ),
    })
}

/// Ends the job with the stop file: fhrun must exit 0, nothing may be left on any host, and
/// the example's replay of the committed worlds must agree with the workers' parameters.
/// Returns fhrun's output and the replay's verdict line.
fn finish(
    mut job: Running,
    c: &Cluster,
    root: &Path,
    py: &Path,
    files: &JobFiles,
) -> Result<(String, String), String> {
    let stop = &files.stop;
    std::fs::write(stop, "stop\n").map_err(|e| format!("{}: {e}", stop.display()))?;
    let start = Instant::now();
    let status = loop {
        if let Ok(Some(s)) = job.child.try_wait() {
            break s;
        }
        if start.elapsed() > PHASE_LIMIT {
            return Err(format!(
                "fhrun still ran {PHASE_LIMIT:?} after the stop file; its output:\n{}",
                tail(&job.output())
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = job.output();
    if !status.success() {
        return Err(format!(
            "fhrun ended with {status}; its output:\n{}",
            tail(&out)
        ));
    }
    for h in 0..5 {
        let left = c.processes(h);
        if !left.is_empty() {
            return Err(format!(
                "processes {left:?} still run on h{h} after the job ended"
            ));
        }
    }
    let example = root
        .join("fh-torch")
        .join("examples")
        .join("elastic_train.py");
    let said = Command::new(py)
        .arg(&example)
        .args(TRAIN_ARGS)
        .arg("--replay")
        .arg(&files.logs)
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run the replay: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&said.stdout),
        String::from_utf8_lossy(&said.stderr)
    );
    if !said.status.success() {
        return Err(format!("the replay disagrees: {}", tail(&text)));
    }
    let verdict = String::from_utf8_lossy(&said.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .to_string();
    Ok((out, verdict))
}

/// `cargo xtask multihost --elastic-runs N`: the elastic check `n` times, each on a fresh
/// cluster; prints each run's recovery and growth times, then their median and worst.
pub(crate) fn elastic_runs(root: &Path, n: usize) -> ExitCode {
    if let Some(why) = cluster::unavailable() {
        eprintln!("multihost: cannot emulate a cluster: {why}");
        return ExitCode::FAILURE;
    }
    let Ok(fhrun) = build_fhrun(root) else {
        return ExitCode::FAILURE;
    };
    let py = match torch_python(root) {
        Ok(py) => py,
        Err(why) => {
            eprintln!("multihost: {why}");
            return ExitCode::FAILURE;
        }
    };
    let (mut recovery, mut growth) = (Vec::new(), Vec::new());
    for i in 0..n {
        let r = Cluster::up(5, &link_shaping()).and_then(|c| {
            let r = run_once(&c, &fhrun, root, &py, i);
            c.down().and(r)
        });
        match r {
            Ok(run) => {
                eprintln!("multihost: elastic run {}/{n}: {}", i + 1, run.summary);
                recovery.push(run.recovery);
                growth.push(run.growth);
            }
            Err(e) => {
                eprintln!("multihost: elastic run {}/{n} FAILED: {e}", i + 1);
                return ExitCode::FAILURE;
            }
        }
    }
    let (rm, rw) = median_and_worst(&recovery);
    let (gm, gw) = median_and_worst(&growth);
    eprintln!(
        "multihost: {n} elastic runs: from h1's SIGKILL to training on 2 ranks: median \
         {rm:.2} s, worst {rw:.2} s; from h4's addition to training with it: median {gm:.2} s, \
         worst {gw:.2} s"
    );
    ExitCode::SUCCESS
}

/// Builds fhrun (test profile, as `run` does) and returns its path.
fn build_fhrun(root: &Path) -> Result<PathBuf, ()> {
    let target = root.join("target");
    let status = Command::new(cargo())
        .current_dir(root)
        .args(["build", "--profile", "test", "-p", "fh-launch", "--bins"])
        .env("CARGO_TARGET_DIR", &target)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!("multihost: cargo build -p fh-launch failed: {status:?}");
        return Err(());
    }
    Ok(target.join("debug").join("fhrun"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_are_read_and_others_skipped() {
        assert_eq!(
            parse_progress("step 1733370000.25 3 1 2 h1"),
            Some(Progress {
                kind: "step".into(),
                time: 1733370000.25,
                generation: 3,
                rank: 1,
                size: 2,
                host: "h1".into(),
            })
        );
        assert_eq!(parse_progress("step 1.0 3 1 2"), None);
        assert_eq!(parse_progress("step 1.0 3 1 2 h1 extra"), None);
        assert_eq!(parse_progress("loss 1.0 3 1 2 h1"), None);
        assert_eq!(parse_progress(""), None);
    }

    #[test]
    fn worlds_are_found_by_size_and_host() {
        let p: Vec<Progress> = [
            "step 1 0 0 3 h0",
            "step 1 0 2 3 h2",
            "commit 2 0 0 3 h0",
            "step 5 1 0 2 h0",
            "step 9 2 2 3 h3",
            "step 9 2 0 3 h0",
        ]
        .iter()
        .filter_map(|l| parse_progress(l))
        .collect();
        assert_eq!(worlds(&p, 3, Some("h2"), 0.0), vec![0]);
        assert_eq!(worlds(&p, 3, Some("h3"), 0.0), vec![2]);
        assert_eq!(worlds(&p, 2, None, 4.0), vec![1]);
        assert_eq!(commits(&p, 0), 1);
        assert_eq!(commits(&p, 1), 0);
    }
}
