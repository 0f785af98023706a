//! The heartbeats' settings, as the launch environment gives them (`FH_HEARTBEAT_TIMEOUT_SECONDS`,
//! `FH_HEARTBEAT_INTERVAL_MS`). The heartbeats themselves are `fh_transport::liveness`'s: they
//! run over the TCP data listeners' ports.

use std::time::Duration;

use crate::error::config;
use crate::Result;

/// The variable of [`Settings::silence`].
pub const SILENCE_VAR: &str = "FH_HEARTBEAT_TIMEOUT_SECONDS";
/// The variable of [`Settings::interval`].
pub const INTERVAL_VAR: &str = "FH_HEARTBEAT_INTERVAL_MS";

/// Default [`Settings::interval`].
///
/// Measured (with fh-transport's `heartbeat_gaps` example): on a 2-core machine loaded with 4 busy ranks
/// and 8 more spinning processes, the longest gap between two heartbeats a rank received was
/// well under a second; four intervals fit in the default silence with room for that gap.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);

/// Default [`Settings::silence`]: short enough that a frozen or cut-off peer is named within 2 s
/// (the silence, at most half an interval until the next look, and the error's way out), long
/// enough for the worst gaps measured on a loaded 2-core machine and for a few lost datagrams
/// in a row on a lossy link.
pub const DEFAULT_SILENCE: Duration = Duration::from_millis(1500);

/// How often the heartbeats are sent and how long a silence is tolerated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Time between two heartbeats to each peer (`FH_HEARTBEAT_INTERVAL_MS`).
    pub interval: Duration,
    /// A peer not heard for this long is declared lost (`FH_HEARTBEAT_TIMEOUT_SECONDS`).
    pub silence: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            interval: DEFAULT_INTERVAL,
            silence: DEFAULT_SILENCE,
        }
    }
}

impl Settings {
    /// The settings from the variables `get` returns (`None`: unset); `Ok(None)` when
    /// heartbeats are turned off (`FH_HEARTBEAT_TIMEOUT_SECONDS=0`). A bad value is an error
    /// naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Settings>> {
        let bad = |var: &str, reason: String| config(var, reason);
        let mut s = Settings::default();
        if let Some(v) = get(SILENCE_VAR).filter(|v| !v.trim().is_empty()) {
            let secs: f64 = v.trim().parse().map_err(|_| {
                bad(
                    SILENCE_VAR,
                    format!("{v:?} is not a number of seconds (e.g. 1.5; 0 turns heartbeats off)"),
                )
            })?;
            if secs == 0.0 {
                return Ok(None);
            }
            if !(0.1..=86_400.0).contains(&secs) {
                return Err(bad(
                    SILENCE_VAR,
                    format!("{v} is out of range: give 0.1 to 86400 seconds, or 0 to turn heartbeats off"),
                ));
            }
            s.silence = Duration::from_secs_f64(secs);
        }
        if let Some(v) = get(INTERVAL_VAR).filter(|v| !v.trim().is_empty()) {
            let ms: u64 = v.trim().parse().map_err(|_| {
                bad(
                    INTERVAL_VAR,
                    format!("{v:?} is not a whole number of milliseconds"),
                )
            })?;
            if ms == 0 {
                return Err(bad(INTERVAL_VAR, "must be at least 1 ms".into()));
            }
            s.interval = Duration::from_millis(ms);
        } else {
            // A silence set alone gets an interval to match.
            s.interval = DEFAULT_INTERVAL.min(s.silence / 4);
        }
        if s.interval * 3 > s.silence {
            return Err(bad(
                INTERVAL_VAR,
                format!(
                    "{} ms leaves fewer than 3 heartbeats in the {:.3} s of {SILENCE_VAR}: one \
                     late heartbeat would condemn a live rank; use at most a third of it",
                    s.interval.as_millis(),
                    s.silence.as_secs_f64()
                ),
            ));
        }
        Ok(Some(s))
    }

    /// [`Settings::from_vars`] on the process environment.
    pub fn from_env() -> Result<Option<Settings>> {
        Self::from_vars(|n| std::env::var(n).ok())
    }
}
