//! Chaos across emulated hosts (issue 38): faults that real clusters see, on a 2 × 2 job
//! (ranks 0 and 1 on h0, 2 and 3 on h1) of `fh-scheduler/examples/chaos_rank.rs` — an engine
//! that trains, results checked exactly — with `FH_TIMEOUT_SECONDS=60`, so that a fault is named
//! by the heartbeats or not in time at all.
//!
//! | fault | what | the job must |
//! |---|---|---|
//! | `kill` | SIGKILL one rank | every survivor names it |
//! | `stop` | SIGSTOP one rank | every survivor names it |
//! | `cut` | a host's link down | every rank names a rank across the cut |
//! | `partition` | nftables drops everything in and out of a host's interface | every rank names a rank across the partition |
//! | `frozen-host` | SIGSTOP every process of a host | every rank of the other host names a rank of it |
//! | `loss` | nftables drops 1–5 % of the packets on every host's interface at random (`numgen random mod 100 < N drop`) | finish with exact results, nobody blamed |
//! | `delay` | delay spikes: a host's link shaped to 10 Mbit/s with a 300 ms queue (`tbf`; this kernel has no `netem`) for a second, every other second | finish with exact results, nobody blamed |
//! | `slow-host` | a host's processes CPU-throttled to 10 % of a core (cgroup `cpu.max`, or v1 `cpu.cfs_quota_us`) | finish with exact results, nobody blamed |
//!
//! Each under `FH_TRANSPORT=tcp` and `hier`, with the ranks started from the environment
//! (direct) or by `fhrun -H h0:2,h1:2` (whose first notice names the rank, and which must
//! end). A run fails when a rank (or fhrun) is still running 20 s after the fault (**hang**;
//! the promise is 2 s), when a survivor's error names a rank it should not (**misnamed**), when
//! a benign fault blames anybody or a result is wrong (**blamed**, **wrong**). The report gives,
//! per fault and transport, runs, hangs, misnamed, failures, and the time from the fault to the
//! last survivor's error (direct) or to fhrun's end (median and worst); under fhrun also, in
//! brackets, the time to fhrun's line naming a rank (it then stops the other ranks, SIGTERM
//! and their grace first, so its end comes later).
//!
//! Under fhrun (which runs on h0) the frozen host is h1: a frozen h0 freezes fhrun with it, as
//! a launcher's own host that freezes stops the launcher anywhere.
//!
//! CI runs every fault once per transport direct and kill, stop, cut, partition and a frozen
//! host under fhrun (21 runs, about 80 s on 2 cores);
//! `FH_HOST_CHAOS_FAULTS=N` draws N runs at random instead (the long mode: 1,000), and
//! `FH_HOST_CHAOS_SEED` replays a draw.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::common::last_lines;
use super::Bins;
use crate::cluster::Cluster;

mod plan;
mod report;

pub(super) use plan::{ci_plans, random_plans, Fault, Plan, Rng};
use report::report;

/// What a run showed.
#[derive(Debug)]
pub(super) struct Outcome {
    pub plan: Plan,
    /// `None` when it passed; else the failure's kind and text.
    pub failure: Option<(&'static str, String)>,
    /// Seconds from the fault to the last survivor's error (direct) or fhrun's end.
    pub took: Option<f64>,
    /// Under fhrun: seconds from the fault to fhrun's line naming a rank (`fhrun: rank R …`),
    /// before it stops the others and waits for them (their SIGTERM grace).
    pub named: Option<f64>,
}

const WORLD: [usize; 2] = [2, 2];
const SIZE: usize = 4;
/// A rank's host.
fn host_of(rank: usize) -> usize {
    rank / 2
}
/// How long the benign faults' jobs train (seconds).
const BENIGN_SECONDS: &str = "6";
/// How long the other jobs would train without the fault.
const FAULT_SECONDS: &str = "60";
/// Every wait of a rank (`FH_TIMEOUT_SECONDS`): far beyond the heartbeats' silence, so that a
/// fault is named by them.
const TIMEOUT: Duration = Duration::from_secs(60);
/// From the fault to the hang verdict.
const HANG_BOUND: Duration = Duration::from_secs(20);
/// Bound on a job's start (every rank's first step).
const START_BOUND: Duration = Duration::from_secs(60);

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// A job of the run: direct ranks, or fhrun on h0.
enum Running {
    Direct(crate::cluster::Job),
    Fhrun {
        child: Child,
        log: std::path::PathBuf,
    },
}

impl Running {
    fn output(&self) -> String {
        match self {
            Running::Direct(j) => (0..SIZE)
                .map(|r| j.output(r))
                .collect::<Vec<_>>()
                .join("\n"),
            Running::Fhrun { log, .. } => std::fs::read_to_string(log).unwrap_or_default(),
        }
    }
}

/// The `CHAOS-READY` lines seen so far: rank → pid.
fn ready(out: &str) -> BTreeMap<usize, u32> {
    let mut m = BTreeMap::new();
    for l in out.lines().filter(|l| l.contains("CHAOS-READY")) {
        let field = |k: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .and_then(|v| v.parse::<u64>().ok())
        };
        if let (Some(r), Some(p)) = (field("rank="), field("pid=")) {
            m.insert(r as usize, p as u32);
        }
    }
    m
}

/// `(rank, t_ms, lost)` of every `CHAOS-ERROR` line.
fn errors(out: &str) -> Vec<(usize, u128, Option<usize>)> {
    out.lines()
        .filter(|l| l.contains("CHAOS-ERROR"))
        .filter_map(|l| {
            let field = |k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k));
            let rank = field("rank=")?.parse().ok()?;
            let t = field("t_ms=")?.parse().ok()?;
            let lost = field("lost=").and_then(|v| v.parse().ok());
            Some((rank, t, lost))
        })
        .collect()
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The cgroup that throttles a slow host, and how to undo it.
struct Throttle {
    dir: std::path::PathBuf,
    parent_procs: std::path::PathBuf,
}

impl Throttle {
    /// Puts `pids` in a new cgroup limited to `pct` % of one core.
    fn start(pids: &[u32], pct: u64, tag: &str) -> Result<Throttle, String> {
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        type Limit = Box<dyn Fn(&Path) -> std::io::Result<()>>;
        let (base, limit): (&Path, Limit) = if std::fs::read_to_string(v2)
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "cpu"))
        {
            let q = pct * 1000;
            (
                Path::new("/sys/fs/cgroup"),
                Box::new(move |d: &Path| std::fs::write(d.join("cpu.max"), format!("{q} 100000"))),
            )
        } else if Path::new("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists() {
            let q = pct * 1000;
            (
                Path::new("/sys/fs/cgroup/cpu"),
                Box::new(move |d: &Path| {
                    std::fs::write(d.join("cpu.cfs_period_us"), "100000")?;
                    std::fs::write(d.join("cpu.cfs_quota_us"), q.to_string())
                }),
            )
        } else {
            return Err("no cgroup cpu controller (cpu.max or cpu.cfs_quota_us)".into());
        };
        let dir = base.join(format!("fh-chaos-{tag}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        limit(&dir).map_err(|e| format!("limiting {}: {e}", dir.display()))?;
        for p in pids {
            // A process that ended meanwhile cannot move: fine.
            let _ = std::fs::write(dir.join("cgroup.procs"), p.to_string());
        }
        Ok(Throttle {
            dir,
            parent_procs: base.join("cgroup.procs"),
        })
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for p in procs.split_whitespace() {
            let _ = std::fs::write(&self.parent_procs, p);
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs one plan on cluster `c` (2 hosts, links shaped); `tag` names its leftovers.
pub(super) fn run_one(c: &Cluster, bins: &Bins, plan: &Plan, tag: &str) -> Outcome {
    let fail = |kind: &'static str, what: String| Outcome {
        plan: plan.clone(),
        failure: Some((kind, what)),
        took: None,
        named: None,
    };
    let seconds = if plan.fault.benign() {
        BENIGN_SECONDS
    } else {
        FAULT_SECONDS
    };
    let env: [(&str, &str); 3] = [
        ("FH_TRANSPORT", plan.transport),
        ("FH_PARTITION_BYTES", "262144"),
        ("FH_LOG_LEVEL", "error"),
    ];
    // Loss is on from the start: the job must also form under it.
    if plan.fault == Fault::Loss {
        for h in 0..WORLD.len() {
            let n = plan.pct;
            let rules = format!(
                "table inet fhchaos {{\n chain i {{\n  type filter hook input priority 0; policy accept;\n  iifname \"eth0\" numgen random mod 100 < {n} drop\n }}\n chain o {{\n  type filter hook output priority 0; policy accept;\n  oifname \"eth0\" numgen random mod 100 < {n} drop\n }}\n}}\n"
            );
            if let Err(e) = c.nft(h, &rules) {
                return fail("setup", e);
            }
        }
    }
    let running = if plan.fhrun {
        let log = c.dir().join(format!("fhrun-{tag}.log"));
        let file = match std::fs::File::create(&log) {
            Ok(f) => f,
            Err(e) => return fail("setup", format!("{}: {e}", log.display())),
        };
        let agent = match c.rsh_agent() {
            Ok(a) => a,
            Err(e) => return fail("setup", e),
        };
        let mut cmd = c.command(0, &bins.fhrun);
        cmd.args(["-np", "4", "-H", "h0:2,h1:2"]);
        for (k, _) in env {
            cmd.args(["-x", k]);
        }
        cmd.arg(&bins.chaos_rank)
            .arg(seconds)
            .envs(env)
            .env("FH_RSH_AGENT", &agent)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("a log file"))
            .stderr(file);
        match cmd.spawn() {
            Ok(child) => Running::Fhrun { child, log },
            Err(e) => return fail("setup", format!("fhrun: {e}")),
        }
    } else {
        match c.launch(&WORLD, &bins.chaos_rank, &[seconds], TIMEOUT, &env) {
            Ok(j) => Running::Direct(j),
            Err(e) => return fail("setup", e),
        }
    };
    let outcome = drive(c, plan, running, tag);
    if let Ok(dir) = std::env::var("FH_HOST_CHAOS_KEEP") {
        // Every run's output, for a look afterwards.
        let from = c.dir();
        let _ = Command::new("sh")
            .args(["-c", &format!("mkdir -p '{dir}/{tag}' && cp -r '{}'/job* '{}'/fhrun-{tag}.log '{dir}/{tag}/' 2>/dev/null", from.display(), from.display())])
            .status();
    }
    // Undo what the fault left (the job is over, its processes killed).
    if plan.fault == Fault::Loss || plan.fault == Fault::Partition {
        for h in 0..WORLD.len() {
            let _ = c.nft(h, "");
        }
    }
    if plan.fault == Fault::Cut {
        let _ = c.set_link(plan.victim, true);
    }
    if plan.fault == Fault::Delay {
        let _ = c.shape(plan.victim, super::LINK, "50ms");
    }
    for h in 0..WORLD.len() {
        for p in c.processes(h) {
            signal(p, "-KILL");
        }
    }
    outcome
}

/// Waits for the job's first steps, injects the fault, and judges the ends.
fn drive(c: &Cluster, plan: &Plan, mut running: Running, tag: &str) -> Outcome {
    let fail = |kind: &'static str, what: String| Outcome {
        plan: plan.clone(),
        failure: Some((kind, what)),
        took: None,
        named: None,
    };
    let t0 = Instant::now();
    let pids = loop {
        let out = running.output();
        let r = ready(&out);
        if r.len() == SIZE {
            break r;
        }
        let ended = match &mut running {
            Running::Direct(_) => false,
            Running::Fhrun { child, .. } => matches!(child.try_wait(), Ok(Some(_))),
        };
        if ended || t0.elapsed() > START_BOUND || out.contains("CHAOS-ERROR") {
            return fail("start", format!("the job did not start:\n{}", tail(&out)));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(plan.delay_ms));
    let fault_ms = now_ms();
    let fault_at = Instant::now();
    // Ranks that cannot end by themselves (stopped or frozen): not survivors.
    let mut gone: Vec<usize> = Vec::new();
    let mut throttle = None;
    let mut spikes: Option<std::thread::JoinHandle<()>> = None;
    let stop_spikes = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let injected = match plan.fault {
        Fault::Kill => {
            signal(pids[&plan.victim], "-KILL");
            gone.push(plan.victim);
            Ok(())
        }
        Fault::Stop => {
            signal(pids[&plan.victim], "-STOP");
            gone.push(plan.victim);
            Ok(())
        }
        Fault::Cut => c.set_link(plan.victim, false),
        Fault::Partition => c.nft(
            plan.victim,
            "table inet fhchaos {\n chain i {\n  type filter hook input priority 0; policy accept;\n  iifname \"eth0\" drop\n }\n chain o {\n  type filter hook output priority 0; policy accept;\n  oifname \"eth0\" drop\n }\n}\n",
        ),
        Fault::FrozenHost => {
            for p in c.processes(plan.victim) {
                signal(p, "-STOP");
            }
            gone.extend((0..SIZE).filter(|&r| host_of(r) == plan.victim));
            Ok(())
        }
        Fault::Loss => Ok(()),
        Fault::Delay => {
            let stop = std::sync::Arc::clone(&stop_spikes);
            let h = plan.victim;
            // `Cluster` is not `Sync`: the spikes run through `tc` on their own.
            let ns = c.netns(h);
            let link = c.link(h);
            spikes = Some(std::thread::spawn(move || {
                let set = |rate: &str, lat: &str| {
                    let tbf = ["root", "tbf", "rate", rate, "burst", "1mb", "latency", lat];
                    let _ = Command::new("tc")
                        .args(["qdisc", "change", "dev", &link])
                        .args(tbf)
                        .status();
                    let _ = Command::new("tc")
                        .args(["-n", &ns, "qdisc", "change", "dev", "eth0"])
                        .args(tbf)
                        .status();
                };
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    set("10mbit", "300ms");
                    std::thread::sleep(Duration::from_secs(1));
                    set(super::LINK, "50ms");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }));
            Ok(())
        }
        Fault::SlowHost => Throttle::start(&c.processes(plan.victim), 10, tag).map(|t| {
            throttle = Some(t);
        }),
    };
    if let Err(e) = injected {
        return fail("setup", format!("injecting {}: {e}", plan.fault.name()));
    }
    // Wait for the ends.
    let bound = if plan.fault.benign() {
        Duration::from_secs(120)
    } else {
        HANG_BOUND
    };
    let survivors: Vec<usize> = (0..SIZE).filter(|r| !gone.contains(r)).collect();
    let mut named = None;
    let (ended, out, fhrun_status) = match running {
        Running::Direct(job) => {
            let mut ended_all = false;
            while fault_at.elapsed() < bound {
                let out: Vec<String> = (0..SIZE).map(|r| job.output(r)).collect();
                if survivors.iter().all(|&r| {
                    out[r].contains("CHAOS-DONE")
                        || out[r].contains("CHAOS-ERROR")
                        || out[r].contains("CHAOS-WRONG")
                        || out[r].contains("panicked")
                }) {
                    ended_all = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let out: Vec<String> = (0..SIZE).map(|r| job.output(r)).collect();
            drop(job);
            (ended_all, out.join("\n"), None)
        }
        Running::Fhrun { mut child, log } => {
            let mut status = None;
            while fault_at.elapsed() < bound {
                if named.is_none()
                    && std::fs::read_to_string(&log)
                        .is_ok_and(|l| l.lines().any(|l| l.starts_with("fhrun: rank ")))
                {
                    named = Some(fault_at.elapsed().as_secs_f64());
                }
                if let Ok(Some(s)) = child.try_wait() {
                    status = Some((s, fault_at.elapsed()));
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if status.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let out = std::fs::read_to_string(&log).unwrap_or_default();
            (status.is_some(), out, status)
        }
    };
    stop_spikes.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(s) = spikes {
        let _ = s.join();
    }
    drop(throttle);
    if !ended {
        return fail(
            "hang",
            format!("still running {bound:?} after the fault:\n{}", tail(&out)),
        );
    }
    if out.contains("CHAOS-WRONG") {
        return fail("wrong", tail(&out));
    }
    let errs = errors(&out);
    if plan.fault.benign() {
        if !errs.is_empty() || out.matches("CHAOS-DONE").count() < SIZE {
            return fail(
                "blamed",
                format!("a benign fault stopped the job:\n{}", tail(&out)),
            );
        }
        if let Some((s, _)) = fhrun_status {
            if !s.success() {
                return fail("blamed", format!("fhrun ended with {s}:\n{}", tail(&out)));
            }
        }
        return Outcome {
            plan: plan.clone(),
            failure: None,
            took: None,
            named: None,
        };
    }
    // Whom each rank may name.
    let allowed = |rank: usize| -> Vec<usize> {
        match plan.fault {
            Fault::Kill | Fault::Stop => vec![plan.victim],
            _ => (0..SIZE).filter(|&r| host_of(r) != host_of(rank)).collect(),
        }
    };
    for &(rank, _, lost) in &errs {
        match lost {
            Some(l) if allowed(rank).contains(&l) => {}
            _ => {
                return fail(
                    "misnamed",
                    format!(
                        "rank {rank} named {lost:?}, not one of {:?}:\n{}",
                        allowed(rank),
                        tail(&out)
                    ),
                )
            }
        }
    }
    let took = if let Some((s, after)) = fhrun_status {
        if s.success() {
            return fail(
                "no-error",
                format!("fhrun exited 0 after a fault:\n{}", tail(&out)),
            );
        }
        // fhrun names the rank its first notice blames: `fhrun: rank R (pid P) ...`.
        let first = out
            .lines()
            .find_map(|l| l.strip_prefix("fhrun: rank "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|r| r.parse::<usize>().ok());
        let right = |r: usize| match plan.fault {
            Fault::Kill | Fault::Stop => r == plan.victim,
            Fault::FrozenHost => host_of(r) == plan.victim,
            // Both sides of a cut name a rank across it, and both reach fhrun.
            _ => true,
        };
        if !first.is_some_and(right) {
            return fail(
                "misnamed",
                format!("fhrun named {first:?}:\n{}", tail(&out)),
            );
        }
        after.as_secs_f64()
    } else {
        // Every survivor must have failed with an error.
        for &r in &survivors {
            if !errs.iter().any(|e| e.0 == r) {
                return fail(
                    "no-error",
                    format!("rank {r} ended without an error:\n{}", tail(&out)),
                );
            }
        }
        let last = errs.iter().map(|e| e.1).max().unwrap_or(fault_ms);
        last.saturating_sub(fault_ms) as f64 / 1000.0
    };
    Outcome {
        plan: plan.clone(),
        failure: None,
        took: Some(took),
        named,
    }
}

fn tail(s: &str) -> String {
    last_lines(s, 30)
}

/// Runs `plans` on fresh 2-host clusters (one per 50 runs) and reports.
pub(super) fn run_plans(bins: &Bins, plans: &[Plan], seed: u64) -> Result<String, String> {
    let mut outcomes = Vec::new();
    let mut cluster: Option<Cluster> = None;
    let started = Instant::now();
    for (i, plan) in plans.iter().enumerate() {
        if i % 50 == 0 {
            drop(cluster.take());
            cluster = Some(Cluster::up(2, &super::link_shaping())?);
        }
        let c = cluster.as_ref().expect("a cluster");
        let o = run_one(c, bins, plan, &format!("{}-{i}", std::process::id()));
        let took = o.took.map_or(String::new(), |t| format!(" {t:.2} s"));
        match &o.failure {
            None => eprintln!(
                "host chaos {}/{}: {} {} {} ok{took}",
                i + 1,
                plans.len(),
                plan.fault.name(),
                plan.transport,
                if plan.fhrun { "fhrun" } else { "direct" }
            ),
            Some((k, what)) => eprintln!(
                "host chaos {}/{}: {} {} {} FAILED ({k}) seed {seed} run {i}: {what}",
                i + 1,
                plans.len(),
                plan.fault.name(),
                plan.transport,
                if plan.fhrun { "fhrun" } else { "direct" }
            ),
        }
        outcomes.push(o);
    }
    let report = report(&outcomes, started.elapsed(), seed);
    if let Ok(path) = std::env::var("FH_HOST_CHAOS_REPORT") {
        let _ = std::fs::write(path, &report);
    }
    if outcomes.iter().any(|o| o.failure.is_some()) {
        Err(report)
    } else {
        Ok(report)
    }
}
