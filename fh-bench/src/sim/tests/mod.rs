//! The scale model's tests, by subject; the helpers they share.

use super::*;

mod costs;
mod flows;
mod schedule;
mod sharing;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
}

fn link(alpha: f64, bw: f64, cap: Option<f64>) -> Link {
    Link {
        name: "test".into(),
        alpha_s: alpha,
        bandwidth_bps: bw,
        stream_cap_bps: cap,
        concurrency: Vec::new(),
        staged_concurrency: Vec::new(),
        host_bound: false,
        wire: fh_scheduler::Wire::Network,
        vectored_io: false,
        agrees_in_band: true,
        flows: None,
        local_passes: 0.0,
        local_chunk: None,
    }
}

const NO_OVERHEAD: Overheads = Overheads {
    round_s: 0.0,
    per_collective_s: 0.0,
    copy_bps: None,
    staged_copy_bps: None,
    shared_host: false,
};

/// `(streams, factor)` points measured at one size.
fn at_size(bytes: usize, pts: &[(usize, f64)]) -> Vec<Concurrency> {
    pts.iter()
        .map(|&(streams, factor)| Concurrency {
            bytes,
            streams,
            factor,
        })
        .collect()
}

/// `fasthorovod` K=1 without the inline rule (every group on its channel).
fn fasthorovod_k1() -> Schedule {
    let mut f = Schedule::fasthorovod(1);
    f.inline_bytes = 0;
    f
}
