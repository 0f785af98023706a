//! Counters the engine keeps, and the stall inspector's reports.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Upper bounds (bytes) of the fused-group size histogram: 4 KiB × 4ᵏ up to 256 MiB; larger
/// groups count in the last bucket (`+Inf`).
pub const GROUP_SIZE_BOUNDS: [u64; 9] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
];

/// The histogram bucket of a fused group of `bytes`.
pub(crate) fn group_bucket(bytes: u64) -> usize {
    GROUP_SIZE_BOUNDS
        .iter()
        .position(|&b| bytes <= b)
        .unwrap_or(GROUP_SIZE_BOUNDS.len())
}

/// A snapshot of an engine's counters (this rank).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Negotiation rounds run.
    pub rounds: u64,
    /// Rounds settled by the bit vector alone (no coordinator step).
    pub bitvector_rounds: u64,
    /// Rounds that needed the coordinator (names not in the cache).
    pub coordinator_rounds: u64,
    /// Bytes this rank contributed to negotiation collectives (bit vectors, request lists,
    /// and on rank 0 the broadcast response lists).
    pub negotiation_bytes_sent: u64,
    /// Time spent in negotiation rounds.
    pub negotiation_time: Duration,
    /// Names that became ready through the response cache.
    pub cache_hits: u64,
    /// Names that became ready through the coordinator.
    pub coordinator_responses: u64,
    /// Operations completed on this rank (successfully or not).
    pub completed: u64,
    /// Fused groups (collectives) executed.
    pub fused_groups: u64,
    /// Payload bytes through data-channel collectives.
    pub data_bytes: u64,
    /// Stall warnings raised.
    pub stall_warnings: u64,
    /// Fused groups the negotiation thread ran itself (small single-group rounds whose channel
    /// was idle; see `Config::inline_bytes`), counted in `fused_groups` and their channel too.
    pub inline_groups: u64,
    /// Small allreduces completed inside their negotiation round, with no collective of their
    /// own (see `Config::eager_bytes`); counted in `completed` too.
    pub eager_tensors: u64,
    /// Negotiation rounds a caller waiting for its own operation ran on its thread while the
    /// negotiation thread idled (see `Config::caller_rounds`); counted in `rounds` too.
    pub caller_rounds: u64,
    /// Their payload bytes (each tensor's once).
    pub eager_bytes: u64,
    /// Fused groups reduced where their tensors lie, without the fusion buffer (over a
    /// transport with scatter-gather I/O; see `Config::fused_in_place`), counted in
    /// `fused_groups` too.
    pub in_place_groups: u64,
    /// Per data channel, in channel order.
    pub channels: Vec<ChannelStats>,
    /// Fused groups by size: the count in each bucket of
    /// [`GROUP_SIZE_BOUNDS`] (not cumulative), then those above the last.
    pub group_sizes: Vec<u64>,
    /// Training steps the framework reported ([`crate::Engine::record_step`]).
    pub steps: u64,
    /// Their exposed communication (the time they waited for their reductions), in all.
    pub exposed: Duration,
    /// Time since the engine started.
    pub uptime: Duration,
}

/// What one data channel has done (this rank).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Payload bytes through its collectives.
    pub bytes: u64,
    /// Fused groups (collectives) it ran.
    pub groups: u64,
    /// Time it spent running groups (packing, the collective, unpacking).
    pub busy: Duration,
}

impl EngineStats {
    /// Each channel's share of the bytes, in channel order (all zero before any traffic).
    pub fn channel_shares(&self) -> Vec<f64> {
        let total: u64 = self.channels.iter().map(|c| c.bytes).sum();
        self.channels
            .iter()
            .map(|c| {
                if total == 0 {
                    0.0
                } else {
                    c.bytes as f64 / total as f64
                }
            })
            .collect()
    }
}

/// One channel's live counters.
#[derive(Debug, Default)]
pub(crate) struct ChannelCounters {
    pub bytes: AtomicU64,
    pub groups: AtomicU64,
    pub busy_nanos: AtomicU64,
    /// Bytes dispatched to the channel and not yet finished (back-pressure reads the sum).
    pub queued: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub rounds: AtomicU64,
    pub bitvector_rounds: AtomicU64,
    pub coordinator_rounds: AtomicU64,
    pub negotiation_bytes_sent: AtomicU64,
    pub negotiation_nanos: AtomicU64,
    pub cache_hits: AtomicU64,
    pub coordinator_responses: AtomicU64,
    pub completed: AtomicU64,
    pub fused_groups: AtomicU64,
    pub data_bytes: AtomicU64,
    pub stall_warnings: AtomicU64,
    pub inline_groups: AtomicU64,
    pub eager_tensors: AtomicU64,
    pub caller_rounds: AtomicU64,
    pub eager_bytes: AtomicU64,
    pub in_place_groups: AtomicU64,
    /// Set once, when the channels are created.
    pub channels: OnceLock<Vec<ChannelCounters>>,
    /// Fused groups per size bucket ([`GROUP_SIZE_BOUNDS`], then above).
    pub group_sizes: [AtomicU64; GROUP_SIZE_BOUNDS.len() + 1],
    pub steps: AtomicU64,
    pub exposed_nanos: AtomicU64,
    /// When the engine started (set once, at start-up).
    pub started: OnceLock<Instant>,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> EngineStats {
        EngineStats {
            rounds: self.rounds.load(Relaxed),
            bitvector_rounds: self.bitvector_rounds.load(Relaxed),
            coordinator_rounds: self.coordinator_rounds.load(Relaxed),
            negotiation_bytes_sent: self.negotiation_bytes_sent.load(Relaxed),
            negotiation_time: Duration::from_nanos(self.negotiation_nanos.load(Relaxed)),
            cache_hits: self.cache_hits.load(Relaxed),
            coordinator_responses: self.coordinator_responses.load(Relaxed),
            completed: self.completed.load(Relaxed),
            fused_groups: self.fused_groups.load(Relaxed),
            data_bytes: self.data_bytes.load(Relaxed),
            stall_warnings: self.stall_warnings.load(Relaxed),
            inline_groups: self.inline_groups.load(Relaxed),
            eager_tensors: self.eager_tensors.load(Relaxed),
            caller_rounds: self.caller_rounds.load(Relaxed),
            eager_bytes: self.eager_bytes.load(Relaxed),
            in_place_groups: self.in_place_groups.load(Relaxed),
            group_sizes: self.group_sizes.iter().map(|c| c.load(Relaxed)).collect(),
            steps: self.steps.load(Relaxed),
            exposed: Duration::from_nanos(self.exposed_nanos.load(Relaxed)),
            uptime: self.started.get().map_or(Duration::ZERO, Instant::elapsed),
            channels: self
                .channels()
                .iter()
                .map(|c| ChannelStats {
                    bytes: c.bytes.load(Relaxed),
                    groups: c.groups.load(Relaxed),
                    busy: Duration::from_nanos(c.busy_nanos.load(Relaxed)),
                })
                .collect(),
        }
    }

    /// Create the per-channel counters (once; later calls keep the first).
    pub(crate) fn init_channels(&self, k: usize) {
        let _ = self
            .channels
            .set((0..k).map(|_| ChannelCounters::default()).collect());
    }

    /// The per-channel counters (empty before the channels exist).
    pub(crate) fn channels(&self) -> &[ChannelCounters] {
        self.channels.get().map_or(&[], Vec::as_slice)
    }

    /// How many channels hold unfinished work (queued or running), and how many bytes of it
    /// they hold together: what the pacing policy looks at.
    pub(crate) fn channel_load(&self) -> (usize, u64) {
        self.channels().iter().fold((0, 0), |(busy, bytes), c| {
            let q = c.queued.load(Relaxed);
            (busy + usize::from(q > 0), bytes + q)
        })
    }
}

/// What the stall inspector found: names some ranks submitted and others did not, for at
/// least the stall-check time. Every rank records the same report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StallReport {
    /// The stalled names, sorted.
    pub names: Vec<String>,
    /// The ranks that have not submitted (some of) them, ascending.
    pub missing_ranks: Vec<usize>,
    /// Each of those ranks with the stalled names it lacks (sorted), ascending by rank.
    pub lacking: Vec<(usize, Vec<String>)>,
    /// How long the oldest stalled name has waited (on the rank that waited longest).
    pub waited: Duration,
}

impl StallReport {
    /// The most names one line lists for a rank before it says how many more there are.
    pub const MAX_NAMES: usize = 8;

    /// The same report with every rank renumbered by `f` (a process set's ranks as world
    /// ranks, for what users read), still ascending.
    pub fn map_ranks(&self, f: impl Fn(usize) -> usize) -> StallReport {
        let mut missing_ranks: Vec<usize> = self.missing_ranks.iter().map(|&r| f(r)).collect();
        missing_ranks.sort_unstable();
        let mut lacking: Vec<(usize, Vec<String>)> = self
            .lacking
            .iter()
            .map(|(r, names)| (f(*r), names.clone()))
            .collect();
        lacking.sort_by_key(|(r, _)| *r);
        StallReport {
            names: self.names.clone(),
            missing_ranks,
            lacking,
            waited: self.waited,
        }
    }

    /// The stalled names rank `rank` lacks, if it is one of the missing ranks.
    pub fn lacked_by(&self, rank: usize) -> Option<&[String]> {
        self.lacking
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, names)| names.as_slice())
    }
}

/// `["a", "b"]`, or `["a", ... ] and 3 more` past [`StallReport::MAX_NAMES`].
pub(crate) fn name_list(names: &[String]) -> String {
    let shown: Vec<String> = names
        .iter()
        .take(StallReport::MAX_NAMES)
        .map(|n| format!("{n:?}"))
        .collect();
    let more = names.len().saturating_sub(StallReport::MAX_NAMES);
    if more == 0 {
        format!("[{}]", shown.join(", "))
    } else {
        format!("[{}] and {more} more", shown.join(", "))
    }
}

/// `stall: rank 0 has not submitted ["b"]; rank 2 has not submitted ["a"] (other ranks
/// submitted them up to 6.0s ago)`: ranks that lack the same names are named together
/// (`ranks 1 and 2 have not submitted ...`), in the order of their lowest rank.
impl std::fmt::Display for StallReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut by_names: Vec<(&[String], Vec<u32>)> = Vec::new();
        for (r, names) in &self.lacking {
            match by_names.iter_mut().find(|(n, _)| *n == names.as_slice()) {
                Some((_, ranks)) => ranks.push(*r as u32),
                None => by_names.push((names, vec![*r as u32])),
            }
        }
        f.write_str("stall: ")?;
        for (i, (names, ranks)) in by_names.iter().enumerate() {
            let set = fh_core::mismatch::RankSet::from_ranks(ranks.iter().copied());
            let verb = if ranks.len() == 1 { "has" } else { "have" };
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{set} {verb} not submitted {}", name_list(names))?;
        }
        write!(
            f,
            " (other ranks submitted them up to {:.1}s ago)",
            self.waited.as_secs_f64()
        )
    }
}

/// One dispatched fused group, as recorded when `Config::record_groups` is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    /// The negotiation round (on this rank) that produced it.
    pub round: u64,
    /// The channels that round found idle on every rank (bit `c` = channel `c`), which the
    /// planner placed its fused groups on.
    pub idle_channels: u64,
    /// The channel it ran on.
    pub channel: usize,
    /// Its parts: name, byte offset, byte length.
    pub parts: Vec<(String, u64, u64)>,
}
