//! The suite: runs the selected benchmarks, aggregates the ranks' figures into a [`RunRecord`].

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::collectives::{algbw_gbps, busbw_gbps, Case, Collective};
use crate::record::{CollRow, Host, NegRow, ReplayRow, RunConfig, RunRecord, Skipped, SCHEMA};
use crate::replay::{NegotiationJob, ReplayJob, ScheduleSpec};
use crate::runner::{Job, Launch, RankOutput, Runner};
use crate::stats::Quantity;
use crate::workload::Workload;
use crate::{mpi_peer, simulate, torch_peer, world};

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
    let ticks_at_start = crate::record::cpu_ticks();
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
                crate::record::measure_copy_gbps()
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
        replay: vec![],
        negotiation: vec![],
        simulation: None,
        skipped: vec![],
        wall: Quantity::exact(0.0, "s"),
    };
    let wants = |s: &str| opts.suites.iter().any(|x| x == s);
    let work_dir = opts.out.join("work");

    // The transports to run on, with their runners.
    let mut runners: Vec<(String, Runner)> = Vec::new();
    for t in &opts.transports {
        let launch = match t.as_str() {
            "local" => Launch::Threads,
            "tcp" | "shm" => {
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
                    reason: "not supported by fh-bench yet (use tcp, shm or local)".into(),
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
        total += (runners.len() * Collective::ALL.len()) as u64 + u64::from(!opts.no_peers) * 2;
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
        for peer in torch_peer::PEERS {
            let reason = if opts.no_peers {
                Some("skipped: --no-peers".to_string())
            } else if !torch_peer::imports(&python, peer.module, Duration::from_secs(120)) {
                Some(peer.not_installed(&python))
            } else {
                None
            };
            match reason {
                None => peers.push(peer),
                Some(reason) => record.skipped.push(Skipped {
                    suite: "replay".into(),
                    what: peer.what.into(),
                    reason,
                }),
            }
        }
        total += (opts.replay_repeats.max(1)
            * workloads.len()
            * (ScheduleSpec::all().len() * replay_transports(&runners).len() + peers.len()))
            as u64;
    }
    if wants("negotiation") {
        total += (neg_nps.len() * 2 * opts.tensor_counts.len()) as u64;
    }
    let bar = ProgressBar::new(total.max(1));
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    if wants("collectives") {
        let warmup = 1;
        for (tname, runner) in &runners {
            for c in Collective::ALL {
                bar.set_message(format!("collectives: {c} over {tname}"));
                let mut cases: Vec<Case> = sizes
                    .iter()
                    .map(|&bytes| Case {
                        collective: c,
                        bytes,
                    })
                    .collect();
                if opts.quick && opts.sizes.is_empty() && c == Collective::Allreduce {
                    cases.push(Case {
                        collective: c,
                        bytes: 64 << 20,
                    });
                }
                let job = Job::Collectives {
                    cases,
                    warmup,
                    repeats: opts.repeats,
                };
                match runner.run(&format!("collectives-{tname}-{c}"), &job) {
                    Ok(outs) => record
                        .collectives
                        .extend(aggregate_collectives(tname, opts.np, &outs)),
                    Err(e) => record.skipped.push(Skipped {
                        suite: "collectives".into(),
                        what: format!("{c} over {tname}"),
                        reason: format!("failed: {e}"),
                    }),
                }
                bar.inc(1);
            }
        }
        if !opts.no_peers {
            bar.set_message("collectives: OpenMPI MPI_Allreduce");
            let mut mpi_sizes = sizes.clone();
            if opts.quick && opts.sizes.is_empty() {
                mpi_sizes.push(64 << 20);
            }
            match mpi_peer::build(&opts.out.join("peers")) {
                Err(why) => {
                    record.skipped.push(Skipped {
                        suite: "collectives".into(),
                        what: "OpenMPI MPI_Allreduce".into(),
                        reason: why,
                    });
                    bar.inc(2);
                }
                Ok(exe) => {
                    for (name, btl) in [("openmpi", None), ("openmpi-tcp", Some("self,tcp"))] {
                        bar.set_message(format!("collectives: {name} MPI_Allreduce"));
                        match mpi_peer::run(
                            &exe,
                            opts.np,
                            btl,
                            warmup,
                            opts.repeats,
                            &mpi_sizes,
                            &work_dir_for(&work_dir),
                            opts.job_timeout,
                        ) {
                            Ok(rows) => {
                                for (bytes, secs) in rows {
                                    record.collectives.push(coll_row(
                                        name,
                                        Collective::Allreduce,
                                        opts.np,
                                        bytes,
                                        &secs,
                                    ));
                                }
                            }
                            Err(e) => record.skipped.push(Skipped {
                                suite: "collectives".into(),
                                what: format!("{name} MPI_Allreduce"),
                                reason: format!("failed: {e}"),
                            }),
                        }
                        bar.inc(1);
                    }
                }
            }
        }
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
        let replay_runners = replay_transports(&runners);
        let backward = Duration::from_secs_f64(opts.backward_ms / 1e3);
        let script = if peers.is_empty() {
            None
        } else {
            match torch_peer::write_script(&opts.out.join("peers")) {
                Ok(p) => Some(p),
                Err(e) => {
                    record.skipped.push(Skipped {
                        suite: "replay".into(),
                        what: "Python peers".into(),
                        reason: format!("failed: {e}"),
                    });
                    None
                }
            }
        };
        // Every configuration: the engine's presets over each transport, then the peers.
        let mut configs: Vec<ReplayConfig> = Vec::new();
        for (tname, runner) in &replay_runners {
            for s in ScheduleSpec::all() {
                configs.push(ReplayConfig::Engine {
                    spec: s,
                    transport: tname.clone(),
                    runner: runner.clone(),
                });
            }
        }
        if script.is_some() {
            configs.extend(peers.iter().map(|p| ReplayConfig::Peer(*p)));
        }
        let repeats = opts.replay_repeats.max(1);
        // runs[w][c][k]: the slowest rank's step times of repeat k (None: failed).
        let mut runs: Vec<Vec<Vec<Option<Vec<f64>>>>> =
            vec![vec![Vec::new(); configs.len()]; workloads.len()];
        // bytes[w][c][channel]: rank 0's bytes per data channel over every repeat.
        let mut bytes: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); configs.len()]; workloads.len()];
        for k in 0..repeats {
            for (wi, w) in workloads.iter().enumerate() {
                for (ci, cfg) in configs.iter().enumerate() {
                    let label = cfg.label();
                    let transport = cfg.transport();
                    bar.set_message(format!(
                        "replay {}/{repeats}: {} {label} ({transport})",
                        k + 1,
                        w.model
                    ));
                    let name = format!(
                        "replay-{}-{}-{}-r{}",
                        w.model,
                        label.replace([' ', '='], ""),
                        transport,
                        k + 1
                    );
                    let result = match cfg {
                        ReplayConfig::Engine { spec, runner, .. } => {
                            let job = Job::Replay(ReplayJob::new(
                                w,
                                backward,
                                spec.clone(),
                                1,
                                opts.steps,
                            ));
                            runner.run(&name, &job).map(|outs| {
                                if let Some(RankOutput::Replay(r0)) = outs.first() {
                                    let acc = &mut bytes[wi][ci];
                                    if acc.len() < r0.channel_bytes.len() {
                                        acc.resize(r0.channel_bytes.len(), 0);
                                    }
                                    for (a, b) in acc.iter_mut().zip(&r0.channel_bytes) {
                                        *a += b;
                                    }
                                }
                                slowest_per_step(&outs)
                            })
                        }
                        ReplayConfig::Peer(peer) => match script.as_deref() {
                            Some(script) => torch_peer::PeerRun {
                                peer: *peer,
                                python: &python,
                                script,
                                workload: &w.path,
                                np: opts.np,
                                backward_ms: opts.backward_ms,
                                warmup: 1,
                                steps: opts.steps,
                                log_dir: &work_dir,
                                timeout: opts.job_timeout,
                            }
                            .run(&name)
                            .map(|r| r.step_seconds),
                            None => Err("no adapter script".into()),
                        },
                    };
                    match result {
                        Ok(t) => runs[wi][ci].push(Some(t)),
                        Err(e) => {
                            runs[wi][ci].push(None);
                            record.skipped.push(Skipped {
                                suite: "replay".into(),
                                what: format!(
                                    "{} {label} ({transport}), repeat {} of {repeats}",
                                    w.model,
                                    k + 1
                                ),
                                reason: format!("failed: {e}"),
                            });
                        }
                    }
                    bar.inc(1);
                }
            }
        }
        for (wi, w) in workloads.iter().enumerate() {
            let mut rows: Vec<ReplayRow> = Vec::new();
            let mut per_repeat: Vec<Vec<Option<f64>>> = Vec::new();
            for (ci, cfg) in configs.iter().enumerate() {
                let reps = &runs[wi][ci];
                if let Some(row) = repeated_row(
                    w,
                    &cfg.label(),
                    &cfg.transport(),
                    opts.np,
                    opts.backward_ms,
                    reps,
                ) {
                    let mut row = row;
                    let total: u64 = bytes[wi][ci].iter().sum();
                    if total > 0 {
                        row.channel_share = bytes[wi][ci]
                            .iter()
                            .map(|&b| b as f64 / total as f64)
                            .collect();
                    }
                    rows.push(row);
                    per_repeat.push(
                        reps.iter()
                            .map(|v| v.as_ref().map(|v| median(v) * 1e3 - opts.backward_ms))
                            .collect(),
                    );
                }
            }
            add_ratios(&mut rows, &per_repeat);
            record.replay.extend(rows);
        }
    }
    if let (true, Some((tname, runner))) = (wants("negotiation"), &engine_runner) {
        let steps = if opts.quick { 3 } else { 10 };
        for &np in &neg_nps {
            let mut runner = runner.clone();
            runner.np = np;
            for mode in ["coordinator", "bit-vector"] {
                for &tensors in &opts.tensor_counts {
                    bar.set_message(format!(
                        "negotiation: {mode}, {tensors} tensors, np {np} over {tname}"
                    ));
                    let job = Job::Negotiation(NegotiationJob {
                        mode: mode.into(),
                        tensors,
                        warmup: 1,
                        steps,
                    });
                    match runner.run(&format!("negotiation-{mode}-{tensors}-np{np}"), &job) {
                        Ok(outs) => record
                            .negotiation
                            .push(negotiation_row(mode, np, tensors, &outs)),
                        Err(e) => record.skipped.push(Skipped {
                            suite: "negotiation".into(),
                            what: format!("{mode}, {tensors} tensors, np {np}"),
                            reason: format!("failed: {e}"),
                        }),
                    }
                    bar.inc(1);
                }
            }
        }
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
    bar.finish_and_clear();
    record.wall = Quantity::exact(started.elapsed().as_secs_f64(), "s");
    record.host.steal_percent =
        crate::record::steal_between(ticks_at_start, crate::record::cpu_ticks());
    record.host.load_average = crate::record::load_average();
    Ok(record)
}

fn work_dir_for(dir: &std::path::Path) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    dir.to_path_buf()
}

/// One row from per-repeat seconds (already the slowest rank's).
pub fn coll_row(transport: &str, c: Collective, np: usize, bytes: usize, secs: &[f64]) -> CollRow {
    let alg: Vec<f64> = secs.iter().map(|&s| algbw_gbps(bytes, s)).collect();
    let bus: Vec<f64> = secs.iter().map(|&s| busbw_gbps(c, bytes, s, np)).collect();
    CollRow {
        transport: transport.to_string(),
        collective: c.name().to_string(),
        np,
        bytes,
        time: Quantity::from_samples(secs, "s").scaled(1e6, "us"),
        algbw: Quantity::from_samples(&alg, "GB/s"),
        busbw: Quantity::from_samples(&bus, "GB/s"),
    }
}

/// Per case and repeat, the slowest rank's time; then the figures.
pub fn aggregate_collectives(transport: &str, np: usize, outs: &[RankOutput]) -> Vec<CollRow> {
    let per_rank: Vec<&Vec<crate::collectives::CaseTimes>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Collectives(c) => Some(c),
            _ => None,
        })
        .collect();
    let Some(first) = per_rank.first() else {
        return vec![];
    };
    (0..first.len())
        .map(|i| {
            let case = &first[i];
            let secs: Vec<f64> = (0..case.seconds.len())
                .map(|j| {
                    per_rank
                        .iter()
                        .filter_map(|r| r.get(i).and_then(|c| c.seconds.get(j)))
                        .copied()
                        .fold(0.0, f64::max)
                })
                .collect();
            coll_row(transport, case.case.collective, np, case.bytes, &secs)
        })
        .collect()
}

/// A replay row from per-rank step times (seconds; the slowest rank per step counts), labelled
/// with a preset or a peer (`ddp-gloo`, `horovod-torch`).
pub fn replay_row_labelled(
    w: &Workload,
    label: &str,
    np: usize,
    backward_ms: f64,
    per_rank: &[&Vec<f64>],
) -> ReplayRow {
    let steps = per_rank.first().map_or(0, |v| v.len());
    let step_ms: Vec<f64> = (0..steps)
        .map(|i| {
            per_rank
                .iter()
                .filter_map(|v| v.get(i))
                .fold(0.0f64, |a, b| a.max(*b))
                * 1e3
        })
        .collect();
    let exposed: Vec<f64> = step_ms.iter().map(|s| s - backward_ms).collect();
    let thr: Vec<f64> = step_ms.iter().map(|s| 1e3 / s).collect();
    ReplayRow {
        workload: w.model.clone(),
        schedule: label.to_string(),
        transport: String::new(),
        repeats: 1,
        np,
        tensors: w.tensors.len(),
        bytes: w.total_bytes(),
        backward: Quantity::exact(backward_ms, "ms"),
        step: Quantity::from_samples(&step_ms, "ms"),
        exposed: Quantity::from_samples(&exposed, "ms"),
        exposed_per_repeat: Vec::new(),
        throughput: Quantity::from_samples(&thr, "1/s"),
        step_ratio_to_horovod: None,
        exposed_ratio_to_horovod: None,
        exposed_vs_ddp: None,
        exposed_vs_horovod_torch: None,
        channel_share: Vec::new(),
    }
}

/// One configuration of the replay.
#[derive(Debug, Clone)]
enum ReplayConfig {
    /// The engine (the Rust harness) with a preset over a transport.
    Engine {
        spec: ScheduleSpec,
        transport: String,
        runner: Runner,
    },
    /// A Python peer.
    Peer(torch_peer::Peer),
}

impl ReplayConfig {
    fn label(&self) -> String {
        match self {
            ReplayConfig::Engine { spec, .. } => spec.label(),
            ReplayConfig::Peer(p) => p.label.to_string(),
        }
    }

    fn transport(&self) -> String {
        match self {
            ReplayConfig::Engine { transport, .. } => transport.clone(),
            ReplayConfig::Peer(p) => p.transport.to_string(),
        }
    }
}

/// The runners the engine's replay runs over: every process transport (`tcp`, `shm`), or the
/// first runner when there is none (`--transports local`).
fn replay_transports(runners: &[(String, Runner)]) -> Vec<(String, Runner)> {
    let procs: Vec<(String, Runner)> = runners
        .iter()
        .filter(|(t, _)| t != "local")
        .cloned()
        .collect();
    if procs.is_empty() {
        runners.iter().take(1).cloned().collect()
    } else {
        procs
    }
}

/// Per step, the slowest rank's time (seconds).
pub fn slowest_per_step(outs: &[RankOutput]) -> Vec<f64> {
    let per_rank: Vec<&Vec<f64>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Replay(v) => Some(&v.step_seconds),
            _ => None,
        })
        .collect();
    let steps = per_rank.first().map_or(0, |v| v.len());
    (0..steps)
        .map(|i| {
            per_rank
                .iter()
                .filter_map(|v| v.get(i))
                .fold(0.0f64, |a, b| a.max(*b))
        })
        .collect()
}

fn median(v: &[f64]) -> f64 {
    Quantity::from_samples(v, "").median
}

/// The row of one configuration over its repeats (`None` for a failed repeat): figures over
/// every timed step of the successful repeats, plus each repeat's median exposed time.
/// `None` when no repeat succeeded.
pub fn repeated_row(
    w: &Workload,
    label: &str,
    transport: &str,
    np: usize,
    backward_ms: f64,
    repeats: &[Option<Vec<f64>>],
) -> Option<ReplayRow> {
    let ok: Vec<&Vec<f64>> = repeats.iter().flatten().collect();
    if ok.is_empty() {
        return None;
    }
    let pooled: Vec<f64> = ok.iter().flat_map(|v| v.iter().copied()).collect();
    let mut row = replay_row_labelled(w, label, np, backward_ms, &[&pooled]);
    row.transport = transport.to_string();
    row.repeats = ok.len();
    row.exposed_per_repeat = ok.iter().map(|v| median(v) * 1e3 - backward_ms).collect();
    Some(row)
}

/// Ratios inside the run: to the `horovod` preset (medians; same transport, else the first
/// `horovod` row), and per repeat to the `ddp-gloo` and `horovod-torch` peers (the medians of
/// the same round; rounds where either failed are left out). `per_repeat[i][k]` is row i's
/// median exposed time in repeat k (`None`: that repeat failed).
pub fn add_ratios(rows: &mut [ReplayRow], per_repeat: &[Vec<Option<f64>>]) {
    let horovod = |t: &str, rows: &[ReplayRow]| {
        rows.iter()
            .find(|r| r.schedule == "horovod" && r.transport == t)
            .or_else(|| rows.iter().find(|r| r.schedule == "horovod"))
            .map(|r| (r.step.median, r.exposed.median))
    };
    let bases: Vec<Option<(f64, f64)>> = rows.iter().map(|r| horovod(&r.transport, rows)).collect();
    let peer = |label: &str| rows.iter().position(|r| r.schedule == label);
    let (ddp, hvd) = (peer("ddp-gloo"), peer("horovod-torch"));
    let paired = |i: usize, base: Option<usize>| -> Option<Quantity> {
        let b = &per_repeat[base?];
        let ratios: Vec<f64> = per_repeat[i]
            .iter()
            .zip(b)
            .filter_map(|(x, y)| match (x, y) {
                (Some(x), Some(y)) if *y > 0.0 => Some(x / y),
                _ => None,
            })
            .collect();
        (!ratios.is_empty()).then(|| Quantity::from_samples(&ratios, "ratio"))
    };
    let vs: Vec<(Option<Quantity>, Option<Quantity>)> = (0..rows.len())
        .map(|i| (paired(i, ddp), paired(i, hvd)))
        .collect();
    for ((r, base), (d, h)) in rows.iter_mut().zip(bases).zip(vs) {
        if let Some((step, exposed)) = base {
            r.step_ratio_to_horovod = Some(r.step.median / step);
            r.exposed_ratio_to_horovod = (exposed > 0.0).then(|| r.exposed.median / exposed);
        }
        r.exposed_vs_ddp = d;
        r.exposed_vs_horovod_torch = h;
    }
}

/// Per step, the slowest rank's latency; rounds, bytes and time per round from the rank that
/// sent the most negotiation bytes (rank 0 in coordinator rounds).
pub fn negotiation_row(mode: &str, np: usize, tensors: usize, outs: &[RankOutput]) -> NegRow {
    let per_rank: Vec<&Vec<crate::replay::NegotiationStep>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Negotiation(v) => Some(v),
            _ => None,
        })
        .collect();
    let steps = per_rank.first().map_or(0, |v| v.len());
    let mut lat = Vec::new();
    let mut rounds = Vec::new();
    let mut per_round = Vec::new();
    let mut bytes = Vec::new();
    for i in 0..steps {
        let at: Vec<&crate::replay::NegotiationStep> =
            per_rank.iter().filter_map(|v| v.get(i)).collect();
        lat.push(at.iter().map(|s| s.seconds).fold(0.0, f64::max) * 1e6);
        if let Some(top) = at.iter().max_by_key(|s| s.bytes) {
            let r = top.rounds.max(1) as f64;
            rounds.push(top.rounds as f64);
            per_round.push(top.negotiation_s / r * 1e6);
            bytes.push(top.bytes as f64 / r);
        }
    }
    NegRow {
        mode: mode.to_string(),
        np,
        tensors,
        step_latency: Quantity::from_samples(&lat, "us"),
        rounds_per_step: Quantity::from_samples(&rounds, "rounds"),
        round_latency: Quantity::from_samples(&per_round, "us"),
        bytes_per_round: Quantity::from_samples(&bytes, "B"),
    }
}

/// `git describe --always --dirty`, or `unknown`.
pub fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Seconds since the epoch → `(YYYY, MM, DD, hh, mm, ss)` in UTC.
pub fn civil_utc(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m,
        d,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
    )
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Now, `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let (y, mo, d, h, mi, s) = civil_utc(now_secs());
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Now, `YYYYMMDD-HHMMSS` (directory names).
pub fn timestamp() -> String {
    let (y, mo, d, h, mi, s) = civil_utc(now_secs());
    format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_utc(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(civil_utc(951_782_400), (2000, 2, 29, 0, 0, 0));
        assert_eq!(civil_utc(1_700_000_000), (2023, 11, 14, 22, 13, 20));
    }

    #[test]
    fn a_peer_result_becomes_a_replay_row() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
        let w = Workload::load(&dir.join("resnet50.json")).unwrap();
        let line = r#"{"peer": "ddp-gloo", "workload": "resnet50", "np": 4, "backward_ms": 100.0, "warmup": 1, "steps": 3, "step_seconds": [0.25, 0.2, 0.3], "tensors": 161, "bytes": 102228128, "version": "torch 2.15.0", "checked": true}"#;
        let r = torch_peer::parse_output(&format!("warning\n{line}\n")).unwrap();
        let row =
            repeated_row(&w, "ddp-gloo", "gloo", r.np, 100.0, &[Some(r.step_seconds)]).unwrap();
        assert_eq!(row.schedule, "ddp-gloo");
        assert_eq!(row.config_label(), "ddp-gloo (gloo)");
        assert_eq!((row.repeats, row.exposed_per_repeat.len()), (1, 1));
        assert_eq!((row.np, row.tensors), (4, w.tensors.len()));
        assert_eq!(row.step.unit, "ms");
        assert!((row.step.median - 250.0).abs() < 1e-9, "{row:?}");
        assert!((row.step.min - 200.0).abs() < 1e-9 && (row.step.max - 300.0).abs() < 1e-9);
        assert!((row.exposed.median - 150.0).abs() < 1e-9, "{row:?}");
        assert!((row.throughput.median - 4.0).abs() < 1e-9, "{row:?}");
    }

    #[test]
    fn repeats_pool_steps_and_ratios_pair_rounds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
        let w = Workload::load(&dir.join("resnet50.json")).unwrap();
        // Failed repeats are left out of the figures; none at all gives no row.
        assert!(repeated_row(&w, "x", "tcp", 4, 100.0, &[None, None]).is_none());
        let fh = [
            Some(vec![0.11, 0.13, 0.12]),
            None,
            Some(vec![0.14, 0.12, 0.13]),
        ];
        let row = repeated_row(&w, "fasthorovod-torch", "shm", 4, 100.0, &fh).unwrap();
        assert_eq!((row.repeats, row.step.n), (2, 6));
        assert!((row.exposed_per_repeat[0] - 20.0).abs() < 1e-9, "{row:?}");
        assert!((row.exposed_per_repeat[1] - 30.0).abs() < 1e-9, "{row:?}");
        assert!((row.exposed.min - 10.0).abs() < 1e-9 && (row.exposed.max - 40.0).abs() < 1e-9);
        let ddp = [Some(vec![0.2]), Some(vec![0.3]), Some(vec![0.15])];
        let ddp_row = repeated_row(&w, "ddp-gloo", "gloo", 4, 100.0, &ddp).unwrap();
        let hv = [Some(vec![0.2]), Some(vec![0.2]), Some(vec![0.2])];
        let hv_row = repeated_row(&w, "horovod", "shm", 4, 100.0, &hv).unwrap();
        let mut rows = vec![hv_row, row, ddp_row];
        let per_repeat = vec![
            vec![Some(100.0), Some(100.0), Some(100.0)],
            vec![Some(20.0), None, Some(30.0)],
            vec![Some(100.0), Some(200.0), Some(50.0)],
        ];
        add_ratios(&mut rows, &per_repeat);
        // Rounds 1 and 3 pair up (round 2 failed): 20/100 and 30/50.
        let vs = rows[1].exposed_vs_ddp.clone().unwrap();
        assert_eq!(vs.n, 2);
        assert!(
            (vs.min - 0.2).abs() < 1e-9 && (vs.max - 0.6).abs() < 1e-9,
            "{vs:?}"
        );
        assert!(rows[1].exposed_vs_horovod_torch.is_none());
        assert_eq!(rows[2].exposed_vs_ddp.as_ref().map(|q| q.median), Some(1.0));
        // The horovod preset over the same transport is the base of the old ratios.
        let r = rows[1].exposed_ratio_to_horovod.unwrap();
        assert!((r - rows[1].exposed.median / 100.0).abs() < 1e-9, "{r}");
    }

    #[test]
    fn aggregation_takes_the_slowest_rank() {
        use crate::collectives::CaseTimes;
        let case = |secs: Vec<f64>| CaseTimes {
            case: Case {
                collective: Collective::Allreduce,
                bytes: 1000,
            },
            bytes: 1000,
            seconds: secs,
        };
        let outs = vec![
            RankOutput::Collectives(vec![case(vec![1e-3, 4e-3])]),
            RankOutput::Collectives(vec![case(vec![2e-3, 3e-3])]),
        ];
        let rows = aggregate_collectives("tcp", 2, &outs);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].time.min, rows[0].time.max), (2000.0, 4000.0));
        // 1000 B in 2 ms = 0.5 MB/s... = 0.0005 GB/s; bus factor 1 on 2 ranks.
        assert!((rows[0].busbw.max - 0.0005).abs() < 1e-12);
    }
}
