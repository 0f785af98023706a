//! fh-bench: FastHorovod's benchmark suite (`cargo xtask bench`).
//!
//! Subcommands: `suite` (everything selected, the default of `cargo xtask bench`),
//! `collectives`, `replay`, `negotiation`, `simulate` (one suite each, same options), `report`
//! (re-generate the report of a recorded `run.json`), `timeline-png` (a picture of a merged
//! timeline) and `worker` (internal: one rank of a job).
//! Output goes to `target/fh-bench/<timestamp>/`: `run.json`, PNG/SVG plots and `report.md`.

mod across;
mod collectives;
mod mpi_peer;
mod plots;
mod record;
mod replay;
mod report;
mod runner;
mod sim;
mod simulate;
mod stats;
mod suite;
mod timeline_png;
mod torch_peer;
mod workload;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::runner::Launch;

#[derive(Parser)]
#[command(
    name = "fh-bench",
    version,
    about = "FastHorovod benchmarks: workload replay, collectives, negotiation, scale simulation"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the selected suites (all by default): what `cargo xtask bench` runs.
    Suite(SuiteArgs),
    /// Collectives sweep only.
    Collectives(SuiteArgs),
    /// Workload replay only (the headline).
    Replay(SuiteArgs),
    /// Negotiation cost only.
    Negotiation(SuiteArgs),
    /// Scale simulation only (a model; calibrated with --calibration RUN_JSON when given).
    Simulate(SuiteArgs),
    /// Re-generate report.md and the plots from a recorded run.json.
    Report {
        /// The recorded run.
        run_json: PathBuf,
        /// Output directory (default: the run.json's directory).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Draw a merged timeline (`fhrun --timeline-filename`) as a PNG: a band per rank, a row
    /// per lane, a window of the trace.
    TimelinePng {
        /// The merged trace.
        input: PathBuf,
        /// The PNG to write.
        output: PathBuf,
        /// Where the window starts, ms after the trace's first span (default: the middle).
        #[arg(long)]
        from_ms: Option<f64>,
        /// How long the window is, ms.
        #[arg(long, default_value_t = 400.0)]
        len_ms: f64,
    },
    /// Internal: one rank of a job (started by the driver or by mpirun/srun).
    #[command(hide = true)]
    Worker {
        /// The job file.
        #[arg(long)]
        job: PathBuf,
        /// Result prefix: this rank writes `<out>.rank<R>.json`.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LauncherArg {
    /// N processes of fh-bench on this host (TCP loopback).
    Local,
    /// One thread per rank, in-process backend.
    Threads,
    /// OpenMPI's mpirun.
    Mpirun,
    /// Slurm's srun.
    Srun,
}

#[derive(Args, Clone)]
struct SuiteArgs {
    /// Suites to run (collectives, replay, negotiation, simulate); default: all.
    #[arg(value_name = "SUITE")]
    suites: Vec<String>,
    /// Few sizes, few repeats, the headline workloads (ResNet-50, BERT-base): a few minutes.
    #[arg(long)]
    quick: bool,
    /// Ranks.
    #[arg(long, default_value_t = 4)]
    np: usize,
    /// Hosts for mpirun (comma-separated, `host:slots` allowed); implies --launcher mpirun.
    #[arg(long)]
    hosts: Option<String>,
    /// How ranks are started.
    #[arg(long, value_enum, default_value = "local")]
    launcher: LauncherArg,
    /// Rank 0's host for the TCP rendezvous under mpirun/srun (default: first of --hosts, else
    /// 127.0.0.1).
    #[arg(long)]
    rendezvous_host: Option<String>,
    /// Output directory (default: a folder named for the start time under target/fh-bench).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Workloads directory.
    #[arg(long, env = "FH_BENCH_WORKLOADS")]
    workloads: Option<PathBuf>,
    /// Workloads to replay and simulate (model names); default: all (quick: resnet50,
    /// bert-base).
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// Emulated backward pass, ms (default 100: a fast GPU's backward for these models, as in
    /// DESIGN.md's targets, so that communication matters).
    #[arg(long, default_value_t = 100.0)]
    backward_ms: f64,
    /// Measured replay steps, after one warm-up step (default: 3 quick, 10 full).
    #[arg(long)]
    steps: Option<usize>,
    /// Runs of each replay configuration, interleaved round-robin so that a slow spell of a
    /// shared host hits every row (default 3).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    replay_repeats: u64,
    /// Timed repeats per collective case (default: 5 quick, 10 full).
    #[arg(long)]
    repeats: Option<usize>,
    /// Collective sizes in bytes, comma-separated (default: quick 8,4K,1M,16M (+64M allreduce);
    /// full 8 B × 4^k … 256 MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Tensor counts of the negotiation measurement (default: quick 16,256,4096; full
    /// 16,64,256,1024,4096).
    #[arg(long, value_delimiter = ',')]
    tensor_counts: Vec<usize>,
    /// Transports of the collectives sweep (tcp: processes over loopback; shm: processes over
    /// shared memory; hier, auto: across --hosts, shared memory within a host and TCP between;
    /// local: threads). The replay runs over every process transport listed (else the first),
    /// interleaved; the negotiation runs over the first.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm,local")]
    transports: Vec<String>,
    /// Do not run the peers (OpenMPI, PyTorch DDP, Horovod).
    #[arg(long)]
    no_peers: bool,
    /// A run.json whose measurements calibrate the simulation (default: this run's).
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// The rate TCP reaches across a host's link, Gbit/s, as measured by the caller (`cargo
    /// xtask bench --emulate` passes the best of 1 and 8 parallel streams): with --hosts, the replay report
    /// gives each row's bytes across the link, its link bound and the model calibrated on it.
    #[arg(long, value_parser = parse_gbps)]
    link_gbps: Option<f64>,
    /// The rate one TCP stream reaches across a host's link, Gbit/s, as measured by the caller
    /// (`cargo xtask bench --emulate` passes it): with --link-gbps, the model's per-flow cap
    /// (each transfer reaches at most its connections' streams of this rate, up to the link).
    #[arg(long, value_parser = parse_gbps)]
    flow_gbps: Option<f64>,
    /// Replay only the shipped fasthorovod (K = 4) with the flight recorder on and off
    /// (FH_FLIGHT_RECORDS=0), interleaved: what always-on recording costs.
    #[arg(long)]
    flight_cost: bool,
    /// Longest one job (one collective over one transport, one replay configuration) may take,
    /// seconds.
    #[arg(long, default_value_t = 300)]
    job_timeout: u64,
}

fn parse_gbps(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err(format!(
            "bad link rate '{s}': want a positive number of Gbit/s, e.g. 0.95"
        )),
    }
}

/// `fhrun` for the `fasthorovod.torch` peer across hosts: `$FH_BENCH_FHRUN`, else the build's
/// (`<target>/release/fhrun`, then `debug`), else `fhrun` on `PATH`.
fn fhrun_path(target: &std::path::Path) -> PathBuf {
    if let Some(p) = std::env::var_os("FH_BENCH_FHRUN") {
        return PathBuf::from(p);
    }
    ["release", "debug"]
        .iter()
        .map(|d| target.join(d).join("fhrun"))
        .find(|p| p.is_file())
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .unwrap_or_else(|| PathBuf::from("fhrun"))
}

fn parse_size(s: &str) -> Result<usize, String> {
    let n = fh_core::units::parse_size(s)?;
    usize::try_from(n).map_err(|_| format!("'{s}' is too large for this machine"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Suite(a) => run_suite(a, None),
        Cmd::Collectives(a) => run_suite(a, Some("collectives")),
        Cmd::Replay(a) => run_suite(a, Some("replay")),
        Cmd::Negotiation(a) => run_suite(a, Some("negotiation")),
        Cmd::Simulate(a) => run_suite(a, Some("simulate")),
        Cmd::Report { run_json, out } => regenerate(run_json, out),
        Cmd::Worker { job, out } => worker(job, out),
        Cmd::TimelinePng {
            input,
            output,
            from_ms,
            len_ms,
        } => timeline_png::render(&input, &output, from_ms, len_ms),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fh-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_suite(a: SuiteArgs, only: Option<&str>) -> Result<(), String> {
    let mut suites: Vec<String> = match only {
        Some(s) => vec![s.to_string()],
        None if a.suites.is_empty() => suite::SUITES.iter().map(|s| s.to_string()).collect(),
        None => a.suites.clone(),
    };
    for s in &suites {
        if !suite::SUITES.contains(&s.as_str()) {
            return Err(format!(
                "unknown suite '{s}' (use {})",
                suite::SUITES.join(", ")
            ));
        }
    }
    suites.sort_by_key(|s| suite::SUITES.iter().position(|x| x == s));
    suites.dedup();
    if a.np == 0 {
        return Err("--np must be at least 1".into());
    }
    let launch = match (a.launcher, &a.hosts) {
        (_, Some(h)) => Launch::Mpirun {
            hosts: Some(h.clone()),
        },
        (LauncherArg::Local, None) => Launch::Local,
        (LauncherArg::Threads, None) => Launch::Threads,
        (LauncherArg::Mpirun, None) => Launch::Mpirun { hosts: None },
        (LauncherArg::Srun, None) => Launch::Srun,
    };
    let target = std::env::var_os("FH_BENCH_TARGET_DIR")
        .or_else(|| std::env::var_os("CARGO_TARGET_DIR"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| target.join("fh-bench").join(suite::timestamp()));
    // The Python peers across --hosts: started through the rsh agent ($FH_RSH_AGENT, else ssh).
    let peer_hosts = match &a.hosts {
        Some(h) => Some(torch_peer::Hosts::parse(
            h,
            std::env::var("FH_RSH_AGENT")
                .ok()
                .filter(|s| !s.trim().is_empty())
                .unwrap_or_else(|| "ssh".into()),
            fhrun_path(&target),
        )?),
        None => None,
    };
    if a.link_gbps.is_some() && a.hosts.is_none() {
        return Err("--link-gbps is the link between hosts: give --hosts too".into());
    }
    if a.flow_gbps.is_some() && a.link_gbps.is_none() {
        return Err("--flow-gbps is one stream across the link: give --link-gbps too".into());
    }
    let opts = suite::Options {
        quick: a.quick,
        np: a.np,
        launch,
        out: out.clone(),
        suites,
        workloads_dir: a.workloads.clone().unwrap_or_else(workload::default_dir),
        workloads: a.models.clone(),
        backward_ms: a.backward_ms,
        steps: a.steps.unwrap_or(if a.quick { 3 } else { 10 }),
        replay_repeats: a.replay_repeats as usize,
        repeats: a.repeats.unwrap_or(if a.quick { 5 } else { 10 }),
        sizes: a.sizes.clone(),
        transports: a.transports.clone(),
        tensor_counts: if a.tensor_counts.is_empty() {
            if a.quick {
                vec![16, 256, 4096]
            } else {
                vec![16, 64, 256, 1024, 4096]
            }
        } else {
            a.tensor_counts.clone()
        },
        no_peers: a.no_peers,
        calibration: a.calibration.clone(),
        job_timeout: Duration::from_secs(a.job_timeout),
        peer_hosts,
        link_gbps: a.link_gbps,
        flow_gbps: a.flow_gbps,
        flight_cost: a.flight_cost,
        rendezvous_host: a.rendezvous_host.clone().unwrap_or_else(|| {
            a.hosts
                .as_deref()
                .and_then(|h| h.split(',').next())
                .map(|h| h.split(':').next().unwrap_or(h).to_string())
                .unwrap_or_else(|| "127.0.0.1".into())
        }),
    };
    let exe = std::env::current_exe().map_err(|e| format!("locating fh-bench itself: {e}"))?;
    eprintln!(
        "fh-bench: {} on {} ranks ({}), output in {}",
        opts.suites.join(", "),
        opts.np,
        opts.launch.name(),
        out.display()
    );
    let record = suite::run(&opts, exe)?;
    let written = report::write_all(&record, &out)?;
    println!("{}", report::summary(&record));
    for e in &written.plot_errors {
        eprintln!("fh-bench: plot not drawn: {e}");
    }
    println!(
        "report: {} ({} plot files)",
        written.report.display(),
        written.plots.len()
    );
    println!("json:   {}", written.json.display());
    Ok(())
}

fn regenerate(run_json: PathBuf, out: Option<PathBuf>) -> Result<(), String> {
    let text = std::fs::read_to_string(&run_json)
        .map_err(|e| format!("reading {}: {e}", run_json.display()))?;
    let record: record::RunRecord = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not an fh-bench run.json: {e}", run_json.display()))?;
    let dir = out.unwrap_or_else(|| {
        run_json
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let written = report::write_all(&record, &dir)?;
    println!("{}", report::summary(&record));
    println!("report: {}", written.report.display());
    Ok(())
}

fn worker(job: PathBuf, out: PathBuf) -> Result<(), String> {
    let text =
        std::fs::read_to_string(&job).map_err(|e| format!("reading job {}: {e}", job.display()))?;
    let job: runner::Job =
        serde_json::from_str(&text).map_err(|e| format!("bad job file {}: {e}", job.display()))?;
    let transport = world::transport_from_env()?;
    let rank = transport.rank();
    let result = runner::execute(&job, transport).map_err(|e| format!("rank {rank}: {e}"))?;
    let path = runner::result_path(&out, rank);
    let text = serde_json::to_string(&result).map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert!(parse_size("3X").unwrap_err().contains("not a byte size"));
    }
}
