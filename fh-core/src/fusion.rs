//! The fusion planner: turns a round's ready responses into fused groups assigned to channels.
//!
//! Pure and deterministic: the same input gives the same plan on every rank, which is what
//! lets the ranks run the groups on their channels without further agreement.

use crate::message::{CollectiveKind, Device, Response};
use crate::{DType, ReduceOp};

/// What must be equal for two tensors to share a fused buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusionKey {
    /// The collective.
    pub kind: CollectiveKind,
    /// Element type.
    pub dtype: DType,
    /// Reduce operator.
    pub op: ReduceOp,
    /// Device.
    pub device: Device,
    /// Prescale factor, as bits.
    pub prescale: u64,
    /// Postscale factor, as bits.
    pub postscale: u64,
}

/// One ready tensor as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanItem {
    /// Fusion compatibility.
    pub key: FusionKey,
    /// Size in bytes.
    pub bytes: u64,
    /// Element size in bytes (chunks are cut at element boundaries).
    pub elem: u64,
    /// Caller priority (lower first under [`PlanOptions::by_priority`]).
    pub priority: i64,
    /// Members of one grouped submission share an id; in fast mode they form one fused group
    /// of their own when they share a key and fit under the fusion threshold.
    pub group: Option<u32>,
}

impl PlanItem {
    /// The planner's view of a (successful) response.
    pub fn from_response(r: &Response) -> Self {
        PlanItem {
            key: FusionKey {
                kind: r.sig.kind,
                dtype: r.sig.dtype,
                op: r.sig.op,
                device: r.sig.device,
                prescale: r.sig.prescale.to_bits(),
                postscale: r.sig.postscale.to_bits(),
            },
            bytes: r.sig.bytes(),
            elem: r.sig.dtype.size() as u64,
            priority: r.priority,
            group: None,
        }
    }

    fn fusable(&self) -> bool {
        self.key.kind == CollectiveKind::Allreduce
    }
}

/// Which fusion rules to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanMode {
    /// FastHorovod: per-key open groups, large tensors split, groups spread over channels.
    Fast,
    /// Horovod 0.28: greedy from the front with bounded look-ahead, one channel, no splitting.
    Horovod,
}

/// Planner settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Fusion rules.
    pub mode: PlanMode,
    /// Most bytes in one fused group.
    pub fusion_threshold: u64,
    /// Allreduce tensors above this size are split into chunks of at most this size (fast mode).
    pub partition_bytes: u64,
    /// Number of channels (at least 1).
    pub channels: usize,
    /// Order by ascending priority (stable) before fusing.
    pub by_priority: bool,
}

/// A byte range of one input item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Index of the item in the planner's input.
    pub item: usize,
    /// Offset in bytes within the item.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A fused group: parts that go through one collective on one channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// The channel that runs it.
    pub channel: usize,
    /// The parts, in buffer order.
    pub parts: Vec<Part>,
}

impl Group {
    /// Total bytes of the group.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }
}

/// The bytes each channel has been given so far, carried from round to round so that
/// channel assignment balances over a whole step rather than restarting at channel 0 in every
/// round. It changes only through [`plan_round`], i.e. only as a function of the agreed rounds,
/// so every rank holds the same value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelLoad {
    bytes: Vec<u64>,
}

impl ChannelLoad {
    /// No load on `channels` channels (at least one).
    pub fn new(channels: usize) -> Self {
        ChannelLoad {
            bytes: vec![0; channels.max(1)],
        }
    }

    /// Bytes assigned to each channel, relative to the least loaded one.
    pub fn bytes(&self) -> &[u64] {
        &self.bytes
    }

    /// The least-loaded channel of `among` (bit `c` = channel `c`; lowest index on ties).
    fn pick(&self, among: u64) -> usize {
        self.bytes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i >= 64 || among & (1 << i) != 0)
            .min_by_key(|(i, l)| (**l, *i))
            .map_or(0, |(i, _)| i)
    }

    fn add(&mut self, channel: usize, bytes: u64) {
        if let Some(l) = self.bytes.get_mut(channel) {
            *l = l.saturating_add(bytes);
        }
        // Keep only the differences, so the counters never grow without bound.
        let min = self.bytes.iter().copied().min().unwrap_or(0);
        self.bytes.iter_mut().for_each(|l| *l -= min);
    }
}

/// The pacing policy (back-pressure), shared by the engine and the scale model: it decides
/// only *when* a rank enters its next negotiation round, never what a round decides.
///
/// A rank defers its next round while **every** channel still holds unfinished work (queued or
/// running) and together at least [`Pacing::min_bytes`], for at most [`Pacing::max_defer`].
/// While every channel is busy, a new round's groups could only queue behind that work, so
/// deferring costs nothing and lets more gradients fuse into the round: fewer, larger
/// collectives, which is what matters where each collective pays a large latency (many
/// ranks). As soon as one channel drains, the round starts, so an idle channel never waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// Whether back-pressure is on.
    pub enabled: bool,
    /// Defer only while the channels together hold at least this many unfinished bytes
    /// (0: any amount, as long as every channel is busy).
    pub min_bytes: u64,
    /// Never defer a round longer than this.
    pub max_defer: std::time::Duration,
}

impl Pacing {
    /// No back-pressure.
    pub const OFF: Pacing = Pacing {
        enabled: false,
        min_bytes: 0,
        max_defer: std::time::Duration::ZERO,
    };

    /// Whether a rank keeps deferring its next round: `busy` of its `channels` channels hold
    /// unfinished work, `unfinished` bytes in all, and it has deferred for `deferred` so far.
    pub fn defer(
        &self,
        busy: usize,
        channels: usize,
        unfinished: u64,
        deferred: std::time::Duration,
    ) -> bool {
        self.enabled
            && channels > 0
            && busy >= channels
            && unfinished >= self.min_bytes
            && deferred < self.max_defer
    }
}

/// Plan a round on fresh channels (no load carried over); see [`plan_round`].
pub fn plan(items: &[PlanItem], opts: &PlanOptions) -> Vec<Group> {
    plan_round(items, opts, &mut ChannelLoad::new(opts.channels))
}

/// Plan a round on every channel; see [`plan_round_on`] (with no agreed idle channels).
pub fn plan_round(items: &[PlanItem], opts: &PlanOptions, load: &mut ChannelLoad) -> Vec<Group> {
    plan_round_on(items, opts, load, 0)
}

/// The channels of `idle` (bit `c` = channel `c`) that exist among `channels`; all of them when
/// none does.
pub fn eligible_channels(idle: u64, channels: usize) -> u64 {
    let all = if channels >= 64 {
        u64::MAX
    } else {
        (1u64 << channels.max(1)) - 1
    };
    match idle & all {
        0 => all,
        m => m,
    }
}

/// Plan a round. Every byte of every item lands in exactly one part; groups only combine
/// allreduce items with equal [`FusionKey`]s; a group of several parts stays within the fusion
/// threshold; groups are listed in execution order, and each channel runs its groups in that
/// order. In fast mode each group goes to the channel with the least bytes so far, counting
/// the rounds before (`load`, updated); `load` must have `opts.channels` channels.
///
/// `idle` is the set of channels every rank found idle when the round started (bit `c` =
/// channel `c`; agreed in the round itself, so the same on every rank): the round's fused
/// groups are sized for and placed on those channels only, so that new work starts at once
/// instead of queueing behind a busy channel (0, or no existing channel: every channel). The
/// chunks of a partitioned tensor still go to every channel, which share its bandwidth.
pub fn plan_round_on(
    items: &[PlanItem],
    opts: &PlanOptions,
    load: &mut ChannelLoad,
    idle: u64,
) -> Vec<Group> {
    let channels = opts.channels.max(1);
    if load.bytes.len() != channels {
        *load = ChannelLoad::new(channels);
    }
    let eligible = eligible_channels(idle, channels);
    let mut order: Vec<usize> = (0..items.len()).collect();
    if opts.by_priority {
        order.sort_by_key(|&i| items[i].priority);
    }
    let mut groups = match opts.mode {
        PlanMode::Horovod => plan_horovod(items, &order, opts.fusion_threshold),
        PlanMode::Fast => plan_fast(
            items,
            &order,
            opts,
            channels,
            eligible.count_ones() as usize,
        ),
    };
    match opts.mode {
        PlanMode::Horovod => groups.iter_mut().for_each(|g| g.channel = 0),
        PlanMode::Fast => {
            // Least-loaded channel first (lowest index on ties): balances bytes, deterministic.
            let all = eligible_channels(0, channels);
            for g in &mut groups {
                let chunk = matches!(g.parts.as_slice(), [p] if p.len < items[p.item].bytes);
                let c = load.pick(if chunk { all } else { eligible });
                g.channel = c;
                load.add(c, g.bytes().max(1));
            }
        }
    }
    groups
}

/// Whether the engine runs a round's plan on its negotiation thread instead of a channel
/// thread (when that channel is idle): a single group of at most `limit` bytes (`0`: never)
/// whose items are all host tensors (`on_host(item)`). Shared by the engine and the scale
/// model.
pub fn runs_inline(groups: &[Group], limit: u64, on_host: impl Fn(usize) -> bool) -> bool {
    match groups {
        [g] => limit > 0 && g.bytes() <= limit && g.parts.iter().all(|p| on_host(p.item)),
        _ => false,
    }
}

/// How many chunks a fusable item of `bytes` is split into: none (1) up to the partition
/// size; above it, enough chunks of at most the partition size, rounded up to a multiple of
/// the channel count so that every channel gets an equal share; never more than its elements.
pub fn chunk_count(bytes: u64, elem: u64, partition: u64, channels: usize) -> u64 {
    let partition = partition.max(1);
    if bytes <= partition {
        return 1;
    }
    let k = channels.max(1) as u64;
    let n = bytes.div_ceil(partition).div_ceil(k).saturating_mul(k);
    n.min(bytes / elem.max(1)).max(1)
}

fn whole(i: usize, it: &PlanItem) -> Part {
    Part {
        item: i,
        offset: 0,
        len: it.bytes,
    }
}

fn plan_horovod(items: &[PlanItem], order: &[usize], threshold: u64) -> Vec<Group> {
    let mut queue: std::collections::VecDeque<usize> = order.iter().copied().collect();
    let mut groups = Vec::new();
    while let Some(first) = queue.pop_front() {
        let head = &items[first];
        let mut parts = vec![whole(first, head)];
        if head.fusable() {
            let mut size = head.bytes;
            let mut skipped = Vec::new();
            let mut skipped_size = 0u64;
            while let Some(&next) = queue.front() {
                let it = &items[next];
                if it.key == head.key && size.saturating_add(it.bytes) <= threshold {
                    size += it.bytes;
                    parts.push(whole(next, it));
                    queue.pop_front();
                } else {
                    // Look past a non-matching response only while the skipped bytes would
                    // still fit under the threshold.
                    skipped_size = skipped_size.saturating_add(it.bytes);
                    if size.saturating_add(skipped_size) <= threshold {
                        skipped.push(next);
                        queue.pop_front();
                    } else {
                        break;
                    }
                }
            }
            for s in skipped.into_iter().rev() {
                queue.push_front(s);
            }
        }
        groups.push(Group { channel: 0, parts });
    }
    groups
}

fn plan_fast(
    items: &[PlanItem],
    order: &[usize],
    opts: &PlanOptions,
    channels: usize,
    eligible: usize,
) -> Vec<Group> {
    // With several eligible channels, cap groups near an equal share of the round so that each
    // of them gets work, but never above the threshold nor below 64 KiB (tiny groups cost
    // latency).
    let total: u64 = order.iter().map(|&i| items[i].bytes).sum();
    let cap = if eligible > 1 {
        opts.fusion_threshold
            .min(total.div_ceil(eligible as u64).max(64 * 1024))
    } else {
        opts.fusion_threshold
    };
    let partition = opts.partition_bytes.max(1);
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Vec<(FusionKey, usize, u64)> = Vec::new(); // key, group index, bytes
    let mut done = vec![false; items.len()];
    for &i in order {
        if done[i] {
            continue;
        }
        let it = &items[i];
        if let Some(gid) = it.group {
            // A grouped submission: all its members in one group of their own, if they can.
            let members: Vec<usize> = order
                .iter()
                .copied()
                .filter(|&j| items[j].group == Some(gid))
                .collect();
            let bytes: u64 = members.iter().map(|&j| items[j].bytes).sum();
            if it.fusable()
                && members.iter().all(|&j| items[j].key == it.key)
                && bytes <= opts.fusion_threshold
            {
                open.retain(|(k, _, _)| *k != it.key);
                groups.push(Group {
                    channel: 0,
                    parts: members.iter().map(|&j| whole(j, &items[j])).collect(),
                });
                for j in members {
                    done[j] = true;
                }
                continue;
            }
        }
        if it.fusable() && it.bytes > partition {
            // Later tensors of this key must not join a group placed before these chunks.
            open.retain(|(k, _, _)| *k != it.key);
            // Equal chunks (element-aligned; the first ones one element longer when it does
            // not divide), a multiple of the channel count.
            let elem = it.elem.max(1);
            let elems = it.bytes / elem;
            let n = chunk_count(it.bytes, elem, partition, channels);
            let (base, extra) = (elems / n, elems % n);
            let mut off = 0;
            for c in 0..n {
                let len = (base + u64::from(c < extra)) * elem;
                groups.push(Group {
                    channel: 0,
                    parts: vec![Part {
                        item: i,
                        offset: off,
                        len,
                    }],
                });
                off += len;
            }
            continue;
        }
        if !it.fusable() {
            groups.push(Group {
                channel: 0,
                parts: vec![whole(i, it)],
            });
            continue;
        }
        match open.iter_mut().find(|(k, _, _)| *k == it.key) {
            Some((_, g, bytes)) if bytes.saturating_add(it.bytes) <= cap => {
                groups[*g].parts.push(whole(i, it));
                *bytes += it.bytes;
            }
            slot => {
                groups.push(Group {
                    channel: 0,
                    parts: vec![whole(i, it)],
                });
                let g = groups.len() - 1;
                match slot {
                    Some(s) => *s = (it.key, g, it.bytes),
                    None => open.push((it.key, g, it.bytes)),
                }
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
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
        let f = key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce);
        let item = |bytes| PlanItem {
            key: f,
            bytes,
            elem: 4,
            priority: 0,
            group: None,
        };
        let opts = PlanOptions {
            mode: PlanMode::Fast,
            fusion_threshold: 1 << 20,
            partition_bytes: 1 << 16,
            channels: 4,
            by_priority: false,
        };
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
        let f = key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce);
        let one = [PlanItem {
            key: f,
            bytes: 400,
            elem: 4,
            priority: 0,
            group: None,
        }];
        let opts = PlanOptions {
            mode: PlanMode::Fast,
            fusion_threshold: 1 << 20,
            partition_bytes: 1 << 20,
            channels: 4,
            by_priority: false,
        };
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
        let it = |k, b| PlanItem {
            key: k,
            bytes: b,
            elem: 4,
            priority: 0,
            group: None,
        };
        let items = [it(f, 8), it(d, 8), it(f, 8)];
        let opts = PlanOptions {
            mode: PlanMode::Horovod,
            fusion_threshold: 1 << 20,
            partition_bytes: 1,
            channels: 4,
            by_priority: false,
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
        let f = key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce);
        let it = |group| PlanItem {
            key: f,
            bytes: 40_000,
            elem: 4,
            priority: 0,
            group,
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
        let opts = PlanOptions {
            mode: PlanMode::Fast,
            fusion_threshold: 1 << 20,
            partition_bytes: 1 << 20,
            channels: 4,
            by_priority: false,
        };
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
        let f = key(DType::F32, ReduceOp::Sum, CollectiveKind::Allreduce);
        let items = [PlanItem {
            key: f,
            bytes: 400,
            elem: 4,
            priority: 0,
            group: None,
        }];
        let opts = PlanOptions {
            mode: PlanMode::Fast,
            fusion_threshold: 1 << 20,
            partition_bytes: 100,
            channels: 4,
            by_priority: false,
        };
        let g = plan(&items, &opts);
        assert_eq!(g.len(), 4);
        let mut chans: Vec<usize> = g.iter().map(|g| g.channel).collect();
        chans.sort();
        assert_eq!(chans, [0, 1, 2, 3]);
    }
}
