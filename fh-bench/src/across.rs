//! The replay across hosts: for each replay row, the bytes that must cross each host's link per
//! step under the row's schedule, the link bound those bytes set at the measured link rate (the
//! caller's: `cargo xtask bench --emulate` passes the best of 1 and 8 parallel TCP streams, the
//! link's rate also under a per-flow cap), and the scale model ([`crate::sim`]) calibrated on that link.
//!
//! What crosses, per step, out of each host (and into it): hierarchical allreduce (`hier`, and
//! `auto` where a host holds several ranks, as it then picks `hier`) reduces within each host
//! first and runs a ring among the H hosts on each host's share: 2(H−1)/H of the gradients. A
//! flat ring over all N ranks (`tcp`, and PyTorch DDP's and Horovod's ring allreduce with the
//! ranks placed host after host) crosses each host's link in each direction on one ring edge,
//! which carries 2(N−1)/N of the gradients. With 2 hosts × 2 ranks that is 1× against 1.5×.
//! The link bound of a row is those bytes at the measured rate minus the backward (the
//! backward hides the rest at best), never below zero.
//!
//! The model of a row: the engine's schedule of the row (the `fasthorovod.torch` peer: the
//! shipped preset) on a link of the measured rate, with H ranks for a hierarchical row (the
//! ring among hosts) and N for a flat ring (each rank's ring traffic crosses one link); the
//! work within a host is taken as free. DDP and Horovod rows have no model.
//!
//! The lines are part of the run's record: their types ([`Across`], [`AcrossRow`], [`Route`])
//! live in [`crate::record`].

use crate::record::{Across, AcrossRow, Route, RunRecord};
use crate::sim::{self, Link, Overheads, Schedule};
use crate::workload::Workload;

/// Hosts and ranks of `h0:2,h1:2` (a host without slots has one).
pub fn layout(hosts: &str) -> Option<(usize, usize)> {
    let mut h = 0;
    let mut n = 0;
    for item in hosts.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        h += 1;
        n += match item.rsplit_once(':') {
            Some((_, s)) => s.parse::<usize>().ok().filter(|&s| s > 0)?,
            None => 1,
        };
    }
    (h >= 1).then_some((h, n))
}

/// The emulated or real link as the model's link: the measured rate, a LAN's latency.
pub fn model_link(link_gbps: f64) -> Link {
    let mut l = Link::defaults().remove(0);
    l.name = format!("measured {link_gbps:.3} Gbit/s link");
    l.alpha_s = 50e-6;
    l.bandwidth_bps = link_gbps * 1e9 / 8.0;
    l.stream_cap_bps = None;
    l
}

/// The model's schedule of a replay row: the engine's preset of that label, the shipped
/// preset for the `fasthorovod.torch` peer, None for the other peers.
fn model_schedule(label: &str) -> Option<Schedule> {
    if label == "fasthorovod-torch" {
        let k = fh_scheduler::Config::default().channels;
        return Some(Schedule::fasthorovod(k));
    }
    crate::simulate::replayed_schedules()
        .into_iter()
        .find(|s| s.label() == label)
}

/// The lines of every replay row of `record` across `hosts` (`h0:2,h1:2`) at `link_gbps`.
pub fn rows(
    record: &RunRecord,
    workloads: &[Workload],
    hosts: &str,
    link_gbps: f64,
) -> Option<Across> {
    let (h, n) = layout(hosts)?;
    let per_host = n / h.max(1);
    let link = model_link(link_gbps);
    let rate_bytes = link_gbps * 1e9 / 8.0;
    let mut out = Vec::new();
    for r in &record.replay {
        let route = Route::of(&r.transport, per_host);
        let bytes_across = route.fraction(h, n) * r.bytes as f64;
        let backward_ms = r.backward.median;
        let bound_ms = (bytes_across / rate_bytes * 1e3 - backward_ms).max(0.0);
        let model_exposed_ms = workloads
            .iter()
            .find(|w| w.model == r.workload)
            .zip(model_schedule(&r.schedule))
            .map(|(w, s)| {
                let b = backward_ms / 1e3;
                let p = route.model_ranks(h, n);
                let m = sim::simulate_workload(w, b, p, &link, &s, &Overheads::default());
                (m.step_s - b).max(0.0) * 1e3
            });
        out.push(AcrossRow {
            workload: r.workload.clone(),
            schedule: r.schedule.clone(),
            transport: r.transport.clone(),
            route,
            bytes_across,
            bound_ms,
            exposed_ms: r.exposed.median,
            model_exposed_ms,
        });
    }
    Some(Across {
        hosts: h,
        ranks: n,
        layout: hosts.to_string(),
        link_gbps,
        rows: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_hosts_of_two_send_the_gradients_once_or_one_and_a_half_times() {
        // 2 hosts: each host sends its half out and gets the other half back, twice over
        // (reduce-scatter, allgather) = 2·1/2 = 1 × the gradients. Ring of 4: 2·3/4 = 1.5 ×.
        assert_eq!(Route::Hierarchical.fraction(2, 4), 1.0);
        assert_eq!(Route::FlatRing.fraction(2, 4), 1.5);
        // 3 hosts × 1: hierarchy changes nothing.
        assert_eq!(
            Route::Hierarchical.fraction(3, 3),
            Route::FlatRing.fraction(3, 3)
        );
        assert_eq!(Route::of("hier", 2), Route::Hierarchical);
        assert_eq!(Route::of("hier-serial", 2), Route::Hierarchical);
        assert_eq!(
            Route::of("hier@FH_TCP_BUFFERS=kernel", 2),
            Route::Hierarchical
        );
        assert_eq!(Route::of("tcp@FH_TCP_BUFFERS=kernel", 2), Route::FlatRing);
        assert_eq!(Route::of("auto", 2), Route::Hierarchical);
        assert_eq!(Route::of("auto", 1), Route::FlatRing);
        for t in ["tcp", "gloo", "horovodrun"] {
            assert_eq!(Route::of(t, 2), Route::FlatRing, "{t}");
        }
    }

    #[test]
    fn layouts_are_counted() {
        assert_eq!(layout("h0:2,h1:2"), Some((2, 4)));
        assert_eq!(layout("a:3,b"), Some((2, 4)));
        assert_eq!(layout("a:0"), None);
        assert_eq!(layout(""), None);
    }

    #[test]
    fn the_model_is_near_the_bound_when_the_link_is_the_limit() {
        // ResNet-50 (102.2 MB of gradients) on 2 × 2 at 1 Gbit/s: the ring among the two hosts
        // sends 102.2 MB out of each host, 817.8 ms at 1 Gbit/s; with the 100 ms backward
        // hiding at most 100 ms, the exposed time is at least 717.8 ms, and not far above it
        // when little of the link sits idle.
        let w = Workload::select(&crate::workload::default_dir(), &["resnet50".into()])
            .unwrap()
            .remove(0);
        let link = model_link(1.0);
        let m = sim::simulate_workload(
            &w,
            0.1,
            Route::Hierarchical.model_ranks(2, 4),
            &link,
            &Schedule::fasthorovod(4),
            &Overheads::default(),
        );
        let exposed_ms = (m.step_s - 0.1) * 1e3;
        assert!(
            (717.0..717.8 * 1.2).contains(&exposed_ms),
            "{exposed_ms} ms"
        );
        assert!(model_schedule("fasthorovod-torch").is_some());
        assert!(model_schedule("ddp-gloo").is_none());
        assert_eq!(
            model_schedule("fasthorovod K=2 -bp").map(|s| s.label()),
            Some("fasthorovod K=2 -bp".to_string())
        );
    }
}
