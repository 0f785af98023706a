//! The run's plots (PNG and SVG), one per figure of the report.

use std::collections::BTreeSet;
use std::path::Path;

use crate::plots::{self, LineChart, Series};
use crate::record::RunRecord;

use super::uniq;

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
