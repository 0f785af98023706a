//! The workload replay: every engine preset over every replay transport, then the Python peers,
//! interleaved round-robin over the repeats; rows with their ratios.

use std::path::Path;
use std::time::Duration;

use indicatif::ProgressBar;

use super::Options;
use crate::collectives::{Case, Collective};
use crate::record::{ReplayRow, RunRecord, Skipped};
use crate::replay::{ReplayJob, ScheduleSpec};
use crate::runner::{Job, RankOutput, Runner};
use crate::stats::Quantity;
use crate::torch_peer;
use crate::workload::Workload;

/// Timed repeats of each allreduce measured between the replay's rounds (per round and
/// workload; all of them together make the row).
pub const LINK_REPEATS: usize = 3;

/// The Python peers whose module imports, and the interpreter that runs them.
pub(super) struct Peers<'a> {
    /// The interpreter.
    pub python: &'a str,
    /// The peers to run.
    pub list: &'a [torch_peer::Peer],
}

/// Run the replay, adding rows (or what was skipped) to `record`.
pub(super) fn run(
    opts: &Options,
    runners: &[(String, Runner)],
    workloads: &[Workload],
    peers: &Peers<'_>,
    work_dir: &Path,
    bar: &ProgressBar,
    record: &mut RunRecord,
) {
    let (python, peers) = (peers.python, peers.list);
    let replay_runners = replay_transports(runners);
    let backward = Duration::from_secs_f64(opts.backward_ms / 1e3);
    let script = if peers.is_empty() {
        None
    } else {
        match torch_peer::write_script(&opts.out.join("peers")) {
            Ok(p) => Some(p),
            Err(e) => {
                record
                    .skipped
                    .push(Skipped::failed("replay", "Python peers", e));
                None
            }
        }
    };
    // Every configuration: the engine's presets over each transport, then the peers.
    let mut configs: Vec<ReplayConfig> = Vec::new();
    for (tname, runner) in &replay_runners {
        for s in schedules_over(tname, opts.np, opts.launch.hosts(), opts.flight_cost) {
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
    // Per workload and configuration, rank 0's TCP stream choice in each run.
    let mut streams: Vec<Vec<Vec<crate::record::TcpStreams>>> =
        vec![vec![Vec::new(); configs.len()]; workloads.len()];
    // cpu[w][c]: (CPU seconds of every rank, of their main threads, timed steps) over every
    // repeat.
    let mut cpu: Vec<Vec<(f64, f64, usize)>> =
        vec![vec![(0.0, 0.0, 0); configs.len()]; workloads.len()];
    // The model's check charges the loopback copies at the rate every rank gets copying at
    // once: sampled between the replay's rounds too, so that it comes from the same spells of
    // this host as the replays it is checked against.
    let mut copy_samples: Vec<f64> = record.host.copy_gbps_shared.into_iter().collect();
    if copy_samples.is_empty() && opts.link_gbps.is_some() {
        // Across hosts the model charges hierarchical allreduce's copies at this rate too.
        copy_samples.extend(super::host::measure_shared_copy_gbps(opts.np));
    }
    let mut staged_samples: Vec<f64> = record.host.copy_gbps_staged.into_iter().collect();
    // So are the allreduces the model's loopback links and the transports' bounds come from:
    // the sweep's smallest and largest sizes, on each replay transport.
    let links: Vec<(&String, &Runner, Vec<usize>)> = replay_runners
        .iter()
        .filter_map(|(t, r)| {
            let (rows, _) = record.link_rows(t, opts.np);
            let mut b: Vec<usize> = rows.iter().map(|c| c.bytes).collect();
            b.sort_unstable();
            b.dedup();
            (b.len() >= 2).then(|| (t, r, vec![b[0], b[b.len() - 1]]))
        })
        .collect();
    // link_secs[l][size]: the slowest rank's seconds of every repeat, every round.
    let mut link_secs: Vec<Vec<Vec<f64>>> = links
        .iter()
        .map(|(_, _, sizes)| vec![Vec::new(); sizes.len()])
        .collect();
    for k in 0..repeats {
        for (wi, w) in workloads.iter().enumerate() {
            for ((tname, runner, sizes), secs) in links.iter().zip(&mut link_secs) {
                bar.set_message(format!(
                    "replay {}/{repeats}: allreduce over {tname} between rounds",
                    k + 1
                ));
                let job = Job::Collectives {
                    cases: sizes
                        .iter()
                        .map(|&bytes| Case {
                            collective: Collective::Allreduce,
                            bytes,
                        })
                        .collect(),
                    warmup: 1,
                    repeats: LINK_REPEATS,
                };
                match runner.run(&format!("link-{tname}-{}-r{}", w.model, k + 1), &job) {
                    Ok(outs) => {
                        for (acc, (_, _, got)) in secs
                            .iter_mut()
                            .zip(super::sweep::slowest_case_seconds(&outs))
                        {
                            acc.extend(got);
                        }
                    }
                    Err(e) => record.skipped.push(Skipped::failed(
                        "replay",
                        format!("allreduce over {tname} between rounds"),
                        e,
                    )),
                }
            }
            if !copy_samples.is_empty() {
                copy_samples.extend(super::host::measure_shared_copy_gbps(opts.np));
            }
            if !staged_samples.is_empty() {
                staged_samples.extend(super::host::measure_staged_copy_gbps(
                    opts.np,
                    super::host::stage_bytes(),
                ));
            }
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
                        let job =
                            Job::Replay(ReplayJob::new(w, backward, spec.clone(), 1, opts.steps));
                        runner.run(&name, &job).map(|outs| {
                            // Every rank is a process of its own (not `local`): their CPU.
                            if transport != "local" {
                                let c = &mut cpu[wi][ci];
                                for o in &outs {
                                    if let RankOutput::Replay(r) = o {
                                        c.0 += r.cpu_seconds;
                                        c.1 += r.main_thread_cpu_seconds;
                                    }
                                }
                                c.2 += opts.steps;
                            }
                            if let Some(RankOutput::Replay(r0)) = outs.first() {
                                if let Some(s) = &r0.tcp_streams {
                                    streams[wi][ci].push(s.clone());
                                }
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
                            python,
                            script,
                            workload: &w.path,
                            np: opts.np,
                            backward_ms: opts.backward_ms,
                            warmup: 1,
                            steps: opts.steps,
                            log_dir: work_dir,
                            timeout: opts.job_timeout,
                            hosts: opts.peer_hosts.as_ref(),
                        }
                        .run(&name)
                        .map(|r| {
                            if let Some(s) = r.tcp_streams {
                                streams[wi][ci].push(s);
                            }
                            // Every rank is a process of its own: their CPU, as the adapter
                            // summed it.
                            if let Some(c) = r.cpu_seconds {
                                let acc = &mut cpu[wi][ci];
                                acc.0 += c;
                                acc.1 += r.main_thread_cpu_seconds.unwrap_or(0.0);
                                acc.2 += opts.steps;
                            }
                            r.step_seconds
                        }),
                        None => Err("no adapter script".into()),
                    },
                };
                match result {
                    Ok(t) => runs[wi][ci].push(Some(t)),
                    Err(e) => {
                        runs[wi][ci].push(None);
                        record.skipped.push(Skipped::failed(
                            "replay",
                            format!(
                                "{} {label} ({transport}), repeat {} of {repeats}",
                                w.model,
                                k + 1
                            ),
                            e,
                        ));
                    }
                }
                bar.inc(1);
            }
        }
    }
    if opts.flight_cost {
        // The replay's rows compare whole steps; this is the recorder's own cost per
        // operation (its four steps, on one thread), which a step pays once per gradient.
        let per_op = fh_scheduler::flight::recording_cost(200_000);
        bar.suspend(|| {
            eprintln!(
                "flight recorder: {:.0} ns per operation (submitted, negotiated, started, done)",
                per_op.as_secs_f64() * 1e9
            );
            for w in workloads {
                eprintln!(
                    "  {}: {} gradients, {:.1} µs of recording per step",
                    w.model,
                    w.tensors.len(),
                    per_op.as_secs_f64() * 1e6 * w.tensors.len() as f64
                );
            }
        });
    }
    for ((tname, _, sizes), secs) in links.iter().zip(&link_secs) {
        for (&bytes, secs) in sizes.iter().zip(secs) {
            if !secs.is_empty() {
                record.replay_allreduce.push(super::sweep::coll_row(
                    tname,
                    Collective::Allreduce,
                    opts.np,
                    bytes,
                    secs,
                ));
            }
        }
    }
    if !copy_samples.is_empty() {
        record.host.copy_gbps_shared = Some(Quantity::from_samples(&copy_samples, "GB/s").median);
    }
    if !staged_samples.is_empty() {
        record.host.copy_gbps_staged = Some(Quantity::from_samples(&staged_samples, "GB/s").median);
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
                row.tcp_streams = std::mem::take(&mut streams[wi][ci]);
                let total: u64 = bytes[wi][ci].iter().sum();
                let (cpu_s, main_s, steps) = cpu[wi][ci];
                if steps > 0 && cpu_s > 0.0 {
                    row.cpu_ms_per_step = Some(cpu_s * 1e3 / steps as f64);
                    row.main_thread_cpu_ms_per_step =
                        (main_s > 0.0).then(|| main_s * 1e3 / steps as f64);
                }
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
        exposed_vs_fasthorovod_torch: None,
        channel_share: Vec::new(),
        tcp_streams: Vec::new(),
        cpu_ms_per_step: None,
        main_thread_cpu_ms_per_step: None,
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

/// The schedules replayed over the transport named `transport` on ranks spanning `hosts`
/// hosts ([`ScheduleSpec::all_for`]), with the wire the engine will see there, so that the
/// rows "as shipped" and "the other way" are what their labels say.
pub(super) fn schedules_over(
    transport: &str,
    np: usize,
    hosts: usize,
    flight_cost: bool,
) -> Vec<ScheduleSpec> {
    if flight_cost {
        return ScheduleSpec::flight_cost();
    }
    ScheduleSpec::all_for(
        np,
        fh_scheduler::Wire::of(fh_transport::wire_of_choice(transport), hosts),
    )
}

/// The runners the engine's replay runs over: every process transport (`tcp`, `shm`), or the
/// first runner when there is none (`--transports local`).
pub(super) fn replay_transports(runners: &[(String, Runner)]) -> Vec<(String, Runner)> {
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
/// `horovod` row), and per repeat to the `ddp-gloo`, `horovod-torch` and (same transport)
/// `fasthorovod-torch` peers (the medians of
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
    // DistributedOptimizer over the row's own transport (the ddp-fasthorovod rows' base).
    let fh_torch: Vec<Option<usize>> = rows
        .iter()
        .map(|r| {
            rows.iter()
                .position(|b| b.schedule == "fasthorovod-torch" && b.transport == r.transport)
        })
        .collect();
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
    let vs: Vec<(Option<Quantity>, Option<Quantity>, Option<Quantity>)> = (0..rows.len())
        .map(|i| (paired(i, ddp), paired(i, hvd), paired(i, fh_torch[i])))
        .collect();
    for ((r, base), (d, h, f)) in rows.iter_mut().zip(bases).zip(vs) {
        if let Some((step, exposed)) = base {
            r.step_ratio_to_horovod = Some(r.step.median / step);
            r.exposed_ratio_to_horovod = (exposed > 0.0).then(|| r.exposed.median / exposed);
        }
        r.exposed_vs_ddp = d;
        r.exposed_vs_horovod_torch = h;
        r.exposed_vs_fasthorovod_torch = f;
    }
}
