//! `cargo xtask multihost` (also a stage of `cargo xtask test`): FastHorovod across hosts, on an
//! emulated cluster ([`crate::cluster`]: one network namespace per host, links at 1 Gbit/s).
//!
//! Checks, each on a fresh cluster or job, every wait bounded:
//! - **collectives**: the scheduler's multi-rank suite (`fh-scheduler/examples/sched_suite.rs`:
//!   allreduce with sum/average/max/min over f32/f64/i32, grouped allreduce, broadcast,
//!   allgather with different rows per rank, alltoall with uneven splits, reduce-scatter,
//!   barrier, join, a mismatch and a duplicate name; both presets) at 2 × 2, 3 × 1 and 2 × 3
//!   under `FH_TRANSPORT` = `auto`, `hier` and `tcp`, ranks started with the launcher's
//!   variables; `auto` must pick `hier` where a host runs several ranks and `tcp` otherwise;
//! - **mpirun**: `mpirun --map-by node` through the cluster's rsh agent (ranks alternate hosts:
//!   every rank must find itself on the host mpirun put it on), and `fhrun -H h0:2,h1:2 --mpi`;
//! - **fhrun across hosts without MPI** (`fhrun -H h0:2,h1:2`, the agent in a session of its
//!   own as ssh would be): ranks placed host by host, nothing but host, path and flag on the
//!   agent's command line; a far rank failing stops the job with its status and leaves no
//!   process on either host; SIGINT to fhrun reaches every far rank; fhrun SIGKILLed leaves no
//!   process on either host;
//! - **training**: `fh-torch/examples/train_synthetic_cnn.py` on 2 × 2 through fhrun: every
//!   rank's parameters bit-identical, and equal (to float tolerance) to one process training on
//!   the four ranks' batches concatenated;
//! - **losses** (`fh-selftest --loop`, 2 × 2, `FH_TIMEOUT_SECONDS=5`): a host's link cut
//!   (under `FH_TRANSPORT` = `auto`, which picks `hier`, and `tcp`), a rank on the far host
//!   killed, and both ranks of a host killed: every survivor must fail on its own (not be
//!   killed at the deadline) with an error naming a rank it lost; with the link cut nobody
//!   died, and every rank must name a rank of the other host (never a live peer of its own);
//!   the check reports when each rank failed, counted from the loss.
//! - **host chaos** ([`chaos`], 2 × 2, `FH_TIMEOUT_SECONDS=60`): a rank killed or stopped, a
//!   host's link cut, a host partitioned both ways (nftables), a whole host frozen, packet loss
//!   of 1–5 % (nftables `numgen`), delay spikes (tbf), a CPU-throttled host (cgroup), over
//!   `tcp` and `hier`, ranks started directly or by fhrun: no hang, the right rank or host
//!   named (by the heartbeats, long before the timeout), and under loss, delay and a slow host
//!   the job finishes with exact results and nobody blamed; `FH_HOST_CHAOS_FAULTS=1000` is the
//!   long mode;
//! - **cloud** ([`cloud`], 2 × 2, links at 400 Mbit/s with each TCP connection capped at
//!   50 Mbit/s): the engine's replay of six 8 MiB gradients under the defaults moves them
//!   across hosts at more than 1.5 × (hier's two lanes × the cap), which only more flows than
//!   lanes can do; it reports the goodput beside the link's measured 1- and 8-stream rates, and
//!   that of a single 12 MiB group (not asserted until a group is striped over connections);
//! - **elastic training** ([`elastic_check`], 5 hosts): `fh-torch/examples/elastic_train.py`
//!   under `fhrun --host-discovery-script`: h1 lost with rank 0 (SIGKILL), h4 added, the final parameters
//!   bit-identical on every rank and equal to a one-process replay of the committed worlds;
//!   `cargo xtask multihost --elastic-runs N` runs it N times and reports the recovery and
//!   growth times (median, worst);
//! - **random kills in elastic training** ([`elastic_check`], 5 hosts, 6 runs in CI,
//!   `FH_CLUSTER_EKILL_RUNS` / `FH_CLUSTER_EKILL_SEED` for more or a replay): the same example
//!   on h1–h4 (`--min-np 2`); after the first commit a worker or a whole host is SIGKILLed at a
//!   random moment (forward, backward, reductions or a commit), in 40% of the runs a second one
//!   while the survivors re-form; the survivors train on without the victims, fhrun exits 0
//!   naming each lost host, nothing is left running, and the replay agrees.
//!
//! Where the machine cannot emulate a cluster ([`cluster::unavailable`]) every check is skipped
//! and the stage says how many and why; checks needing `mpirun` are skipped without it, the
//! training and elastic checks without a `target/fh-venv` that imports `fasthorovod.torch`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::cargo;
use crate::cluster::{self, Cluster, RankEnd};

mod chaos;
mod cloud;
mod elastic_check;
mod launchers;
mod losses;

use launchers::{
    fhrun_mpi, fhrun_remote, fhrun_remote_fails_fast, fhrun_remote_killed, fhrun_remote_signal,
    mpirun_map_by_node,
};
pub(crate) use losses::median_and_worst;
use losses::{losses, Loss};
#[cfg(test)]
use losses::{names_rank, other_host};

/// How a stage of checks ended.
pub(crate) enum Verdict {
    /// Every check that ran passed (the text says how many, and how many were skipped).
    Passed(String),
    /// Some check failed.
    Failed(String),
    /// Nothing could run.
    Skipped(String),
}

/// The layouts of the collective checks: ranks per host, and what `auto` must pick there.
const LAYOUTS: [(&[usize], &str); 3] = [(&[2, 2], "hier"), (&[1, 1, 1], "tcp"), (&[3, 3], "hier")];

/// The link rate of the emulated hosts.
pub(crate) const LINK: &str = "1gbit";

/// The emulated hosts' links: [`LINK`], no per-flow cap.
pub(crate) fn link_shaping() -> cluster::Shaping {
    cluster::Shaping::link(LINK).unwrap_or_default()
}

/// The programs the checks run.
struct Bins {
    sched_suite: PathBuf,
    replay: PathBuf,
    selftest: PathBuf,
    fhrun: PathBuf,
    chaos_rank: PathBuf,
}

/// How a check ended: passed (with what it saw), skipped (why) or failed (why).
enum End {
    Passed(String),
    Skipped(String),
}

/// One check's name and result.
type Ran = (String, Result<End, String>);

/// `cargo xtask multihost`.
pub(crate) fn task(root: &Path, args: &[String]) -> ExitCode {
    let usage = || {
        eprintln!(
            "usage: cargo xtask multihost [FILTER]   (runs the checks whose name contains FILTER)\n\
             \x20      cargo xtask multihost --elastic-runs N   (the elastic check N times: \
             recovery and growth times, median and worst)"
        );
        ExitCode::from(2)
    };
    if args.first().is_some_and(|a| a == "--elastic-runs") {
        return match args.get(1).map(|n| n.parse::<usize>()) {
            Some(Ok(n)) if n > 0 && args.len() == 2 => elastic_check::elastic_runs(root, n),
            _ => usage(),
        };
    }
    if args.len() > 1 || args.first().is_some_and(|a| a.starts_with('-')) {
        return usage();
    }
    match run(root, args.first().map(String::as_str)) {
        Verdict::Passed(s) => {
            eprintln!("multihost: {s}");
            ExitCode::SUCCESS
        }
        Verdict::Skipped(s) => {
            eprintln!("multihost: skipped: {s}");
            ExitCode::SUCCESS
        }
        Verdict::Failed(s) => {
            eprintln!("multihost: FAILED: {s}");
            ExitCode::FAILURE
        }
    }
}

/// Number of checks [`run`] makes (reported as skipped when none can run).
fn total_checks() -> usize {
    LAYOUTS.len() * 3 + 2 + 4 + 1 + 4 + 1 + 1 + 1 + 1
}

/// The name of the chaos check across hosts.
const HOST_CHAOS_CHECK: &str =
    "host chaos: kill, stop, cut, partition, frozen host, loss, delay, slow host (tcp, hier; direct, fhrun)";

/// The chaos runs ([`chaos`]): the CI set, or `FH_HOST_CHAOS_FAULTS` runs drawn from
/// `FH_HOST_CHAOS_SEED` (default: the clock); `nft` missing skips the check.
fn host_chaos(bins: &Bins) -> Result<String, String> {
    if Command::new("nft")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .map_or(true, |s| !s.success())
    {
        return Err("no `nft` on PATH (install Debian's nftables: cargo xtask test does)".into());
    }
    let seed = std::env::var("FH_HOST_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let mut rng = chaos::Rng::new(seed);
    let plans = match std::env::var("FH_HOST_CHAOS_FAULTS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
    {
        Some(n) if n > 0 => chaos::random_plans(&mut rng, n),
        _ => chaos::ci_plans(&mut rng),
    };
    // FH_HOST_CHAOS_KINDS=cut,stop and FH_HOST_CHAOS_LAUNCHER=fhrun|direct narrow the draw.
    let kinds = std::env::var("FH_HOST_CHAOS_KINDS").unwrap_or_default();
    let launcher = std::env::var("FH_HOST_CHAOS_LAUNCHER").unwrap_or_default();
    let plans: Vec<chaos::Plan> = plans
        .into_iter()
        .filter(|p| kinds.is_empty() || kinds.split(',').any(|k| k == p.fault.name()))
        .filter(|p| match launcher.as_str() {
            "fhrun" => p.fhrun,
            "direct" => !p.fhrun,
            _ => true,
        })
        .collect();
    chaos::run_plans(bins, &plans, seed)
}

/// The name of the cloud check ([`cloud`]).
const CLOUD_CHECK: &str =
    "cloud 2x2: gradients cross per-flow-capped links over more flows than hier has lanes";

/// The name of the elastic check.
const ELASTIC_CHECK: &str =
    "elastic training: h1 (rank 0) lost, h4 added (fhrun --host-discovery-script)";

/// The name of the elastic check with kills at random moments.
const RANDOM_KILL_CHECK: &str =
    "elastic training: workers and hosts SIGKILLed at random moments (fhrun --host-discovery-script)";

/// The random-kill runs: [`elastic_check::RANDOM_KILL_RUNS`], or `FH_CLUSTER_EKILL_RUNS`, drawn
/// from `FH_CLUSTER_EKILL_SEED` (default: the clock), on one cluster of five hosts.
fn random_kills(root: &Path, bins: &Bins, py: &Path) -> Result<String, String> {
    let runs = std::env::var("FH_CLUSTER_EKILL_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(elastic_check::RANDOM_KILL_RUNS);
    let seed = std::env::var("FH_CLUSTER_EKILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let c = Cluster::up(5, &link_shaping())?;
    let r = elastic_check::random_kills(&c, &bins.fhrun, root, py, runs, seed);
    c.down().and(r)
}

/// Builds the programs and runs every check (whose name contains `filter`, when given).
pub(crate) fn run(root: &Path, filter: Option<&str>) -> Verdict {
    let wanted = |name: &str| filter.is_none_or(|f| name.contains(f));
    if let Some(why) = cluster::unavailable() {
        return Verdict::Skipped(format!(
            "{} multi-host checks skipped: cannot emulate a cluster: {why}",
            total_checks()
        ));
    }
    let target = root.join("target");
    for args in [
        &["build", "--profile", "test", "-p", "fh-launch", "--bins"][..],
        &[
            "build",
            "--profile",
            "test",
            "-p",
            "fh-scheduler",
            "--example",
            "sched_suite",
            "--example",
            "chaos_rank",
            "--example",
            "replay",
        ][..],
    ] {
        let status = Command::new(cargo())
            .current_dir(root)
            .args(args)
            .env("CARGO_TARGET_DIR", &target)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            return Verdict::Failed(format!("cargo {} failed: {status:?}", args.join(" ")));
        }
    }
    let debug = target.join("debug");
    let bins = Bins {
        sched_suite: debug.join("examples").join("sched_suite"),
        replay: debug.join("examples").join("replay"),
        selftest: debug.join("fh-selftest"),
        fhrun: debug.join("fhrun"),
        chaos_rank: debug.join("examples").join("chaos_rank"),
    };
    let mut ran: Vec<Ran> = Vec::new();
    let mut note = |name: String, r: Result<End, String>, t: Instant| {
        match &r {
            Ok(End::Passed(saw)) => eprintln!(
                "multihost: {name}: ok ({:.1} s): {saw}",
                t.elapsed().as_secs_f64()
            ),
            Ok(End::Skipped(why)) => eprintln!("multihost: {name}: skipped: {why}"),
            Err(e) => eprintln!("multihost: {name}: FAILED: {e}"),
        }
        ran.push((name, r));
    };

    for (layout, auto_picks) in LAYOUTS {
        let shape = format!("{}x{}", layout.len(), layout[0]);
        if !["auto", "hier", "tcp"]
            .iter()
            .any(|t| wanted(&format!("collectives {shape} {t}")))
        {
            continue;
        }
        match Cluster::up(layout.len(), &link_shaping()) {
            Ok(c) => {
                for transport in ["auto", "hier", "tcp"] {
                    if !wanted(&format!("collectives {shape} {transport}")) {
                        continue;
                    }
                    let t = Instant::now();
                    let want = if transport == "auto" {
                        auto_picks
                    } else {
                        transport
                    };
                    let r = collectives(&c, &bins, layout, transport, want).map(End::Passed);
                    note(format!("collectives {shape} {transport}"), r, t);
                }
                if let Err(e) = c.down() {
                    note(format!("teardown {shape}"), Err(e), Instant::now());
                }
            }
            Err(e) => {
                for transport in ["auto", "hier", "tcp"] {
                    note(
                        format!("collectives {shape} {transport}"),
                        Err(format!("cluster: {e}")),
                        Instant::now(),
                    );
                }
            }
        }
    }

    let mpirun = which("mpirun");
    for (name, f) in [
        (
            "mpirun --map-by node (2x2, rsh agent)",
            mpirun_map_by_node as fn(&Cluster, &Bins) -> Result<String, String>,
        ),
        ("fhrun -H h0:2,h1:2 --mpi (rsh agent)", fhrun_mpi),
    ] {
        if !wanted(name) {
            continue;
        }
        let t = Instant::now();
        let r = match &mpirun {
            None => Ok(End::Skipped(
                "no mpirun on PATH (Debian: apt-get install openmpi-bin)".to_string(),
            )),
            Some(_) => Cluster::up(2, &link_shaping())
                .and_then(|c| {
                    let r = f(&c, &bins);
                    c.down().and(r)
                })
                .map(End::Passed),
        };
        note(name.to_string(), r, t);
    }

    for (name, f) in [
        (
            "fhrun -H h0:2,h1:2 through the rsh agent (no MPI)",
            fhrun_remote as fn(&Cluster, &Bins) -> Result<String, String>,
        ),
        (
            "fhrun across hosts: a far rank fails, the job stops",
            fhrun_remote_fails_fast,
        ),
        (
            "fhrun across hosts: SIGINT reaches the far ranks",
            fhrun_remote_signal,
        ),
        (
            "fhrun across hosts: fhrun SIGKILLed, far ranks cleaned up",
            fhrun_remote_killed,
        ),
    ] {
        if !wanted(name) {
            continue;
        }
        let t = Instant::now();
        let r = Cluster::up(2, &link_shaping())
            .and_then(|c| {
                let r = f(&c, &bins);
                c.down().and(r)
            })
            .map(End::Passed);
        note(name.to_string(), r, t);
    }

    {
        let name = "fasthorovod.torch training 2x2 (fhrun through the rsh agent)";
        if wanted(name) {
            let t = Instant::now();
            let r = match torch_python(root) {
                Err(why) => Ok(End::Skipped(why)),
                Ok(py) => Cluster::up(2, &link_shaping())
                    .and_then(|c| {
                        let r = training(&c, &bins, root, &py);
                        c.down().and(r)
                    })
                    .map(End::Passed),
            };
            note(name.to_string(), r, t);
        }
    }

    for (name, loss, transport) in [
        ("link of h1 cut (2x2, auto)", Loss::LinkDown, "auto"),
        ("link of h1 cut (2x2, tcp)", Loss::LinkDown, "tcp"),
        ("rank 3 on h1 killed (2x2)", Loss::Ranks(&[3]), "auto"),
        (
            "both ranks of h1 killed (2x2)",
            Loss::Ranks(&[2, 3]),
            "auto",
        ),
    ] {
        if !wanted(name) {
            continue;
        }
        let t = Instant::now();
        let r = Cluster::up(2, &link_shaping())
            .and_then(|c| {
                let r = losses(&c, &bins, &loss, transport);
                c.down().and(r)
            })
            .map(End::Passed);
        note(name.to_string(), r, t);
    }

    {
        let name = CLOUD_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = cloud::shaping()
                .and_then(|s| Cluster::up(2, &s))
                .and_then(|c| {
                    let r = cloud::cloud_goodput(&c, &bins);
                    c.down().and(r)
                })
                .map(End::Passed);
            note(name.to_string(), r, t);
        }
    }

    {
        let name = ELASTIC_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = match torch_python(root) {
                Err(why) => Ok(End::Skipped(why)),
                Ok(py) => Cluster::up(5, &link_shaping())
                    .and_then(|c| {
                        let r = elastic_check::run_once(&c, &bins.fhrun, root, &py, 0);
                        c.down().and(r.map(|run| run.summary))
                    })
                    .map(End::Passed),
            };
            note(name.to_string(), r, t);
        }
    }

    {
        let name = RANDOM_KILL_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = match torch_python(root) {
                Err(why) => Ok(End::Skipped(why)),
                Ok(py) => random_kills(root, &bins, &py).map(End::Passed),
            };
            note(name.to_string(), r, t);
        }
    }

    {
        let name = HOST_CHAOS_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = host_chaos(&bins).map(End::Passed);
            note(name.to_string(), r, t);
        }
    }

    let failed: Vec<String> = ran
        .iter()
        .filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}")))
        .collect();
    let skipped = ran
        .iter()
        .filter(|(_, r)| matches!(r, Ok(End::Skipped(_))))
        .count();
    let passed = ran.len() - failed.len() - skipped;
    if !failed.is_empty() {
        Verdict::Failed(format!(
            "{} of {} multi-host checks failed: {}",
            failed.len(),
            ran.len(),
            failed.join("; ")
        ))
    } else {
        Verdict::Passed(format!(
            "{passed} multi-host checks passed, {skipped} skipped"
        ))
    }
}

/// The scheduler's suite on `layout` under `FH_TRANSPORT=transport`; rank 0 must report the
/// backend `want`.
fn collectives(
    c: &Cluster,
    bins: &Bins,
    layout: &[usize],
    transport: &str,
    want: &str,
) -> Result<String, String> {
    let job = c.launch(
        layout,
        &bins.sched_suite,
        &["--schedule", "all", "--channels", "1,2,4"],
        Duration::from_secs(20),
        &[("FH_TRANSPORT", transport)],
    )?;
    let ends = job.wait(Duration::from_secs(240));
    all_passed(&ends)?;
    let over = format!("sched_suite over {want}: passed");
    match ends[0].output.lines().find(|l| l.contains(&over)) {
        Some(line) => Ok(line.trim().to_string()),
        None => Err(format!(
            "rank 0 did not report `{over}`; its output:\n{}",
            tail(&ends[0].output)
        )),
    }
}

/// Every rank exited 0, or an error quoting the first that did not.
fn all_passed(ends: &[RankEnd]) -> Result<(), String> {
    for (rank, e) in ends.iter().enumerate() {
        match e.status {
            Some(s) if s.success() => {}
            Some(s) => {
                return Err(format!(
                    "rank {rank} exited with {s}; its output:\n{}",
                    tail(&e.output)
                ))
            }
            None => {
                return Err(format!(
                    "rank {rank} was still running at the deadline; its output:\n{}",
                    tail(&e.output)
                ))
            }
        }
    }
    Ok(())
}

/// The last lines of `s` (for error messages).
fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Where fh-selftest says each rank is: `(rank, local size, cross rank)` from its lines
/// `fh-selftest: rank R of N (local L/LS, cross C/CS), ...`.
fn places(output: &str) -> Vec<(usize, usize, usize)> {
    let mut found = Vec::new();
    for line in output.lines() {
        let Some(at) = line.find("fh-selftest: rank ") else {
            continue;
        };
        let rest = &line[at + "fh-selftest: rank ".len()..];
        let nums: Vec<usize> = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse().ok())
            .collect();
        // R, N, L, LS, C, CS
        if rest.contains(" of ") && rest.contains("cross") && nums.len() >= 6 {
            found.push((nums[0], nums[3], nums[4]));
        }
    }
    found.sort();
    found
}

/// Runs `cmd`, at most `limit`, output to a file; returns the status (`None`: killed at the
/// deadline) and the output.
fn bounded(
    mut cmd: Command,
    log: &Path,
    limit: Duration,
) -> Result<(Option<ExitStatus>, String), String> {
    let file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let start = Instant::now();
    let status = loop {
        if let Ok(Some(s)) = child.try_wait() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((status, std::fs::read_to_string(log).unwrap_or_default()))
}

/// Checks that a 4-rank fh-selftest run passed with ranks placed as `hosts[r]` says (the
/// host index mpirun put rank r on; the settled cross ranks must group the ranks the same way).
fn check_placed(
    status: Option<ExitStatus>,
    out: &str,
    hosts: [usize; 4],
) -> Result<String, String> {
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!("ended with {status:?}; output:\n{}", tail(out)));
    }
    let p = places(out);
    if p.len() != 4 || out.matches("PASSED").count() != 4 {
        return Err(format!(
            "expected four ranks to report and pass; output:\n{}",
            tail(out)
        ));
    }
    for a in 0..4 {
        for b in 0..4 {
            let same = hosts[a] == hosts[b];
            if (p[a].2 == p[b].2) != same || p[a].1 != 2 {
                return Err(format!(
                    "ranks {a} and {b} should be on {} host{} (2 ranks each); they report \
                     (rank, local size, cross rank) {:?} and {:?}",
                    if same { "the same" } else { "different" },
                    if same { "" } else { "s" },
                    p[a],
                    p[b]
                ));
            }
        }
    }
    Ok(format!(
        "cross ranks of ranks 0-3: {:?}",
        p.iter().map(|x| x.2).collect::<Vec<_>>()
    ))
}

/// The Python of `target/fh-venv` when it can import `fasthorovod.torch` (the Python stages of
/// `cargo xtask test` make it), or why not.
pub(crate) fn torch_python(root: &Path) -> Result<PathBuf, String> {
    let py = root
        .join("target")
        .join("fh-venv")
        .join("bin")
        .join("python");
    let mut cmd = Command::new(&py);
    cmd.args(["-c", "import fasthorovod.torch"]);
    match bounded(
        cmd,
        &root.join("target").join("fh-import-check.log"),
        Duration::from_secs(120),
    ) {
        Ok((Some(s), _)) if s.success() => Ok(py),
        Ok((_, out)) => Err(format!(
            "{} cannot import fasthorovod.torch (the Python stages of `cargo xtask test` set it \
             up): {}",
            py.display(),
            tail(&out)
        )),
        Err(e) => Err(format!("no Python environment at {}: {e}", py.display())),
    }
}

/// Compares the saved parameters: every rank's equal to rank 0's bit for bit, and rank 0's
/// equal to one process's on the ranks' batches concatenated (to float tolerance: the sum
/// runs in another order). Prints the largest difference from one process.
const COMPARE_PARAMS: &str = r#"
import sys, torch
n, ranks, ref = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ps = [torch.load(ranks.format(rank=r)) for r in range(n)]
want = torch.load(ref)
for r in range(1, n):
    for k in ps[0]:
        if not torch.equal(ps[0][k], ps[r][k]):
            sys.exit(f"{k}: rank {r} differs from rank 0")
worst = 0.0
for k in ps[0]:
    if not torch.allclose(ps[0][k], want[k], rtol=1e-4, atol=1e-5):
        sys.exit(f"{k}: {n} ranks and one process differ")
    worst = max(worst, (ps[0][k] - want[k]).abs().max().item())
print(f"{n} ranks bit-identical; largest difference from one process {worst:.3g}")
"#;

/// `fh-torch/examples/train_synthetic_cnn.py` on 2 × 2 through fhrun's rsh agent (rank 0 on h0,
/// ranks 2 and 3 on h1): bit-identical parameters on every rank, equal to one process.
fn training(c: &Cluster, bins: &Bins, root: &Path, py: &Path) -> Result<String, String> {
    let agent = c.rsh_agent()?;
    let example = root
        .join("fh-torch")
        .join("examples")
        .join("train_synthetic_cnn.py");
    let ranks = c.dir().join("params-{rank}.pt");
    let reference = c.dir().join("params-ref.pt");
    let steps = "12";
    let mut cmd = c.command(0, &bins.fhrun);
    cmd.args([
        "-np",
        "4",
        "-H",
        "h0:2,h1:2",
        "-x",
        "FH_TIMEOUT_SECONDS",
        "-x",
        "OMP_NUM_THREADS",
    ])
    .arg(py)
    .arg(&example)
    .args(["--steps", steps, "--save"])
    .arg(&ranks)
    .env("FH_RSH_AGENT", &agent)
    .env("FH_TIMEOUT_SECONDS", "60")
    .env("OMP_NUM_THREADS", "1");
    let (status, out) = bounded(cmd, &c.dir().join("train.log"), Duration::from_secs(300))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!(
            "the 4-rank run ended with {status:?}; output:\n{}",
            tail(&out)
        ));
    }
    let mut one = Command::new(py);
    one.arg(&example)
        .args(["--steps", steps, "--concat-ranks", "4", "--save"])
        .arg(&reference)
        .env("OMP_NUM_THREADS", "1");
    let (status, out1) = bounded(one, &c.dir().join("one.log"), Duration::from_secs(300))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!(
            "the one-process run ended with {status:?}; output:\n{}",
            tail(&out1)
        ));
    }
    let mut cmp = Command::new(py);
    cmp.args(["-c", COMPARE_PARAMS, "4"])
        .arg(&ranks)
        .arg(&reference);
    let (status, said) = bounded(cmp, &c.dir().join("compare.log"), Duration::from_secs(120))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!("the parameters differ: {}", tail(&said)));
    }
    Ok(said.lines().last().unwrap_or("").trim().to_string())
}

/// Finds `prog` on `PATH`.
fn which(prog: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_read_from_selftest_lines() {
        let out = "[1,2]<stdout>:fh-selftest: rank 2 of 4 (local 1/2, cross 0/2), backend hier, connected in 0.1 s\n\
                   fh-selftest: rank 0 of 4 (local 0/2, cross 1/2), backend hier, connected in 0.2 s\n\
                   fh-selftest: rank 0: PASSED\n";
        assert_eq!(places(out), vec![(0, 2, 1), (2, 2, 0)]);
    }

    #[test]
    fn the_other_host_of_a_2x2_job() {
        assert_eq!(other_host(0), vec![2, 3]);
        assert_eq!(other_host(1), vec![2, 3]);
        assert_eq!(other_host(2), vec![0, 1]);
        assert_eq!(other_host(3), vec![0, 1]);
    }

    #[test]
    fn median_and_worst_of_failure_times() {
        assert_eq!(median_and_worst(&[6.0, 5.0, 9.0]), (6.0, 9.0));
        assert_eq!(median_and_worst(&[6.0, 5.0, 9.0, 7.0]), (6.5, 9.0));
        assert_eq!(median_and_worst(&[]), (0.0, 0.0));
    }

    #[test]
    fn a_rank_is_named_only_in_full() {
        assert!(names_rank("timed out waiting for rank 3 during recv", &[3]));
        assert!(names_rank("rank 2 is gone: reset", &[2, 3]));
        assert!(!names_rank("rank 31 is gone", &[3]));
        assert!(!names_rank("rank 1 is gone", &[2, 3]));
    }
}
