use super::host::civil_utc;
use super::replay::{add_ratios, repeated_row};
use super::sweep::aggregate_collectives;
use super::*;
use crate::collectives::Case;
use crate::runner::RankOutput;

#[test]
fn civil_dates() {
    assert_eq!(civil_utc(0), (1970, 1, 1, 0, 0, 0));
    assert_eq!(civil_utc(951_782_400), (2000, 2, 29, 0, 0, 0));
    assert_eq!(civil_utc(1_700_000_000), (2023, 11, 14, 22, 13, 20));
}

#[test]
fn a_peer_result_becomes_a_replay_row() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
    let w = Workload::load(&dir.join("resnet50.json")).unwrap();
    let line = r#"{"peer": "ddp-gloo", "workload": "resnet50", "np": 4, "backward_ms": 100.0, "warmup": 1, "steps": 3, "step_seconds": [0.25, 0.2, 0.3], "tensors": 161, "bytes": 102228128, "version": "torch 2.15.0", "checked": true}"#;
    let r = torch_peer::parse_output(&format!("warning\n{line}\n")).unwrap();
    let row = repeated_row(&w, "ddp-gloo", "gloo", r.np, 100.0, &[Some(r.step_seconds)]).unwrap();
    assert_eq!(row.schedule, "ddp-gloo");
    assert_eq!(row.config_label(), "ddp-gloo (gloo)");
    assert_eq!((row.repeats, row.exposed_per_repeat.len()), (1, 1));
    assert_eq!((row.np, row.tensors), (4, w.tensors.len()));
    assert_eq!(row.step.unit, "ms");
    assert!((row.step.median - 250.0).abs() < 1e-9, "{row:?}");
    assert!((row.step.min - 200.0).abs() < 1e-9 && (row.step.max - 300.0).abs() < 1e-9);
    assert!((row.exposed.median - 150.0).abs() < 1e-9, "{row:?}");
    assert!((row.throughput.median - 4.0).abs() < 1e-9, "{row:?}");
}

#[test]
fn repeats_pool_steps_and_ratios_pair_rounds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
    let w = Workload::load(&dir.join("resnet50.json")).unwrap();
    // Failed repeats are left out of the figures; none at all gives no row.
    assert!(repeated_row(&w, "x", "tcp", 4, 100.0, &[None, None]).is_none());
    let fh = [
        Some(vec![0.11, 0.13, 0.12]),
        None,
        Some(vec![0.14, 0.12, 0.13]),
    ];
    let row = repeated_row(&w, "fasthorovod-torch", "shm", 4, 100.0, &fh).unwrap();
    assert_eq!((row.repeats, row.step.n), (2, 6));
    assert!((row.exposed_per_repeat[0] - 20.0).abs() < 1e-9, "{row:?}");
    assert!((row.exposed_per_repeat[1] - 30.0).abs() < 1e-9, "{row:?}");
    assert!((row.exposed.min - 10.0).abs() < 1e-9 && (row.exposed.max - 40.0).abs() < 1e-9);
    let ddp = [Some(vec![0.2]), Some(vec![0.3]), Some(vec![0.15])];
    let ddp_row = repeated_row(&w, "ddp-gloo", "gloo", 4, 100.0, &ddp).unwrap();
    let hv = [Some(vec![0.2]), Some(vec![0.2]), Some(vec![0.2])];
    let hv_row = repeated_row(&w, "horovod", "shm", 4, 100.0, &hv).unwrap();
    let mut rows = vec![hv_row, row, ddp_row];
    let per_repeat = vec![
        vec![Some(100.0), Some(100.0), Some(100.0)],
        vec![Some(20.0), None, Some(30.0)],
        vec![Some(100.0), Some(200.0), Some(50.0)],
    ];
    add_ratios(&mut rows, &per_repeat);
    // Rounds 1 and 3 pair up (round 2 failed): 20/100 and 30/50.
    let vs = rows[1].exposed_vs_ddp.clone().unwrap();
    assert_eq!(vs.n, 2);
    assert!(
        (vs.min - 0.2).abs() < 1e-9 && (vs.max - 0.6).abs() < 1e-9,
        "{vs:?}"
    );
    assert!(rows[1].exposed_vs_horovod_torch.is_none());
    assert_eq!(rows[2].exposed_vs_ddp.as_ref().map(|q| q.median), Some(1.0));
    // The horovod preset over the same transport is the base of the old ratios.
    let r = rows[1].exposed_ratio_to_horovod.unwrap();
    assert!((r - rows[1].exposed.median / 100.0).abs() < 1e-9, "{r}");
}

#[test]
fn ddp_on_the_fasthorovod_backend_pairs_with_distributed_optimizer_over_its_transport() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
    let w = Workload::load(&dir.join("resnet50.json")).unwrap();
    let row = |label: &str, t: &str| {
        repeated_row(&w, label, t, 4, 100.0, &[Some(vec![0.2]), Some(vec![0.2])]).unwrap()
    };
    let mut rows = vec![
        row("fasthorovod-torch", "shm"),
        row("fasthorovod-torch", "tcp"),
        row("ddp-fasthorovod", "shm"),
        row("ddp-fasthorovod", "tcp"),
        row("ddp-gloo", "gloo"),
    ];
    let per_repeat = vec![
        vec![Some(10.0), Some(20.0)],
        vec![Some(40.0), Some(40.0)],
        vec![Some(30.0), Some(20.0)],
        vec![Some(20.0), Some(80.0)],
        vec![Some(100.0), Some(100.0)],
    ];
    add_ratios(&mut rows, &per_repeat);
    // shm: 30/10 and 20/20; tcp: 20/40 and 80/40 — each against its own transport's row.
    let shm = rows[2].exposed_vs_fasthorovod_torch.clone().unwrap();
    assert!(
        (shm.min - 1.0).abs() < 1e-9 && (shm.max - 3.0).abs() < 1e-9,
        "{shm:?}"
    );
    let tcp = rows[3].exposed_vs_fasthorovod_torch.clone().unwrap();
    assert!(
        (tcp.min - 0.5).abs() < 1e-9 && (tcp.max - 2.0).abs() < 1e-9,
        "{tcp:?}"
    );
    assert_eq!(rows[2].exposed_vs_ddp.as_ref().map(|q| q.n), Some(2));
    assert!(
        rows[4].exposed_vs_fasthorovod_torch.is_none(),
        "no fasthorovod-torch over gloo"
    );
}

#[test]
fn aggregation_takes_the_slowest_rank() {
    use crate::collectives::CaseTimes;
    let case = |secs: Vec<f64>| CaseTimes {
        case: Case {
            collective: Collective::Allreduce,
            bytes: 1000,
        },
        bytes: 1000,
        seconds: secs,
    };
    let outs = vec![
        RankOutput::Collectives(vec![case(vec![1e-3, 4e-3])]),
        RankOutput::Collectives(vec![case(vec![2e-3, 3e-3])]),
    ];
    let rows = aggregate_collectives("tcp", 2, &outs);
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].time.min, rows[0].time.max), (2000.0, 4000.0));
    // 1000 B in 2 ms = 0.5 MB/s... = 0.0005 GB/s; bus factor 1 on 2 ranks.
    assert!((rows[0].busbw.max - 0.0005).abs() < 1e-12);
}

#[test]
fn concurrent_allreduces_aggregate_the_slowest_rank_and_calibrate_the_model() {
    use crate::collectives::StreamTimes;
    use crate::record::{Host, RunConfig, RunRecord, SCHEMA};
    use crate::stats::Quantity;
    let times = |k: usize, secs: Vec<f64>| StreamTimes {
        streams: k,
        bytes: 1_000_000,
        stage: None,
        seconds: secs,
    };
    let outs = vec![
        RankOutput::Streams(vec![times(1, vec![1e-3, 1e-3]), times(2, vec![4e-3, 3e-3])]),
        RankOutput::Streams(vec![times(1, vec![2e-3, 1e-3]), times(2, vec![2e-3, 5e-3])]),
    ];
    let rows = sweep::aggregate_streams("shm", 2, &outs);
    assert_eq!(rows.len(), 2);
    // One: the slowest rank 2 ms and 1 ms; 1 MB each: 0.5 and 1 GB/s.
    assert_eq!((rows[0].time.min, rows[0].time.max), (1.0, 2.0));
    assert!((rows[0].aggregate_algbw.max - 1.0).abs() < 1e-12);
    // Two at once: 4 ms and 5 ms for 2 MB: 0.5 and 0.4 GB/s.
    assert_eq!((rows[1].time.min, rows[1].time.max), (4.0, 5.0));
    assert!((rows[1].aggregate_algbw.min - 0.4).abs() < 1e-12);

    // The model's concurrency factor: the medians' ratio, 0.45 / 0.75.
    let sweep_row =
        |bytes: usize, s: f64| sweep::coll_row("shm", Collective::Allreduce, 2, bytes, &[s]);
    let record = RunRecord {
        schema: SCHEMA,
        tool: "test".into(),
        started_utc: String::new(),
        git_revision: String::new(),
        host: Host {
            hostname: "h".into(),
            cpus: 2,
            os: "linux".into(),
            steal_percent: None,
            load_average: None,
            copy_gbps: None,
            copy_gbps_shared: None,
            copy_gbps_staged: None,
        },
        config: RunConfig {
            quick: true,
            np: 2,
            launcher: "local".into(),
            hosts: None,
            suites: vec![],
            sizes: vec![],
            repeats: 2,
            backward_ms: 100.0,
            steps: 1,
            replay_repeats: 1,
            workloads_dir: String::new(),
            workloads: vec![],
            tensor_counts: vec![],
        },
        collectives: vec![
            sweep_row(1 << 10, 1e-5),
            sweep_row(1 << 20, 1e-3),
            sweep_row(16 << 20, 1.6e-2),
        ],
        streams: rows,
        replay: vec![],
        replay_allreduce: vec![],
        negotiation: vec![],
        simulation: None,
        across: None,
        skipped: vec![],
        wall: Quantity::exact(0.0, "s"),
    };
    let (links, _, notes) = crate::simulate::calibrate(&record, "a test");
    let (shm, _) = links
        .iter()
        .find(|(l, _)| l.name == "measured shm loopback")
        .expect("a shm link");
    assert_eq!(shm.concurrency.len(), 1);
    assert_eq!(
        (shm.concurrency[0].streams, shm.concurrency[0].bytes),
        (2, 1_000_000)
    );
    assert!(
        (shm.concurrency[0].factor - 0.45 / 0.75).abs() < 1e-9,
        "{shm:?}"
    );
    assert!(
        shm.host_bound,
        "shared memory moves data with the host's copies"
    );
    assert!(
        notes.iter().any(|n| n.contains("0.60 with 2 of")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("shm allreduce sweep (3 sizes)")),
        "{notes:?}"
    );

    // Allreduces measured between the replay's rounds, at two sizes, take the sweep's place:
    // 1 MB in 2 ms instead of 1 MiB in 1 ms: about half the fitted bandwidth.
    let mut between = record.clone();
    let fitted = |r: &RunRecord| {
        let (links, _, notes) = crate::simulate::calibrate(r, "a test");
        let shm = links
            .into_iter()
            .find(|(l, _)| l.name == "measured shm loopback")
            .expect("a shm link")
            .0;
        (shm, notes)
    };
    between.replay_allreduce = vec![sweep_row(1 << 10, 1e-5), sweep_row(1_000_000, 2e-3)];
    let (sweep_link, _) = fitted(&record);
    let (shm, notes) = fitted(&between);
    assert!(
        (shm.bandwidth_bps - sweep_link.bandwidth_bps / 2.0).abs() < 0.05 * shm.bandwidth_bps,
        "{shm:?} vs {sweep_link:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("shm allreduces measured between the replay's rounds")),
        "{notes:?}"
    );
    // One size between the rounds cannot fit a line: the sweep's stand.
    between.replay_allreduce.truncate(1);
    assert_eq!(fitted(&between).0, sweep_link);
}

#[test]
fn shared_copy_rate_is_measured_per_thread() {
    assert_eq!(super::host::measure_shared_copy_gbps(0), None);
    let g = super::host::measure_shared_copy_gbps(2).expect("two threads copy");
    assert!(g.is_finite() && g > 0.0, "{g}");
    assert_eq!(super::host::measure_staged_copy_gbps(0, 1 << 20), None);
    // A stage that does not divide 64 MiB: the last piece is short.
    let g = super::host::measure_staged_copy_gbps(2, 3 << 20).expect("two threads stage");
    assert!(g.is_finite() && g > 0.0, "{g}");
}

#[test]
fn the_copy_measurement_packs_and_unpacks_every_byte_once() {
    use super::host::fusion_round_trip;
    // Tensors of odd lengths, pieces that straddle them: every element goes through the
    // buffer and comes back divided by 4 and scaled by 4 (unchanged), whatever the piece.
    for piece in [4, 12, 1000, 1 << 20] {
        let mut tensors: Vec<Vec<u8>> = [3usize, 250, 1, 77]
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                (0..n)
                    .flat_map(|i| ((t * 1000 + i) as f32).to_ne_bytes())
                    .collect()
            })
            .collect();
        let want = tensors.clone();
        let mut buf = vec![0u8; 4096];
        assert_eq!(fusion_round_trip(&mut tensors, &mut buf, piece), 331 * 4);
        assert_eq!(tensors, want, "piece {piece}");
        // The buffer saw the last piece's bytes: packing happened.
        let last = *want[3].last().unwrap();
        let tail = 331 * 4 % piece.min(4096);
        let end = if tail == 0 { piece.min(4096) } else { tail };
        assert_eq!(buf[end - 1], last, "piece {piece}");
    }
}

#[test]
fn small_concurrent_allreduces_are_repeated_more() {
    use sweep::{stream_repeats, STREAM_REPEATS};
    assert_eq!(stream_repeats(1, 16 << 20), STREAM_REPEATS);
    assert_eq!(stream_repeats(1, 64 << 20), STREAM_REPEATS);
    assert_eq!(stream_repeats(1, 4 << 20), 4 * STREAM_REPEATS);
    assert_eq!(stream_repeats(1, 1 << 20), 100);
    assert_eq!(stream_repeats(1, 0), 100);
    assert_eq!(stream_repeats(200, 1 << 20), 200, "never fewer than asked");
}
