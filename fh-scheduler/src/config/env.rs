//! Reading a configuration from the `FH_*` environment variables.

use std::path::PathBuf;
use std::time::Duration;

use super::parse::{parse_bytes, parse_seconds, parse_seconds_at_most, parse_switch, parse_u64};
use super::*;

impl Config {
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
            c.backpressure_max =
                parse_seconds_at_most("FH_BACKPRESSURE_MAX_MS", &v, 1e-3, Duration::from_secs(1))?;
        }
        if let Some(v) = get("FH_INLINE_BYTES") {
            c.inline_bytes = parse_bytes("FH_INLINE_BYTES", &v)?;
        }
        if let Some(v) = get("FH_STAGE_BYTES") {
            c.stage_bytes = parse_bytes("FH_STAGE_BYTES", &v)?;
        }
        if let Some(v) = get("FH_CONTROL_SPIN_US") {
            c.control_spin =
                parse_seconds_at_most("FH_CONTROL_SPIN_US", &v, 1e-6, MAX_CONTROL_SPIN)?;
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
}
