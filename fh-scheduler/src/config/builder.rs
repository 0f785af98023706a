//! Setting a configuration in code, one value at a time.

use std::path::PathBuf;
use std::time::Duration;

use super::{Config, Priority, MAX_CONTROL_SPIN};

impl Config {
    /// Set the number of data channels (fixed: [`Config::channels_auto`] off).
    pub fn channels(mut self, k: usize) -> Self {
        self.channels = k;
        self.channels_auto = false;
        self
    }
    /// Fit the channel count to the cores, at most [`Config::channels`] (on), or open exactly
    /// [`Config::channels`] (off): see [`Config::channels_auto`].
    pub fn channels_auto(mut self, on: bool) -> Self {
        self.channels_auto = on;
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

    /// Let small cached allreduces of at most `bytes` in all ride inside the negotiation round
    /// ([`Config::eager_bytes`](Config#structfield.eager_bytes); `0`: off).
    pub fn eager_bytes(mut self, bytes: u64) -> Self {
        self.eager_bytes = bytes;
        self
    }

    /// Stage fused host groups through the fusion buffer `bytes` at a time
    /// ([`Config::stage_bytes`](Config#structfield.stage_bytes); `0`: whole groups).
    pub fn stage_bytes(mut self, bytes: u64) -> Self {
        self.stage_bytes = bytes;
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
    /// Let a waiting caller run the negotiation round while the control thread idles (see
    /// [`Config::caller_rounds`](Config#structfield.caller_rounds)).
    pub fn caller_rounds(mut self, on: bool) -> Self {
        self.caller_rounds = on;
        self
    }
    /// Open the GPU path at start-up (see [`Config::cuda`](Config#structfield.cuda)).
    pub fn cuda(mut self, on: bool) -> Self {
        self.cuda = on;
        self
    }
}
