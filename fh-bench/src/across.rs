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
//! ring among hosts) and N for a flat ring (each rank's ring traffic crosses one link). It is
//! calibrated from the caller's probe and this run's host copy rate, never fitted to the rows:
//! under a per-flow cap (one stream's measured rate below the link's) an allreduce reaches at
//! most its connections' streams ([`row_link`]: one connection per lane for hierarchical
//! allreduce, each striped over the S the row's runtime reported, [`row_streams`]); a
//! hierarchical row adds its shared-memory passes ([`hier_local_passes`]) at the copy rate,
//! of which a pipelined row ([`hier_pipeline_chunk`]) exposes one chunk's.
//! The transport's CPU cost per byte (TCP, and the emulation's own packet handling) is not
//! modelled. DDP and Horovod rows have no model.
//!
//! The lines are part of the run's record: their types ([`Across`], [`AcrossRow`], [`Route`])
//! live in [`crate::record`].

use crate::record::{transport_env, Across, AcrossRow, Route, RunRecord};
use crate::sim::{self, Flows, Link, Overheads, Schedule};
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

/// Passes over a group at the host's copy rate that hierarchical allreduce adds within a host
/// (fh-transport's `compose::hier`, lanes) with `per_host` ranks on each host, each rank
/// working where its buffer lies: the shared-memory reduce-scatter copies the parts of the
/// vector that other ranks reduce into its slots and reduces its own block from theirs, the
/// allgather publishes its block and copies the others' in, each a share (L−1)/L of the
/// vector: 4(L−1)/L. With `FH_HIER_STAGED=1` (the engine packs the group, the block goes
/// through a buffer of its own) 3 passes.
pub fn hier_local_passes(per_host: usize, staged: bool) -> f64 {
    if staged {
        return 3.0;
    }
    let l = per_host.max(1) as f64;
    4.0 * (l - 1.0) / l
}

/// The chunk a hierarchical row's allreduce is pipelined in (its shared-memory phases overlap
/// the transfer across hosts but for one chunk's), from the row's transport (`hier-serial`,
/// `hier@FH_HIER_PIPELINE=…`) read by the runtime's own parser; `None`: not pipelined.
pub fn hier_pipeline_chunk(transport: &str) -> Option<usize> {
    let var = transport_env(transport).1;
    let chunk = fh_transport::backend::tcp::settings::StreamSettings::from_lookup(|k| {
        var.filter(|(v, _)| *v == k)
            .map(|(_, value)| value.to_string())
    })
    .pipeline_chunk;
    (chunk > 0).then_some(chunk)
}

/// The streams a row's runtime uses to each peer on another host: the count its transport
/// reported (the median over the runs), else the count the runtime's rule would choose from
/// the probe's rates ([`fh_transport::backend::tcp::streams::choose`], as `FH_TCP_STREAMS=auto`
/// does at start-up), else 1. With whether it was reported.
pub fn row_streams(row: &crate::record::ReplayRow, probe: &Probe) -> (usize, bool) {
    let mut s: Vec<usize> = row.tcp_streams.iter().map(|t| t.streams).collect();
    if !s.is_empty() {
        s.sort_unstable();
        return (s[s.len() / 2], true);
    }
    let chosen = match probe.flow_gbps {
        Some(f) => fh_transport::backend::tcp::streams::choose(f, probe.link_gbps),
        None => 1,
    };
    (chosen, false)
}

/// What the caller measured across a host's link: the link's rate (the best of 1 and many
/// parallel TCP streams) and one stream's (the per-flow cap where one binds), Gbit/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    /// The link's rate, Gbit/s.
    pub link_gbps: f64,
    /// One TCP stream's rate, Gbit/s (`None`: not measured; the model then assumes one
    /// transfer reaches the link).
    pub flow_gbps: Option<f64>,
}

/// The model's link for a row over `transport` on `route` with `per_host` ranks per host and
/// `streams` streams per peer connection: the probe's link rate; under a per-flow cap (the
/// probe's one-stream rate below the link's) each transfer reaches at most its connections'
/// flows (one per lane for hierarchical allreduce, each striped over `streams`;
/// [`Link::transfer_cap`]); and for hierarchical allreduce the passes within a host
/// ([`hier_local_passes`]), of which only one pipeline chunk's stay outside the transfer
/// ([`hier_pipeline_chunk`]).
pub fn row_link(
    probe: &Probe,
    transport: &str,
    route: Route,
    per_host: usize,
    streams: usize,
) -> Link {
    let mut l = model_link(probe.link_gbps);
    let hier = route == Route::Hierarchical && per_host > 1;
    l.flows = probe.flow_gbps.map(|f| Flows {
        flow_bps: f * 1e9 / 8.0,
        streams: streams.max(1),
        lanes: if hier { per_host } else { 1 },
        stripe_min: fh_transport::backend::tcp::settings::DEFAULT_STRIPE_MIN,
    });
    if hier {
        let staged = transport_env(transport).1 == Some(("FH_HIER_STAGED", "1"));
        l.local_passes = hier_local_passes(per_host, staged);
        l.local_chunk = if staged {
            None
        } else {
            hier_pipeline_chunk(transport)
        };
        // Its channels' tiny allreduces are collectives of shared memory and TCP: the
        // negotiation thread's one-byte agreement stays a step of its own.
        l.agrees_in_band = false;
        // As the engine decides it (`Communicator::segments_in_place`): a staged hierarchical
        // world does not reduce fused groups where they lie; the engine packs them.
        if staged {
            l.vectored_io = false;
        }
    }
    l
}

/// The model's schedule of a replay row: the engine's preset of that label, the shipped
/// preset for the `fasthorovod.torch` peer (with the channels its engine opens with
/// `per_host` ranks on each host, all on this machine's cores), None for the other peers.
fn model_schedule(label: &str, per_host: usize) -> Option<Schedule> {
    if label == "fasthorovod-torch" {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let k = fh_scheduler::Config::default().channels_for(cores, per_host);
        return Some(Schedule::fasthorovod(k));
    }
    crate::simulate::replayed_schedules()
        .into_iter()
        .find(|s| s.label() == label)
}

/// The lines of every replay row of `record` across `hosts` (`h0:2,h1:2`) on the link the
/// caller measured; `copy_gbps`: the rate of a rank's host copies while every rank copies
/// (GB/s per pass; `None`: copies taken as free). Where this machine has fewer cores than the
/// job has ranks (emulated hosts all run here) the copies in progress on a rank's channels
/// share that rate ([`Overheads::shared_host`]).
pub fn rows(
    record: &RunRecord,
    workloads: &[Workload],
    hosts: &str,
    probe: Probe,
    copy_gbps: Option<f64>,
) -> Option<Across> {
    let (h, n) = layout(hosts)?;
    let per_host = n / h.max(1);
    let rate_bytes = probe.link_gbps * 1e9 / 8.0;
    let overheads = Overheads {
        copy_bps: copy_gbps.filter(|g| *g > 0.0).map(|g| g * 1e9),
        // Fewer cores here than ranks in the job (emulated hosts all run on this machine):
        // a rank's channels copying at once share its copy rate.
        shared_host: record.host.cpus < n,
        ..Overheads::default()
    };
    let mut out = Vec::new();
    for r in &record.replay {
        let route = Route::of(&r.transport, per_host);
        let bytes_across = route.fraction(h, n) * r.bytes as f64;
        let backward_ms = r.backward.median;
        let bound_ms = (bytes_across / rate_bytes * 1e3 - backward_ms).max(0.0);
        let (streams, reported) = row_streams(r, &probe);
        let link = row_link(&probe, &r.transport, route, per_host, streams);
        let model_exposed_ms = workloads
            .iter()
            .find(|w| w.model == r.workload)
            .zip(model_schedule(&r.schedule, per_host))
            .map(|(w, s)| {
                let b = backward_ms / 1e3;
                let p = route.model_ranks(h, n);
                let m = sim::simulate_workload(w, b, p, &link, &s, &overheads);
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
            tcp_streams: r.tcp_streams.clone(),
            model_streams: Some(streams).filter(|_| probe.flow_gbps.is_some()),
            streams_reported: reported,
        });
    }
    Some(Across {
        hosts: h,
        ranks: n,
        layout: hosts.to_string(),
        link_gbps: probe.link_gbps,
        flow_gbps: probe.flow_gbps,
        copy_gbps,
        rows: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hierarchical_rows_model_the_runtimes_passes_and_pipeline() {
        // In place: 4(L−1)/L passes (2 for two ranks a host); staged: 3.
        assert_eq!(hier_local_passes(2, false), 2.0);
        assert_eq!(hier_local_passes(4, false), 3.0);
        assert_eq!(hier_local_passes(1, false), 0.0);
        assert_eq!(hier_local_passes(2, true), 3.0);
        // The pipeline chunk as the runtime reads its variable.
        let default = fh_transport::backend::tcp::settings::DEFAULT_PIPELINE_CHUNK;
        assert_eq!(hier_pipeline_chunk("hier"), Some(default));
        assert_eq!(hier_pipeline_chunk("hier-serial"), None);
        assert_eq!(
            hier_pipeline_chunk("hier@FH_HIER_PIPELINE=1M"),
            Some(1 << 20)
        );
        assert_eq!(hier_pipeline_chunk("hier@FH_HIER_PIPELINE=off"), None);
        let probe = Probe {
            link_gbps: 4.0,
            flow_gbps: None,
        };
        let l = row_link(&probe, "hier", Route::Hierarchical, 2, 1);
        assert_eq!((l.local_passes, l.local_chunk), (2.0, Some(default)));
        assert!(l.vectored_io);
        let l = row_link(&probe, "hier@FH_HIER_STAGED=1", Route::Hierarchical, 2, 1);
        assert_eq!(
            (l.local_passes, l.local_chunk, l.vectored_io),
            (3.0, None, false)
        );
        let l = row_link(&probe, "tcp", Route::FlatRing, 2, 1);
        assert_eq!((l.local_passes, l.local_chunk), (0.0, None));
    }

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
        for t in ["tcp", "gloo", "mpi", "mpi-busy"] {
            assert_eq!(Route::of(t, 2), Route::FlatRing, "{t}");
        }
    }

    #[test]
    fn the_stream_choice_and_the_per_flow_model_reach_the_report() {
        use crate::record::TcpStreams;
        let mut r: RunRecord =
            serde_json::from_str(include_str!("../tests/data/recorded-run.json")).unwrap();
        let mut base = r
            .replay
            .iter()
            .find(|x| x.schedule == "fasthorovod K=4")
            .unwrap()
            .clone();
        // One channel: one group in flight at a time (K channels would each drive flows of
        // their own).
        base.schedule = "fasthorovod K=1".into();
        let auto = TcpStreams {
            streams: 4,
            setting: "auto".into(),
            one_stream_gbps: Some(0.48),
            many_streams_gbps: Some(1.91),
            probe_streams: Some(8),
        };
        let set = TcpStreams {
            streams: 1,
            setting: "1".into(),
            one_stream_gbps: None,
            many_streams_gbps: None,
            probe_streams: None,
        };
        let row = |transport: &str, streams: Vec<TcpStreams>| {
            let mut x = base.clone();
            x.transport = transport.into();
            x.tcp_streams = streams;
            x
        };
        r.replay = vec![
            row("hier", vec![auto.clone(); 3]),
            row("tcp", vec![set.clone()]),
            row("tcp", vec![]),
        ];
        let w = Workload::select(&crate::workload::default_dir(), &["resnet50".into()]).unwrap();
        let probe = Probe {
            link_gbps: 1.91,
            flow_gbps: Some(0.48),
        };
        let a = rows(&r, &w, "h0:2,h1:2", probe, Some(2.0)).unwrap();
        assert_eq!(a.flow_gbps, Some(0.48));
        assert_eq!(a.rows[0].tcp_streams, vec![auto; 3]);
        assert_eq!(
            (a.rows[0].model_streams, a.rows[0].streams_reported),
            (Some(4), true)
        );
        assert_eq!(
            (a.rows[1].model_streams, a.rows[1].streams_reported),
            (Some(1), true)
        );
        // No choice reported: the runtime's rule on the probe's rates (1.91 / 0.48 → 4).
        assert_eq!(
            (a.rows[2].model_streams, a.rows[2].streams_reported),
            (Some(4), false)
        );
        // One stream per connection under a per-flow cap of a quarter of the link: the model
        // moves the flat ring's 1.5 × 102.2 MB at one flow's rate (2.56 s, less the backward),
        // four streams at the link's.
        let one = a.rows[1].model_exposed_ms.unwrap();
        let four = a.rows[2].model_exposed_ms.unwrap();
        assert!((2455.0..2455.0 * 1.25).contains(&one), "{one} ms");
        assert!(one > 3.0 * four, "{one} vs {four}");
        // The report shows every row's choice (and which the model only assumed).
        r.across = Some(a);
        let md = crate::report::markdown(&r, &[], &[]);
        for want in [
            "| S=4 auto (1: 0.48, 8: 1.91 Gbit/s) |",
            "| S=1 set |",
            "| S=4* |",
            "one TCP stream across it at 0.480 Gbit/s",
        ] {
            assert!(md.contains(want), "{want} missing: {md}");
        }
        // Runs that chose differently are each shown.
        assert_eq!(
            TcpStreams::summary(std::slice::from_ref(&set)).as_deref(),
            Some("S=1 set")
        );
        let mut five = set.clone();
        five.streams = 5;
        assert_eq!(
            TcpStreams::summary(&[set, five]).as_deref(),
            Some("S=1/5 1")
        );
        assert_eq!(TcpStreams::summary(&[]), None);
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
        assert!(model_schedule("fasthorovod-torch", 2).is_some());
        assert!(model_schedule("ddp-gloo", 2).is_none());
        assert_eq!(
            model_schedule("fasthorovod K=2 -bp", 2).map(|s| s.label()),
            Some("fasthorovod K=2 -bp".to_string())
        );
    }
}
