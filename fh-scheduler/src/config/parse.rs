//! Values of the configuration variables: integers, durations and byte sizes, with errors
//! naming the variable.

use std::time::Duration;

use crate::SchedulerError;

pub(super) fn parse_u64(var: &str, v: &str) -> Result<u64, SchedulerError> {
    v.trim()
        .parse::<u64>()
        .map_err(|_| SchedulerError::config(var, format!("'{v}' is not a non-negative integer")))
}

pub(super) fn parse_seconds(var: &str, v: &str, unit: f64) -> Result<Duration, SchedulerError> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 && x * unit < 1e9 => {
            Ok(Duration::from_secs_f64(x * unit))
        }
        _ => Err(SchedulerError::config(
            var,
            format!("'{v}' is not a non-negative number"),
        )),
    }
}

/// As [`parse_seconds`], refusing more than `max` with the accepted range in `unit`s.
pub(super) fn parse_seconds_at_most(
    var: &str,
    v: &str,
    unit: f64,
    max: Duration,
) -> Result<Duration, SchedulerError> {
    let d = parse_seconds(var, v, unit)?;
    if d > max {
        return Err(SchedulerError::config(
            var,
            format!(
                "'{v}' is out of range; accepted values: 0 to {}",
                (max.as_secs_f64() / unit).round()
            ),
        ));
    }
    Ok(d)
}

/// Parse a byte size ([`fh_core::units::parse_size`]), the error naming the variable.
pub(super) fn parse_bytes(var: &str, v: &str) -> Result<u64, SchedulerError> {
    fh_core::units::parse_size(v).map_err(|reason| SchedulerError::config(var, reason))
}

/// An on/off switch (`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`; empty is off).
pub(super) fn parse_switch(var: &str, v: &str) -> Result<bool, SchedulerError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err(SchedulerError::config(
            var,
            format!("'{v}' is not a switch; accepted values: 0, 1, true, false"),
        )),
    }
}
