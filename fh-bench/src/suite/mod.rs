//! The suite: runs the selected benchmarks, aggregates the ranks' figures into a [`RunRecord`].

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::collectives::Collective;
use crate::record::{Host, RunConfig, RunRecord, Skipped, SCHEMA};
use crate::runner::{Launch, Runner};
use crate::stats::Quantity;
use crate::workload::Workload;
use crate::{simulate, torch_peer, world};

mod host;
mod negotiation;
mod replay;
mod sweep;
#[cfg(test)]
mod tests;

pub use host::timestamp;
use host::{git_revision, hostname, utc_now};
use replay::replay_transports;

/// The suites, in run order.
pub const SUITES: [&str; 4] = ["collectives", "replay", "negotiation", "simulate"];

/// Everything the suite needs to know.
#[derive(Debug, Clone)]
pub struct Options {
    /// Small sizes, few repeats, headline workloads only.
    pub quick: bool,
    /// Ranks.
    pub np: usize,
    /// How ranks are started for the TCP runs.
    pub launch: Launch,
    /// Output directory.
    pub out: PathBuf,
    /// Suites to run.
    pub suites: Vec<String>,
    /// Workloads directory.
    pub workloads_dir: PathBuf,
    /// Workload names (empty: quick → resnet50 + bert-base; else all).
    pub workloads: Vec<String>,
    /// Emulated backward, ms.
    pub backward_ms: f64,
    /// Measured replay steps.
    pub steps: usize,
    /// Runs of each replay configuration, interleaved round-robin (every configuration once,
    /// then again), so that a slow spell of a shared host hits every row.
    pub replay_repeats: usize,
    /// Timed repeats per collective case.
    pub repeats: usize,
    /// Collective sizes (bytes); empty → the default for quick/full.
    pub sizes: Vec<usize>,
    /// Tensor counts of the negotiation measurement.
    pub tensor_counts: Vec<usize>,
    /// Transports for the collectives sweep (`tcp`, `shm`, `local`); the engine suites use the
    /// first.
    pub transports: Vec<String>,
    /// Skip the peers (OpenMPI, PyTorch DDP, Horovod).
    pub no_peers: bool,
    /// A previous `run.json` to calibrate the simulation from (else this run's figures).
    pub calibration: Option<PathBuf>,
    /// Longest one job may take.
    pub job_timeout: Duration,
    /// Rank 0's host for the TCP rendezvous under mpirun/srun.
    pub rendezvous_host: String,
    /// Where the Python peers' ranks run when they span hosts (`--hosts`); None: this host.
    pub peer_hosts: Option<torch_peer::Hosts>,
    /// The rate TCP measured across a host's link, Gbit/s (`--link-gbps`, given by
    /// whoever measured it, e.g. `cargo xtask bench --emulate`): the replay's link bounds and
    /// the model calibrated on that link.
    pub link_gbps: Option<f64>,
    /// The rate one TCP stream measured across a host's link, Gbit/s (`--flow-gbps`): the
    /// model's per-flow cap.
    pub flow_gbps: Option<f64>,
    /// Replay only the shipped `fasthorovod` with the flight recorder on and off, interleaved
    /// (`--flight-cost`): what always-on recording costs.
    pub flight_cost: bool,
}

/// Default sizes of the sweep: quick → 8 B, 4 KiB, 1 MiB, 16 MiB (+64 MiB for allreduce);
/// full → 8 B × 4ᵏ up to 128 MiB, then 256 MiB.
pub fn default_sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![8, 4 << 10, 1 << 20, 16 << 20]
    } else {
        let mut v: Vec<usize> = (0..13).map(|k| 8usize << (2 * k)).collect();
        v.push(256 << 20);
        v
    }
}

/// Runs the suite; the record is complete even when parts were skipped or failed (they are
/// listed in `skipped`).
pub fn run(opts: &Options, exe: PathBuf) -> Result<RunRecord, String> {
    let started = Instant::now();
    let ticks_at_start = host::cpu_ticks();
    std::fs::create_dir_all(&opts.out)
        .map_err(|e| format!("creating {}: {e}", opts.out.display()))?;
    let all_workloads =
        Workload::select(&opts.workloads_dir, &opts.workloads).map_err(|e| e.to_string())?;
    let workloads: Vec<Workload> = if opts.workloads.is_empty() && opts.quick {
        all_workloads
            .into_iter()
            .filter(|w| w.model == "resnet50" || w.model == "bert-base")
            .collect()
    } else {
        all_workloads
    };
    let sizes = if opts.sizes.is_empty() {
        default_sizes(opts.quick)
    } else {
        opts.sizes.clone()
    };
    let mut record = RunRecord {
        schema: SCHEMA,
        tool: format!("fh-bench {}", env!("CARGO_PKG_VERSION")),
        started_utc: utc_now(),
        git_revision: git_revision(),
        host: Host {
            hostname: hostname(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            os: format!("{}/{}", std::env::consts::OS, std::env::consts::ARCH),
            steal_percent: None,
            load_average: None,
            copy_gbps: if opts.suites.iter().any(|x| x == "simulate") {
                host::measure_copy_gbps()
            } else {
                None
            },
            copy_gbps_shared: if opts.suites.iter().any(|x| x == "simulate") {
                host::measure_shared_copy_gbps(opts.np)
            } else {
                None
            },
            copy_gbps_staged: if opts.suites.iter().any(|x| x == "simulate") {
                host::measure_staged_copy_gbps(opts.np, host::stage_bytes())
            } else {
                None
            },
        },
        config: RunConfig {
            quick: opts.quick,
            np: opts.np,
            launcher: opts.launch.name().to_string(),
            hosts: match &opts.launch {
                Launch::Mpirun { hosts } => hosts.clone(),
                _ => None,
            },
            suites: opts.suites.clone(),
            sizes: sizes.clone(),
            repeats: opts.repeats,
            backward_ms: opts.backward_ms,
            steps: opts.steps,
            replay_repeats: opts.replay_repeats.max(1),
            workloads_dir: opts.workloads_dir.display().to_string(),
            workloads: workloads.iter().map(|w| w.model.clone()).collect(),
            tensor_counts: opts.tensor_counts.clone(),
        },
        collectives: vec![],
        streams: vec![],
        replay: vec![],
        replay_allreduce: vec![],
        negotiation: vec![],
        simulation: None,
        across: None,
        skipped: vec![],
        wall: Quantity::exact(0.0, "s"),
    };
    let wants = |s: &str| opts.suites.iter().any(|x| x == s);
    let work_dir = opts.out.join("work");

    // The transports to run on, with their runners.
    let mut runners: Vec<(String, Runner)> = Vec::new();
    for t in &opts.transports {
        let launch = match crate::record::transport_env(t).0 {
            "local" => Launch::Threads,
            // hier and auto: across hosts (--hosts; shared memory within a host, TCP between);
            // NAME@VAR=VALUE: NAME with a setting of its own (`record::transport_env`).
            "tcp" | "shm" | "hier" | "auto" => {
                if let Err(why) = world::tcp_available() {
                    record.skipped.push(Skipped {
                        suite: "all".into(),
                        what: "tcp transport".into(),
                        reason: why,
                    });
                    continue;
                }
                opts.launch.clone()
            }
            other => {
                record.skipped.push(Skipped {
                    suite: "all".into(),
                    what: format!("{other} transport"),
                    reason: "not supported by fh-bench yet (use tcp, shm, hier, auto or local, \
                             each optionally NAME@VAR=VALUE, or hier-serial)"
                        .into(),
                });
                continue;
            }
        };
        runners.push((
            t.clone(),
            Runner {
                np: opts.np,
                launch,
                exe: exe.clone(),
                work_dir: work_dir.clone(),
                timeout: opts.job_timeout,
                rendezvous_host: opts.rendezvous_host.clone(),
                transport: t.clone(),
            },
        ));
    }

    // Progress: one tick per job.
    let mut total = 0u64;
    if wants("collectives") {
        total += (runners.len() * (Collective::ALL.len() + sweep::stream_jobs().len())) as u64
            + u64::from(!opts.no_peers) * 2;
    }
    if wants("simulate") {
        total += 1;
    }
    let neg_nps: Vec<usize> = if opts.quick || opts.np <= 2 {
        vec![opts.np]
    } else {
        vec![2, opts.np]
    };
    // The Python peers of the replay: those whose module imports, unless --no-peers.
    let python = torch_peer::python();
    let mut peers = Vec::new();
    if wants("replay") {
        let list: &[torch_peer::Peer] = if opts.peer_hosts.is_some() {
            &torch_peer::PEERS_ACROSS_HOSTS
        } else {
            &torch_peer::PEERS
        };
        for peer in list {
            let reason = if opts.no_peers {
                Some("skipped: --no-peers".to_string())
            } else if !torch_peer::imports(
                &peer.python(&python),
                peer.module,
                Duration::from_secs(120),
            ) {
                Some(peer.not_installed(&peer.python(&python)))
            } else {
                None
            };
            match reason {
                None => peers.push(*peer),
                Some(reason) => record.skipped.push(Skipped {
                    suite: "replay".into(),
                    what: peer.what.into(),
                    reason,
                }),
            }
        }
        total += (opts.replay_repeats.max(1)
            * workloads.len()
            * (replay_transports(&runners)
                .iter()
                .map(|(t, _)| {
                    replay::schedules_over(t, opts.np, opts.launch.hosts(), opts.flight_cost).len()
                })
                .sum::<usize>()
                + peers.len())) as u64;
    }
    if wants("negotiation") {
        // Three modes per tensor count, and two back-to-back measurements, at each rank count.
        total += (neg_nps.len()
            * (negotiation::MODES.len() * opts.tensor_counts.len()
                + negotiation::BACK_TO_BACK_MODES.len())) as u64;
    }
    let bar = ProgressBar::new(total.max(1));
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    if wants("collectives") {
        sweep::run(opts, &runners, &sizes, &work_dir, &bar, &mut record);
    }

    // The engine runs over the first transport (tcp unless --transports says otherwise).
    let engine_runner = runners.first().map(|(t, r)| (t.clone(), r.clone()));
    if (wants("replay") || wants("negotiation")) && engine_runner.is_none() {
        record.skipped.push(Skipped {
            suite: "replay, negotiation".into(),
            what: "everything".into(),
            reason: "no usable transport (see --transports)".into(),
        });
    }
    if wants("replay") && engine_runner.is_some() {
        let peers = replay::Peers {
            python: &python,
            list: &peers,
        };
        replay::run(
            opts,
            &runners,
            &workloads,
            &peers,
            &work_dir,
            &bar,
            &mut record,
        );
    }
    if let (true, Some((tname, runner))) = (wants("negotiation"), &engine_runner) {
        negotiation::run(opts, tname, runner, &neg_nps, &bar, &mut record);
    }

    if wants("simulate") {
        bar.set_message("simulate");
        let calib_source = match &opts.calibration {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("reading the calibration file {}: {e}", p.display()))?;
                let r: RunRecord = serde_json::from_str(&text)
                    .map_err(|e| format!("{} is not an fh-bench run.json: {e}", p.display()))?;
                Some((p.display().to_string(), r))
            }
            None => None,
        };
        let source = match &calib_source {
            Some((name, r)) => (name.as_str(), r),
            None => ("this run", &record),
        };
        let result = simulate::run(&workloads, opts.backward_ms, source.0, source.1, opts.quick);
        record.simulation = Some(result);
        bar.inc(1);
    }
    if let (Some(g), Launch::Mpirun { hosts: Some(h) }) = (opts.link_gbps, &opts.launch) {
        let probe = crate::across::Probe {
            link_gbps: g,
            flow_gbps: opts.flow_gbps,
        };
        // The model charges a rank's host copies at the rate each gets while every rank of
        // this machine copies (all the emulated hosts share it): this run's, else measured now.
        let copy = record
            .host
            .copy_gbps_shared
            .or_else(|| host::measure_shared_copy_gbps(opts.np));
        record.across = crate::across::rows(&record, &workloads, h, probe, copy);
    }
    bar.finish_and_clear();
    record.wall = Quantity::exact(started.elapsed().as_secs_f64(), "s");
    record.host.steal_percent = host::steal_between(ticks_at_start, host::cpu_ticks());
    record.host.load_average = host::load_average();
    Ok(record)
}
