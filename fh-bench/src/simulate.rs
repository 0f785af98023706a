//! The `simulate` suite: calibrates the model from measured figures, projects step time and
//! scaling efficiency for 8 … 1024 ranks, and checks the model against the measured replay.

use crate::record::{RunRecord, SimCheck, SimResult, SimRow};
use crate::sim::{self, Concurrency, Link, Overheads, Schedule};
use crate::stats::Quantity;
use crate::workload::Workload;

/// What the simulation is, said in every report.
pub const NOTE: &str = "MODEL, not a measurement: a discrete-event simulation of both schedules \
(negotiation rounds, fusion, K channels sharing the link (with the loss measured for K \
allreduces at once on the loopback check), alpha-beta costs of ring or \
recursive-doubling allreduce, host copies at the measured copy rate; on the loopback \
check the copies in flight share the host, with the transfers over shared memory), fed by \
the workloads' gradient sizes and release times. Step time = backward start to last gradient \
reduced; efficiency = (F + B) / (F + step) with a forward pass F = B/2.";

/// Rank counts projected.
pub fn ranks(quick: bool) -> Vec<usize> {
    let _ = quick;
    (3..=10).map(|k| 1usize << k).collect()
}

/// The schedules projected: `horovod`, `fasthorovod` K = 1, 2, 4 as shipped (back-pressure
/// `auto`: on over the Ethernet-class links and from 64 ranks), and K = 4 with back-pressure
/// forced either way.
pub fn schedules() -> Vec<Schedule> {
    vec![
        Schedule::horovod(),
        Schedule::fasthorovod(1),
        Schedule::fasthorovod(2),
        Schedule::fasthorovod(4),
        Schedule::fasthorovod(4).with_back_pressure(),
        Schedule::fasthorovod(4).without_back_pressure(),
    ]
}

/// Every schedule the replay may have measured (its labels): the projected ones and K = 1, 2,
/// 4 with back-pressure forced on (`+bp`) or off (`-bp`).
pub fn replayed_schedules() -> Vec<Schedule> {
    let mut v = vec![Schedule::horovod()];
    for k in crate::replay::CHANNEL_COUNTS {
        let s = Schedule::fasthorovod(k);
        v.extend([
            s.clone(),
            s.clone().with_back_pressure(),
            s.without_back_pressure(),
        ]);
    }
    v
}

/// Calibration from a run's figures: a loopback link per transport swept (TCP, shared memory,
/// in-process), each fitted to that transport's allreduces ([`RunRecord::link_rows`]: those
/// measured between the replay's rounds, else the sweep's), and the per-round overhead from
/// the negotiation measurements.
pub fn calibrate(record: &RunRecord, source: &str) -> (Vec<(Link, usize)>, Overheads, Vec<String>) {
    let mut notes = Vec::new();
    let mut overheads = Overheads::default();
    let mut links = Vec::new();
    for transport in ["tcp", "shm", "local"] {
        let Some(np) = record
            .collectives
            .iter()
            .find(|r| r.transport == transport && r.collective == "allreduce")
            .map(|r| r.np)
        else {
            continue;
        };
        // Preferably the allreduces measured between the replay's rounds: the same spells of
        // a shared host as the replays the model is checked against.
        let (rows, between) = record.link_rows(transport, np);
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.time.median.is_finite())
            .map(|r| (r.bytes as f64, r.time.median * 1e-6))
            .collect();
        if let Some(mut l) =
            sim::calibrate_link(&format!("measured {transport} loopback"), np, &points)
        {
            let what = if between {
                let n = rows.iter().map(|r| r.time.n).min().unwrap_or(0);
                format!(
                    "allreduces measured between the replay's rounds ({} sizes, {n} repeats \
                     each)",
                    points.len()
                )
            } else {
                format!("allreduce sweep ({} sizes)", points.len())
            };
            notes.push(format!(
                "{transport}: alpha = {:.1} us, bandwidth = {:.2} GB/s: fitted to the \
                 {transport} {what} at np = {np} (the line through the smallest and the \
                 largest size: beta from the largest, alpha from the smallest) from {source}",
                l.alpha_s * 1e6,
                l.bandwidth_bps / 1e9,
            ));
            l.concurrency = concurrency(record, transport, np, false);
            // Shared memory and threads move data with the ranks' own memory copies; TCP's
            // transfers spend their time in the kernel's socket path, where the measured
            // replay shows the ranks' copies overlapping them.
            l.host_bound = transport != "tcp";
            // Where transfers and copies share the host alike, staged groups in flight at once
            // share it as measured for them (copies included).
            if l.host_bound {
                l.staged_concurrency = concurrency(record, transport, np, true);
            }
            // What the engine's `auto` back-pressure goes by on this transport, on one host.
            l.wire = fh_scheduler::Wire::of(fh_transport::wire_of_choice(transport), 1);
            // TCP's communicators do scatter-gather I/O and shared memory's reduce slices where
            // they lie (`Communicator::segments_in_place`): `fasthorovod` reduces fused groups
            // in place over both.
            l.vectored_io = matches!(transport, "tcp" | "shm");
            // Its small allreduces carry the can-run flag in their own messages.
            l.agrees_in_band = transport == "tcp";
            if l.host_bound {
                notes.push(format!(
                    "{transport}: its transfers are the ranks' own memory copies: in the \
                     loopback check, transfers and host copies in flight share the host \
                     equally (times the measured concurrency factor)"
                ));
            }
            if !l.concurrency.is_empty() {
                let shown: Vec<String> = l
                    .concurrency
                    .iter()
                    .map(|c| {
                        format!(
                            "{:.2} with {} of {}",
                            c.factor,
                            c.streams,
                            crate::plots::fmt_bytes(c.bytes as f64)
                        )
                    })
                    .collect();
                notes.push(format!(
                    "{transport}: allreduces in flight at once move together {} times what \
                     one of that size moves alone: measured concurrent allreduces from {source}",
                    shown.join(", ")
                ));
            }
            if !l.staged_concurrency.is_empty() {
                let shown: Vec<String> = l
                    .staged_concurrency
                    .iter()
                    .map(|c| format!("{:.2} with {}", c.factor, c.streams))
                    .collect();
                notes.push(format!(
                    "{transport}: staged fused groups in flight at once (each packed, reduced \
                     and unpacked a stage piece at a time, as the engine runs them on one host) \
                     move together {} times what one moves alone: measured concurrent staged \
                     groups of {} from {source}",
                    shown.join(", "),
                    crate::plots::fmt_bytes(l.staged_concurrency[0].bytes as f64)
                ));
            }
            links.push((l, np));
        }
    }
    if links.is_empty() {
        notes.push(format!(
            "no allreduce sweep in {source}: the loopback check is skipped; link classes use \
             documented defaults"
        ));
    }
    let bitvec: Vec<_> = record
        .negotiation
        .iter()
        .filter(|r| r.mode == "bit-vector" && r.round_latency.median.is_finite())
        .collect();
    // The fewest tensors: a round's fixed cost, not the per-tensor bookkeeping.
    let largest_np = bitvec.iter().map(|r| r.np).max();
    if let Some(r) = bitvec
        .iter()
        .filter(|r| Some(r.np) == largest_np)
        .min_by_key(|r| r.tensors)
    {
        let alpha = links.first().map_or(0.0, |(l, _)| l.alpha_s);
        let steps = (r.np as f64).log2().ceil();
        overheads.round_s = (r.round_latency.median * 1e-6 - steps * alpha).max(1e-6);
        notes.push(format!(
            "per-round overhead = {:.1} us: measured bit-vector round latency at np = {}, {} \
             tensors, less the network latency",
            overheads.round_s * 1e6,
            r.np,
            r.tensors
        ));
    } else {
        notes.push(format!(
            "per-round overhead = {:.0} us, per-collective overhead = {:.0} us: documented \
             defaults (no negotiation measurement)",
            overheads.round_s * 1e6,
            overheads.per_collective_s * 1e6
        ));
    }
    match record.host.copy_gbps {
        Some(g) if g > 0.0 => {
            overheads.copy_bps = Some(g * 1e9);
            notes.push(format!(
                "host copies (packing fused groups, unpacking them with the average's \
                 scaling; scaling a tensor reduced in place) at {g:.1} GB/s: one thread's \
                 measured rate packing and unpacking fused groups as the engine does on this \
                 host (each rank of a cluster has its own core)"
            ));
            if let Some(s) = record.host.copy_gbps_staged.filter(|s| *s > 0.0) {
                notes.push(format!(
                    "the loopback check's staged fused groups (the engine stages them on one \
                     host) at {s:.1} GB/s per rank for packing and unpacking together: \
                     measured for that pattern with one thread per rank at once"
                ));
            }
            notes.push(match record.host.copy_gbps_shared {
                Some(s) if s > 0.0 => format!(
                    "the loopback check's copies at {s:.1} GB/s per rank: measured with one \
                     thread per rank packing and unpacking at once on this host; a rank's \
                     channels copying at once share it"
                ),
                _ => "the loopback check's copies at that rate divided by the ranks sharing \
                      each core (no shared copy-rate measurement)"
                    .to_string(),
            });
        }
        _ => notes.push(format!(
            "no copy-rate measurement in {source}: host copies are free in the model"
        )),
    }
    (links, overheads, notes)
}

/// A transport's measured concurrency factors at `np` ranks: aggregate bandwidth of `n`
/// allreduces at once ÷ that of one of the same size, from the same measurement (medians),
/// for `n` ≥ 2, by size and count; of plain allreduces, or (`staged`) of staged fused groups.
fn concurrency(record: &RunRecord, transport: &str, np: usize, staged: bool) -> Vec<Concurrency> {
    let mut f: Vec<Concurrency> = record
        .streams
        .iter()
        .filter(|r| r.transport == transport && r.np == np && r.streams >= 2)
        .filter(|r| r.stage.is_some() == staged)
        .filter_map(|r| {
            Some(Concurrency {
                bytes: r.bytes,
                streams: r.streams,
                factor: r.vs_one(&record.streams)?,
            })
        })
        .collect();
    f.sort_by_key(|c| (c.bytes, c.streams));
    f.dedup_by_key(|c| (c.bytes, c.streams));
    f
}

/// Runs the projections.
pub fn run(
    workloads: &[Workload],
    backward_ms: f64,
    source: &str,
    record: &RunRecord,
    quick: bool,
) -> SimResult {
    let b = backward_ms / 1e3;
    let (measured, overheads, calibration) = calibrate(record, source);
    let links = Link::defaults();
    let mut rows = Vec::new();
    for w in workloads {
        for link in &links {
            for s in schedules() {
                for p in ranks(quick) {
                    let m = sim::simulate_workload(w, b, p, link, &s, &overheads);
                    rows.push(SimRow {
                        workload: w.model.clone(),
                        link: link.name.clone(),
                        schedule: s.label(),
                        ranks: p,
                        step: Quantity::exact(m.step_s * 1e3, "ms"),
                        exposed: Quantity::exact((m.step_s - b).max(0.0) * 1e3, "ms"),
                        efficiency: Quantity::exact(sim::efficiency(b, m.step_s), "ratio"),
                    });
                }
            }
        }
    }
    let mut check = Vec::new();
    for r in &record.replay {
        let Some(w) = workloads.iter().find(|w| w.model == r.workload) else {
            continue;
        };
        let Some(s) = replayed_schedules()
            .into_iter()
            .find(|s| s.label() == r.schedule)
        else {
            continue;
        };
        // Each replay against the link calibrated on its own transport (older records do not
        // name the transport: the first link).
        let Some((link, np)) = measured.iter().find(|(l, _)| {
            r.transport.is_empty() || l.name == format!("measured {} loopback", r.transport)
        }) else {
            continue;
        };
        let b = r.backward.median / 1e3;
        // Ranks on this host share its cores and memory: each rank's copies run at the rate
        // measured with every rank copying at once, else one thread's rate over the ranks
        // sharing each core.
        let share = (*np as f64 / record.host.cpus.max(1) as f64).max(1.0);
        let shared = record.host.copy_gbps_shared.filter(|g| *g > 0.0);
        let local = Overheads {
            copy_bps: overheads
                .copy_bps
                .map(|r| shared.map_or(r / share, |g| g * 1e9)),
            // One host: the engine stages fused groups, at the rate measured for that pattern.
            staged_copy_bps: record
                .host
                .copy_gbps_staged
                .filter(|g| *g > 0.0)
                .map(|g| g * 1e9),
            // Every rank on this host: a rank's channels copy on shared cores, and on shared
            // memory their transfers are copies too.
            shared_host: true,
            ..overheads.clone()
        };
        let m = sim::simulate_workload(w, b, *np, link, &s, &local);
        check.push(SimCheck {
            workload: r.workload.clone(),
            schedule: r.schedule.clone(),
            transport: r.transport.clone(),
            ranks: *np,
            measured_ms: r.step.median,
            simulated_ms: m.step_s * 1e3,
            measured_exposed_ms: Some(r.exposed.median),
            simulated_exposed_ms: Some((m.step_s - b).max(0.0) * 1e3),
        });
    }
    let mut all_links = links;
    all_links.extend(measured.into_iter().map(|(l, _)| l));
    SimResult {
        note: NOTE.to_string(),
        backward_ms,
        links: all_links,
        overheads,
        calibration,
        rows,
        check,
    }
}
