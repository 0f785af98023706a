//! Output of a run: `run.json`, PNG/SVG plots, `report.md` linking them, and the terminal
//! summary. Everything is generated from a [`RunRecord`], so a recorded `run.json` can be
//! re-reported (`fh-bench report run.json`).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::plots::{self, fmt_bytes, LineChart, Series};
use crate::record::RunRecord;
use crate::stats::Quantity;

/// The files written.
#[derive(Debug, Clone)]
pub struct Written {
    /// `run.json`.
    pub json: PathBuf,
    /// `report.md`.
    pub report: PathBuf,
    /// Plot files (PNG and SVG).
    pub plots: Vec<PathBuf>,
    /// Plots that could not be drawn, and why.
    pub plot_errors: Vec<String>,
}

/// Writes `run.json`, the plots and `report.md` into `dir`.
pub fn write_all(record: &RunRecord, dir: &Path) -> Result<Written, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let json = dir.join("run.json");
    let text = serde_json::to_string_pretty(record).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("writing {}: {e}", json.display()))?;
    let (plots, plot_errors) = draw_plots(record, dir);
    let report = dir.join("report.md");
    let md = markdown(record, &plots, &plot_errors);
    std::fs::write(&report, md).map_err(|e| format!("writing {}: {e}", report.display()))?;
    Ok(Written {
        json,
        report,
        plots: plots.iter().map(|p| dir.join(p)).collect(),
        plot_errors,
    })
}

fn uniq<'a>(it: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut seen = Vec::<String>::new();
    for s in it {
        if !seen.iter().any(|x| x == s) {
            seen.push(s.to_string());
        }
    }
    seen
}

/// Draws every plot the record has data for; returns file names and errors.
pub fn draw_plots(r: &RunRecord, dir: &Path) -> (Vec<String>, Vec<String>) {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    let mut keep = |res: Result<Vec<String>, String>| match res {
        Ok(f) => files.extend(f),
        Err(e) => errors.push(e),
    };
    if !r.collectives.is_empty() {
        let transports = uniq(r.collectives.iter().map(|c| c.transport.as_str()));
        let series: Vec<Series> = transports
            .iter()
            .map(|t| {
                let pts = r
                    .collectives
                    .iter()
                    .filter(|c| &c.transport == t && c.collective == "allreduce")
                    .map(|c| (c.bytes as f64, c.busbw.median))
                    .collect();
                (t.clone(), pts)
            })
            .filter(|(_, p): &Series| !p.is_empty())
            .collect();
        let title = format!("allreduce bus bandwidth, np = {}", r.config.np);
        keep(plots::line_chart(
            dir,
            "collectives-allreduce",
            &LineChart {
                title: &title,
                x_label: "size",
                y_label: "bus bandwidth (GB/s)",
                log_x: true,
                log_y: true,
                x_bytes: true,
                series,
            },
        ));
        for t in transports.iter().filter(|t| !t.starts_with("openmpi")) {
            let colls = uniq(
                r.collectives
                    .iter()
                    .filter(|c| &c.transport == t)
                    .map(|c| c.collective.as_str()),
            );
            let series: Vec<Series> = colls
                .iter()
                .map(|c| {
                    let pts = r
                        .collectives
                        .iter()
                        .filter(|x| &x.transport == t && &x.collective == c)
                        .map(|x| (x.bytes as f64, x.busbw.median))
                        .collect();
                    (c.clone(), pts)
                })
                .collect();
            let title = format!("collectives over {t}, np = {}: bus bandwidth", r.config.np);
            keep(plots::line_chart(
                dir,
                &format!("collectives-{t}"),
                &LineChart {
                    title: &title,
                    x_label: "size",
                    y_label: "bus bandwidth (GB/s)",
                    log_x: true,
                    log_y: true,
                    x_bytes: true,
                    series,
                },
            ));
        }
    }
    if !r.replay.is_empty() {
        let workloads = uniq(r.replay.iter().map(|x| x.workload.as_str()));
        let labels: Vec<String> = r.replay.iter().map(|x| x.config_label()).collect();
        let schedules = uniq(labels.iter().map(String::as_str));
        let series: Vec<(String, Vec<f64>)> = schedules
            .iter()
            .map(|s| {
                let v = workloads
                    .iter()
                    .map(|w| {
                        r.replay
                            .iter()
                            .find(|x| &x.workload == w && &x.config_label() == s)
                            .map_or(f64::NAN, |x| x.exposed.median)
                    })
                    .collect();
                (s.clone(), v)
            })
            .collect();
        let title = format!(
            "exposed communication per step (step − {} ms backward), np = {}",
            r.config.backward_ms, r.config.np
        );
        keep(plots::bar_chart(
            dir,
            "replay-exposed",
            &title,
            "exposed communication (ms)",
            &workloads,
            &series,
        ));
    }
    if !r.negotiation.is_empty() {
        let keys = uniq(r.negotiation.iter().map(|x| x.mode.as_str()));
        let nps: BTreeSet<usize> = r.negotiation.iter().map(|x| x.np).collect();
        let mut series = Vec::new();
        for m in &keys {
            for np in &nps {
                let pts: Vec<(f64, f64)> = r
                    .negotiation
                    .iter()
                    .filter(|x| &x.mode == m && x.np == *np)
                    .map(|x| (x.tensors as f64, x.round_latency.median))
                    .collect();
                if !pts.is_empty() {
                    series.push((format!("{m}, np = {np}"), pts));
                }
            }
        }
        keep(plots::line_chart(
            dir,
            "negotiation",
            &LineChart {
                title: "negotiation round latency",
                x_label: "tensors per step",
                y_label: "latency per round (us)",
                log_x: true,
                log_y: true,
                x_bytes: false,
                series,
            },
        ));
    }
    if let Some(sim) = &r.simulation {
        let workloads = uniq(sim.rows.iter().map(|x| x.workload.as_str()));
        let links = uniq(sim.rows.iter().map(|x| x.link.as_str()));
        let schedules = uniq(sim.rows.iter().map(|x| x.schedule.as_str()));
        for w in &workloads {
            let titles: Vec<String> = links.iter().map(|l| format!("{l} links")).collect();
            let charts: Vec<LineChart<'_>> = links
                .iter()
                .zip(&titles)
                .map(|(l, title)| LineChart {
                    title,
                    x_label: "ranks",
                    y_label: "scaling efficiency",
                    log_x: true,
                    log_y: false,
                    x_bytes: false,
                    series: schedules
                        .iter()
                        .map(|s| {
                            let pts = sim
                                .rows
                                .iter()
                                .filter(|x| &x.workload == w && &x.link == l && &x.schedule == s)
                                .map(|x| (x.ranks as f64, x.efficiency.median))
                                .collect();
                            (s.clone(), pts)
                        })
                        .collect(),
                })
                .collect();
            let title = format!(
                "{w}: simulated scaling efficiency (MODEL, B = {} ms)",
                sim.backward_ms
            );
            keep(plots::line_grid(
                dir,
                &format!("simulate-{w}"),
                &title,
                2,
                &charts,
            ));
        }
    }
    (files, errors)
}

fn link_images(md: &mut String, plots: &[String], stem: &str) {
    if plots.iter().any(|p| p == &format!("{stem}.png")) {
        let _ = writeln!(md, "\n![{stem}]({stem}.png) ([SVG]({stem}.svg))\n");
    }
}

/// The machine's state during the run (CPU steal, load), with a warning when timings are
/// unreliable.
pub fn machine_line(r: &RunRecord) -> String {
    let steal = r
        .host
        .steal_percent
        .map_or("unknown".into(), |v| format!("{v:.0} %"));
    let load = r
        .host
        .load_average
        .map_or("unknown".into(), |v| format!("{v:.1}"));
    let busy = r.host.steal_percent.is_some_and(|v| v > 10.0)
        || r.host
            .load_average
            .is_some_and(|v| v > 1.5 * r.host.cpus.max(1) as f64);
    format!(
        "- CPU steal during the run {steal}, load average at the end {load}{}\n",
        if busy {
            " — **warning: the machine was busy; compare only ratios inside this run**"
        } else {
            ""
        }
    )
}

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
             the {} timed steps of every run; per run: each run's median exposed; ÷ ddp-gloo \
             and ÷ horovod-torch: the exposed ratio within each round, median [min–max] over \
             the rounds; ÷ horovod: medians against the engine's `horovod` preset.\n",
            c.backward_ms, c.replay_repeats, c.steps
        );
        let _ = writeln!(md, "| workload | schedule (transport) | step | exposed | exposed per run | throughput | step ÷ horovod | exposed ÷ horovod | exposed ÷ ddp-gloo | exposed ÷ horovod-torch | bytes per channel |");
        let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|");
        for x in &r.replay {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
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
                x.channel_share_text(),
            );
        }
        link_images(&mut md, plots, "replay-exposed");
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

    if !r.negotiation.is_empty() {
        let _ = writeln!(md, "## Negotiation\n");
        let _ = writeln!(
            md,
            "| mode | np | tensors | step latency | rounds/step | latency/round | bytes/round |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|---|");
        for x in &r.negotiation {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} |",
                x.mode,
                x.np,
                x.tensors,
                x.step_latency.display(1),
                x.rounds_per_step.display(1),
                x.round_latency.display(1),
                x.bytes_per_round.display(0)
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
                "\nModel against measurement (calibrated loopback link):\n"
            );
            let _ = writeln!(
                md,
                "| workload | schedule | ranks | measured step (ms) | simulated step (ms) |"
            );
            let _ = writeln!(md, "|---|---|---|---|---|");
            for x in &sim.check {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.1} | {:.1} |",
                    x.workload, x.schedule, x.ranks, x.measured_ms, x.simulated_ms
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

fn sim_keys(r: &RunRecord) -> Vec<(String, String, String)> {
    let mut keys: Vec<(String, String, String)> = Vec::new();
    if let Some(sim) = &r.simulation {
        for x in &sim.rows {
            let k = (x.workload.clone(), x.link.clone(), x.schedule.clone());
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    keys
}

/// Each run's median exposed time, `12.3, 15.0, 9.8 ms` (`–` when not recorded).
fn per_run(v: &[f64]) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let parts: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
    format!("{} ms", parts.join(", "))
}

/// A ratio's median with its range, `0.25 [0.20–0.31]`.
fn ratio_range(q: &Quantity) -> String {
    if q.n <= 1 || q.min == q.max {
        format!("{:.2}", q.median)
    } else {
        format!("{:.2} [{:.2}–{:.2}]", q.median, q.min, q.max)
    }
}

/// The terminal summary.
pub fn summary(r: &RunRecord) -> String {
    let mut s = String::new();
    if !r.replay.is_empty() {
        let _ = writeln!(
            s,
            "\nreplay (np {}, backward {} ms): median step / exposed, ratio to horovod",
            r.config.np, r.config.backward_ms
        );
        let _ = writeln!(
            s,
            "  {:<12} {:<32} {:>10} {:>10} {:>8} {:>8} {:>18} {:>18} {}",
            "workload",
            "schedule (transport)",
            "step ms",
            "exposed",
            "step÷hv",
            "exp÷hv",
            "exp÷ddp",
            "exp÷hvd-torch",
            "channels"
        );
        for x in &r.replay {
            let _ = writeln!(
                s,
                "  {:<12} {:<32} {:>10.1} {:>10.1} {:>8} {:>8} {:>18} {:>18} {}",
                x.workload,
                x.config_label(),
                x.step.median,
                x.exposed.median,
                x.step_ratio_to_horovod
                    .map_or("-".into(), |v| format!("{v:.2}")),
                x.exposed_ratio_to_horovod
                    .map_or("-".into(), |v| format!("{v:.2}")),
                x.exposed_vs_ddp.as_ref().map_or("-".into(), ratio_range),
                x.exposed_vs_horovod_torch
                    .as_ref()
                    .map_or("-".into(), ratio_range),
                x.channel_share_text(),
            );
        }
    }
    if !r.collectives.is_empty() {
        let _ = writeln!(
            s,
            "\ncollectives (np {}): median time and bus bandwidth",
            r.config.np
        );
        let _ = writeln!(
            s,
            "  {:<12} {:<15} {:>9} {:>12} {:>10}",
            "transport", "collective", "size", "time us", "busbw GB/s"
        );
        for x in &r.collectives {
            let _ = writeln!(
                s,
                "  {:<12} {:<15} {:>9} {:>12.1} {:>10.3}",
                x.transport,
                x.collective,
                fmt_bytes(x.bytes as f64),
                x.time.median,
                x.busbw.median
            );
        }
    }
    if !r.negotiation.is_empty() {
        let _ = writeln!(s, "\nnegotiation: latency and bytes per round");
        for x in &r.negotiation {
            let _ = writeln!(
                s,
                "  {:<12} np {:<3} {:>5} tensors {:>10.1} us/round {:>8.0} B/round",
                x.mode, x.np, x.tensors, x.round_latency.median, x.bytes_per_round.median
            );
        }
    }
    if let Some(sim) = &r.simulation {
        let _ = writeln!(
            s,
            "\nsimulate (MODEL): scaling efficiency at 8 / 64 / 1024 ranks, B = {} ms",
            sim.backward_ms
        );
        for (w, l, sc) in sim_keys(r) {
            let eff = |p: usize| {
                sim.rows
                    .iter()
                    .find(|x| x.workload == w && x.link == l && x.schedule == sc && x.ranks == p)
                    .map_or(f64::NAN, |x| x.efficiency.median)
            };
            let _ = writeln!(
                s,
                "  {:<12} {:<14} {:<20} {:.3} {:.3} {:.3}",
                w,
                l,
                sc,
                eff(8),
                eff(64),
                eff(1024)
            );
        }
    }
    for x in &r.skipped {
        let _ = writeln!(s, "skipped: {} / {}: {}", x.suite, x.what, x.reason);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run recorded by hand (as `run.json` stores it): report generation must not need a
    /// live run.
    const RECORDED: &str = include_str!("../tests/data/recorded-run.json");

    #[test]
    fn replay_rows_show_transport_repeats_and_peer_ratios() {
        let mut r: RunRecord = serde_json::from_str(RECORDED).unwrap();
        r.config.replay_repeats = 3;
        let mut row = r.replay[1].clone();
        row.schedule = "fasthorovod-torch".into();
        row.transport = "shm".into();
        row.repeats = 3;
        row.exposed_per_repeat = vec![20.0, 25.0, 30.0];
        row.exposed_vs_ddp = Some(Quantity::from_samples(&[0.2, 0.3, 0.25], "ratio"));
        row.exposed_vs_horovod_torch = Some(Quantity::from_samples(&[0.4], "ratio"));
        r.replay.push(row);
        let dir = std::env::temp_dir().join(format!("fh-bench-report-t-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let w = write_all(&r, &dir).unwrap();
        let md = std::fs::read_to_string(&w.report).unwrap();
        assert!(md.contains("ran 3 time(s), interleaved"), "{md}");
        assert!(
            md.contains("| resnet50 | fasthorovod-torch (shm) | 120.0 [118.0–125.0] ms | 20.0 [18.0–25.0] ms | 20.0, 25.0, 30.0 ms |"),
            "{md}"
        );
        assert!(
            md.contains("| 0.25 [0.20–0.30] ratio | 0.40 ratio |"),
            "{md}"
        );
        let s = summary(&r);
        assert!(
            s.contains("fasthorovod-torch (shm)") && s.contains("0.25 [0.20–0.30]"),
            "{s}"
        );
        // A record from before the transports were recorded reads as before.
        assert_eq!(r.replay[0].config_label(), "horovod");
        assert_eq!(r.replay[0].repeats, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn report_from_a_recorded_run() {
        let r: RunRecord = serde_json::from_str(RECORDED).unwrap();
        let dir = std::env::temp_dir().join(format!("fh-bench-report-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let w = write_all(&r, &dir).unwrap();
        let md = std::fs::read_to_string(&w.report).unwrap();
        // Headline rows with their ratios.
        assert!(
            md.contains("| resnet50 | horovod | 160.0 [150.0–170.0] ms | 60.0 [50.0–70.0] ms |"),
            "{md}"
        );
        assert!(md.contains("| resnet50 | fasthorovod K=4 | 120.0 [118.0–125.0] ms | 20.0 [18.0–25.0] ms | – | 8.33 [8.00–8.47] 1/s | 0.75 | 0.33 | – | – |"), "{md}");
        // Collectives with bus bandwidth.
        assert!(md.contains("| tcp | allreduce | 64 MiB | 50000.0 [48000.0–52000.0] us | 1.342 [1.291–1.398] GB/s | 2.013 [1.936–2.097] GB/s |"), "{md}");
        // The simulation says it is a model; skipped peers are listed.
        assert!(
            md.contains("a model") && md.contains("MODEL, not a measurement"),
            "{md}"
        );
        assert!(
            md.contains("replay / PyTorch DDP (Gloo): skipped: not installed"),
            "{md}"
        );
        // Plots are linked and exist (PNG and SVG).
        for stem in [
            "collectives-allreduce",
            "collectives-tcp",
            "replay-exposed",
            "negotiation",
            "simulate-resnet50",
        ] {
            assert!(
                md.contains(&format!("({stem}.png)")),
                "{stem} not linked: {md}"
            );
            for ext in ["png", "svg"] {
                let p = dir.join(format!("{stem}.{ext}"));
                assert!(
                    std::fs::metadata(&p)
                        .map(|m| m.len() > 1000)
                        .unwrap_or(false),
                    "{}",
                    p.display()
                );
            }
        }
        let svg = std::fs::read_to_string(dir.join("collectives-allreduce.svg")).unwrap();
        assert!(
            svg.contains("allreduce bus bandwidth"),
            "the SVG has its title"
        );
        // run.json round-trips.
        let back: RunRecord =
            serde_json::from_str(&std::fs::read_to_string(&w.json).unwrap()).unwrap();
        assert_eq!(back, r);
        let term = summary(&r);
        assert!(
            term.contains("fasthorovod K=4") && term.contains("0.33"),
            "{term}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
