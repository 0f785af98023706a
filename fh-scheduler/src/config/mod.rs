//! Engine configuration: presets, a builder, and the `FH_*` environment variables.

use std::path::PathBuf;
use std::time::Duration;

use crate::SchedulerError;

mod agree;
mod builder;
mod colour;
pub use colour::{colour_for, log_colour, LOG_COLOR_VAR};
mod env;
pub use env::{unknown_variables, UnknownVariable, ENV_VARIABLES};
mod parse;
#[cfg(test)]
mod tests;

pub(crate) use agree::{agree, agree_incarnation, measure_clock};

const MIB: u64 = 1024 * 1024;

/// A schedule preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// The FastHorovod schedule: negotiation on its own thread, woken by submissions, the
    /// bit-vector cache, parallel fused dispatch over several channels.
    FastHorovod,
    /// Horovod 0.28's schedule, as a yardstick: one background thread that wakes every 1 ms,
    /// negotiates (response cache + coordinator on misses) and then executes each fused
    /// response itself on one channel, with a 128 MiB fusion threshold and Horovod's fusion
    /// rules.
    Horovod,
}

impl Preset {
    /// The name used by `FH_SCHEDULE`.
    pub const fn name(self) -> &'static str {
        match self {
            Preset::FastHorovod => "fasthorovod",
            Preset::Horovod => "horovod",
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = SchedulerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fasthorovod" | "fast" => Ok(Preset::FastHorovod),
            "horovod" => Ok(Preset::Horovod),
            _ => Err(SchedulerError::config(
                "FH_SCHEDULE",
                format!("'{s}' is not a schedule; accepted values: fasthorovod, horovod"),
            )),
        }
    }
}

/// How a job's data channels move bytes, as far as the `auto` defaults care
/// ([`Config::backpressure_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wire {
    /// Between hosts: TCP, or any transport whose ranks span hosts. Every collective pays
    /// system calls and the network's latency on every message.
    Network,
    /// Through a network stack within one host: TCP over loopback. Every message pays system
    /// calls and the kernel's copies, not a network's latency.
    Loopback,
    /// Through one host's memory: shared memory, threads, or MPI and the hierarchical
    /// transport when every rank is on one host.
    Memory,
}

impl Wire {
    /// The wire of a world whose data moves through `kind`
    /// ([`Transport::wire`](fh_transport::Transport::wire)), on a job spanning `hosts` hosts
    /// (between hosts, every world's data crosses a network).
    pub fn of(kind: fh_transport::WireKind, hosts: usize) -> Wire {
        match kind {
            _ if hosts > 1 => Wire::Network,
            fh_transport::WireKind::Network => Wire::Loopback,
            fh_transport::WireKind::Memory => Wire::Memory,
        }
    }
}

/// How the groups of a round are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Priority {
    /// In the order the names became ready (the negotiated order).
    Ready,
    /// By ascending caller-supplied priority (e.g. the layer index, so that the layers the
    /// next forward pass needs first go first).
    Forward,
}

impl std::str::FromStr for Priority {
    type Err = SchedulerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ready" => Ok(Priority::Ready),
            "forward" => Ok(Priority::Forward),
            _ => Err(SchedulerError::config(
                "FH_PRIORITY",
                format!("'{s}' is not a priority order; accepted values: ready, forward"),
            )),
        }
    }
}

/// Engine configuration. Start from [`Config::preset`] (or [`Config::default`], the
/// FastHorovod preset) or [`Config::from_env`], then adjust with the builder methods.
///
/// ```
/// use fh_scheduler::{Config, Preset};
/// let c = Config::preset(Preset::FastHorovod).channels(2).fusion_threshold(1 << 20);
/// assert_eq!(c.channels, 2);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The schedule.
    pub preset: Preset,
    /// Data channels (the `horovod` preset always uses one). While [`Config::channels_auto`]
    /// holds, the most the engine opens.
    pub channels: usize,
    /// FastHorovod (`FH_CHANNELS` unset or `auto`, the default): the engine fits the channel
    /// count to the cores it finds. Each channel is a thread per rank running collectives;
    /// where a host's ranks have fewer than [`AUTO_CORES_PER_RANK`] cores each, the engine
    /// opens at most [`AUTO_FEW_CORES_CHANNELS`] channels, else [`Config::channels`]. A rank
    /// counts the cores it may run on (its affinity and CPU quota,
    /// `std::thread::available_parallelism`) and divides them by its host's ranks: where each
    /// rank is bound to cores of its own (`mpirun --bind-to core`, Slurm's `--cpu-bind`) it
    /// sees only those, and may open 2 where 4 would fit: set `FH_CHANNELS` there. The
    /// count in effect is agreed at start-up (the smallest any rank asks for), logged, and is
    /// what [`Engine::config`](crate::Engine::config) reports. Setting
    /// [`Config::channels`] through its builder or `FH_CHANNELS=K` fixes the count (every
    /// rank must then give the same). (Replayed at np 4 on a 2-core VM, interleaved, in three
    /// runs: K=2 exposed less than K=4 on BERT-base every time — 3–11 % over TCP, 13–21 % over
    /// shared memory — and spent less CPU per byte.)
    pub channels_auto: bool,
    /// Most bytes per fused group.
    pub fusion_threshold: u64,
    /// Allreduce tensors above this size are split into chunks across the channels
    /// (FastHorovod only).
    pub partition_bytes: u64,
    /// Zero: negotiation wakes on submission. Above zero: a fixed polling cycle.
    pub cycle_time: Duration,
    /// After waking on a submission while idle, wait this long to batch more submissions into
    /// the same round (zero: no wait).
    pub batching_window: Duration,
    /// Response-cache slots (0: the coordinator negotiates every name every time).
    pub cache_capacity: usize,
    /// Group ordering.
    pub priority: Priority,
    /// Where rank 0 writes a Chrome-trace timeline, if anywhere.
    pub timeline: Option<PathBuf>,
    /// Warn about names submitted by some ranks but not others for this long (`None`: off).
    pub stall_check: Option<Duration>,
    /// Shut down when a stall lasts this long (`None`: never).
    pub stall_shutdown: Option<Duration>,
    /// While nothing is pending, an idle engine still takes part in one tiny negotiation round
    /// this often, so that a peer waiting for it neither times out nor goes unreported by the
    /// stall inspector. Must be well below the transport timeout; [`Config::from_env`] caps it
    /// at a quarter of `FH_TIMEOUT_SECONDS`.
    pub idle_heartbeat: Duration,
    /// Keep a log of every fused group dispatched (see `Engine::group_log`); a diagnostic for
    /// tests and tools, off by default.
    pub record_groups: bool,
    /// Back-pressure (`FH_BACKPRESSURE`): while every channel of this rank still holds
    /// unfinished work, the rank defers its next negotiation round (at most
    /// [`Config::backpressure_max`]) so that more gradients fuse into it; a round's groups could
    /// only queue behind that work anyway. It changes only *when* a rank enters a round, never
    /// what a round decides. `None` (`auto`, the `fasthorovod` default): on where the data
    /// crosses hosts ([`Wire::Network`]) and in worlds of at least [`BACKPRESSURE_AUTO_RANKS`]
    /// ranks, where every collective pays a long latency and fewer, larger ones win; off within
    /// one host in smaller worlds (shared memory, [`Wire::Memory`], or TCP over loopback,
    /// [`Wire::Loopback`]), where the copies themselves are the wire and waiting only idles
    /// it. (Replayed at np 4 on a 2-core VM, interleaved: over shared memory it slowed
    /// BERT-base in every run; over loopback TCP, once small allreduces rode in the rounds and
    /// two channels were the default there, off exposed less on ResNet-50 in each of three
    /// runs at K=2 and on BERT-base in three of four.) `horovod`: off (its fixed cycle paces
    /// it, as Horovod's does). See [`Config::backpressure_on`].
    pub backpressure: Option<bool>,
    /// Back-pressure defers only while the channels together hold at least this many
    /// unfinished bytes (`FH_BACKPRESSURE_BYTES`; 0: any amount).
    pub backpressure_bytes: u64,
    /// The longest a rank defers a round under back-pressure (`FH_BACKPRESSURE_MAX_MS`).
    pub backpressure_max: Duration,
    /// Open the GPU path at start-up (`FH_CUDA`): one device channel (NCCL communicator and
    /// CUDA stream) per data channel, so that device tensors can be submitted. Every rank must
    /// agree; start-up fails on every rank, naming the ranks that cannot, when one has no GPU,
    /// no NCCL, or a build without the `cuda` feature.
    pub cuda: bool,
    /// FastHorovod (`FH_INLINE_BYTES`): a round whose plan is a single group of at most this
    /// many bytes of host tensors runs that group on the negotiation thread itself when the
    /// group's channel has nothing queued or running, saving the hand-off to the channel's
    /// thread (`0`: always hand groups to the channel threads). The group, its channel and
    /// the order of groups on that channel stay the
    /// planner's. Agreed at start-up: in such a round each rank says whether it can run the
    /// group, so that none is left waiting in it (inside the group's allreduce, or a one-byte
    /// step first for other kinds).
    pub inline_bytes: u64,
    /// FastHorovod (`FH_EAGER_BYTES`, at most [`MAX_EAGER_BYTES`]; `0`: off): allreduces of
    /// host tensors small enough to share this many bytes ride inside the negotiation round
    /// once their response is cached: each rank puts its data beside its bit vector, the one
    /// collective of the round reduces both, and a tensor ready on every rank completes in that
    /// round — one collective's latency for a small allreduce instead of two. Which cached
    /// tensors ride is a function of the cache (the same on every rank: the most recently used
    /// while the bytes last, chosen again every 64 rounds), and only where the negotiation communicator reduces a
    /// message of mixed parts in one collective (TCP, shared memory, hierarchical; not MPI:
    /// `Communicator::parts_in_band`). Agreed at start-up.
    pub eager_bytes: u64,
    /// FastHorovod, every rank on one host (`FH_STAGE_BYTES`; `0`: off): a fused group of
    /// host tensors goes through its channel's fusion buffer a piece of at most this many
    /// bytes at a time, each piece packed, reduced and unpacked before the next, so that the
    /// buffer stays in cache instead of every fused byte making two extra trips through
    /// memory (on one host the ranks' memory is the wire). Groups that the transport reduces
    /// where they lie ([`Config::fused_in_place`]) skip the buffer. Across hosts groups go
    /// whole: each piece would pay the network's full collective latency. The engine agrees
    /// the effective value at start-up, since it sets the collectives every rank runs.
    pub stage_bytes: u64,
    /// How long the negotiation thread keeps polling for the next submission (yielding the
    /// core between polls) after a round that completed work, before it sleeps
    /// (`FH_CONTROL_SPIN_US`, at most 1000 µs; zero: sleep at once). Back-to-back small
    /// collectives then skip a thread wake-up. Where callers run the rounds
    /// ([`Config::caller_rounds`]) the thread parks at once instead. A local choice, never
    /// agreed.
    pub control_spin: Duration,
    /// Whether a caller blocked in [`crate::Handle::wait`] on an operation not yet dispatched
    /// runs the negotiation round itself while the control thread idles
    /// (`FH_CALLER_ROUNDS`, default on): a small synchronous collective then costs no thread
    /// hand-off. A bounded wait runs one only when it may last 100 ms or more (the round ends
    /// when every rank has entered it). Only under the `fasthorovod` preset where the rounds'
    /// timing is the negotiation thread's alone (no cycle time, batching window or
    /// back-pressure), without GPU channels, and not over MPI; a local choice, never agreed
    /// (every rank runs the same rounds whichever of its threads runs them).
    pub caller_rounds: bool,
    /// Operations the flight recorder keeps (`FH_FLIGHT_RECORDS`; 0: off): see
    /// [`crate::flight`]. A local choice, never agreed.
    pub flight_records: usize,
    /// Where the flight records go (`FH_FLIGHT_DIR`; `None`: fhrun's job directory when fhrun
    /// sets it, else [`crate::flight::dump::default_dir`]).
    pub flight_dir: Option<PathBuf>,
    /// Where the rank's figures are served in Prometheus' text format (`FH_METRICS_ADDR`:
    /// `PORT`, `:PORT` or `IP:PORT`, the host 127.0.0.1 unless given; each rank listens on
    /// the port plus its local rank). `None`: not served. `fasthorovod` serves it.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// Under [`Config::channels_auto`], the cores each of a host's ranks needs for the engine to
/// open all [`Config::channels`].
pub const AUTO_CORES_PER_RANK: usize = 2;

/// Under [`Config::channels_auto`], the most channels a rank with fewer than
/// [`AUTO_CORES_PER_RANK`] cores opens.
pub const AUTO_FEW_CORES_CHANNELS: usize = 2;

/// Most operations `FH_FLIGHT_RECORDS` accepts (a slot is about 200 bytes).
pub const MAX_FLIGHT_RECORDS: usize = 1 << 20;

/// Default [`Config::stage_bytes`]: 1 MiB, a piece that stays in a server core's L2 cache
/// (on the 2-core development VM, with 1 MiB of L2 per core, 512 KiB–1 MiB pieces replayed
/// BERT-base fastest; 4 MiB pieces gained less than half as much).
pub const DEFAULT_STAGE_BYTES: u64 = 1024 * 1024;

/// Longest `FH_CONTROL_SPIN_US` accepted: polling is only worth it for a few tens of
/// microseconds, and ranks may share cores.
pub const MAX_CONTROL_SPIN: Duration = Duration::from_millis(1);

/// Most response-cache slots `FH_CACHE_CAPACITY` accepts (the negotiation vector of every round
/// carries one bit per slot: 64 Ki slots make 8 KiB per round).
pub const MAX_CACHE_CAPACITY: usize = 1 << 16;

/// Most bytes of small allreduces `FH_EAGER_BYTES` lets ride in every negotiation round (the
/// round's message grows by what the cached ones take, whether or not they are ready).
pub const MAX_EAGER_BYTES: u64 = 64 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config::preset(Preset::FastHorovod)
    }
}

/// Under `FH_BACKPRESSURE=auto` (the default), back-pressure is on in worlds of at least this
/// many ranks, whatever the [`Wire`].
pub const BACKPRESSURE_AUTO_RANKS: usize = 64;

impl Config {
    /// The defaults of a preset.
    pub fn preset(p: Preset) -> Self {
        let base = Config {
            preset: p,
            channels: 4,
            channels_auto: true,
            fusion_threshold: 64 * MIB,
            partition_bytes: 16 * MIB,
            cycle_time: Duration::ZERO,
            batching_window: Duration::ZERO,
            cache_capacity: 1024,
            priority: Priority::Ready,
            timeline: None,
            stall_check: Some(Duration::from_secs(60)),
            stall_shutdown: None,
            idle_heartbeat: Duration::from_secs(1),
            record_groups: false,
            backpressure: None,
            backpressure_bytes: 0,
            backpressure_max: Duration::from_millis(50),
            cuda: false,
            inline_bytes: 64 * 1024,
            eager_bytes: 1024,
            stage_bytes: DEFAULT_STAGE_BYTES,
            control_spin: Duration::from_micros(30),
            caller_rounds: true,
            flight_records: crate::flight::DEFAULT_RECORDS,
            flight_dir: None,
            metrics_addr: None,
        };
        match p {
            Preset::FastHorovod => base,
            Preset::Horovod => Config {
                channels: 1,
                channels_auto: false,
                fusion_threshold: 128 * MIB,
                partition_bytes: u64::MAX,
                cycle_time: Duration::from_millis(1),
                backpressure: Some(false),
                // Horovod packs a whole fused group into its fusion buffer at once.
                stage_bytes: 0,
                // Horovod negotiates, then runs the collective.
                eager_bytes: 0,
                ..base
            },
        }
    }

    /// Check the values for consistency.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if self.channels == 0 || self.channels > 64 {
            return Err(SchedulerError::config(
                "channels",
                format!(
                    "{} is out of range; accepted values: 1 to 64",
                    self.channels
                ),
            ));
        }
        if self.partition_bytes == 0 {
            return Err(SchedulerError::config(
                "partition_bytes",
                "must be at least 1",
            ));
        }
        if self.cache_capacity > MAX_CACHE_CAPACITY {
            return Err(SchedulerError::config(
                "cache_capacity",
                format!(
                    "{} is out of range; accepted values: 0 to {MAX_CACHE_CAPACITY}",
                    self.cache_capacity
                ),
            ));
        }
        if self.eager_bytes > MAX_EAGER_BYTES {
            return Err(SchedulerError::config(
                "eager_bytes",
                format!(
                    "{} is out of range; accepted values: 0 (off) to {MAX_EAGER_BYTES}",
                    self.eager_bytes
                ),
            ));
        }
        if self.backpressure_max > Duration::from_secs(1) {
            return Err(SchedulerError::config(
                "backpressure_max",
                "must be at most 1 s",
            ));
        }
        if self.idle_heartbeat.is_zero() {
            return Err(SchedulerError::config(
                "idle_heartbeat",
                "must be above zero",
            ));
        }
        Ok(())
    }

    /// The fusion planner's settings under this configuration (what the engine plans every
    /// round with; the scale model uses the same).
    pub fn plan_options(&self) -> fh_core::fusion::PlanOptions {
        use fh_core::fusion::{PlanMode, PlanOptions};
        PlanOptions {
            mode: match self.preset {
                Preset::Horovod => PlanMode::Horovod,
                Preset::FastHorovod => PlanMode::Fast,
            },
            fusion_threshold: self.fusion_threshold,
            partition_bytes: self.partition_bytes,
            channels: self.effective_channels(),
            by_priority: self.priority == Priority::Forward,
        }
    }

    /// Whether back-pressure is on in a world of `world_size` ranks whose data channels move
    /// bytes over `wire` (see [`Config::backpressure`]).
    pub fn backpressure_on(&self, world_size: usize, wire: Wire) -> bool {
        match self.preset {
            Preset::Horovod => false,
            Preset::FastHorovod => self
                .backpressure
                .unwrap_or(world_size >= BACKPRESSURE_AUTO_RANKS || wire == Wire::Network),
        }
    }

    /// The pacing policy (back-pressure) under this configuration in a world of `world_size`
    /// ranks over `wire`: what the engine paces its rounds with, and the scale model too.
    pub fn pacing(&self, world_size: usize, wire: Wire) -> fh_core::fusion::Pacing {
        fh_core::fusion::Pacing {
            enabled: self.backpressure_on(world_size, wire),
            min_bytes: self.backpressure_bytes,
            max_defer: self.backpressure_max,
        }
    }

    /// The stage size in effect on a job spanning `hosts` hosts: [`Config::stage_bytes`] under
    /// `fasthorovod` on one host, else 0 (whole groups; `horovod` packs whole groups, as
    /// Horovod does).
    pub fn effective_stage_bytes(&self, hosts: usize) -> u64 {
        match self.preset {
            Preset::FastHorovod if hosts <= 1 => self.stage_bytes,
            _ => 0,
        }
    }

    /// Whether a fused group of several whole host tensors is reduced where its tensors lie
    /// (no fusion buffer: the transport sends from and receives into the tensors, and the
    /// average's division and the postscale run on this rank's block of the ring) over a
    /// transport whose communicators reduce slices where they lie for less than packing them
    /// (`in_place`: `fh_transport::Communicator::segments_in_place`: TCP, with scatter-gather
    /// I/O, shared memory, through its slots, and the hierarchical backend's lanes). Only under
    /// `fasthorovod`: the `horovod` preset packs into its fusion buffer, as Horovod does. The
    /// engine and the scale model both decide by this.
    pub fn fused_in_place(&self, in_place: bool) -> bool {
        self.preset == Preset::FastHorovod && in_place
    }

    /// The channel count this rank asks for at start-up on a host where `cores` cores serve
    /// `local_ranks` ranks: under [`Config::channels_auto`], at most
    /// [`AUTO_FEW_CORES_CHANNELS`] when each rank has fewer than [`AUTO_CORES_PER_RANK`]
    /// cores, else [`Config::effective_channels`]. The engine opens the smallest any rank asks
    /// for.
    pub fn channels_for(&self, cores: usize, local_ranks: usize) -> usize {
        let k = self.effective_channels();
        let auto = self.channels_auto && self.preset == Preset::FastHorovod;
        if auto && cores < AUTO_CORES_PER_RANK.saturating_mul(local_ranks.max(1)) {
            k.min(AUTO_FEW_CORES_CHANNELS)
        } else {
            k
        }
    }

    /// Number of data channels the engine opens (one under the `horovod` preset); under
    /// [`Config::channels_auto`] the most it opens ([`Config::channels_for`]).
    pub fn effective_channels(&self) -> usize {
        match self.preset {
            Preset::Horovod => 1,
            Preset::FastHorovod => self.channels.max(1),
        }
    }
}
