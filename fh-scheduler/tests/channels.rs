//! Channel assignment across rounds, partitioned tensors, and the per-channel counters.

mod common;

use common::{run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, Config, ReduceOp, Tensor};

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

#[test]
fn load_is_carried_across_rounds_and_counted_per_channel() {
    // 1 KiB tensors: none rides in the negotiation round, every one is a group.
    let cfg = Config::default()
        .channels(4)
        .eager_bytes(0)
        .record_groups(true);
    let out = run_world(2, cfg, |e, r| {
        // One tensor per round (each waits for the previous): with the load restarting at
        // zero in every round, every group would land on channel 0.
        for i in 0..20 {
            let t = e
                .allreduce("t", Tensor::from_slice(&[r as f32 + i as f32; 256]), sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap();
            assert_eq!(t.to_vec::<f32>().unwrap()[0], 1.0 + 2.0 * i as f32);
        }
        (e.stats(), e.group_log())
    });
    for (stats, log) in &out {
        assert_eq!(
            log, &out[0].1,
            "the same groups on the same channels on every rank"
        );
        assert_eq!(stats.channels.len(), 4);
        let bytes: u64 = stats.channels.iter().map(|c| c.bytes).sum();
        assert_eq!(bytes, stats.data_bytes);
        let groups: u64 = stats.channels.iter().map(|c| c.groups).sum();
        assert_eq!(groups, stats.fused_groups);
        for (c, ch) in stats.channels.iter().enumerate() {
            assert_eq!(ch.groups, 5, "channel {c}: {:?}", stats.channels);
            assert_eq!(ch.bytes, 5 * 1024);
        }
        let shares = stats.channel_shares();
        assert!(
            shares.iter().all(|&s| (s - 0.25).abs() < 1e-9),
            "{shares:?}"
        );
    }
}

#[test]
fn a_large_tensor_is_shared_by_every_channel_and_reduced_correctly() {
    let cfg = Config::default()
        .channels(4)
        .partition_bytes(1000)
        .record_groups(true);
    let out = run_world(3, cfg, |e, r| {
        // 2501 f32 = 10004 bytes over a 1000-byte partition: 11 chunks rounded up to 12, an
        // equal share per channel; the length does not divide evenly.
        let x: Vec<f32> = (0..2501).map(|i| (i * (r + 1)) as f32).collect();
        let got = e
            .allreduce("big", Tensor::from_slice(&x), sum())
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let avg = e
            .allreduce("avg", Tensor::from_slice(&x), AllreduceOptions::default())
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        (got, avg, e.group_log(), e.stats())
    });
    for (got, avg, log, stats) in &out {
        let want: Vec<f32> = (0..2501).map(|i| (i * 6) as f32).collect();
        assert_eq!(got, &want);
        let want: Vec<f32> = (0..2501).map(|i| (i * 2) as f32).collect();
        assert_eq!(avg, &want);
        let big: Vec<_> = log.iter().filter(|g| g.parts[0].0 == "big").collect();
        assert_eq!(big.len(), 12, "{log:?}");
        let mut per_channel = [0u64; 4];
        for g in &big {
            per_channel[g.channel] += g.parts[0].2;
        }
        assert!(
            per_channel.iter().all(|&b| (2500..=2504).contains(&b)),
            "{per_channel:?}"
        );
        assert_eq!(stats.channels.len(), 4);
    }
}

/// A fused group staged through the fusion buffer in pieces (which cut tensors, and a
/// 100-byte piece that is no multiple of an f64) reduces, averages and scales every member
/// exactly as a whole group does, for every piece size, one channel or two.
#[test]
fn a_fused_group_staged_in_pieces_gives_the_whole_groups_result() {
    let n = 3;
    for (stage, channels) in [(0u64, 1usize), (100, 1), (24, 2), (4096, 2), (1 << 20, 1)] {
        let cfg = Config::default()
            .channels(channels)
            .fusion_threshold(1 << 20)
            .partition_bytes(1 << 20)
            .stage_bytes(stage)
            .record_groups(true);
        let out = run_world(n, cfg, move |e, r| {
            let lens = [7usize, 33, 50, 1, 129];
            let f64s: Vec<Tensor> = lens
                .iter()
                .map(|&len| {
                    Tensor::from_slice(&(0..len).map(|i| (i * (r + 1)) as f64).collect::<Vec<_>>())
                })
                .collect();
            let avg = AllreduceOptions::with_op(ReduceOp::Average)
                .prescale(2.0)
                .postscale(0.5);
            let got64 = e
                .grouped_allreduce("staged.f64", f64s, avg)
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap();
            let f32s: Vec<Tensor> = lens
                .iter()
                .map(|&len| Tensor::from_slice(&vec![r as f32 + 1.0; len]))
                .collect();
            let got32 = e
                .grouped_allreduce("staged.f32", f32s, sum().postscale(0.25))
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap();
            (got64, got32, e.group_log())
        });
        for (rank, (got64, got32, log)) in out.iter().enumerate() {
            assert_eq!(
                log, &out[0].2,
                "stage {stage}: the same groups on every rank"
            );
            assert!(
                log.iter().any(|g| g.parts.len() > 1),
                "stage {stage}: the members fused: {log:?}"
            );
            let lens = [7usize, 33, 50, 1, 129];
            for (t, &len) in got64.iter().zip(&lens) {
                // Average of i·(r+1) over r = 0..3, prescaled by 2 and postscaled by 0.5: 2i.
                let want: Vec<f64> = (0..len).map(|i| 2.0 * i as f64).collect();
                assert_eq!(
                    t.to_vec::<f64>().unwrap(),
                    want,
                    "stage {stage}, rank {rank}"
                );
            }
            for (t, &len) in got32.iter().zip(&lens) {
                // (1 + 2 + 3) × 0.25.
                assert_eq!(
                    t.to_vec::<f32>().unwrap(),
                    vec![1.5f32; len],
                    "stage {stage}, rank {rank}"
                );
            }
        }
    }
}

/// Staging takes effect on one host only, and only under `fasthorovod`; the value in effect
/// is what the ranks agree on at start-up.
#[test]
fn staging_applies_on_one_host_under_fasthorovod() {
    use fh_scheduler::Preset;
    let c = Config::default().stage_bytes(4096);
    assert_eq!(c.effective_stage_bytes(1), 4096);
    assert_eq!(
        c.effective_stage_bytes(2),
        0,
        "across hosts groups go whole"
    );
    assert_eq!(Config::preset(Preset::Horovod).effective_stage_bytes(1), 0);
    assert_eq!(
        Config::preset(Preset::Horovod)
            .stage_bytes(4096)
            .effective_stage_bytes(1),
        0,
        "horovod packs whole groups"
    );
}
