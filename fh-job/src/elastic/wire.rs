//! The session protocol between an elastic worker and its driver: frames, the handshake's
//! proofs and the messages. Every decoder checks every length before using it and returns an
//! error (never panics, never allocates more than [`MAX_FRAME`]) on any input.
//!
//! ## Frames
//!
//! A 4-byte little-endian body length (1 to [`MAX_FRAME`]) and the body; the body's first byte
//! is the message type.
//!
//! ## Handshake (mutual HMAC-SHA-256 challenge–response, as the TCP backend's)
//!
//! 1. **Hello** (worker → driver): magic `FHEL`, protocol version (2 bytes), the worker's
//!    fresh nonce (32), its id (1-byte length and text, `host:slot`).
//! 2. **Challenge** (driver → worker): the driver's nonce (32) and its proof
//!    HMAC(token, driver label ‖ hello body ‖ driver nonce). The hello holds the worker's
//!    nonce, so only a holder of the token can answer this worker.
//! 3. **Proof** (worker → driver): HMAC(token, worker label ‖ hello body ‖ driver nonce), sent
//!    only once the driver's proof checked out.
//! 4. **Welcome** (driver → worker): the driver's elastic timeout in milliseconds; or
//!    **Refuse** with a reason, and the connection closes.
//!
//! ## Messages
//!
//! Worker → driver: **Register** (the worker's rendezvous candidate `ip:port`), **HostUpdates**
//! (`since`, 8 bytes). Driver → worker: **Member** (an [`Assignment`]), **Removed** and
//! **Failed** (a reason), **HostUpdate** (stamp, added, removed).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fh_core::bytes::{self, DecodeError};

use super::{Assignment, HostUpdate, Membership};
use crate::token::{constant_time_eq, proof, Key, NONCE_LEN, PROOF_TAG_LEN};
use crate::{JobError, Topology};

/// Largest frame body accepted or sent.
pub const MAX_FRAME: usize = 64 * 1024;
/// Magic opening a hello.
const MAGIC: [u8; 4] = *b"FHEL";
/// Version of this protocol (2: the proofs are the job's one MAC construction, [`Key::mac`]).
pub const VERSION: u16 = 2;
/// Longest worker id, rendezvous address or candidate.
pub const MAX_NAME_LEN: usize = 255;
/// Longest reason sent or accepted.
pub const MAX_REASON_LEN: usize = 4096;

const DRIVER_LABEL: &[u8] = b"fasthorovod elastic v1: driver proof\0";
const WORKER_LABEL: &[u8] = b"fasthorovod elastic v1: worker proof\0";

const T_HELLO: u8 = 1;
const T_CHALLENGE: u8 = 2;
const T_PROOF: u8 = 3;
const T_WELCOME: u8 = 4;
const T_REFUSE: u8 = 5;
const T_REGISTER: u8 = 0x10;
const T_HOST_UPDATES: u8 = 0x11;
const T_MEMBER: u8 = 0x20;
const T_REMOVED: u8 = 0x21;
const T_FAILED: u8 = 0x22;
const T_HOST_UPDATE: u8 = 0x23;

/// One message of the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Worker → driver, first.
    Hello {
        /// The worker's id (`host:slot`).
        worker: String,
        /// Its fresh nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// Driver → worker: its nonce and proof.
    Challenge {
        /// The driver's nonce.
        nonce: [u8; NONCE_LEN],
        /// Its proof of the token.
        proof: [u8; PROOF_TAG_LEN],
    },
    /// Worker → driver: its proof.
    Proof([u8; PROOF_TAG_LEN]),
    /// Driver → worker: accepted; the driver's elastic timeout.
    Welcome {
        /// `--elastic-timeout`, in milliseconds.
        timeout_ms: u64,
    },
    /// Driver → worker: refused.
    Refuse(String),
    /// Worker → driver: register for the next world.
    Register {
        /// `ip:port` where this worker would listen as rank 0.
        candidate: String,
    },
    /// Worker → driver: host-set changes after `since`?
    HostUpdates {
        /// The last stamp the worker saw.
        since: u64,
    },
    /// Driver → worker: the answer to a Register.
    Answer(Membership),
    /// Driver → worker: the answer to a HostUpdates.
    Update(HostUpdate),
}

fn put_str(out: &mut Vec<u8>, s: &str, max: usize, wide: bool) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    if wide {
        out.extend_from_slice(&(end as u16).to_le_bytes());
    } else {
        out.push(end as u8);
    }
    out.extend_from_slice(&s.as_bytes()[..end]);
}

impl Msg {
    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Msg::Hello { worker, nonce } => {
                out.push(T_HELLO);
                out.extend_from_slice(&MAGIC);
                out.extend_from_slice(&VERSION.to_le_bytes());
                out.extend_from_slice(nonce);
                put_str(&mut out, worker, MAX_NAME_LEN, false);
            }
            Msg::Challenge { nonce, proof } => {
                out.push(T_CHALLENGE);
                out.extend_from_slice(nonce);
                out.extend_from_slice(proof);
            }
            Msg::Proof(tag) => {
                out.push(T_PROOF);
                out.extend_from_slice(tag);
            }
            Msg::Welcome { timeout_ms } => {
                out.push(T_WELCOME);
                out.extend_from_slice(&timeout_ms.to_le_bytes());
            }
            Msg::Refuse(why) => {
                out.push(T_REFUSE);
                put_str(&mut out, why, MAX_REASON_LEN, true);
            }
            Msg::Register { candidate } => {
                out.push(T_REGISTER);
                put_str(&mut out, candidate, MAX_NAME_LEN, false);
            }
            Msg::HostUpdates { since } => {
                out.push(T_HOST_UPDATES);
                out.extend_from_slice(&since.to_le_bytes());
            }
            Msg::Answer(Membership::Member(a)) => {
                out.push(T_MEMBER);
                out.extend_from_slice(&a.generation.to_le_bytes());
                out.extend_from_slice(&a.hosts_stamp.to_le_bytes());
                let t = a.topology;
                for v in [
                    t.rank,
                    t.size,
                    t.local_rank,
                    t.local_size,
                    t.cross_rank,
                    t.cross_size,
                ] {
                    out.extend_from_slice(&(v.min(u32::MAX as usize) as u32).to_le_bytes());
                }
                put_str(&mut out, &a.rendezvous, MAX_NAME_LEN, false);
            }
            Msg::Answer(Membership::Removed(why)) => {
                out.push(T_REMOVED);
                put_str(&mut out, why, MAX_REASON_LEN, true);
            }
            Msg::Answer(Membership::Failed(why)) => {
                out.push(T_FAILED);
                put_str(&mut out, why, MAX_REASON_LEN, true);
            }
            Msg::Update(u) => {
                out.push(T_HOST_UPDATE);
                out.extend_from_slice(&u.stamp.to_le_bytes());
                out.push(u8::from(u.added));
                out.push(u8::from(u.removed));
            }
        }
        out
    }

    /// Decode a whole frame body.
    pub fn decode(body: &[u8]) -> Result<Msg, DecodeError> {
        let mut r = Reader(bytes::Reader::new(body));
        let [kind] = r.take::<1>()?;
        let msg = match kind {
            T_HELLO => {
                if r.take::<4>()? != MAGIC {
                    return Err(invalid("not an elastic session hello (bad magic)"));
                }
                let version = r.read(bytes::Reader::u16)?;
                if version != VERSION {
                    return Err(invalid(format!(
                        "the worker speaks elastic protocol version {version}, this fhrun \
                         speaks {VERSION} (run the same FastHorovod version everywhere)"
                    )));
                }
                let nonce = r.take::<NONCE_LEN>()?;
                let worker = r.text(false)?;
                Msg::Hello { worker, nonce }
            }
            T_CHALLENGE => Msg::Challenge {
                nonce: r.take::<NONCE_LEN>()?,
                proof: r.take::<PROOF_TAG_LEN>()?,
            },
            T_PROOF => Msg::Proof(r.take::<PROOF_TAG_LEN>()?),
            T_WELCOME => Msg::Welcome {
                timeout_ms: r.read(bytes::Reader::u64)?,
            },
            T_REFUSE => Msg::Refuse(r.text(true)?),
            T_REGISTER => Msg::Register {
                candidate: r.text(false)?,
            },
            T_HOST_UPDATES => Msg::HostUpdates {
                since: r.read(bytes::Reader::u64)?,
            },
            T_MEMBER => {
                let generation = r.read(bytes::Reader::u64)?;
                let hosts_stamp = r.read(bytes::Reader::u64)?;
                let mut v = [0usize; 6];
                for x in v.iter_mut() {
                    *x = r.read(bytes::Reader::u32)? as usize;
                }
                let topology = Topology {
                    rank: v[0],
                    size: v[1],
                    local_rank: v[2],
                    local_size: v[3],
                    cross_rank: v[4],
                    cross_size: v[5],
                };
                check_topology(&topology)?;
                let rendezvous = r.text(false)?;
                if rendezvous
                    .rsplit_once(':')
                    .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().map_or(true, |p| p == 0))
                {
                    return Err(invalid(format!(
                        "an assignment whose rendezvous {rendezvous:?} is not ip:port"
                    )));
                }
                Msg::Answer(Membership::Member(Assignment {
                    generation,
                    topology,
                    rendezvous,
                    hosts_stamp,
                }))
            }
            T_REMOVED => Msg::Answer(Membership::Removed(r.text(true)?)),
            T_FAILED => Msg::Answer(Membership::Failed(r.text(true)?)),
            T_HOST_UPDATE => {
                let stamp = r.read(bytes::Reader::u64)?;
                let [added, removed] = r.take::<2>()?;
                if added > 1 || removed > 1 {
                    return Err(invalid("a host update whose flags are not 0 or 1"));
                }
                Msg::Update(HostUpdate {
                    stamp,
                    added: added == 1,
                    removed: removed == 1,
                })
            }
            k => return Err(invalid(format!("unknown elastic message type {k:#x}"))),
        };
        if r.0.pos() != body.len() {
            return Err(invalid(format!(
                "{} stray bytes after an elastic message",
                body.len() - r.0.pos()
            )));
        }
        Ok(msg)
    }
}

fn check_topology(t: &Topology) -> Result<(), DecodeError> {
    let ok = t.size >= 1
        && t.rank < t.size
        && t.local_size >= 1
        && t.local_size <= t.size
        && t.local_rank < t.local_size
        && t.cross_size >= 1
        && t.cross_size <= t.size
        && t.cross_rank < t.cross_size;
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "an assignment with an impossible topology {t:?}"
        )))
    }
}

/// The elastic messages' view of the one byte reader: a frame arrives whole, so a short
/// message is malformed ([`DecodeError::Invalid`] "a truncated elastic message", never
/// [`DecodeError::NeedMore`]: nothing more will come); text has a one- or two-byte length.
struct Reader<'a>(bytes::Reader<'a>);

fn invalid(why: impl Into<String>) -> DecodeError {
    DecodeError::Invalid(why.into())
}

impl<'a> Reader<'a> {
    /// A field read with `read` from the one byte reader.
    fn read<T>(
        &mut self,
        read: impl FnOnce(&mut bytes::Reader<'a>) -> Result<T, DecodeError>,
    ) -> Result<T, DecodeError> {
        read(&mut self.0).map_err(|e| match e {
            DecodeError::NeedMore(_) => invalid("a truncated elastic message"),
            e => e,
        })
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        self.read(bytes::Reader::array)
    }

    fn text(&mut self, wide: bool) -> Result<String, DecodeError> {
        let len = if wide {
            usize::from(self.read(bytes::Reader::u16)?)
        } else {
            usize::from(self.read(bytes::Reader::u8)?)
        };
        self.read(|r| r.text(len, "text"))
    }
}

/// The driver's proof over the hello body and its nonce.
pub fn driver_proof(key: &Key, hello: &[u8], nonce: &[u8; NONCE_LEN]) -> [u8; PROOF_TAG_LEN] {
    proof(key, DRIVER_LABEL, hello, nonce)
}

/// The worker's proof over the hello body and the driver's nonce.
pub fn worker_proof(key: &Key, hello: &[u8], nonce: &[u8; NONCE_LEN]) -> [u8; PROOF_TAG_LEN] {
    proof(key, WORKER_LABEL, hello, nonce)
}

/// Check a proof (`driver`: the driver's, else the worker's) in constant time.
pub fn verify(driver: bool, key: &Key, hello: &[u8], nonce: &[u8; NONCE_LEN], tag: &[u8]) -> bool {
    let label = if driver { DRIVER_LABEL } else { WORKER_LABEL };
    constant_time_eq(&proof(key, label, hello, nonce), tag)
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the connection cleanly before a frame began.
    Closed,
    /// The deadline passed.
    TimedOut,
    /// The stop flag was raised while waiting.
    Stopped,
    /// An I/O error.
    Io(std::io::Error),
    /// Bytes that are not a frame.
    Bad(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => f.write_str("the connection was closed"),
            ReadError::TimedOut => f.write_str("timed out"),
            ReadError::Stopped => f.write_str("stopped"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Bad(why) => f.write_str(why),
        }
    }
}

/// How long one blocking read may last before the deadline and the stop flag are looked at.
const POLL: Duration = Duration::from_millis(200);

fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: &dyn Fn() -> bool,
    started: bool,
) -> Result<(), ReadError> {
    let mut got = 0;
    while got < buf.len() {
        if stop() {
            return Err(ReadError::Stopped);
        }
        let wait = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ReadError::TimedOut);
                }
                left.min(POLL)
            }
            None => POLL,
        };
        stream.set_read_timeout(Some(wait)).map_err(ReadError::Io)?;
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 && !started => return Err(ReadError::Closed),
            Ok(0) => {
                return Err(ReadError::Bad(
                    "the connection ended in the middle of a frame".into(),
                ))
            }
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

/// Read one frame body (bounded by `deadline`, `None`: no deadline, and by `stop`).
pub fn read_frame(
    stream: &mut TcpStream,
    deadline: Option<Instant>,
    stop: &dyn Fn() -> bool,
) -> Result<Vec<u8>, ReadError> {
    let mut head = [0u8; 4];
    read_full(stream, &mut head, deadline, stop, false)?;
    let len = u32::from_le_bytes(head) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(ReadError::Bad(format!(
            "a frame of {len} bytes (expected 1 to {MAX_FRAME}); is something else talking to \
             this port?"
        )));
    }
    let mut body = vec![0u8; len];
    read_full(stream, &mut body, deadline, stop, true)?;
    Ok(body)
}

/// Write one frame (bounded by `timeout`).
pub fn write_frame(stream: &mut TcpStream, body: &[u8], timeout: Duration) -> std::io::Result<()> {
    if body.is_empty() || body.len() > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "an elastic frame of {} bytes",
            body.len()
        )));
    }
    stream.set_write_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)?;
    stream.flush()
}

/// A `JobError` for a protocol violation by the peer `who`.
pub fn protocol(who: &str, detail: impl std::fmt::Display) -> JobError {
    JobError::Handshake {
        peer: who.to_string(),
        reason: detail.to_string(),
    }
}
