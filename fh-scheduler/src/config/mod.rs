//! Engine configuration: presets, a builder, and the `FH_*` environment variables.

use std::path::PathBuf;
use std::time::Duration;

use crate::SchedulerError;

mod agree;
mod parse;

pub(crate) use agree::agree;
use parse::{parse_bytes, parse_seconds, parse_switch, parse_u64};

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
    /// Data channels (the `horovod` preset always uses one).
    pub channels: usize,
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
    /// what a round decides. `None` (`auto`, the `fasthorovod` default): on in worlds of at
    /// least [`BACKPRESSURE_AUTO_RANKS`] ranks, where every collective pays a long latency and
    /// fewer, larger ones win (the scale model's finding), off in smaller ones, where the
    /// replay measured it slower. `horovod`: off (its fixed cycle paces it, as Horovod's does).
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
    /// planner's. Agreed at start-up: such a round takes one more step on every rank (each
    /// rank says whether it can run the group, so that none is left waiting in it).
    pub inline_bytes: u64,
    /// How long the negotiation thread keeps polling for the next submission (yielding the
    /// core between polls) after a round that completed work, before it sleeps
    /// (`FH_CONTROL_SPIN_US`, at most 1000 µs; zero: sleep at once). Back-to-back small
    /// collectives then skip a thread wake-up. A local choice, never agreed.
    pub control_spin: Duration,
}

/// Longest `FH_CONTROL_SPIN_US` accepted: polling is only worth it for a few tens of
/// microseconds, and ranks may share cores.
pub const MAX_CONTROL_SPIN: Duration = Duration::from_millis(1);

/// Most response-cache slots `FH_CACHE_CAPACITY` accepts (the negotiation vector of every round
/// carries one bit per slot: 64 Ki slots make 8 KiB per round).
pub const MAX_CACHE_CAPACITY: usize = 1 << 16;

impl Default for Config {
    fn default() -> Self {
        Config::preset(Preset::FastHorovod)
    }
}

/// Under `FH_BACKPRESSURE=auto` (the default), back-pressure is on in worlds of at least this
/// many ranks.
pub const BACKPRESSURE_AUTO_RANKS: usize = 64;

impl Config {
    /// The defaults of a preset.
    pub fn preset(p: Preset) -> Self {
        let base = Config {
            preset: p,
            channels: 4,
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
            control_spin: Duration::from_micros(30),
        };
        match p {
            Preset::FastHorovod => base,
            Preset::Horovod => Config {
                channels: 1,
                fusion_threshold: 128 * MIB,
                partition_bytes: u64::MAX,
                cycle_time: Duration::from_millis(1),
                backpressure: Some(false),
                ..base
            },
        }
    }

    /// The configuration the `FH_*` environment variables describe (see the README's table);
    /// unset variables keep the preset's defaults. A bad value is an error naming the variable
    /// and the accepted values.
    pub fn from_env() -> Result<Self, SchedulerError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`], reading variables through `get` (handy for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, SchedulerError> {
        let preset = match get("FH_SCHEDULE") {
            Some(s) if !s.trim().is_empty() => s.parse()?,
            _ => Preset::FastHorovod,
        };
        let mut c = Config::preset(preset);
        if let Some(v) = get("FH_CHANNELS") {
            let n = parse_u64("FH_CHANNELS", &v)?;
            if !(1..=64).contains(&n) {
                return Err(SchedulerError::config(
                    "FH_CHANNELS",
                    format!("'{v}' is out of range; accepted values: 1 to 64"),
                ));
            }
            c.channels = n as usize;
        }
        if let Some(v) = get("FH_FUSION_THRESHOLD") {
            c.fusion_threshold = parse_bytes("FH_FUSION_THRESHOLD", &v)?;
        }
        if let Some(v) = get("FH_PARTITION_BYTES") {
            let b = parse_bytes("FH_PARTITION_BYTES", &v)?;
            if b == 0 {
                return Err(SchedulerError::config(
                    "FH_PARTITION_BYTES",
                    "must be at least 1 byte (e.g. 16MiB)",
                ));
            }
            c.partition_bytes = b;
        }
        if let Some(v) = get("FH_CYCLE_TIME_MS") {
            c.cycle_time = parse_seconds("FH_CYCLE_TIME_MS", &v, 1e-3)?;
        }
        if let Some(v) = get("FH_BATCHING_WINDOW_MS") {
            c.batching_window = parse_seconds("FH_BATCHING_WINDOW_MS", &v, 1e-3)?;
        }
        if let Some(v) = get("FH_CACHE_CAPACITY") {
            let n = parse_u64("FH_CACHE_CAPACITY", &v)?;
            if n > MAX_CACHE_CAPACITY as u64 {
                return Err(SchedulerError::config(
                    "FH_CACHE_CAPACITY",
                    format!("'{v}' is out of range; accepted values: 0 to {MAX_CACHE_CAPACITY}"),
                ));
            }
            c.cache_capacity = n as usize;
        }
        if let Some(v) = get("FH_BACKPRESSURE") {
            c.backpressure = if v.trim().eq_ignore_ascii_case("auto") {
                None
            } else {
                Some(parse_switch("FH_BACKPRESSURE", &v).map_err(|_| {
                    SchedulerError::config(
                        "FH_BACKPRESSURE",
                        format!("'{v}' is not a setting; accepted values: auto, 0, 1, true, false"),
                    )
                })?)
            };
        }
        if let Some(v) = get("FH_BACKPRESSURE_BYTES") {
            c.backpressure_bytes = parse_bytes("FH_BACKPRESSURE_BYTES", &v)?;
        }
        if let Some(v) = get("FH_BACKPRESSURE_MAX_MS") {
            let d = parse_seconds("FH_BACKPRESSURE_MAX_MS", &v, 1e-3)?;
            if d > Duration::from_secs(1) {
                return Err(SchedulerError::config(
                    "FH_BACKPRESSURE_MAX_MS",
                    format!("'{v}' is out of range; accepted values: 0 to 1000"),
                ));
            }
            c.backpressure_max = d;
        }
        if let Some(v) = get("FH_INLINE_BYTES") {
            c.inline_bytes = parse_bytes("FH_INLINE_BYTES", &v)?;
        }
        if let Some(v) = get("FH_CONTROL_SPIN_US") {
            let d = parse_seconds("FH_CONTROL_SPIN_US", &v, 1e-6)?;
            if d > MAX_CONTROL_SPIN {
                return Err(SchedulerError::config(
                    "FH_CONTROL_SPIN_US",
                    format!("'{v}' is out of range; accepted values: 0 to 1000"),
                ));
            }
            c.control_spin = d;
        }
        if let Some(v) = get("FH_CUDA") {
            c.cuda = parse_switch("FH_CUDA", &v)?;
        }
        if let Some(v) = get("FH_PRIORITY") {
            c.priority = v.parse()?;
        }
        if let Some(v) = get("FH_TIMELINE") {
            c.timeline = if v.trim().is_empty() {
                None
            } else {
                Some(PathBuf::from(v))
            };
        }
        if let Some(v) = get("FH_STALL_CHECK_SECONDS") {
            let d = parse_seconds("FH_STALL_CHECK_SECONDS", &v, 1.0)?;
            c.stall_check = (!d.is_zero()).then_some(d);
        }
        if let Some(v) = get("FH_STALL_SHUTDOWN_SECONDS") {
            let d = parse_seconds("FH_STALL_SHUTDOWN_SECONDS", &v, 1.0)?;
            c.stall_shutdown = (!d.is_zero()).then_some(d);
        }
        // Keep the idle heartbeat well inside the transport's receive timeout, so that a rank
        // waiting in a round for an idle peer never times out.
        if let Some(t) = get("FH_TIMEOUT_SECONDS").and_then(|v| v.trim().parse::<f64>().ok()) {
            if t.is_finite() && t > 0.0 {
                c.idle_heartbeat = c.idle_heartbeat.min(Duration::from_secs_f64(t / 4.0));
            }
        }
        if let Some(v) = get("FH_LOG_LEVEL") {
            let ok = ["trace", "debug", "info", "warn", "warning", "error", "off"];
            if !ok.contains(&v.trim().to_ascii_lowercase().as_str()) {
                return Err(SchedulerError::config(
                    "FH_LOG_LEVEL",
                    format!("'{v}' is not a log level; accepted values: trace, debug, info, warn, error, off"),
                ));
            }
        }
        c.validate()?;
        Ok(c)
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

    /// Whether back-pressure is on in a world of `world_size` ranks (see
    /// [`Config::backpressure`]).
    pub fn backpressure_on(&self, world_size: usize) -> bool {
        match self.preset {
            Preset::Horovod => false,
            Preset::FastHorovod => self
                .backpressure
                .unwrap_or(world_size >= BACKPRESSURE_AUTO_RANKS),
        }
    }

    /// The pacing policy (back-pressure) under this configuration in a world of `world_size`
    /// ranks: what the engine paces its rounds with, and the scale model too.
    pub fn pacing(&self, world_size: usize) -> fh_core::fusion::Pacing {
        fh_core::fusion::Pacing {
            enabled: self.backpressure_on(world_size),
            min_bytes: self.backpressure_bytes,
            max_defer: self.backpressure_max,
        }
    }

    /// Number of data channels the engine opens (one under the `horovod` preset).
    pub fn effective_channels(&self) -> usize {
        match self.preset {
            Preset::Horovod => 1,
            Preset::FastHorovod => self.channels.max(1),
        }
    }

    /// Set the number of data channels.
    pub fn channels(mut self, k: usize) -> Self {
        self.channels = k;
        self
    }
    /// Set the fusion threshold in bytes.
    pub fn fusion_threshold(mut self, bytes: u64) -> Self {
        self.fusion_threshold = bytes;
        self
    }
    /// Set the partition size in bytes.
    pub fn partition_bytes(mut self, bytes: u64) -> Self {
        self.partition_bytes = bytes;
        self
    }
    /// Set the polling cycle (zero: wake on submission).
    pub fn cycle_time(mut self, d: Duration) -> Self {
        self.cycle_time = d;
        self
    }
    /// Set the batching window.
    pub fn batching_window(mut self, d: Duration) -> Self {
        self.batching_window = d;
        self
    }
    /// Set the response-cache capacity in slots.
    pub fn cache_capacity(mut self, slots: usize) -> Self {
        self.cache_capacity = slots;
        self
    }
    /// Set the group ordering.
    pub fn priority(mut self, p: Priority) -> Self {
        self.priority = p;
        self
    }
    /// Write a timeline (rank 0).
    pub fn timeline(mut self, path: impl Into<PathBuf>) -> Self {
        self.timeline = Some(path.into());
        self
    }
    /// Set the stall-check time (`None`: off).
    pub fn stall_check(mut self, d: Option<Duration>) -> Self {
        self.stall_check = d;
        self
    }
    /// Set the stall-shutdown time (`None`: never).
    pub fn stall_shutdown(mut self, d: Option<Duration>) -> Self {
        self.stall_shutdown = d;
        self
    }
    /// Keep a log of the fused groups (diagnostic).
    pub fn record_groups(mut self, on: bool) -> Self {
        self.record_groups = on;
        self
    }
    /// Turn back-pressure on or off, or leave it to the world size with `None` (see
    /// [`Config::backpressure`]).
    pub fn backpressure(mut self, on: impl Into<Option<bool>>) -> Self {
        self.backpressure = on.into();
        self
    }
    /// Bound back-pressure: defer only while the channels hold at least `min_bytes` of
    /// unfinished work, and never longer than `max`.
    pub fn backpressure_bounds(mut self, min_bytes: u64, max: Duration) -> Self {
        self.backpressure_bytes = min_bytes;
        self.backpressure_max = max;
        self
    }
    /// Set the largest single group run on the negotiation thread (see
    /// [`Config::inline_bytes`](Config#structfield.inline_bytes); `0`: never).
    pub fn inline_bytes(mut self, bytes: u64) -> Self {
        self.inline_bytes = bytes;
        self
    }
    /// Set how long the negotiation thread polls for the next submission before sleeping
    /// (see [`Config::control_spin`](Config#structfield.control_spin); capped at
    /// [`MAX_CONTROL_SPIN`]).
    pub fn control_spin(mut self, d: Duration) -> Self {
        self.control_spin = d.min(MAX_CONTROL_SPIN);
        self
    }
    /// Set the idle heartbeat.
    pub fn idle_heartbeat(mut self, d: Duration) -> Self {
        self.idle_heartbeat = d;
        self
    }
    /// Open the GPU path at start-up (see [`Config::cuda`](Config#structfield.cuda)).
    pub fn cuda(mut self, on: bool) -> Self {
        self.cuda = on;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_match_the_design_table() {
        let c = Config::from_lookup(env(&[])).unwrap();
        assert_eq!(c.preset, Preset::FastHorovod);
        assert_eq!(c.channels, 4);
        assert_eq!(c.fusion_threshold, 64 * MIB);
        assert_eq!(c.partition_bytes, 16 * MIB);
        assert_eq!(c.cycle_time, Duration::ZERO);
        assert_eq!(c.cache_capacity, 1024);
        assert_eq!(c.stall_check, Some(Duration::from_secs(60)));
        assert_eq!(c.stall_shutdown, None);
        let h = Config::from_lookup(env(&[("FH_SCHEDULE", "horovod")])).unwrap();
        assert_eq!(h.cycle_time, Duration::from_millis(1));
        assert_eq!(h.fusion_threshold, 128 * MIB);
        assert_eq!(h.effective_channels(), 1);
    }

    #[test]
    fn variables_are_read() {
        let c = Config::from_lookup(env(&[
            ("FH_CHANNELS", "2"),
            ("FH_FUSION_THRESHOLD", "1MiB"),
            ("FH_PARTITION_BYTES", "4096"),
            ("FH_CYCLE_TIME_MS", "2.5"),
            ("FH_CACHE_CAPACITY", "0"),
            ("FH_PRIORITY", "forward"),
            ("FH_TIMELINE", "/tmp/t.json"),
            ("FH_STALL_CHECK_SECONDS", "0"),
            ("FH_STALL_SHUTDOWN_SECONDS", "5"),
        ]))
        .unwrap();
        assert_eq!(c.channels, 2);
        assert_eq!(c.fusion_threshold, MIB);
        assert_eq!(c.partition_bytes, 4096);
        assert_eq!(c.cycle_time, Duration::from_micros(2500));
        assert_eq!(c.cache_capacity, 0);
        assert_eq!(c.priority, Priority::Forward);
        assert_eq!(c.timeline, Some(PathBuf::from("/tmp/t.json")));
        assert_eq!(c.stall_check, None);
        assert_eq!(c.stall_shutdown, Some(Duration::from_secs(5)));
        // Auto: on from BACKPRESSURE_AUTO_RANKS ranks; never under horovod.
        let auto = Config::default();
        assert_eq!(auto.backpressure, None);
        assert!(!auto.backpressure_on(BACKPRESSURE_AUTO_RANKS - 1));
        assert!(auto.pacing(BACKPRESSURE_AUTO_RANKS).enabled);
        assert!(!Config::preset(Preset::Horovod).backpressure_on(4096));
        let off = Config::from_lookup(env(&[("FH_BACKPRESSURE", "off")])).unwrap();
        assert!(!off.pacing(4096).enabled);
        let on = Config::from_lookup(env(&[("FH_BACKPRESSURE", "1")])).unwrap();
        assert!(on.pacing(2).enabled);
        let auto = Config::from_lookup(env(&[("FH_BACKPRESSURE", "Auto")])).unwrap();
        assert_eq!(auto.backpressure, None);
        let e = Config::from_lookup(env(&[("FH_BACKPRESSURE", "sometimes")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("FH_BACKPRESSURE"), "{e}");
        let bp = Config::from_lookup(env(&[
            ("FH_BACKPRESSURE_BYTES", "1MiB"),
            ("FH_BACKPRESSURE_MAX_MS", "3"),
        ]))
        .unwrap();
        assert_eq!(bp.backpressure_bytes, MIB);
        assert_eq!(bp.backpressure_max, Duration::from_millis(3));
        assert!(Config::default()
            .cache_capacity(MAX_CACHE_CAPACITY + 1)
            .validate()
            .is_err());
        let hot = Config::from_lookup(env(&[
            ("FH_INLINE_BYTES", "4KiB"),
            ("FH_CONTROL_SPIN_US", "20"),
        ]))
        .unwrap();
        assert_eq!(hot.inline_bytes, 4096);
        assert_eq!(hot.control_spin, Duration::from_micros(20));
        assert_eq!(
            Config::default()
                .control_spin(Duration::from_secs(1))
                .control_spin,
            MAX_CONTROL_SPIN
        );
        let short = Config::from_lookup(env(&[("FH_TIMEOUT_SECONDS", "2")])).unwrap();
        assert_eq!(short.idle_heartbeat, Duration::from_millis(500));
    }

    #[test]
    fn the_gpu_switch_is_read_and_off_by_default() {
        assert!(!Config::from_lookup(env(&[])).unwrap().cuda);
        for (v, on) in [
            ("1", true),
            ("true", true),
            ("0", false),
            ("off", false),
            ("", false),
        ] {
            assert_eq!(
                Config::from_lookup(env(&[("FH_CUDA", v)])).unwrap().cuda,
                on,
                "{v}"
            );
        }
        // It is a planning field: ranks that disagree refuse to start.
        assert!(agree::planning_fields(&Config::default().cuda(true), 2).contains(&("FH_CUDA", 1)));
    }

    #[test]
    fn bad_values_name_the_variable_and_accepted_values() {
        for (var, val, expect) in [
            ("FH_SCHEDULE", "fast-ish", "fasthorovod, horovod"),
            ("FH_CHANNELS", "0", "1 to 64"),
            ("FH_CHANNELS", "four", "integer"),
            ("FH_FUSION_THRESHOLD", "64XB", "suffix"),
            ("FH_CYCLE_TIME_MS", "-1", "non-negative"),
            ("FH_PRIORITY", "backward", "ready, forward"),
            ("FH_STALL_CHECK_SECONDS", "soon", "non-negative"),
            ("FH_LOG_LEVEL", "loud", "info"),
            ("FH_CACHE_CAPACITY", "1000000000", "0 to 65536"),
            ("FH_BACKPRESSURE_BYTES", "lots", "byte size"),
            ("FH_BACKPRESSURE_MAX_MS", "5000", "0 to 1000"),
            ("FH_CUDA", "maybe", "0, 1, true, false"),
            ("FH_INLINE_BYTES", "lots", "byte size"),
            ("FH_CONTROL_SPIN_US", "5000", "0 to 1000"),
        ] {
            let err = Config::from_lookup(env(&[(var, val)]))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(var) && err.contains(expect),
                "{var}={val}: {err}"
            );
        }
    }
}
