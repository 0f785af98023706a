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
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use crate::cargo;
use crate::cluster::{self, Cluster};

mod chaos;
mod cloud;
mod collectives;
mod common;
mod elastic_check;
mod launchers;
mod losses;
mod training;

use collectives::collectives;
pub(crate) use common::{bounded, last_lines, torch_python, which};
use launchers::{
    fhrun_mpi, fhrun_remote, fhrun_remote_fails_fast, fhrun_remote_killed, fhrun_remote_signal,
    mpirun_map_by_node,
};
pub(crate) use losses::median_and_worst;
use losses::{losses, Loss};
#[cfg(test)]
use losses::{names_rank, other_host};
use training::training;

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

/// Runs `f` on a fresh cluster of `hosts` hosts shaped as `shaping`, then takes the cluster
/// down (a failure to do so fails the check).
fn on_cluster(
    hosts: usize,
    shaping: &cluster::Shaping,
    f: impl FnOnce(&Cluster) -> Result<String, String>,
) -> Result<End, String> {
    let c = Cluster::up(hosts, shaping)?;
    let r = f(&c);
    c.down().and(r).map(End::Passed)
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
            Some(_) => on_cluster(2, &link_shaping(), |c| f(c, &bins)),
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
        let r = on_cluster(2, &link_shaping(), |c| f(c, &bins));
        note(name.to_string(), r, t);
    }

    {
        let name = "fasthorovod.torch training 2x2 (fhrun through the rsh agent)";
        if wanted(name) {
            let t = Instant::now();
            let r = match torch_python(root) {
                Err(why) => Ok(End::Skipped(why)),
                Ok(py) => on_cluster(2, &link_shaping(), |c| training(c, &bins, root, &py)),
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
        let r = on_cluster(2, &link_shaping(), |c| losses(c, &bins, &loss, transport));
        note(name.to_string(), r, t);
    }

    {
        let name = CLOUD_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = cloud::shaping()
                .and_then(|s| on_cluster(2, &s, |c| cloud::cloud_goodput(c, &bins)));
            note(name.to_string(), r, t);
        }
    }

    {
        let name = ELASTIC_CHECK;
        if wanted(name) {
            let t = Instant::now();
            let r = match torch_python(root) {
                Err(why) => Ok(End::Skipped(why)),
                Ok(py) => on_cluster(5, &link_shaping(), |c| {
                    elastic_check::run_once(c, &bins.fhrun, root, &py, 0).map(|run| run.summary)
                }),
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

#[cfg(test)]
mod tests {
    use super::*;

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
