use super::*;
use proptest::prelude::*;

fn key(dtype: DType, op: ReduceOp, kind: CollectiveKind) -> FusionKey {
    FusionKey {
        kind,
        dtype,
        op,
        device: Device::Cpu,
        prescale: 1f64.to_bits(),
        postscale: 1f64.to_bits(),
    }
}

/// An f32 sum allreduce of `bytes`, not in a group.
fn f32_item(bytes: u64) -> PlanItem {
    PlanItem {
        key: key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce),
        bytes,
        elem: 4,
        priority: 0,
        group: None,
    }
}

/// `fasthorovod` on 4 channels, 1 MiB fusion threshold, partitions of `partition_bytes`.
fn fast4(partition_bytes: u64) -> PlanOptions {
    PlanOptions {
        mode: PlanMode::Fast,
        fusion_threshold: 1 << 20,
        partition_bytes,
        channels: 4,
        by_priority: false,
    }
}

fn arb_item() -> impl Strategy<Value = PlanItem> {
    (0usize..3, 0usize..2, 0usize..4, 0u64..400, -3i64..3).prop_map(|(d, o, k, n, p)| {
        let dtype = [DType::F32, DType::F64, DType::I32][d];
        let op = [ReduceOp::Sum, ReduceOp::Average][o];
        let kind = [
            CollectiveKind::Allreduce,
            CollectiveKind::Allreduce,
            CollectiveKind::Allreduce,
            CollectiveKind::Broadcast,
        ][k];
        PlanItem {
            key: key(dtype, op, kind),
            bytes: n * dtype.size() as u64,
            elem: dtype.size() as u64,
            priority: p,
            group: None,
        }
    })
}

fn arb_opts() -> impl Strategy<Value = PlanOptions> {
    (
        any::<bool>(),
        1u64..2000,
        1u64..1000,
        1usize..5,
        any::<bool>(),
    )
        .prop_map(|(h, t, p, c, pr)| PlanOptions {
            mode: if h { PlanMode::Horovod } else { PlanMode::Fast },
            fusion_threshold: t,
            partition_bytes: p,
            channels: c,
            by_priority: pr,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn planner_invariants(
        items in proptest::collection::vec(arb_item(), 0..30),
        opts in arb_opts(),
        idle in any::<u8>(),
    ) {
        let idle = u64::from(idle);
        let on = |idle| plan_round_on(&items, &opts, &mut ChannelLoad::new(opts.channels), idle);
        let groups = on(idle);
        // Deterministic; no agreed idle channel means every channel.
        prop_assert_eq!(&groups, &on(idle));
        prop_assert_eq!(&on(0), &plan(&items, &opts));
        let eligible = eligible_channels(idle, opts.channels);
        prop_assert!(eligible != 0);
        // Every byte of every item covered exactly once, by contiguous ascending parts.
        let mut covered = vec![0u64; items.len()];
        let mut chunked = vec![0usize; items.len()];
        for g in &groups {
            prop_assert!(g.channel < opts.channels.max(1));
            prop_assert!(!g.parts.is_empty());
            let k = items[g.parts[0].item].key;
            for p in &g.parts {
                prop_assert_eq!(items[p.item].key, k, "group mixes keys");
                prop_assert_eq!(p.offset, covered[p.item], "parts out of order");
                prop_assert_eq!(p.len % items[p.item].elem, 0);
                covered[p.item] += p.len;
                chunked[p.item] += 1;
            }
            if g.parts.len() > 1 {
                prop_assert_eq!(k.kind, CollectiveKind::Allreduce);
                prop_assert!(g.bytes() <= opts.fusion_threshold, "cap exceeded");
            }
            if opts.mode == PlanMode::Horovod {
                prop_assert_eq!(g.channel, 0);
            } else if !matches!(g.parts.as_slice(), [p] if p.len < items[p.item].bytes) {
                // Fused or whole groups only on channels idle everywhere.
                prop_assert!(eligible & (1 << g.channel) != 0, "group on busy channel {}", g.channel);
            }
        }
        for (i, it) in items.iter().enumerate() {
            prop_assert_eq!(covered[i], it.bytes);
            prop_assert!(chunked[i] >= 1, "item {} missing", i);
            if chunked[i] > 1 {
                prop_assert_eq!(opts.mode, PlanMode::Fast);
                prop_assert!(it.bytes > opts.partition_bytes);
            }
        }
        // Order kept: in the effective order, the first part of each item appears no
        // earlier than that of the items before it that share its key.
        let mut eff: Vec<usize> = (0..items.len()).collect();
        if opts.by_priority { eff.sort_by_key(|&i| items[i].priority); }
        let rank_of: Vec<usize> = {
            let mut r = vec![0; items.len()];
            for (pos, &i) in eff.iter().enumerate() { r[i] = pos; }
            r
        };
        let mut first_pos = vec![usize::MAX; items.len()];
        let mut pos = 0;
        for g in &groups { for p in &g.parts { if first_pos[p.item] == usize::MAX { first_pos[p.item] = pos; } pos += 1; } }
        for a in 0..items.len() { for b in 0..items.len() {
            if items[a].key == items[b].key && rank_of[a] < rank_of[b] {
                prop_assert!(first_pos[a] < first_pos[b], "order of {} and {} not kept", a, b);
            }
        }}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The planner never fuses across devices: items alike in everything but their device
    /// (host, GPU 0, GPU 1) never share a group, in either mode, whatever the threshold.
    #[test]
    fn never_fuses_across_devices(
        items in proptest::collection::vec((arb_item(), 0u32..3), 0..30),
        opts in arb_opts(),
    ) {
        let items: Vec<PlanItem> = items
            .into_iter()
            .map(|(mut it, d)| {
                it.key.device = if d == 0 { Device::Cpu } else { Device::Gpu(d - 1) };
                it
            })
            .collect();
        for g in plan(&items, &opts) {
            let d = items[g.parts[0].item].key.device;
            for p in &g.parts {
                prop_assert_eq!(items[p.item].key.device, d, "group mixes devices");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Load carried across rounds: deterministic, and the channels never drift apart by
    /// more than the largest group (greedy least-loaded assignment).
    #[test]
    fn carried_load_balances_across_rounds(
        rounds in proptest::collection::vec(proptest::collection::vec(arb_item(), 0..12), 1..12),
        channels in 1usize..6,
        partition in 1u64..1000,
    ) {
        let opts = PlanOptions {
            mode: PlanMode::Fast,
            fusion_threshold: 1 << 20,
            partition_bytes: partition,
            channels,
            by_priority: false,
        };
        let mut a = ChannelLoad::new(channels);
        let mut b = ChannelLoad::new(channels);
        let mut largest = 0u64;
        let mut total = vec![0u64; channels];
        for items in &rounds {
            let ga = plan_round(items, &opts, &mut a);
            prop_assert_eq!(&ga, &plan_round(items, &opts, &mut b));
            for g in &ga {
                largest = largest.max(g.bytes().max(1));
                total[g.channel] += g.bytes().max(1);
            }
            prop_assert!(a.bytes().iter().all(|&l| l <= largest), "{:?} > {}", a.bytes(), largest);
        }
        let spread = total.iter().max().unwrap() - total.iter().min().unwrap();
        prop_assert!(spread <= largest, "{:?}", total);
    }

    /// A large tensor is cut into a multiple of the channel count of equal chunks.
    #[test]
    fn large_tensors_are_shared_by_every_channel(
        elems in 1u64..5000, partition in 1u64..2000, channels in 1usize..6,
    ) {
        let n = chunk_count(elems * 4, 4, partition, channels);
        prop_assert!(n >= 1 && n <= elems);
        if elems * 4 > partition && elems >= channels as u64 * (elems * 4).div_ceil(partition) {
            prop_assert_eq!(n % channels as u64, 0);
        }
    }
}

#[test]
fn pacing_defers_only_while_every_channel_is_busy_and_within_the_bound() {
    use std::time::Duration;
    let p = Pacing {
        enabled: true,
        min_bytes: 100,
        max_defer: Duration::from_millis(2),
    };
    let zero = Duration::ZERO;
    assert!(p.defer(4, 4, 100, zero));
    // One idle channel: start the round at once.
    assert!(!p.defer(3, 4, 1 << 40, zero));
    assert!(!p.defer(0, 0, 1 << 40, zero));
    // Below the byte floor, or past the bound.
    assert!(!p.defer(4, 4, 99, zero));
    assert!(!p.defer(4, 4, 1 << 40, Duration::from_millis(2)));
    assert!(Pacing { min_bytes: 0, ..p }.defer(1, 1, 0, zero));
    assert!(!Pacing {
        enabled: false,
        ..p
    }
    .defer(4, 4, u64::MAX, zero));
    assert!(!Pacing::OFF.defer(4, 4, u64::MAX, zero));
}

#[test]
fn new_work_goes_to_the_idle_channels_and_chunks_to_all() {
    let item = f32_item;
    let opts = fast4(1 << 16);
    // Channels 1 and 3 idle: 8 small tensors of 64 KiB fuse into 2 groups (one per idle
    // channel), not 4.
    let small = vec![item(64 << 10); 8];
    let g = plan_round_on(&small, &opts, &mut ChannelLoad::new(4), 0b1010);
    let chans: Vec<usize> = g.iter().map(|g| g.channel).collect();
    assert_eq!(chans, [1, 3]);
    assert!(g.iter().all(|g| g.bytes() == 256 << 10));
    // A partitioned tensor (4 chunks of 64 KiB) still spreads over every channel.
    let g = plan_round_on(&[item(256 << 10)], &opts, &mut ChannelLoad::new(4), 0b0010);
    let mut chans: Vec<usize> = g.iter().map(|g| g.channel).collect();
    chans.sort();
    assert_eq!(chans, [0, 1, 2, 3]);
    // Bits of channels that do not exist are ignored; none left means every channel.
    assert_eq!(eligible_channels(0b1_0000, 4), 0b1111);
    assert_eq!(eligible_channels(0, 2), 0b11);
    assert_eq!(eligible_channels(u64::MAX, 64), u64::MAX);
}

#[test]
fn only_a_small_single_host_group_runs_inline() {
    let part = |item, len| Part {
        item,
        offset: 0,
        len,
    };
    let one = vec![Group {
        channel: 1,
        parts: vec![part(0, 8), part(1, 8)],
    }];
    let host = |_| true;
    assert!(runs_inline(&one, 16, host));
    assert!(!runs_inline(&one, 15, host), "over the limit");
    assert!(!runs_inline(&one, 0, host), "off");
    assert!(!runs_inline(&one, 16, |i| i != 1), "a device tensor");
    let two = vec![one[0].clone(), one[0].clone()];
    assert!(!runs_inline(&two, 1 << 20, host), "two groups");
    assert!(!runs_inline(&[], 1 << 20, host), "nothing");
    // A barrier (no bytes) is small.
    let barrier = vec![Group {
        channel: 0,
        parts: vec![part(0, 0)],
    }];
    assert!(runs_inline(&barrier, 1, host));
}

#[test]
fn a_round_does_not_always_start_on_channel_0() {
    let one = [f32_item(400)];
    let opts = fast4(1 << 20);
    let mut load = ChannelLoad::new(4);
    let chans: Vec<usize> = (0..8)
        .map(|_| plan_round(&one, &opts, &mut load)[0].channel)
        .collect();
    assert_eq!(chans, [0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn horovod_looks_ahead_past_other_dtypes() {
    let f = key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce);
    let d = key(DType::F64, ReduceOp::Sum, CollectiveKind::Allreduce);
    let it = |key, bytes| PlanItem {
        key,
        ..f32_item(bytes)
    };
    let items = [it(f, 8), it(d, 8), it(f, 8)];
    let opts = PlanOptions {
        mode: PlanMode::Horovod,
        ..fast4(1)
    };
    let g = plan(&items, &opts);
    assert_eq!(g.len(), 2);
    assert_eq!(
        g[0].parts.iter().map(|p| p.item).collect::<Vec<_>>(),
        [0, 2]
    );
    assert_eq!(g[1].parts[0].item, 1);
}

#[test]
fn grouped_members_share_one_collective_when_they_fit() {
    let it = |group| PlanItem {
        group,
        ..f32_item(40_000)
    };
    // Without the group the 4-channel cap (total / 4, at least 64 KiB) would split them.
    let items = [
        it(None),
        it(Some(7)),
        it(None),
        it(Some(7)),
        it(Some(7)),
        it(None),
    ];
    let opts = fast4(1 << 20);
    let g = plan(&items, &opts);
    let grouped: Vec<&Group> = g
        .iter()
        .filter(|g| g.parts.iter().any(|p| items[p.item].group.is_some()))
        .collect();
    assert_eq!(grouped.len(), 1);
    assert_eq!(
        grouped[0].parts.iter().map(|p| p.item).collect::<Vec<_>>(),
        [1, 3, 4]
    );
    let total: usize = g.iter().map(|g| g.parts.len()).sum();
    assert_eq!(total, items.len());
}

#[test]
fn fast_splits_large_tensors_over_channels() {
    let items = [f32_item(400)];
    let opts = fast4(100);
    let g = plan(&items, &opts);
    assert_eq!(g.len(), 4);
    let mut chans: Vec<usize> = g.iter().map(|g| g.channel).collect();
    chans.sort();
    assert_eq!(chans, [0, 1, 2, 3]);
}

#[test]
fn the_small_tensors_beside_a_partitioned_one_are_shared_by_the_channels_too() {
    // BERT-base's last round in little: one tensor split into chunks over every channel and
    // a run of small ones. The small ones (4 × 64 KiB) must not become one group on one
    // channel because the chunks' bytes made the round look large: a group each for 2 of the
    // 4 channels at least, every channel's bytes within one small group of each other.
    let mut items = vec![f32_item(1 << 20)];
    items.extend(vec![f32_item(64 << 10); 4]);
    let mut opts = fast4(256 << 10);
    opts.fusion_threshold = 4 << 20;
    let g = plan(&items, &opts);
    let fused: Vec<&Group> = g.iter().filter(|g| g.parts[0].item != 0).collect();
    assert!(fused.len() >= 2, "{g:?}");
    let mut per = [0u64; 4];
    for x in &g {
        per[x.channel] += x.bytes();
    }
    let (lo, hi) = (per.iter().min().unwrap(), per.iter().max().unwrap());
    assert!(hi - lo <= 128 << 10, "unbalanced: {per:?}");
}
