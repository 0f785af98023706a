//! The terminal summary printed at the end of a run.

use std::fmt::Write as _;

use crate::plots::fmt_bytes;
use crate::record::RunRecord;

use super::{ratio_range, sim_keys};

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
            "  {:<12} {:<32} {:>10} {:>10} {:>8} {:>8} {:>18} {:>18} {:>18} channels",
            "workload",
            "schedule (transport)",
            "step ms",
            "exposed",
            "step÷hv",
            "exp÷hv",
            "exp÷ddp",
            "exp÷hvd-torch",
            "exp÷fh-torch",
        );
        for x in &r.replay {
            let _ = writeln!(
                s,
                "  {:<12} {:<32} {:>10.1} {:>10.1} {:>8} {:>8} {:>18} {:>18} {:>18} {}",
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
                x.exposed_vs_fasthorovod_torch
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
        let _ = writeln!(
            s,
            "\nnegotiation: latency per step (submit all, wait all) and per round, bytes per round, CPU per step of all ranks"
        );
        for x in &r.negotiation {
            let cpu = x
                .cpu_per_step
                .as_ref()
                .map_or(String::new(), |q| format!(" {:>8.1} us CPU/step", q.median));
            let _ = writeln!(
                s,
                "  {:<12} np {:<3} {:>5} tensors {:>8.1} us/step {:>8.1} us/round {:>6.0} B/round{cpu}",
                x.mode,
                x.np,
                x.tensors,
                x.step_latency.median,
                x.round_latency.median,
                x.bytes_per_round.median
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
