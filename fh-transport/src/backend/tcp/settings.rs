//! The settings of a TCP world's data connections: the parallel streams to peers on other
//! hosts (`FH_TCP_STREAMS`, `FH_TCP_STRIPE_MIN`, `FH_TCP_STRIPE_LOCAL`), the `hier` pipeline's
//! chunk (`FH_HIER_PIPELINE`), compared at the rendezvous ([`StreamSettings::encode`]); and
//! what stays local to a rank: the per-flow cap of tests (`FH_TCP_FLOW_CAP`) and the socket
//! buffers (`FH_TCP_BUFFERS`). How the streams are chosen and used: [`super::streams`].

use fh_core::bytes::{DecodeError, Reader};

use crate::{Result, TransportError};

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

/// How many streams a communicator holds to each peer on another host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCount {
    /// Chosen by the runtime: in a world spanning hosts, measured when the transport starts
    /// ([`choose`](super::streams::choose)); else (striping forced between ranks of one host) [`DEFAULT_STREAMS`].
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

#[cfg(test)]
mod tests {
    use fh_core::bytes::DecodeError;

    use super::{
        Buffers, StreamCount, StreamSettings, DEFAULT_PIPELINE_CHUNK, DEFAULT_STREAMS, ENCODED_LEN,
        PIPELINE_VAR, STREAMS_VAR,
    };

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
