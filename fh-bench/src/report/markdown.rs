//! `report.md`: the tables of every suite, with the plots linked.

use std::fmt::Write as _;

use crate::plots::fmt_bytes;
use crate::record::RunRecord;

use super::{link_images, machine_line, per_run, sim_keys, uniq};

/// The Markdown report.
pub fn markdown(r: &RunRecord, plots: &[String], plot_errors: &[String]) -> String {
    let mut md = String::new();
    let c = &r.config;
    let _ = writeln!(md, "# FastHorovod benchmark report\n");
    let _ = writeln!(
        md,
        "- started {} on `{}` ({} CPUs, {}), revision `{}`, {}\n- {} ranks, launcher `{}`{}, \
         suites: {}{}\n- machine-readable figures: [run.json](run.json)\n",
        r.started_utc,
        r.host.hostname,
        r.host.cpus,
        r.host.os,
        r.git_revision,
        r.tool,
        c.np,
        c.launcher,
        c.hosts
            .as_deref()
            .map(|h| format!(" on {h}"))
            .unwrap_or_default(),
        c.suites.join(", "),
        if c.quick { " (quick)" } else { "" },
    );
    let _ = writeln!(md, "{}", machine_line(r));

    if !r.replay.is_empty() {
        let _ = writeln!(
            md,
            "## Workload replay (headline)\n\nGradients released over an emulated backward pass \
             of {} ms at fixed deadlines; step = backward start to last gradient reduced \
             (slowest rank); exposed = step − backward. Each configuration ran {} time(s), \
             interleaved round-robin with the others; step and exposed: median [min–max] over \
             the {} timed steps of every run; per run: each run's median exposed; ÷ ddp-gloo, \
             ÷ horovod-torch and ÷ fasthorovod-torch (its row over the same transport): the \
             exposed ratio within each round, median [min–max] over the rounds; ÷ horovod: \
             medians against the engine's `horovod` preset. `ddp-fasthorovod`: DDP with its \
             process group on FastHorovod's torch.distributed backend; `ddp-floor`: the same \
             DDP communicating nothing (a hook that hands each bucket back), its own bucket \
             copies alone — no backend can expose less under DDP.\n",
            c.backward_ms, c.replay_repeats, c.steps
        );
        let _ = writeln!(md, "| workload | schedule (transport) | step | exposed | exposed per run | throughput | step ÷ horovod | exposed ÷ horovod | exposed ÷ ddp-gloo | exposed ÷ horovod-torch | exposed ÷ fasthorovod-torch | bytes per channel |");
        let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for x in &r.replay {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                x.workload,
                x.config_label(),
                x.step.display(1),
                x.exposed.display(1),
                per_run(&x.exposed_per_repeat),
                x.throughput.display(2),
                x.step_ratio_to_horovod
                    .map_or("–".into(), |v| format!("{v:.2}")),
                x.exposed_ratio_to_horovod
                    .map_or("–".into(), |v| format!("{v:.2}")),
                x.exposed_vs_ddp
                    .as_ref()
                    .map_or("–".into(), |q| q.display(2)),
                x.exposed_vs_horovod_torch
                    .as_ref()
                    .map_or("–".into(), |q| q.display(2)),
                x.exposed_vs_fasthorovod_torch
                    .as_ref()
                    .map_or("–".into(), |q| q.display(2)),
                x.channel_share_text(),
            );
        }
        link_images(&mut md, plots, "replay-exposed");
        transport_bounds(&mut md, r);
        if let Some(a) = &r.across {
            across_hosts(&mut md, a, c.backward_ms);
            cpu_per_gb(&mut md, r, a);
        } else {
            cpu_per_step(&mut md, r);
        }
    }

    if !r.collectives.is_empty() {
        let _ = writeln!(
            md,
            "## Collectives\n\nnccl-tests definitions: size = bytes of a rank's whole buffer; \
             algbw = size / time; busbw = algbw × factor (allreduce 2(n−1)/n; allgather, \
             reduce-scatter, alltoall (n−1)/n; broadcast 1). Time = slowest rank per repeat; \
             median [min–max] over {} repeats.\n",
            c.repeats
        );
        let _ = writeln!(
            md,
            "| transport | collective | size | time | algbw | busbw |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|");
        for x in &r.collectives {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                x.transport,
                x.collective,
                fmt_bytes(x.bytes as f64),
                x.time.display(1),
                x.algbw.display(3),
                x.busbw.display(3)
            );
        }
        link_images(&mut md, plots, "collectives-allreduce");
        for t in uniq(r.collectives.iter().map(|x| x.transport.as_str())) {
            link_images(&mut md, plots, &format!("collectives-{t}"));
        }
    }

    if !r.replay_allreduce.is_empty() {
        let _ = writeln!(
            md,
            "\n### Allreduce between the replay's rounds\n\nThe sweep's smallest and largest \
             allreduce, measured again on each replay transport between the replay's rounds \
             (every round's repeats together): the model's links and the transports' own bounds \
             come from these, which share the replay's spells of the host.\n"
        );
        let _ = writeln!(md, "| transport | np | size | time | algbw |");
        let _ = writeln!(md, "|---|---|---|---|---|");
        for x in &r.replay_allreduce {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                x.transport,
                x.np,
                fmt_bytes(x.bytes as f64),
                x.time.display(1),
                x.algbw.display(3)
            );
        }
    }

    if !r.streams.is_empty() {
        let _ = writeln!(
            md,
            "\n### Concurrent allreduces\n\nK allreduces of the same size at once, each on its \
             own communicator, as the engine's K channels run them. Time = from a barrier to \
             the last one finished (slowest rank); aggregate = K × size / time; ÷ one = the \
             aggregate against one allreduce alone in the same measurement (the scale model's \
             concurrency factor for the loopback check). A size marked *staged* ran as the \
             engine runs a fused group on one host: a stage piece at a time packed, reduced \
             and unpacked with the average.\n"
        );
        let _ = writeln!(
            md,
            "| transport | np | size | K | time | aggregate algbw | ÷ one |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|---|");
        for x in &r.streams {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} |",
                x.transport,
                x.np,
                match x.stage {
                    Some(p) => format!(
                        "{} staged ({} pieces)",
                        fmt_bytes(x.bytes as f64),
                        fmt_bytes(p as f64)
                    ),
                    None => fmt_bytes(x.bytes as f64),
                },
                x.streams,
                x.time.display(1),
                x.aggregate_algbw.display(3),
                x.vs_one(&r.streams)
                    .map_or("–".into(), |f| format!("{f:.2}"))
            );
        }
    }

    if !r.negotiation.is_empty() {
        let _ = writeln!(md, "## Negotiation\n");
        let _ = writeln!(
            md,
            "| mode | np | tensors | step latency | rounds/step | latency/round | bytes/round | CPU/step, all ranks |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
        for x in &r.negotiation {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                x.mode,
                x.np,
                x.tensors,
                x.step_latency.display(1),
                x.rounds_per_step.display(1),
                x.round_latency.display(1),
                x.bytes_per_round.display(0),
                x.cpu_per_step.as_ref().map_or("–".into(), |q| q.display(1))
            );
        }
        link_images(&mut md, plots, "negotiation");
    }

    if let Some(sim) = &r.simulation {
        let _ = writeln!(md, "## Scale simulation — a model\n\n**{}**\n", sim.note);
        let _ = writeln!(md, "Calibration:\n");
        for n in &sim.calibration {
            let _ = writeln!(md, "- {n}");
        }
        let _ = writeln!(md, "\nLinks:\n");
        for l in &sim.links {
            let _ = writeln!(
                md,
                "- {}: alpha = {:.1} us, {:.2} GB/s per rank{}",
                l.name,
                l.alpha_s * 1e6,
                l.bandwidth_bps / 1e9,
                l.stream_cap_bps
                    .map(|c| format!(", one stream at most {:.2} GB/s", c / 1e9))
                    .unwrap_or_default()
            );
        }
        if !sim.check.is_empty() {
            let _ = writeln!(
                md,
                "\nModel against measurement (each replay against the link calibrated on its \
                 transport, at the measured rank count):\n"
            );
            let errs: Vec<f64> = sim.check.iter().map(|x| x.step_error().abs()).collect();
            let _ = writeln!(
                md,
                "Step-time error of the model: median {:.1} %, largest {:.1} % over {} \
                 configurations. Exposed communication is a small difference of large times on \
                 a shared host: compare it in absolute terms.\n",
                crate::stats::Quantity::from_samples(&errs, "ratio").median * 100.0,
                errs.iter().copied().fold(0.0, f64::max) * 100.0,
                errs.len()
            );
            let _ = writeln!(
                md,
                "| workload | schedule | transport | ranks | measured step (ms) | simulated \
                 step (ms) | error | measured exposed (ms) | simulated exposed (ms) |"
            );
            let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
            let ms = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
            for x in &sim.check {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:+.1} % | {} | {} |",
                    x.workload,
                    x.schedule,
                    if x.transport.is_empty() {
                        "–"
                    } else {
                        &x.transport
                    },
                    x.ranks,
                    x.measured_ms,
                    x.simulated_ms,
                    x.step_error() * 100.0,
                    ms(x.measured_exposed_ms),
                    ms(x.simulated_exposed_ms)
                );
            }
        }
        let _ = writeln!(
            md,
            "\nSimulated scaling efficiency at 8 / 64 / 1024 ranks (B = {} ms):\n",
            sim.backward_ms
        );
        let _ = writeln!(
            md,
            "| workload | link | schedule | 8 | 64 | 1024 | step at 1024 (ms) |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|---|");
        for (w, l, s) in sim_keys(r) {
            let at = |p: usize| {
                sim.rows
                    .iter()
                    .find(|x| x.workload == w && x.link == l && x.schedule == s && x.ranks == p)
            };
            let eff = |p| at(p).map_or("–".into(), |x| format!("{:.3}", x.efficiency.median));
            let _ = writeln!(
                md,
                "| {w} | {l} | {s} | {} | {} | {} | {} |",
                eff(8),
                eff(64),
                eff(1024),
                at(1024).map_or("–".into(), |x| format!("{:.1}", x.step.median))
            );
        }
        for w in uniq(sim.rows.iter().map(|x| x.workload.as_str())) {
            link_images(&mut md, plots, &format!("simulate-{w}"));
        }
    }

    if !r.skipped.is_empty() {
        let _ = writeln!(md, "## Not measured\n");
        for s in &r.skipped {
            let _ = writeln!(md, "- {} / {}: {}", s.suite, s.what, s.reason);
        }
        let _ = writeln!(md);
    }
    if !plot_errors.is_empty() {
        let _ = writeln!(md, "## Plots not drawn\n");
        for e in plot_errors {
            let _ = writeln!(md, "- {e}");
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "Run time: {:.1} s.", r.wall.median);
    md
}

/// The replay across hosts: layout, measured link, and per row the bytes across each host's
/// link, the link bound and the model on that link.
fn across_hosts(md: &mut String, a: &crate::record::Across, backward_ms: f64) {
    let flow = match a.flow_gbps {
        Some(f) => format!(
            "; one TCP stream across it at {f:.3} Gbit/s (the per-flow cap where it is below \
             the link's)"
        ),
        None => String::new(),
    };
    let copy = match a.copy_gbps {
        Some(c) => format!("{c:.2} GB/s per pass and rank, every rank copying at once"),
        None => "taken as free".into(),
    };
    let _ = writeln!(
        md,
        "\n### Across the hosts' links\n\nLayout {} ({} hosts, {} ranks); a host's link measured \
         at {:.3} Gbit/s (by the caller: `cargo xtask bench --emulate` gives the best of 1 and 8 \
         parallel TCP streams, the link's rate also where each flow is capped below it){flow}. \
         Bytes across: what must leave each host per \
         step (and enter it) under the row's schedule: hierarchical 2(H−1)/H of the gradients, \
         a flat ring over every rank (tcp, DDP's Gloo ring) 2(N−1)/N. Link bound: those bytes \
         at the measured rate minus the {backward_ms} ms backward. TCP streams: what the row's \
         runtime chose to each peer on another host (S) and, under `auto`, the rates of 1 and \
         8 streams it measured at start-up (rank 0's, per run). Model: `simulate` on this link, \
         calibrated from the probe, not from the rows: the measured link rate; H ranks on it \
         for hierarchical, N for a flat ring; under a per-flow cap each allreduce reaches at \
         most lanes × S streams of the one-stream rate (lanes: ranks per host for \
         hierarchical, 1 for a flat ring; S: the runtime's, or `auto`'s rule on the probe's \
         rates where the row reports none, marked *; frames below the striping threshold on \
         one stream), up to the link; hierarchical allreduce's shared-memory phases add {} \
         passes over each group at the host copy rate ({copy}; a rank's channels copying at \
         once share it where this machine has fewer cores than the job has ranks), of which \
         only the first pipeline chunk's stay outside the transfer across hosts (all of them \
         under `hier-serial`; 3 passes, one after another, under `FH_HIER_STAGED=1`).\n",
        a.layout,
        a.hosts,
        a.ranks,
        a.link_gbps,
        crate::across::hier_local_passes(a.ranks / a.hosts.max(1), false)
    );
    let _ = writeln!(
        md,
        "| workload | schedule (transport) | route | TCP streams | bytes across | link bound | exposed | exposed ÷ bound | model exposed | model ÷ measured |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    for x in &a.rows {
        let label = if x.transport.is_empty() {
            x.schedule.clone()
        } else {
            format!("{} ({})", x.schedule, x.transport)
        };
        let streams = match (
            crate::record::TcpStreams::summary(&x.tcp_streams),
            x.model_streams,
        ) {
            (Some(t), _) => t,
            (None, Some(s)) if !x.streams_reported => format!("S={s}*"),
            _ => "–".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {} | {} | {} |",
            x.workload,
            label,
            x.route.name(),
            streams,
            fmt_bytes(x.bytes_across),
            x.bound_ms,
            x.exposed_ms,
            x.vs_bound().map_or("–".into(), |v| format!("{v:.2}")),
            x.model_exposed_ms
                .map_or("–".into(), |v| format!("{v:.0} ms")),
            x.model_vs_measured()
                .map_or("–".into(), |v| format!("{v:.2}")),
        );
    }
    md.push('\n');
}

/// The CPU the ranks spent per GB that crossed the hosts' links: each engine row's CPU time of
/// all ranks per step ÷ the bytes that left all hosts per step (bytes across × hosts), and how
/// many cores that kept busy during the step on average.
fn cpu_per_gb(md: &mut String, r: &RunRecord, a: &crate::record::Across) {
    let mut lines = Vec::new();
    for x in &a.rows {
        let Some(row) = r.replay.iter().find(|y| {
            y.workload == x.workload && y.schedule == x.schedule && y.transport == x.transport
        }) else {
            continue;
        };
        let (Some(cpu_ms), true) = (row.cpu_ms_per_step, x.bytes_across > 0.0) else {
            continue;
        };
        let gb = x.bytes_across * a.hosts as f64 / 1e9;
        lines.push(format!(
            "| {} | {} ({}) | {:.0} ms | {} | {:.2} | {:.2} |",
            x.workload,
            x.schedule,
            x.transport,
            cpu_ms,
            main_thread_cell(row),
            cpu_ms / 1e3 / gb,
            cpu_ms / row.step.median.max(f64::MIN_POSITIVE),
        ));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "CPU per GB across: the CPU time (user and system, `getrusage`) of all ranks over the \
         timed steps, per step and per GB that left the hosts (bytes across × {} hosts); {MAIN_THREADS}; \
         cores busy: that CPU time ÷ the median step.\n",
        a.hosts
    );
    let _ = writeln!(
        md,
        "| workload | schedule (transport) | CPU per step | of it, main threads | CPU s per GB across | cores busy |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|");
    for l in lines {
        let _ = writeln!(md, "{l}");
    }
    md.push('\n');
}

/// What the CPU tables' "of it, main threads" column holds.
const MAIN_THREADS: &str = "of it, main threads: the ranks' training loops (the thread that \
     runs the backward — for the peers, the framework's hooks and submissions in it, and DDP's \
     bucket copies — and waits for the results; the engine's rows: the thread that submits each \
     gradient at its deadline and waits), the rest being the communication library's threads";

/// A row's main-thread CPU per step (`–` where not measured).
fn main_thread_cell(x: &crate::record::ReplayRow) -> String {
    x.main_thread_cpu_ms_per_step
        .map_or_else(|| "–".into(), |m| format!("{m:.0} ms"))
}

/// On one host: each row's CPU time of all ranks per step (the engine's rows over process
/// transports, and the peers), per GB of gradients reduced, and how many cores that kept busy
/// during the step on average.
fn cpu_per_step(md: &mut String, r: &RunRecord) {
    let rows: Vec<_> = r
        .replay
        .iter()
        .filter_map(|x| x.cpu_ms_per_step.map(|c| (x, c)))
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "CPU: the CPU time (user and system, every thread) of all ranks over the timed steps, \
         per step and per GB of gradients (each rank's); {MAIN_THREADS}; cores busy: that CPU \
         time ÷ the median step.\n"
    );
    let _ = writeln!(
        md,
        "| workload | schedule (transport) | CPU per step | of it, main threads | CPU s per GB of gradients | cores busy |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|");
    for (x, cpu_ms) in rows {
        let gb = x.bytes as f64 / 1e9;
        let _ = writeln!(
            md,
            "| {} | {} ({}) | {:.0} ms | {} | {} | {:.2} |",
            x.workload,
            x.schedule,
            x.transport,
            cpu_ms,
            main_thread_cell(x),
            if gb > 0.0 {
                format!("{:.2}", cpu_ms / 1e3 / gb)
            } else {
                "–".into()
            },
            cpu_ms / x.step.median.max(f64::MIN_POSITIVE),
        );
    }
    md.push('\n');
}

/// Per workload and transport: the transport's own bound on exposed communication (the
/// workload's bytes ÷ the allreduce algorithm bandwidth measured at the sweep's largest size,
/// between the replay's rounds where measured there ([`RunRecord::link_rows`]), same
/// transport and rank count, minus the backward) beside the best engine schedule.
fn transport_bounds(md: &mut String, r: &RunRecord) {
    let mut lines = Vec::new();
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut any_between = false;
    for x in &r.replay {
        let key = (x.workload.clone(), x.transport.clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let (rows, between) = r.link_rows(&x.transport, x.np);
        any_between |= between;
        let Some(bw) = rows
            .iter()
            .max_by_key(|c| c.bytes)
            .map(|c| c.algbw.median)
            .filter(|b| b.is_finite() && *b > 0.0)
        else {
            continue;
        };
        let bound = (x.bytes as f64 / (bw * 1e9) * 1e3 - x.backward.median).max(0.0);
        let best = r
            .replay
            .iter()
            .filter(|y| {
                y.workload == x.workload
                    && y.transport == x.transport
                    && y.schedule.starts_with("fasthorovod K=")
            })
            .min_by(|a, b| a.exposed.median.total_cmp(&b.exposed.median));
        if let Some(b) = best {
            lines.push(format!(
                "| {} | {} | {:.2} | {:.1} | {} | {:.1} | {} |",
                x.workload,
                x.transport,
                bw,
                bound,
                b.schedule,
                b.exposed.median,
                if bound > 0.0 {
                    format!("{:.2}", b.exposed.median / bound)
                } else {
                    "–".into()
                }
            ));
        }
    }
    if lines.is_empty() {
        return;
    }
    let measured = if any_between {
        "measured at the sweep's largest size between the replay's rounds, so that it shares \
         their spells of the host"
    } else {
        "measured at the sweep's largest size"
    };
    let _ = writeln!(
        md,
        "\nThe transport's own bound: a step cannot expose less than the workload's bytes ÷ the \
         allreduce algorithm bandwidth {measured} (same transport and rank count), minus the \
         backward (0 when the backward can hide it all).\n"
    );
    let _ = writeln!(
        md,
        "| workload | transport | algbw (GB/s) | bound (ms) | best engine schedule | its exposed \
         (ms) | ÷ bound |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for l in lines {
        let _ = writeln!(md, "{l}");
    }
}
