//! Parallel streams to a peer on another host: how many connections a communicator holds to
//! each peer, and how a large frame is striped over them.
//!
//! Clouds cap the rate of each TCP flow well below a VM's link; several flows fill it where one
//! cannot. A communicator therefore holds [`StreamSettings::count`] connections to every peer
//! on another host (peers on the same host keep one), and a data frame of at least
//! [`StreamSettings::stripe_min`] bytes to such a peer is split into that many contiguous
//! stripes ([`stripe_range`]), stripe `i` sent on stream `i` as a frame of its own. Each stripe's
//! header carries the length of the *whole* message, so a receiver that expects another length
//! refuses it as it would an unstriped frame; the split itself never crosses the wire: both
//! ends compute it from the length and the settings, which the rendezvous checks to be the
//! same on every rank ([`StreamSettings::encode`], sent by every member after its host place).
//!
//! How many: [`StreamCount::Auto`] (the default) is measured when a world spanning hosts
//! starts. Rank 0 and the first rank on another host send for [`PROBE_TIME`] over one stream,
//! then as long over [`PROBE_STREAMS`] at once; [`choose`] turns the two rates into a count
//! (1 where one flow already gets close to what many get), which rank 0 logs and sends every
//! rank. [`FLOW_CAP_VAR`] emulates a cloud's per-flow cap on one machine, so that tests and
//! benches can see the difference.

use std::time::Instant;

use fh_core::bytes::{DecodeError, Reader};

use super::{TcpComm, TcpTransport};
use crate::{Communicator, Interrupt, Result, TransportError};

/// The variable that sets the number of streams to each peer on another host.
pub const STREAMS_VAR: &str = "FH_TCP_STREAMS";
/// The variable that sets the smallest frame striped over several streams, in bytes.
pub const STRIPE_MIN_VAR: &str = "FH_TCP_STRIPE_MIN";
/// The variable that, set to 1, stripes to every peer, also on this rank's host (for tests:
/// loopback jobs then take the striped path).
pub const STRIPE_LOCAL_VAR: &str = "FH_TCP_STRIPE_LOCAL";

/// The variable that caps the rate of every data connection to a peer on another host (every
/// peer with [`STRIPE_LOCAL_VAR`]), in bytes per second: an emulated cloud, whose per-flow cap
/// the streams exist to overcome (for tests and benches on one machine; Linux's
/// `SO_MAX_PACING_RATE`).
pub const FLOW_CAP_VAR: &str = "FH_TCP_FLOW_CAP";

/// The variable that sets the chunk of the hierarchical allreduce's pipeline
/// ([`crate::compose::hier`]): a size in bytes (e.g. `4M`), `0` or `off` to run its phases one
/// after another on the whole buffer, `auto` (the default) for [`DEFAULT_PIPELINE_CHUNK`]. It
/// shapes the frames between hosts, so it travels and is checked with these settings.
pub const PIPELINE_VAR: &str = "FH_HIER_PIPELINE";
/// Default chunk of the hierarchical allreduce's pipeline ([`PIPELINE_VAR`]).
pub const DEFAULT_PIPELINE_CHUNK: usize = 4 << 20;
/// The smallest pipeline chunk [`PIPELINE_VAR`] accepts.
pub const MIN_PIPELINE_CHUNK: usize = 64 << 10;

/// The variable that sets the socket buffers of the data connections to peers on other hosts:
/// `kernel` (the default: Linux's autotuning), `max` (per direction the kernel's unprivileged
/// maximum where it exceeds what autotuning reaches, else autotuning; `sys::roomier_buffers`),
/// or a size in bytes for both directions (the kernel caps it and doubles it). A rank's own
/// business: not compared between ranks.
pub const BUFFERS_VAR: &str = "FH_TCP_BUFFERS";

/// How the data connections to peers on other hosts get their socket buffers ([`BUFFERS_VAR`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Buffers {
    /// Linux's autotuning (the default: larger buffers showed no gain in the engine's replay,
    /// only for a lone stream, see the README).
    #[default]
    Kernel,
    /// The kernel's unprivileged maximum where autotuning reaches less, per direction.
    Max,
    /// This many bytes, both directions.
    Fixed(usize),
}

impl Buffers {
    /// The (send, receive) buffer sizes to set on a connection; `None`: leave it to the kernel.
    pub fn sizes(self) -> (Option<usize>, Option<usize>) {
        match self {
            Buffers::Max => super::sys::roomier_buffers(),
            Buffers::Kernel => (None, None),
            Buffers::Fixed(n) => (Some(n), Some(n)),
        }
    }
}

/// The most streams to one peer.
pub const MAX_STREAMS: usize = 16;
/// Streams to a peer under `auto` where nothing was measured (striping forced between ranks of
/// one host, [`STRIPE_LOCAL_VAR`]).
pub const DEFAULT_STREAMS: usize = 4;
/// Default smallest frame striped ([`STRIPE_MIN_VAR`]): below it a frame's time is dominated
/// by the round trip, not the flow's rate, and one stream is cheaper. At most the ring's piece
/// ([`crate::algorithms::RING_CHUNK_BYTES`], 512 KiB), so that a large allreduce's pieces are
/// striped.
pub const DEFAULT_STRIPE_MIN: usize = 256 << 10;

/// Streams the measurement of `auto` tries at once (against one), and the most it chooses.
pub const PROBE_STREAMS: usize = 8;
/// How long each of the measurement's two phases sends.
pub const PROBE_TIME: std::time::Duration = std::time::Duration::from_millis(150);
/// Bytes of each frame the measurement sends on a stream.
pub const PROBE_FRAME: usize = 1 << 20;

/// The streams to use from the measured rates of one stream and of [`PROBE_STREAMS`] at once
/// (bytes per second): 1 where one stream reaches within a quarter of the many-stream rate
/// (one flow already fills the link, or the CPU is the limit), else as many as the ratio says
/// (each flow gets one stream's rate), at least 2 and at most [`PROBE_STREAMS`].
pub fn choose(one: f64, many: f64) -> usize {
    let several_help = one > 0.0 && many >= 1.25 * one;
    if !several_help {
        return 1;
    }
    ((many / one).ceil() as usize).clamp(2, PROBE_STREAMS)
}

/// The streams a TCP world uses to each peer on another host, and what they were chosen
/// from: the same on every rank ([`crate::Transport::stream_choice`]), for reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamChoice {
    /// Connections a communicator holds to each peer on another host.
    pub streams: usize,
    /// The setting it came from ([`STREAMS_VAR`]): [`StreamCount::Auto`] where measured.
    pub setting: StreamCount,
    /// What `auto` measured at the start (`None` where the count was set, or nothing was
    /// measured).
    pub measured: Option<MeasuredRates>,
}

/// The rates `auto`'s start-up measurement saw between rank 0 and the first rank on another
/// host, bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredRates {
    /// One stream alone.
    pub one_stream_bps: f64,
    /// [`MeasuredRates::probe_streams`] streams at once, together.
    pub many_streams_bps: f64,
    /// How many streams the second phase sent over ([`PROBE_STREAMS`]).
    pub probe_streams: usize,
}

impl MeasuredRates {
    /// The rates as rank 0 sends them to every rank with the choice (16 bytes).
    fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.one_stream_bps.to_le_bytes());
        b[8..].copy_from_slice(&self.many_streams_bps.to_le_bytes());
        b
    }

    /// [`MeasuredRates::encode`]'s bytes back; `None` for rates that are not finite and
    /// non-negative.
    fn decode(b: &[u8; 16], probe_streams: usize) -> Option<Self> {
        let one = f64::from_le_bytes(b[..8].try_into().ok()?);
        let many = f64::from_le_bytes(b[8..].try_into().ok()?);
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        (ok(one) && ok(many)).then_some(MeasuredRates {
            one_stream_bps: one,
            many_streams_bps: many,
            probe_streams,
        })
    }
}

/// How many streams a communicator holds to each peer on another host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCount {
    /// Chosen by the runtime: in a world spanning hosts, measured when the transport starts
    /// ([`choose`]); else (striping forced between ranks of one host) [`DEFAULT_STREAMS`].
    Auto,
    /// Exactly this many (1: one connection per peer, no striping).
    Fixed(usize),
}

impl StreamCount {
    /// The number of streams to a peer on another host.
    pub fn resolve(self) -> usize {
        match self {
            StreamCount::Auto => DEFAULT_STREAMS,
            StreamCount::Fixed(n) => n,
        }
    }
}

impl std::fmt::Display for StreamCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamCount::Auto => write!(f, "auto"),
            StreamCount::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// The parallel-stream settings of a TCP world; identical on every rank (the rendezvous
/// checks it and stops every rank, naming both values, where one differs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// Streams to each peer on another host ([`STREAMS_VAR`]).
    pub count: StreamCount,
    /// Smallest data frame striped, in bytes ([`STRIPE_MIN_VAR`]); at least 1.
    pub stripe_min: usize,
    /// Stripe to every peer, also on this rank's host ([`STRIPE_LOCAL_VAR`]; for tests).
    pub every_peer: bool,
    /// Cap every data connection's sending rate at this many bytes per second
    /// ([`FLOW_CAP_VAR`]; emulation, a rank's own business: not compared between ranks).
    pub flow_cap: Option<u64>,
    /// Socket buffers of the data connections to other hosts ([`BUFFERS_VAR`]; a rank's own
    /// business: not compared between ranks).
    pub buffers: Buffers,
    /// The hierarchical allreduce's pipeline chunk in bytes, 0 for none ([`PIPELINE_VAR`]).
    pub pipeline_chunk: usize,
    /// A variable that could not be read, with the reason (reported when the transport starts).
    invalid: Option<(String, String)>,
}

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            count: StreamCount::Auto,
            stripe_min: DEFAULT_STRIPE_MIN,
            every_peer: false,
            flow_cap: None,
            buffers: Buffers::Kernel,
            pipeline_chunk: DEFAULT_PIPELINE_CHUNK,
            invalid: None,
        }
    }
}

impl StreamSettings {
    /// Settings with `n` streams to every peer (also on this host) and frames of at least
    /// `stripe_min` bytes striped: the striped path on loopback, for tests.
    pub fn everywhere(n: usize, stripe_min: usize) -> Self {
        StreamSettings {
            count: StreamCount::Fixed(n),
            stripe_min,
            every_peer: true,
            flow_cap: None,
            buffers: Buffers::Kernel,
            pipeline_chunk: DEFAULT_PIPELINE_CHUNK,
            invalid: None,
        }
    }

    /// The settings from the environment ([`STREAMS_VAR`], [`STRIPE_MIN_VAR`],
    /// [`STRIPE_LOCAL_VAR`]); a value that cannot be read is reported by
    /// [`StreamSettings::check`].
    pub fn from_env() -> Self {
        Self::from_lookup(|v| std::env::var(v).ok())
    }

    /// [`StreamSettings::from_env`] with the variables looked up by `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let mut s = StreamSettings::default();
        if let Some(v) = get(STREAMS_VAR) {
            let v = v.trim();
            match v {
                "" | "auto" => {}
                _ => match v.parse::<usize>() {
                    Ok(n) if (1..=MAX_STREAMS).contains(&n) => s.count = StreamCount::Fixed(n),
                    _ => {
                        s.invalid = Some((
                            STREAMS_VAR.into(),
                            format!(
                                "{v:?} is not a number of streams: give 1 to {MAX_STREAMS}, or \
                                 `auto` (the default)"
                            ),
                        ))
                    }
                },
            }
        }
        if let Some(v) = get(STRIPE_MIN_VAR) {
            match v.trim().parse::<usize>() {
                Ok(n) if n >= 1 => s.stripe_min = n,
                _ => {
                    s.invalid = Some((
                        STRIPE_MIN_VAR.into(),
                        format!("{v:?} is not a size in bytes (at least 1)"),
                    ))
                }
            }
        }
        if let Some(v) = get(FLOW_CAP_VAR) {
            match fh_core::units::parse_size(v.trim()) {
                Ok(n) if n >= 1 => s.flow_cap = Some(n),
                _ => {
                    s.invalid = Some((
                        FLOW_CAP_VAR.into(),
                        format!("{v:?} is not a rate in bytes per second (e.g. 62500000 or 60M)"),
                    ))
                }
            }
        }
        if let Some(v) = get(PIPELINE_VAR) {
            match v.trim() {
                "" | "auto" => {}
                "0" | "off" => s.pipeline_chunk = 0,
                t => match fh_core::units::parse_size(t) {
                    Ok(n) if n >= MIN_PIPELINE_CHUNK as u64 && n <= usize::MAX as u64 => {
                        s.pipeline_chunk = n as usize
                    }
                    _ => {
                        s.invalid = Some((
                            PIPELINE_VAR.into(),
                            format!(
                                "{v:?}: give a chunk size in bytes of at least \
                                 {MIN_PIPELINE_CHUNK} (e.g. 4M), 0 or off (no pipeline), or \
                                 auto (the default)"
                            ),
                        ))
                    }
                },
            }
        }
        if let Some(v) = get(BUFFERS_VAR) {
            match v.trim() {
                "" | "kernel" => {}
                "max" => s.buffers = Buffers::Max,
                t => match fh_core::units::parse_size(t) {
                    Ok(n) if n >= 4096 && n <= usize::MAX as u64 => {
                        s.buffers = Buffers::Fixed(n as usize)
                    }
                    _ => {
                        s.invalid = Some((
                            BUFFERS_VAR.into(),
                            format!(
                                "{v:?}: give kernel (autotuning, the default), max or a size in \
                                 bytes of at least 4096 (e.g. 4M)"
                            ),
                        ))
                    }
                },
            }
        }
        if let Some(v) = get(STRIPE_LOCAL_VAR) {
            match v.trim() {
                "" | "0" => {}
                "1" => s.every_peer = true,
                _ => {
                    s.invalid = Some((
                        STRIPE_LOCAL_VAR.into(),
                        format!("{v:?}: give 1 (stripe to every peer) or 0"),
                    ))
                }
            }
        }
        s
    }

    /// An error naming the variable that could not be read, if one could not.
    pub fn check(&self) -> Result<()> {
        match &self.invalid {
            None if !(1..=MAX_STREAMS).contains(&self.count.resolve()) => {
                Err(TransportError::Config {
                    var: STREAMS_VAR.into(),
                    reason: format!("{} streams: give 1 to {MAX_STREAMS}", self.count.resolve()),
                })
            }
            None if self.stripe_min == 0 => Err(TransportError::Config {
                var: STRIPE_MIN_VAR.into(),
                reason: "0: give a size in bytes (at least 1)".into(),
            }),
            None => Ok(()),
            Some((var, reason)) => Err(TransportError::Config {
                var: var.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// Streams to a peer: [`StreamCount::resolve`] for one on another host (or for every
    /// peer with [`StreamSettings::every_peer`]), else 1.
    pub fn streams_to(&self, same_host: bool) -> usize {
        if same_host && !self.every_peer {
            1
        } else {
            self.count.resolve()
        }
    }

    /// The settings as a rendezvous member sends them to rank 0 ([`ENCODED_LEN`] bytes): the
    /// count (0: auto), whether every peer is striped, the smallest striped frame, the
    /// hierarchical pipeline's chunk.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        let count = match self.count {
            StreamCount::Auto => 0u8,
            StreamCount::Fixed(n) => n.min(u8::MAX as usize) as u8,
        };
        out.push(count);
        out.push(u8::from(self.every_peer));
        out.extend_from_slice(&(self.stripe_min as u64).to_le_bytes());
        out.extend_from_slice(&(self.pipeline_chunk as u64).to_le_bytes());
        out
    }

    /// Decode [`StreamSettings::encode`]'s bytes (with the bytes used).
    pub fn decode(b: &[u8]) -> std::result::Result<(Self, usize), DecodeError> {
        let mut r = Reader::new(b);
        r.need(ENCODED_LEN)?;
        let count = r.u8()?;
        let every = r.u8()?;
        let min = r.u64()?;
        let chunk = r.u64()?;
        let count = match count {
            0 => StreamCount::Auto,
            n if (n as usize) <= MAX_STREAMS => StreamCount::Fixed(n as usize),
            n => {
                return Err(DecodeError::Invalid(format!(
                    "{n} streams (at most {MAX_STREAMS})"
                )))
            }
        };
        let every_peer = match every {
            0 => false,
            1 => true,
            v => return Err(DecodeError::Invalid(format!("stripe-local flag {v}"))),
        };
        if min == 0 || min > usize::MAX as u64 {
            return Err(DecodeError::Invalid(format!(
                "smallest striped frame {min}"
            )));
        }
        let pipeline_chunk = usize::try_from(chunk)
            .map_err(|_| DecodeError::Invalid(format!("pipeline chunk {chunk}")))?;
        let s = StreamSettings {
            count,
            stripe_min: min as usize,
            every_peer,
            flow_cap: None,
            buffers: Buffers::Kernel,
            pipeline_chunk,
            invalid: None,
        };
        Ok((s, ENCODED_LEN))
    }

    /// How `other` (rank `rank`'s settings) differs from these (rank 0's), naming both values.
    /// Returns the variable and the reason.
    pub(crate) fn mismatch(&self, rank: usize, other: &StreamSettings) -> Option<(String, String)> {
        let (a, b) = (self, other);
        let (var, what) = if a.count != b.count {
            (
                STREAMS_VAR,
                format!("{} on rank 0 but {} on rank {rank}", a.count, b.count),
            )
        } else if a.stripe_min != b.stripe_min {
            (
                STRIPE_MIN_VAR,
                format!(
                    "{} on rank 0 but {} on rank {rank}",
                    a.stripe_min, b.stripe_min
                ),
            )
        } else if a.pipeline_chunk != b.pipeline_chunk {
            (
                PIPELINE_VAR,
                format!(
                    "{} bytes on rank 0 but {} on rank {rank}",
                    a.pipeline_chunk, b.pipeline_chunk
                ),
            )
        } else if a.every_peer != b.every_peer {
            (
                STRIPE_LOCAL_VAR,
                format!(
                    "{} on rank 0 but {} on rank {rank}",
                    u8::from(a.every_peer),
                    u8::from(b.every_peer)
                ),
            )
        } else {
            return None;
        };
        Some((
            var.to_string(),
            format!(
                "{var} is {what}: the TCP streams between two ranks must be the same on both \
                 ends; set the same value on every rank (or leave it unset)"
            ),
        ))
    }
}

/// Bytes of [`StreamSettings::encode`].
pub const ENCODED_LEN: usize = 18;

/// How many stripes a message of `len` bytes to a peer with `streams` connections takes: all of
/// them from `stripe_min` bytes on (never more than there are bytes), else 1.
pub fn stripe_count(len: usize, streams: usize, stripe_min: usize) -> usize {
    if streams <= 1 || len < stripe_min.max(2) {
        1
    } else {
        streams.min(len)
    }
}

/// The bytes of stripe `i` of `n` of a message of `len` bytes: contiguous, in order, sizes
/// differing by at most one byte.
pub fn stripe_range(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let at = |k: usize| ((len as u128 * k as u128) / n as u128) as usize;
    at(i)..at(i + 1)
}

impl TcpTransport {
    /// `FH_TCP_STREAMS=auto` in a world spanning hosts: rank 0 and the first rank on another
    /// host measure the rate of one stream and of [`PROBE_STREAMS`] at once, each for
    /// [`PROBE_TIME`], over a communicator of their own (the world's first, opened by
    /// every rank), and rank 0 sends every rank the streams the ratio asks for
    /// ([`choose`]) with the rates it measured. Returns both, the same on every rank.
    pub(super) fn measure_streams(&mut self) -> Result<(usize, Option<MeasuredRates>)> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let host0 = self.layout.topology(0).cross_rank;
        let Some(q) = (1..size).find(|&r| self.layout.topology(r).cross_rank != host0) else {
            return Ok((self.opts.streams.count.resolve(), None));
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let label = "fh-tcp-stream-probe";
        let want: Vec<usize> = (0..size)
            .map(|p| match (rank, p) {
                _ if p == rank => 0,
                (0, p) | (p, 0) if p == q => PROBE_STREAMS,
                _ => 1,
            })
            .collect();
        let peers = self
            .open_mesh(label, seq, &want)
            .map_err(|e| self.tell_formation_failed(e, seq))?;
        let mut c = TcpComm::new(
            label.to_owned(),
            seq,
            rank,
            size,
            peers,
            &self.opts,
            self.link.clone(),
            Interrupt::new(),
        );
        // The count, then the two rates (for reports: every rank knows what was chosen from).
        let mut chosen = [0u8; 24];
        if rank == 0 || rank == q {
            let mut rates = [0.0f64; 2];
            for (phase, k) in [1, PROBE_STREAMS].into_iter().enumerate() {
                c.set_stripe_cap(k);
                // Frames of PROBE_FRAME bytes on each stream in use; the first byte says
                // whether more follow, so the receiver needs no clock.
                let len = (k * PROBE_FRAME).max(self.opts.streams.stripe_min);
                let mut buf = vec![1u8; len];
                let mut ack = [0u8; 8];
                if rank == 0 {
                    let start = Instant::now();
                    let mut sent = 0usize;
                    loop {
                        let last = start.elapsed() >= PROBE_TIME;
                        buf[0] = u8::from(!last);
                        c.send(q, &buf)?;
                        sent += buf.len();
                        if last {
                            break;
                        }
                    }
                    c.recv(q, &mut ack)?;
                    rates[phase] = sent as f64 / start.elapsed().as_secs_f64();
                } else {
                    loop {
                        c.recv(0, &mut buf)?;
                        if buf[0] == 0 {
                            break;
                        }
                    }
                    c.send(0, &ack)?;
                }
            }
            if rank == 0 {
                let s = choose(rates[0], rates[1]);
                tracing::info!(
                    with = q,
                    one_stream_mb_s = rates[0] / 1e6,
                    streams_mb_s = rates[1] / 1e6,
                    probe_streams = PROBE_STREAMS,
                    chosen = s,
                    stripe_min = self.opts.streams.stripe_min,
                    "TCP streams to each peer on another host, measured (FH_TCP_STREAMS=auto)"
                );
                chosen[..8].copy_from_slice(&(s as u64).to_le_bytes());
                let rates = MeasuredRates {
                    one_stream_bps: rates[0],
                    many_streams_bps: rates[1],
                    probe_streams: PROBE_STREAMS,
                };
                chosen[8..].copy_from_slice(&rates.encode());
            }
        }
        c.broadcast(&mut chosen, 0)?;
        let mut count = [0u8; 8];
        count.copy_from_slice(&chosen[..8]);
        let s = u64::from_le_bytes(count) as usize;
        let mut rates = [0u8; 16];
        rates.copy_from_slice(&chosen[8..]);
        if !(1..=MAX_STREAMS).contains(&s) {
            return Err(TransportError::Protocol {
                rank: 0,
                detail: format!("rank 0 chose {s} TCP streams (at most {})", MAX_STREAMS),
            });
        }
        Ok((s, MeasuredRates::decode(&rates, PROBE_STREAMS)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_the_message_in_order() {
        for len in [0usize, 1, 2, 3, 7, 1000, 1 << 20, (1 << 20) + 3] {
            for streams in 1..=5 {
                let n = stripe_count(len, streams, 2);
                let mut next = 0;
                for i in 0..n {
                    let r = stripe_range(len, n, i);
                    assert_eq!(r.start, next);
                    assert!(n == 1 || !r.is_empty(), "len {len} n {n} stripe {i} empty");
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(stripe_count(999, 4, 1000), 1);
        assert_eq!(stripe_count(1000, 4, 1000), 4);
        assert_eq!(stripe_count(1000, 1, 1), 1);
    }

    #[test]
    fn the_measured_ratio_chooses_the_streams() {
        // One flow fills the link (or the CPU is the limit): one stream.
        assert_eq!(choose(100.0, 110.0), 1);
        assert_eq!(choose(100.0, 60.0), 1);
        assert_eq!(choose(0.0, 60.0), 1);
        assert_eq!(choose(f64::NAN, 60.0), 1);
        // A per-flow cap of a quarter of the link: four.
        assert_eq!(choose(0.48, 1.91), 4);
        assert_eq!(choose(100.0, 130.0), 2);
        // Never more than were tried.
        assert_eq!(choose(1.0, 100.0), PROBE_STREAMS);
    }

    #[test]
    fn measured_rates_travel_with_the_choice() {
        let r = MeasuredRates {
            one_stream_bps: 59.75e6,
            many_streams_bps: 238.7e6,
            probe_streams: PROBE_STREAMS,
        };
        assert_eq!(MeasuredRates::decode(&r.encode(), PROBE_STREAMS), Some(r));
        let mut bad = r.encode();
        bad[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(MeasuredRates::decode(&bad, PROBE_STREAMS), None);
    }

    #[test]
    fn settings_round_trip_and_mismatches_name_both_values() {
        let s = StreamSettings::everywhere(3, 4096);
        let (d, used) = StreamSettings::decode(&s.encode()).unwrap();
        assert_eq!((d, used), (s.clone(), ENCODED_LEN));
        assert!(matches!(
            StreamSettings::decode(&s.encode()[..5]),
            Err(DecodeError::NeedMore(_))
        ));
        let other = StreamSettings::everywhere(2, 4096);
        let (var, why) = s.mismatch(5, &other).unwrap();
        assert_eq!(var, STREAMS_VAR);
        assert!(
            why.contains("FH_TCP_STREAMS is 3 on rank 0 but 2 on rank 5"),
            "{why}"
        );
        assert_eq!(s.mismatch(1, &s.clone()), None);
        let off = StreamSettings {
            pipeline_chunk: 0,
            ..s.clone()
        };
        let (d, _) = StreamSettings::decode(&off.encode()).unwrap();
        assert_eq!(d.pipeline_chunk, 0);
        let (var, why) = s.mismatch(2, &off).unwrap();
        assert_eq!(var, PIPELINE_VAR);
        assert!(why.contains("on rank 2"), "{why}");
    }

    #[test]
    fn the_environment_is_read_and_bad_values_are_named() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            StreamSettings::from_lookup(move |v| {
                pairs.iter().find(|p| p.0 == v).map(|p| p.1.to_string())
            })
        };
        let s = env(&[
            ("FH_TCP_STREAMS", "8"),
            ("FH_TCP_STRIPE_MIN", "100"),
            ("FH_TCP_FLOW_CAP", "20M"),
        ]);
        assert_eq!(s.flow_cap, Some(20 << 20));
        assert_eq!(
            (s.count, s.stripe_min, s.every_peer),
            (StreamCount::Fixed(8), 100, false)
        );
        assert!(s.check().is_ok());
        assert_eq!(env(&[]).count, StreamCount::Auto);
        assert_eq!(
            env(&[("FH_TCP_STREAMS", "auto")]).streams_to(false),
            DEFAULT_STREAMS
        );
        assert_eq!(env(&[("FH_TCP_STREAMS", "8")]).streams_to(true), 1);
        assert_eq!(env(&[]).pipeline_chunk, DEFAULT_PIPELINE_CHUNK);
        assert_eq!(env(&[]).buffers, Buffers::Kernel);
        assert_eq!(env(&[("FH_TCP_BUFFERS", "max")]).buffers, Buffers::Max);
        assert_eq!(
            env(&[("FH_TCP_BUFFERS", "4M")]).buffers,
            Buffers::Fixed(4 << 20)
        );
        assert_eq!(Buffers::Kernel.sizes(), (None, None));
        assert_eq!(env(&[("FH_HIER_PIPELINE", "0")]).pipeline_chunk, 0);
        assert_eq!(env(&[("FH_HIER_PIPELINE", "8M")]).pipeline_chunk, 8 << 20);
        assert_eq!(
            env(&[("FH_TCP_STREAMS", "8"), ("FH_TCP_STRIPE_LOCAL", "1")]).streams_to(true),
            8
        );
        for bad in [
            &[("FH_TCP_STREAMS", "0")][..],
            &[("FH_TCP_STREAMS", "many")],
            &[("FH_TCP_STREAMS", "17")],
            &[("FH_TCP_STRIPE_MIN", "0")],
            &[("FH_TCP_STRIPE_LOCAL", "yes")],
            &[("FH_TCP_FLOW_CAP", "fast")],
            &[("FH_HIER_PIPELINE", "1k")],
            &[("FH_HIER_PIPELINE", "yes")],
            &[("FH_TCP_BUFFERS", "huge")],
        ] {
            let err = env(bad).check().unwrap_err().to_string();
            assert!(err.contains(bad[0].0), "{err}");
        }
    }
}
