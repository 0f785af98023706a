//! Reading a configuration from the `FH_*` environment variables.

use std::path::PathBuf;
use std::time::Duration;

use crate::SchedulerError;

use super::parse::{parse_bytes, parse_seconds, parse_seconds_at_most, parse_switch, parse_u64};
use super::{
    Config, Preset, MAX_CACHE_CAPACITY, MAX_CONTROL_SPIN, MAX_EAGER_BYTES, MAX_FLIGHT_RECORDS,
};

/// The variables [`Config::from_env`] reads, and the logging variables read where a log
/// subscriber is installed (`FH_LOG_LEVEL`, `FH_LOG_COLOR`: [`super::log_colour`]).
pub const ENV_VARIABLES: &[&str] = &[
    "FH_SCHEDULE",
    "FH_CHANNELS",
    "FH_FUSION_THRESHOLD",
    "FH_PARTITION_BYTES",
    "FH_CYCLE_TIME_MS",
    "FH_BATCHING_WINDOW_MS",
    "FH_CACHE_CAPACITY",
    "FH_BACKPRESSURE",
    "FH_BACKPRESSURE_BYTES",
    "FH_BACKPRESSURE_MAX_MS",
    "FH_INLINE_BYTES",
    "FH_EAGER_BYTES",
    "FH_STAGE_BYTES",
    "FH_CONTROL_SPIN_US",
    "FH_CALLER_ROUNDS",
    "FH_CUDA",
    "FH_PRIORITY",
    "FH_TIMELINE",
    "FH_FLIGHT_RECORDS",
    "FH_FLIGHT_DIR",
    "FH_METRICS_ADDR",
    "FH_SUMMARY",
    "FH_STALL_CHECK_SECONDS",
    "FH_STALL_SHUTDOWN_SECONDS",
    "FH_TIMEOUT_SECONDS",
    "FH_LOG_LEVEL",
    "FH_LOG_COLOR",
];

/// Variables of FastHorovod's own tools (the build and test scripts, the benchmarks, fhrun's
/// rsh agent `FH_RSH_AGENT`) and fhrun's notice pipe (`FH_NOTICE_FD`, read by
/// `fasthorovod.torch`'s excepthook).
const TOOL_VARIABLES: &[&str] = &[
    "FH_NOTICE_FD",
    "FH_RSH_AGENT",
    "FH_VENV",
    "FH_FHRUN",
    "FH_NCCL_INCLUDE",
    "FH_EXPECT_CUDA_BUILD",
    "FH_REPLAY_TRACE",
    "FH_MPI_RUN_TIMEOUT",
    "FH_SUITE_SEED",
    "FH_SUITE_ARGS",
];

/// Name prefixes of the tools' variables (benchmarks, test harnesses).
const TOOL_PREFIXES: &[&str] = &[
    "FH_BENCH_",
    "FH_TEST_",
    "FH_SHM_TEST_",
    "FH_HIER_TEST_",
    "FH_MPI_SUITE_",
    "FH_CHAOS_",
    "FH_EKILL_",
];

/// Names people reach for that FastHorovod spells otherwise.
const SPELLED_OTHERWISE: &[(&str, &str)] = &[
    ("FH_PRESET", "FH_SCHEDULE"),
    ("FH_NUM_CHANNELS", "FH_CHANNELS"),
    ("FH_CYCLE_TIME", "FH_CYCLE_TIME_MS"),
    ("FH_FUSION_BYTES", "FH_FUSION_THRESHOLD"),
    ("FH_BACKEND", "FH_TRANSPORT"),
];

/// An `FH_*` variable that no part of FastHorovod reads: it has no effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVariable {
    /// The variable's name.
    pub name: String,
    /// The closest variable that is read, when one is close (a likely typo or another
    /// library's spelling).
    pub suggestion: Option<&'static str>,
}

impl std::fmt::Display for UnknownVariable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is set, but FastHorovod reads no such variable",
            self.name
        )?;
        match self.suggestion {
            Some(s) => write!(f, " (did you mean {s}?)"),
            None => write!(f, " (the README lists the FH_* variables)"),
        }
    }
}

/// The `FH_*` names among `names` that neither the engine ([`ENV_VARIABLES`]), the transports
/// ([`fh_transport::ENV_VARIABLES`]) nor FastHorovod's tools read, each with the closest name
/// that is read. Other names are ignored.
pub fn unknown_variables<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<UnknownVariable> {
    let known = || {
        ENV_VARIABLES
            .iter()
            .chain(fh_transport::ENV_VARIABLES)
            .copied()
    };
    names
        .into_iter()
        .filter(|n| n.starts_with("FH_"))
        .filter(|n| !known().any(|k| k == *n) && !TOOL_VARIABLES.contains(n))
        .filter(|n| !TOOL_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| {
            let spelled = SPELLED_OTHERWISE
                .iter()
                .find(|(wrong, _)| *wrong == n)
                .map(|(_, right)| *right);
            let closest = || {
                known()
                    .map(|k| (strsim::levenshtein(n, k), k))
                    .filter(|(d, _)| *d <= 3)
                    .min()
                    .map(|(_, k)| k)
            };
            UnknownVariable {
                name: n.to_string(),
                suggestion: spelled.or_else(closest),
            }
        })
        .collect()
}

impl Config {
    /// The configuration the `FH_*` environment variables describe (see the README's table);
    /// unset variables keep the preset's defaults. A bad value is an error naming the variable
    /// and the accepted values. An `FH_*` variable that nothing reads (a typo such as
    /// `FH_CHANNEL`, or `FH_PRESET` for `FH_SCHEDULE`) is logged as a warning once per
    /// process, with the closest name that is read ([`unknown_variables`]).
    pub fn from_env() -> Result<Self, SchedulerError> {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            let names: Vec<String> = std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .collect();
            for u in unknown_variables(names.iter().map(String::as_str)) {
                tracing::warn!("{u}; it has no effect");
            }
        });
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`], reading variables through `get` (handy for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, SchedulerError> {
        let preset = match get("FH_SCHEDULE") {
            Some(s) if !s.trim().is_empty() => s.parse()?,
            _ => Preset::FastHorovod,
        };
        let mut c = Config::preset(preset);
        // Unset, empty or `auto`: fitted to the cores (`Config::channels_auto`).
        let fixed = get("FH_CHANNELS")
            .filter(|v| !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("auto"));
        if let Some(v) = fixed {
            let n = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| {
                    SchedulerError::config(
                        "FH_CHANNELS",
                        format!("'{v}' is not an integer from 1 to 64; accepted values: 1 to 64, or auto"),
                    )
                })?;
            c.channels = n;
            c.channels_auto = false;
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
        if let Some(v) = get("FH_EAGER_BYTES") {
            let n = parse_bytes("FH_EAGER_BYTES", &v)?;
            if n > MAX_EAGER_BYTES {
                return Err(SchedulerError::config(
                    "FH_EAGER_BYTES",
                    format!("'{v}' is out of range; accepted values: 0 (off) to {MAX_EAGER_BYTES}"),
                ));
            }
            c.eager_bytes = n;
        }
        if let Some(v) = get("FH_STAGE_BYTES") {
            c.stage_bytes = parse_bytes("FH_STAGE_BYTES", &v)?;
        }
        if let Some(v) = get("FH_CONTROL_SPIN_US") {
            c.control_spin =
                parse_seconds_at_most("FH_CONTROL_SPIN_US", &v, 1e-6, MAX_CONTROL_SPIN)?;
        }
        if let Some(v) = get("FH_CALLER_ROUNDS") {
            c.caller_rounds = parse_switch("FH_CALLER_ROUNDS", &v)?;
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
        if let Some(v) = get("FH_FLIGHT_RECORDS") {
            let n = parse_u64("FH_FLIGHT_RECORDS", &v)?;
            if n > MAX_FLIGHT_RECORDS as u64 {
                return Err(SchedulerError::config(
                    "FH_FLIGHT_RECORDS",
                    format!(
                        "'{v}' is out of range; accepted values: 0 (off) to {MAX_FLIGHT_RECORDS}"
                    ),
                ));
            }
            c.flight_records = n as usize;
        }
        if let Some(v) = get("FH_FLIGHT_DIR") {
            c.flight_dir = (!v.trim().is_empty()).then(|| PathBuf::from(v));
        }
        if let Some(v) = get("FH_METRICS_ADDR") {
            c.metrics_addr = parse_metrics_addr(&v)?;
        }
        if let Some(v) = get("FH_SUMMARY") {
            parse_switch("FH_SUMMARY", &v)?;
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

/// `FH_METRICS_ADDR`: `PORT`, `:PORT` or `IP:PORT` (127.0.0.1 unless an address is given);
/// empty: off.
fn parse_metrics_addr(v: &str) -> Result<Option<std::net::SocketAddr>, SchedulerError> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    let port_only = t.strip_prefix(':').unwrap_or(t);
    if let Ok(port) = port_only.parse::<u16>() {
        return Ok(Some(std::net::SocketAddr::from(([127, 0, 0, 1], port))));
    }
    t.parse::<std::net::SocketAddr>().map(Some).map_err(|_| {
        SchedulerError::config(
            "FH_METRICS_ADDR",
            format!(
                "'{v}' is not an address; accepted: PORT, :PORT or IP:PORT (127.0.0.1 unless \
                 given; each rank listens on PORT plus its local rank)"
            ),
        )
    })
}
