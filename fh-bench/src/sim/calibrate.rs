//! Fitting a link to measured allreduce times.

use super::Link;

/// α and bandwidth of a link fitted to measured allreduce times on `p` ranks, against
/// `t = 2(p−1)α + 2(p−1)/p·m·β`: the line through the smallest and the largest size, so β is
/// set by the largest (the regime fused groups live in; the slope between the two largest
/// sizes, a difference of two noisy times, swung the bandwidth by half from one run to the next)
/// and α by the smallest less its bandwidth term; with fewer than two sizes or a non-positive
/// slope, `None`.
pub fn calibrate_link(name: &str, p: usize, points: &[(f64, f64)]) -> Option<Link> {
    if p < 2 {
        return None;
    }
    let mut pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|q| q.0.is_finite() && q.1.is_finite() && q.1 > 0.0)
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts.dedup_by(|a, b| a.0 == b.0);
    if pts.len() < 2 {
        return None;
    }
    let pf = p as f64;
    let (hi, lo) = (pts[pts.len() - 1], pts[0]);
    let slope = (hi.1 - lo.1) / (hi.0 - lo.0);
    let beta = slope / (2.0 * (pf - 1.0) / pf);
    if beta <= 0.0 || !beta.is_finite() {
        return None;
    }
    let small = pts[0];
    let alpha = ((small.1 - slope * small.0) / (2.0 * (pf - 1.0))).max(1e-7);
    Some(Link {
        name: name.to_string(),
        alpha_s: alpha,
        bandwidth_bps: 1.0 / beta,
        stream_cap_bps: None,
        concurrency: Vec::new(),
        staged_concurrency: Vec::new(),
        host_bound: false,
        wire: fh_scheduler::Wire::Network,
        vectored_io: false,
        agrees_in_band: false,
        flows: None,
        local_passes: 0.0,
        local_chunk: None,
    })
}
