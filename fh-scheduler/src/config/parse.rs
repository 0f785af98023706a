//! Values of the configuration variables: integers, durations and byte sizes, with errors
//! naming the variable.

use std::time::Duration;

use super::MIB;
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

/// Parse a byte size: a plain integer, or one with a suffix K/KB/KiB, M/MB/MiB, G/GB/GiB
/// (all binary multiples).
pub(super) fn parse_bytes(var: &str, v: &str) -> Result<u64, SchedulerError> {
    let s = v.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let mult = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1024,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => 1024 * MIB,
        _ => 0,
    };
    num.parse::<u64>()
        .ok()
        .filter(|_| mult > 0)
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            SchedulerError::config(
                var,
                format!("'{v}' is not a byte size; accepted: an integer with an optional suffix K, M or G (e.g. 67108864, 64MiB)"),
            )
        })
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
