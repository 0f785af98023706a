//! The start-up agreement: the settings that shape a round must be the same on every rank.

use std::time::Duration;

use fh_core::bytes::{DecodeError, Reader};

use super::{Config, Preset, Priority, Wire};
use crate::SchedulerError;

/// The settings that shape what a negotiation round decides (or whether a rank stops), or when
/// rounds start (back-pressure, as it takes effect in a world of `world_size` ranks over
/// `wire`), as `(variable, value)`: every rank must hold the same values.
pub(crate) fn planning_fields(
    c: &Config,
    world_size: usize,
    wire: Wire,
) -> Vec<(&'static str, i64)> {
    let clamp = |x: u64| x.min(i64::MAX as u64) as i64;
    let millis = |d: Option<Duration>| d.map_or(0, |d| clamp(d.as_millis() as u64));
    vec![
        (
            "FH_SCHEDULE",
            match c.preset {
                Preset::FastHorovod => 0,
                Preset::Horovod => 1,
            },
        ),
        // A fixed count as it is; `auto` as minus the most it may open (the count itself is
        // agreed apart: [`agree`]).
        (
            "FH_CHANNELS",
            if c.channels_auto && c.preset == Preset::FastHorovod {
                -(c.effective_channels() as i64)
            } else {
                c.effective_channels() as i64
            },
        ),
        ("FH_CACHE_CAPACITY", clamp(c.cache_capacity as u64)),
        ("FH_FUSION_THRESHOLD", clamp(c.fusion_threshold)),
        ("FH_PARTITION_BYTES", clamp(c.partition_bytes)),
        (
            "FH_PRIORITY",
            match c.priority {
                Priority::Ready => 0,
                Priority::Forward => 1,
            },
        ),
        ("FH_STALL_SHUTDOWN_SECONDS", millis(c.stall_shutdown)),
        (
            "FH_BACKPRESSURE",
            i64::from(c.backpressure_on(world_size, wire)),
        ),
        ("FH_BACKPRESSURE_BYTES", clamp(c.backpressure_bytes)),
        ("FH_BACKPRESSURE_MAX_MS", millis(Some(c.backpressure_max))),
        ("FH_CUDA", i64::from(c.cuda)),
        // Whether a round's single group may run on the negotiation thread decides whether
        // the round agrees that every rank can run it (and how).
        (
            "FH_INLINE_BYTES",
            match c.preset {
                Preset::FastHorovod => clamp(c.inline_bytes),
                Preset::Horovod => 0,
            },
        ),
        // Which small allreduces ride in the rounds shapes every round's message.
        (
            "FH_EAGER_BYTES",
            match c.preset {
                Preset::FastHorovod => clamp(c.eager_bytes),
                Preset::Horovod => 0,
            },
        ),
        // The pieces a fused group is reduced in are the collectives every rank runs.
        ("FH_STAGE_BYTES", clamp(c.stage_bytes)),
    ]
}

/// What the start-up agreement settles beyond checking the settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Agreed {
    /// The data channels every rank opens: the smallest count any rank asked for
    /// (`channels`, [`Config::channels_for`]); under a fixed count, that count.
    pub(crate) channels: usize,
}

/// The start-up agreement: every rank checks that the others run with the same
/// [`planning_fields`], so that a difference is a clear configuration error naming the
/// variable on every rank instead of diverging rounds later. Collective over `comm`; `wire` is
/// the data channels' ([`Wire::of`] their transport). `channels`: the count this rank asks
/// for ([`Config::channels_for`]); the smallest over the ranks is the one in effect.
///
/// The world's heartbeat settings (`liveness`, from its transport) are agreed too: a rank that
/// beats less often than another tolerates would be declared lost while alive.
pub(crate) fn agree(
    comm: &mut dyn fh_transport::Communicator,
    c: &Config,
    wire: Wire,
    liveness: Option<fh_transport::liveness::Settings>,
    channels: usize,
) -> Result<Agreed, SchedulerError> {
    use fh_core::{DType, ReduceOp};
    let mut fields = planning_fields(c, comm.size(), wire);
    let ms = |d: Duration| d.as_millis().min(i64::MAX as u128) as i64;
    fields.push((
        fh_transport::liveness::SILENCE_VAR,
        liveness.map_or(0, |l| ms(l.silence)),
    ));
    fields.push((
        fh_transport::liveness::INTERVAL_VAR,
        liveness.map_or(0, |l| ms(l.interval)),
    ));
    // The values checked for equality, then the requests agreed by their smallest (carried
    // in the same two collectives).
    let mut vals: Vec<i64> = fields.iter().map(|f| f.1).collect();
    vals.push(channels as i64);
    let mut lo: Vec<u8> = bytemuck::cast_slice(&vals).to_vec();
    let mut hi = lo.clone();
    comm.allreduce(&mut lo, DType::I64, ReduceOp::Min)?;
    comm.allreduce(&mut hi, DType::I64, ReduceOp::Max)?;
    let lo = read_fields(&lo, vals.len(), "the smallest planning fields")?;
    let hi = read_fields(&hi, vals.len(), "the largest planning fields")?;
    for (i, (var, _)) in fields.iter().enumerate() {
        if lo[i] != hi[i] {
            return Err(SchedulerError::config(
                var,
                format!(
                    "ranks disagree (one has {}, another {}); every rank must use the same setting",
                    render(var, lo[i]),
                    render(var, hi[i])
                ),
            ));
        }
    }
    let smallest = lo[fields.len()];
    let channels = usize::try_from(smallest)
        .ok()
        .filter(|&k| (1..=64).contains(&k))
        .ok_or_else(|| {
            SchedulerError::Internal(format!(
                "the start-up agreement found a channel count of {smallest}; every rank asks \
                 for 1 to 64"
            ))
        })?;
    Ok(Agreed { channels })
}

/// A planning field's value as a user sets it (`FH_CHANNELS`: `auto` is carried as minus the
/// most it may open).
fn render(var: &str, v: i64) -> String {
    if var == "FH_CHANNELS" && v < 0 {
        format!("auto (at most {})", -v)
    } else {
        v.to_string()
    }
}

/// Broadcasts of rank 0's clock in [`measure_clock`].
const CLOCK_SAMPLES: usize = 5;

/// This rank's wall clock minus rank 0's, in microseconds, so that every rank's timeline can
/// be put on one clock. Ranks on rank 0's host share its clock: 0. Between hosts (only there:
/// every rank takes part, since `cross_size` is the same on all), rank 0 broadcasts its clock
/// [`CLOCK_SAMPLES`] times and each rank keeps the smallest difference from its own on
/// arrival: the delivery delay only adds, so the smallest is off by the fastest delivery.
pub(crate) fn measure_clock(
    comm: &mut dyn fh_transport::Communicator,
    topo: fh_transport::Topology,
) -> Result<i64, SchedulerError> {
    if topo.cross_size <= 1 {
        return Ok(0);
    }
    let now = || crate::flight::unix_micros(std::time::SystemTime::now());
    let mut best = i64::MAX;
    let mut host0 = 0;
    for _ in 0..CLOCK_SAMPLES {
        let mut b = [0u8; 16];
        if comm.rank() == 0 {
            b[..8].copy_from_slice(&now().to_le_bytes());
            b[8..].copy_from_slice(&(topo.cross_rank as u64).to_le_bytes());
        }
        comm.broadcast(&mut b, 0)?;
        let sent;
        (sent, host0) = read_clock(&b)?;
        best = best.min(now().saturating_sub(sent));
    }
    Ok(if topo.cross_rank as u64 == host0 {
        0
    } else {
        best
    })
}

/// The engine's incarnation: a value rank 0 draws afresh for every engine it starts and
/// broadcasts over the control communicator at start-up. Every control message of the engine
/// carries it (`negotiate::collect`), so that a message of an earlier engine of the same
/// processes (a script that calls `shutdown()` and `init()` again) is refused on every rank,
/// never taken for one of this engine's. Collective over `comm`.
pub(crate) fn agree_incarnation(
    comm: &mut dyn fh_transport::Communicator,
) -> Result<u64, SchedulerError> {
    let mut b = if comm.rank() == 0 {
        fresh_incarnation()
    } else {
        0
    }
    .to_le_bytes();
    comm.broadcast(&mut b, 0)?;
    read_incarnation(&b)
}

/// `n` planning fields (little-endian `i64`s) reduced over every rank; `what` names them.
pub(super) fn read_fields(b: &[u8], n: usize, what: &str) -> Result<Vec<i64>, SchedulerError> {
    read_exactly(b, what, |r| (0..n).map(|_| r.i64()).collect())
}

/// Rank 0's clock sample: its wall clock in microseconds (`i64`) and its host (`u64`).
pub(super) fn read_clock(b: &[u8]) -> Result<(i64, u64), SchedulerError> {
    read_exactly(b, "rank 0's clock", |r| Ok((r.i64()?, r.u64()?)))
}

/// The engine's incarnation as rank 0 broadcast it (a `u64`).
pub(super) fn read_incarnation(b: &[u8]) -> Result<u64, SchedulerError> {
    read_exactly(b, "the engine's incarnation", Reader::u64)
}

/// The values in `b` (rank 0's broadcast, or every rank's reduction, of `what`), read with
/// `read`. The buffer is this rank's, sized for exactly those values, so bytes missing or left
/// over are a broken invariant: an internal error, never a value made up.
fn read_exactly<'a, T>(
    b: &'a [u8],
    what: &str,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<T, SchedulerError> {
    let mut r = Reader::new(b);
    read(&mut r).and_then(|v| r.end().map(|()| v)).map_err(|e| {
        SchedulerError::internal(format!("{what} ({} bytes) cannot be read: {e}", b.len()))
    })
}

/// A value unlikely to repeat: the clock, the process and a count of the engines this process
/// started, through the standard library's randomly keyed hasher.
fn fresh_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static STARTED: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(STARTED.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}
