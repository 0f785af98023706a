//! The fusion planner: turns a round's ready responses into fused groups assigned to channels.
//!
//! Pure and deterministic: the same input gives the same plan on every rank, which is what
//! lets the ranks run the groups on their channels without further agreement.

use crate::message::{CollectiveKind, Device, Response};
use crate::{DType, ReduceOp};

mod load;
mod pacing;
mod rules;
#[cfg(test)]
mod tests;

pub use load::ChannelLoad;
pub use pacing::Pacing;
use rules::{plan_fast, plan_horovod};

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
