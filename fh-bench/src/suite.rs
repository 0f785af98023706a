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
    let ticks0 = crate::record::cpu_ticks();
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
        let replay_transports = opts
            .transports
            .iter()
            .filter(|t| *t == "tcp" || *t == "shm")
            .count()
            .max(1);
        total += (workloads.len() * (replay_transports * ScheduleSpec::all().len() + peers.len()))
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
    // The replay runs over TCP and shared memory (what `FH_TRANSPORT=auto` picks on one host)
    // when both are among the transports, else over the first.
    let mut replay_runners: Vec<(String, Runner)> = runners
        .iter()
        .filter(|(t, _)| t == "tcp" || t == "shm")
        .cloned()
        .collect();
    if replay_runners.is_empty() {
        replay_runners.extend(engine_runner.clone());
    }
    if let (true, false) = (wants("replay"), replay_runners.is_empty()) {
        let backward = Duration::from_secs_f64(opts.backward_ms / 1e3);
        for w in &workloads {
            // Interleaved: one timed step of every (transport, schedule) in turn, round-robin
            // over the steps (each after its own warm-up step), so that a slow spell of a
            // shared machine hits every configuration rather than one.
            let configs: Vec<(&str, &Runner, ScheduleSpec)> = replay_runners
                .iter()
                .flat_map(|(t, r)| {
                    ScheduleSpec::all()
                        .into_iter()
                        .map(move |s| (t.as_str(), r, s))
                })
                .collect();
            let mut outs: Vec<Option<Vec<RankOutput>>> = vec![Some(Vec::new()); configs.len()];
            for rep in 0..opts.steps.max(1) {
                for (i, (tname, runner, s)) in configs.iter().enumerate() {
                    if outs[i].is_none() {
                        continue; // failed before
                    }
                    bar.set_message(format!(
                        "replay: {} {} over {tname} (step {}/{})",
                        w.model,
                        s.label(),
                        rep + 1,
                        opts.steps
                    ));
                    let job = Job::Replay(ReplayJob::new(w, backward, s.clone(), 1, 1));
                    let name = format!(
                        "replay-{}-{tname}-{}-{rep}",
                        w.model,
                        s.label().replace([' ', '=', '+'], "")
                    );
                    match runner.run(&name, &job) {
                        Ok(got) => {
                            if let Some(acc) = outs[i].as_mut() {
                                merge_replay(acc, got);
                            }
                        }
                        Err(e) => {
                            outs[i] = None;
                            record.skipped.push(Skipped {
                                suite: "replay".into(),
                                what: format!("{} {} over {tname}", w.model, s.label()),
                                reason: format!("failed: {e}"),
                            });
                        }
                    }
                }
            }
            let mut rows: Vec<ReplayRow> = Vec::new();
            for ((tname, _, s), outs) in configs.iter().zip(outs) {
                if let Some(outs) = outs {
                    let mut row = replay_row(w, s, opts.np, opts.backward_ms, &outs);
                    row.transport = tname.to_string();
                    rows.push(row);
                }
                bar.inc(1);
            }
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
            for peer in peers.iter().filter(|_| script.is_some()) {
                let Some(script) = script.as_deref() else {
                    continue;
                };
                bar.set_message(format!("replay: {} {}", w.model, peer.label));
                let run = torch_peer::PeerRun {
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
                };
                match run.run(&format!("replay-{}-{}", w.model, peer.label)) {
                    Ok(r) => rows.push(peer_row(w, &r, opts.backward_ms)),
                    Err(e) => record.skipped.push(Skipped {
                        suite: "replay".into(),
                        what: format!("{} {}", w.model, peer.what),
                        reason: format!("failed: {e}"),
                    }),
                }
                bar.inc(1);
            }
            // Ratios against the `horovod` preset over the same transport (peers, which pick
            // their own, against the first transport's).
            let first = rows
                .first()
                .map(|r| r.transport.clone())
                .unwrap_or_default();
            let bases: Vec<(String, f64, f64)> = rows
                .iter()
                .filter(|r| r.schedule == "horovod")
                .map(|r| (r.transport.clone(), r.step.median, r.exposed.median))
                .collect();
            for r in &mut rows {
                let t = if r.transport.is_empty() {
                    &first
                } else {
                    &r.transport
                };
                if let Some((_, step, exposed)) = bases.iter().find(|b| &b.0 == t) {
                    r.step_ratio_to_horovod = Some(r.step.median / step);
                    r.exposed_ratio_to_horovod =
                        (*exposed > 0.0).then(|| r.exposed.median / exposed);
                }
            }
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
    record.host.steal_percent = crate::record::steal_between(ticks0, crate::record::cpu_ticks());
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

/// Per step, the slowest rank's time; then the replay figures.
pub fn replay_row(
    w: &Workload,
    s: &ScheduleSpec,
    np: usize,
    backward_ms: f64,
    outs: &[RankOutput],
) -> ReplayRow {
    let per_rank: Vec<&Vec<f64>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Replay(v) => Some(&v.step_seconds),
            _ => None,
        })
        .collect();
    let mut row = replay_row_labelled(w, &s.label(), np, backward_ms, &per_rank);
    if let Some(RankOutput::Replay(r0)) = outs.first() {
        let total: u64 = r0.channel_bytes.iter().sum();
        if total > 0 {
            row.channel_share = r0
                .channel_bytes
                .iter()
                .map(|&b| b as f64 / total as f64)
                .collect();
        }
    }
    row
}

/// Append one interleaved run's per-rank replay outputs to those gathered so far (rank by
/// rank: step times concatenated, channel bytes added).
fn merge_replay(acc: &mut Vec<RankOutput>, got: Vec<RankOutput>) {
    if acc.is_empty() {
        *acc = got;
        return;
    }
    for (a, g) in acc.iter_mut().zip(got) {
        if let (RankOutput::Replay(a), RankOutput::Replay(g)) = (a, g) {
            a.step_seconds.extend(g.step_seconds);
            if a.channel_bytes.len() < g.channel_bytes.len() {
                a.channel_bytes.resize(g.channel_bytes.len(), 0);
            }
            for (x, y) in a.channel_bytes.iter_mut().zip(g.channel_bytes) {
                *x += y;
            }
        }
    }
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
        np,
        tensors: w.tensors.len(),
        bytes: w.total_bytes(),
        backward: Quantity::exact(backward_ms, "ms"),
        step: Quantity::from_samples(&step_ms, "ms"),
        exposed: Quantity::from_samples(&exposed, "ms"),
        throughput: Quantity::from_samples(&thr, "1/s"),
        step_ratio_to_horovod: None,
        exposed_ratio_to_horovod: None,
        channel_share: Vec::new(),
        transport: String::new(),
    }
}

/// The replay row of a Python peer's result (already the slowest rank per step).
pub fn peer_row(w: &Workload, r: &torch_peer::PeerResult, backward_ms: f64) -> ReplayRow {
    replay_row_labelled(w, &r.peer, r.np, backward_ms, &[&r.step_seconds])
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
        let row = peer_row(&w, &r, 100.0);
        assert_eq!(row.schedule, "ddp-gloo");
        assert_eq!((row.np, row.tensors), (4, w.tensors.len()));
        assert_eq!(row.step.unit, "ms");
        assert!((row.step.median - 250.0).abs() < 1e-9, "{row:?}");
        assert!((row.step.min - 200.0).abs() < 1e-9 && (row.step.max - 300.0).abs() < 1e-9);
        assert!((row.exposed.median - 150.0).abs() < 1e-9, "{row:?}");
        assert!((row.throughput.median - 4.0).abs() < 1e-9, "{row:?}");
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
