//! Output of a run: `run.json`, PNG/SVG plots, `report.md` linking them, and the terminal
//! summary. Everything is generated from a [`RunRecord`], so a recorded `run.json` can be
//! re-reported (`fh-bench report run.json`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::record::RunRecord;
use crate::stats::Quantity;

mod figures;
mod markdown;
mod summary;

pub use figures::draw_plots;
pub use markdown::markdown;
pub use summary::summary;

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

pub(super) fn link_images(md: &mut String, plots: &[String], stem: &str) {
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

pub(super) fn sim_keys(r: &RunRecord) -> Vec<(String, String, String)> {
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
pub(super) fn per_run(v: &[f64]) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let parts: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
    format!("{} ms", parts.join(", "))
}

/// A ratio's median with its range, `0.25 [0.20–0.31]`.
pub(super) fn ratio_range(q: &Quantity) -> String {
    if q.n <= 1 || q.min == q.max {
        format!("{:.2}", q.median)
    } else {
        format!("{:.2} [{:.2}–{:.2}]", q.median, q.min, q.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run recorded by hand (as `run.json` stores it): report generation must not need a
    /// live run.
    const RECORDED: &str = include_str!("../../tests/data/recorded-run.json");

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
