//! The TCP backend's wire format: handshake, refusal/acceptance reply, address book and frame
//! headers. Every decoder here works on bounded buffers, checks every length before using it,
//! and returns an error (never panics) on any input.
//!
//! ## Handshake
//!
//! Mutual challenge–response: each side proves that it knows the job token with
//! HMAC-SHA-256 over the handshake and a fresh 32-byte nonce of the *other* side, so the token
//! never crosses the wire, a recorded handshake cannot be replayed, and a connector never
//! proves anything to (or trusts) a listener that has not proved the token first.
//!
//! 1. **Hello** (connector → acceptor), [`HELLO_LEN`] bytes:
//!
//!    | bytes | field |
//!    |---|---|
//!    | 4 | magic `FHTP` |
//!    | 2 | protocol version, little endian |
//!    | 16 | the FastHorovod release ([`fh_core::RELEASE`]), UTF-8 padded with zeros |
//!    | 1 | kind: 0 rendezvous, 1 data connection, 2 abort notice |
//!    | 1 | reserved, 0 |
//!    | 4 | world size |
//!    | 4 | rank of the connector |
//!    | 8 | communicator sequence number |
//!    | 2 | data-listener port (rendezvous); the stream index, from 0 (data connections); else 0 |
//!    | 4 | the lost rank (abort notices only; else 0) |
//!    | 16 | the world id: the job's nonce, drawn by rank 0 and sent with the address book (0 on rendezvous connections) |
//!    | 32 | the connector's nonce |
//!
//!    The first [`PREAMBLE_LEN`] bytes (magic, protocol version, release) keep their place in
//!    every protocol version from 5 on, so that a listener can always name the release of a
//!    connector it refuses. Both must equal the listener's own: a rank of another release is
//!    refused before the challenge, with a reason naming both releases and both protocol
//!    versions.
//! 2. **Challenge** (acceptor → connector), [`CHALLENGE_LEN`] bytes: magic `FHTC`, the
//!    acceptor's nonce (32 bytes) and its proof (32 bytes), [`acceptor_proof`] =
//!    HMAC(token, label ‖ hello ‖ acceptor nonce). The hello holds the connector's nonce, so
//!    only a holder of the token can answer this connector. (An acceptor that refuses at once
//!    — garbage, another version — sends a refusal reply instead.)
//! 3. **Proof** (connector → acceptor), [`PROOF_LEN`] bytes: magic `FHTK` and
//!    [`connector_proof`] = HMAC(token, other label ‖ hello ‖ acceptor nonce), sent only after
//!    the acceptor's proof checked out. The distinct labels keep one side's proof from being
//!    reflected as the other's.
//! 4. **Reply** (acceptor → connector): accepted or refused with a reason.
//!
//! ## Reply (acceptor → connector)
//!
//! magic `FHTR`, status (0 accepted, 1 refused), a 2-byte reason length (≤ [`MAX_REASON_LEN`])
//! and the UTF-8 reason. A refusal is followed by closing the connection.
//!
//! ## Rendezvous
//!
//! On an accepted rendezvous connection the member sends its host place
//! ([`fh_job::hosts::Place::encode`]) and its stream settings
//! ([`super::settings::StreamSettings::encode`], which rank 0 checks against its own); once every rank is in, rank 0 answers with the address
//! book ([`encode_book`]) followed by every rank's place ([`fh_job::hosts::encode_places`]).
//! Both decoders check every length against the world size before using it. Then rank 0 sends
//! the job's world id ([`WORLD_ID_LEN`] random bytes, [`Hello::world`]), which every later
//! connection of the job names.
//!
//! ## Frames (on data connections)
//!
//! An 8-byte little-endian header followed by the payload. A header below [`CONTROL_BIT`] is a
//! payload length; with the bit set it is a control frame without payload: an *abort notice*
//! carrying the rank whose loss made the sender give up. When a sender gives up in the middle
//! of a frame, where a notice would be taken for payload, it delivers the notice over a fresh
//! connection of kind *abort notice* instead.
//!
//! A message striped over several streams to one peer ([`super::streams`]) is one frame per
//! stream, each carrying its stripe as payload but the length of the *whole* message in its
//! header, so that a receiver expecting another length refuses it before any payload.

use fh_core::bytes::{DecodeError, Reader};
use fh_job::token::{proof, Key};
// The handshake's fields whose owner is fh-job (the token's and the world's).
pub use fh_job::token::{constant_time_eq, fresh_nonce, MAX_TOKEN_LEN, NONCE_LEN, PROOF_TAG_LEN};
pub use fh_job::world::{world_hex, WORLD_ID_LEN};

/// Magic opening every handshake.
pub const HELLO_MAGIC: [u8; 4] = *b"FHTP";
/// Magic opening every reply.
pub const REPLY_MAGIC: [u8; 4] = *b"FHTR";
/// Magic opening the acceptor's challenge.
pub const CHALLENGE_MAGIC: [u8; 4] = *b"FHTC";
/// Magic opening the connector's proof.
pub const PROOF_MAGIC: [u8; 4] = *b"FHTK";
/// Protocol version spoken by this build (2: mutual HMAC challenge–response; 3: the
/// rendezvous carries every rank's host place, [`fh_job::hosts::Place`]; 4: every connection
/// after the rendezvous names the job's world id, [`Hello::world`]; 5: the hello carries the
/// release after the protocol version, in a preamble every later version keeps; 6: the proofs
/// are the job's one MAC construction, `fh_job::token::Key::mac`; 7: a rendezvous member
/// sends its stream settings after its place, and a data connection's hello names its stream,
/// [`super::streams`]; 8: the stream measurement's answer carries the measured rates with the
/// count).
pub const PROTOCOL_VERSION: u16 = 8;
/// Bytes of the release in a hello ([`fh_core::RELEASE`], padded with zeros).
pub const RELEASE_LEN: usize = 16;
/// Bytes of a hello's preamble: magic, protocol version and release, in that place in every
/// protocol version from 5 on.
pub const PREAMBLE_LEN: usize = 6 + RELEASE_LEN;
/// The first protocol version whose hello carries the release.
const FIRST_WITH_RELEASE: u16 = 5;
/// This build's release as a hello carries it.
const RELEASE_FIELD: [u8; RELEASE_LEN] = release_field(fh_core::RELEASE);
/// Longest refusal reason sent or accepted.
pub const MAX_REASON_LEN: usize = 1024;
/// Size of a handshake.
pub const HELLO_LEN: usize = PREAMBLE_LEN + 24 + WORLD_ID_LEN + NONCE_LEN;
/// Largest possible handshake (all handshakes have the same size).
pub const MAX_HELLO_LEN: usize = HELLO_LEN;
/// Size of a challenge.
pub const CHALLENGE_LEN: usize = 4 + NONCE_LEN + PROOF_TAG_LEN;
/// Size of a connector's proof.
pub const PROOF_LEN: usize = 4 + PROOF_TAG_LEN;
/// Size of the fixed part of a reply.
pub const REPLY_FIXED_LEN: usize = 7;
/// Headers with this bit set are control frames.
pub const CONTROL_BIT: u64 = 1 << 63;
/// Control kind (bits 56..63) of an abort notice.
const CONTROL_ABORT: u64 = 1;

const ACCEPTOR_LABEL: &[u8] = b"fasthorovod tcp v2: acceptor proof\0";
const CONNECTOR_LABEL: &[u8] = b"fasthorovod tcp v2: connector proof\0";

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnKind {
    /// A rank's connection to rank 0's rendezvous listener.
    Rendezvous,
    /// A data connection of communicator `seq`.
    Data,
    /// A one-shot notice that the connector gave up on communicator `seq` because it lost
    /// rank `lost`, sent when the notice cannot travel on the data connection itself.
    Abort,
    /// A liveness probe: the connector timed out waiting for this rank and asks whether its
    /// process still answers (a completed handshake is the answer; nothing follows).
    Probe,
}

/// A decoded handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// What the connection is for.
    pub kind: ConnKind,
    /// World size as the connector knows it.
    pub size: u32,
    /// The connector's rank.
    pub rank: u32,
    /// Communicator sequence number (0 for the rendezvous).
    pub seq: u64,
    /// The connector's data-listener port (rendezvous); the connection's stream index to the
    /// acceptor (data connections, [`super::streams`]).
    pub port: u16,
    /// The rank whose loss made the connector give up (abort notices only).
    pub lost: u32,
    /// The job's world id: a random nonce rank 0 draws for each job and sends with the address
    /// book; every connection after the rendezvous names it (and the proofs cover it), so a
    /// rank of another job with the same token is refused. All zeros on rendezvous connections.
    pub world: [u8; WORLD_ID_LEN],
    /// The connector's fresh nonce.
    pub nonce: [u8; NONCE_LEN],
}

/// `release` as a hello carries it: its bytes, padded with zeros to [`RELEASE_LEN`].
const fn release_field(release: &str) -> [u8; RELEASE_LEN] {
    let bytes = release.as_bytes();
    assert!(
        bytes.len() <= RELEASE_LEN,
        "the release does not fit in the hello's release field"
    );
    let mut field = [0u8; RELEASE_LEN];
    let mut i = 0;
    while i < bytes.len() {
        field[i] = bytes[i];
        i += 1;
    }
    field
}

/// A release read from a peer's hello, fit to print: the bytes before the padding, anything
/// but printable ASCII shown as `?` (the bytes come from the network).
fn release_text(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    field[..end]
        .iter()
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect()
}

/// Why a hello of another FastHorovod is refused: its protocol version and, from protocol 5
/// on, its release (`None` before, whose hellos do not carry it), named beside this build's.
fn version_mismatch(protocol: u16, release: Option<&str>) -> DecodeError {
    let theirs = match release {
        Some(r) => format!("FastHorovod {r}"),
        None => "an older FastHorovod".to_string(),
    };
    DecodeError::Invalid(format!(
        "FastHorovod versions differ: the connecting rank runs {theirs} (wire protocol \
         {protocol}), the listening rank runs FastHorovod {} (wire protocol \
         {PROTOCOL_VERSION}); install the same FastHorovod version on every host (`fhrun \
         --version` and `fasthorovod.__version__` say which)",
        fh_core::RELEASE
    ))
}

impl Hello {
    /// Encode ([`HELLO_LEN`] bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&HELLO_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&RELEASE_FIELD);
        out.push(match self.kind {
            ConnKind::Rendezvous => 0,
            ConnKind::Data => 1,
            ConnKind::Abort => 2,
            ConnKind::Probe => 3,
        });
        out.push(0);
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.port.to_le_bytes());
        out.extend_from_slice(&self.lost.to_le_bytes());
        out.extend_from_slice(&self.world);
        out.extend_from_slice(&self.nonce);
        out
    }

    /// Decode from the start of `buf`; returns the handshake and the bytes it used.
    /// Checks the magic, the protocol version and the release as soon as their bytes are
    /// present, so garbage and other versions are refused without waiting for more. The
    /// encoded release is always this build's ([`fh_core::RELEASE`]): a hello of another
    /// release or protocol is refused with a reason naming both releases.
    pub fn decode(buf: &[u8]) -> Result<(Hello, usize), DecodeError> {
        let mut r = Reader::new(buf);
        r.magic(&HELLO_MAGIC, || {
            "not a FastHorovod handshake (bad magic)".into()
        })?;
        let version = r.u16()?;
        if version < FIRST_WITH_RELEASE {
            return Err(version_mismatch(version, None));
        }
        let release: [u8; RELEASE_LEN] = r.array()?;
        if version != PROTOCOL_VERSION || release != RELEASE_FIELD {
            return Err(version_mismatch(version, Some(&release_text(&release))));
        }
        // The rest has a fixed size: wait for all of it.
        r.need(HELLO_LEN - PREAMBLE_LEN)?;
        let kind = match r.u8()? {
            0 => ConnKind::Rendezvous,
            1 => ConnKind::Data,
            2 => ConnKind::Abort,
            3 => ConnKind::Probe,
            k => return Err(DecodeError::Invalid(format!("unknown connection kind {k}"))),
        };
        if r.u8()? != 0 {
            return Err(DecodeError::Invalid(
                "reserved handshake byte is not 0".into(),
            ));
        }
        let hello = Hello {
            version,
            kind,
            size: r.u32()?,
            rank: r.u32()?,
            seq: r.u64()?,
            port: r.u16()?,
            lost: r.u32()?,
            world: r.array()?,
            nonce: r.array()?,
        };
        Ok((hello, r.pos()))
    }
}

/// The acceptor's proof: [`proof`] under the job's key over the encoded hello (which holds
/// the connector's nonce) and the acceptor's nonce.
pub fn acceptor_proof(
    key: &Key,
    hello: &[u8],
    acceptor_nonce: &[u8; NONCE_LEN],
) -> [u8; PROOF_TAG_LEN] {
    proof(key, ACCEPTOR_LABEL, hello, acceptor_nonce)
}

/// The connector's proof: as [`acceptor_proof`] with another label.
pub fn connector_proof(
    key: &Key,
    hello: &[u8],
    acceptor_nonce: &[u8; NONCE_LEN],
) -> [u8; PROOF_TAG_LEN] {
    proof(key, CONNECTOR_LABEL, hello, acceptor_nonce)
}

/// Check an acceptor's proof in constant time.
pub fn verify_acceptor_proof(
    key: &Key,
    hello: &[u8],
    acceptor_nonce: &[u8; NONCE_LEN],
    tag: &[u8],
) -> bool {
    constant_time_eq(&acceptor_proof(key, hello, acceptor_nonce), tag)
}

/// Check a connector's proof in constant time.
pub fn verify_connector_proof(
    key: &Key,
    hello: &[u8],
    acceptor_nonce: &[u8; NONCE_LEN],
    tag: &[u8],
) -> bool {
    constant_time_eq(&connector_proof(key, hello, acceptor_nonce), tag)
}

/// The acceptor's first answer: a challenge, or a refusal before any challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The acceptor's nonce and proof.
    Challenge {
        /// The acceptor's nonce.
        nonce: [u8; NONCE_LEN],
        /// Its proof of the token ([`acceptor_proof`]).
        proof: [u8; PROOF_TAG_LEN],
    },
    /// A reply at once (in practice a refusal: garbage, another version).
    Reply(Reply),
}

impl Answer {
    /// Encode a challenge.
    pub fn encode_challenge(nonce: &[u8; NONCE_LEN], proof: &[u8; PROOF_TAG_LEN]) -> Vec<u8> {
        let mut out = Vec::with_capacity(CHALLENGE_LEN);
        out.extend_from_slice(&CHALLENGE_MAGIC);
        out.extend_from_slice(nonce);
        out.extend_from_slice(proof);
        out
    }

    /// Decode from the start of `buf`: a challenge or a reply.
    pub fn decode(buf: &[u8]) -> Result<(Answer, usize), DecodeError> {
        let mut r = Reader::new(buf);
        if r.could_be(&REPLY_MAGIC) {
            return Reply::decode(buf).map(|(reply, n)| (Answer::Reply(reply), n));
        }
        r.magic(&CHALLENGE_MAGIC, || {
            "the peer did not answer with a FastHorovod challenge (bad magic); is something \
             else listening on that port?"
                .into()
        })?;
        r.need(NONCE_LEN + PROOF_TAG_LEN)?;
        let challenge = Answer::Challenge {
            nonce: r.array()?,
            proof: r.array()?,
        };
        Ok((challenge, r.pos()))
    }
}

/// Encode a connector's proof.
pub fn encode_proof(tag: &[u8; PROOF_TAG_LEN]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PROOF_LEN);
    out.extend_from_slice(&PROOF_MAGIC);
    out.extend_from_slice(tag);
    out
}

/// Decode a connector's proof.
pub fn decode_proof(buf: &[u8]) -> Result<([u8; PROOF_TAG_LEN], usize), DecodeError> {
    let mut r = Reader::new(buf);
    r.magic(&PROOF_MAGIC, || {
        "not a FastHorovod handshake proof (bad magic)".into()
    })?;
    let tag = r.array()?;
    Ok((tag, r.pos()))
}

/// The acceptor's answer to a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Accepted.
    Accept,
    /// Refused, with the reason (at most [`MAX_REASON_LEN`] bytes).
    Refuse(String),
}

impl Reply {
    /// Encode (reasons are cut to [`MAX_REASON_LEN`] bytes at a character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let (status, reason) = match self {
            Reply::Accept => (0u8, ""),
            Reply::Refuse(r) => {
                let mut end = r.len().min(MAX_REASON_LEN);
                while !r.is_char_boundary(end) {
                    end -= 1;
                }
                (1u8, &r[..end])
            }
        };
        let mut out = Vec::with_capacity(REPLY_FIXED_LEN + reason.len());
        out.extend_from_slice(&REPLY_MAGIC);
        out.push(status);
        out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        out.extend_from_slice(reason.as_bytes());
        out
    }

    /// Decode from the start of `buf`; returns the reply and the bytes it used.
    pub fn decode(buf: &[u8]) -> Result<(Reply, usize), DecodeError> {
        let mut r = Reader::new(buf);
        r.magic(&REPLY_MAGIC, || {
            "the peer did not answer with a FastHorovod reply (bad magic); is something else \
             listening on that port?"
                .into()
        })?;
        r.need(REPLY_FIXED_LEN - REPLY_MAGIC.len())?;
        let status = r.u8()?;
        let len = usize::from(r.u16()?);
        if len > MAX_REASON_LEN {
            return Err(DecodeError::Invalid(format!(
                "reply reason of {len} bytes exceeds the maximum of {MAX_REASON_LEN}"
            )));
        }
        match status {
            0 if len == 0 => Ok((Reply::Accept, r.pos())),
            0 => Err(DecodeError::Invalid(
                "an acceptance carrying a reason".into(),
            )),
            1 => {
                // Printed, never parsed: lossy keeps a garbled reason readable.
                let reason = String::from_utf8_lossy(r.bytes(len)?).into_owned();
                Ok((Reply::Refuse(reason), r.pos()))
            }
            s => Err(DecodeError::Invalid(format!("unknown reply status {s}"))),
        }
    }
}

/// Encode the address book rank 0 sends after the rendezvous: every rank's data-listener
/// address (`ip:port` strings; rank 0's entry carries only its port, prefixed by `:`).
pub fn encode_book(addrs: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
    for a in addrs {
        let a = &a.as_bytes()[..a.len().min(255)];
        out.push(a.len() as u8);
        out.extend_from_slice(a);
    }
    out
}

/// Longest encoded address book for `size` ranks.
pub fn max_book_len(size: usize) -> usize {
    4 + size.saturating_mul(256)
}

/// Decode an address book that must hold exactly `size` entries.
pub fn decode_book(buf: &[u8], size: usize) -> Result<(Vec<String>, usize), DecodeError> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    if n != size {
        return Err(DecodeError::Invalid(format!(
            "address book lists {n} ranks, expected {size}"
        )));
    }
    let mut out = Vec::with_capacity(n.min(buf.len()));
    for _ in 0..n {
        let len = usize::from(r.u8()?);
        out.push(r.text(len, "an address book entry")?);
    }
    Ok((out, r.pos()))
}

/// The count that marks rank 0's answer at the rendezvous as a failure notice instead of an
/// address book ([`encode_rendezvous_failure`]).
const RENDEZVOUS_FAILED: u32 = u32::MAX;

/// Longest reason in a rendezvous failure notice.
const MAX_FAILURE_TEXT: usize = 1024;

/// Rank 0's answer at the rendezvous when it gives up (a rank never joined, or failed while
/// joining): which rank to blame and why, so that the members name that rank, not rank 0.
pub fn encode_rendezvous_failure(lost: u32, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_FAILURE_TEXT);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = RENDEZVOUS_FAILED.to_le_bytes().to_vec();
    out.extend_from_slice(&lost.to_le_bytes());
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&reason.as_bytes()[..end]);
    out
}

/// Rank 0's answer at the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousAnswer {
    /// The address book: one entry per rank.
    Book(Vec<String>),
    /// Rank 0 gave up, blaming `lost`.
    Failed {
        /// The rank rank 0 blames.
        lost: u32,
        /// Why (rank 0's error).
        reason: String,
    },
}

/// Decode rank 0's answer: an address book of exactly `size` entries, or a failure notice.
pub fn decode_rendezvous_answer(
    buf: &[u8],
    size: usize,
) -> Result<(RendezvousAnswer, usize), DecodeError> {
    let mut r = Reader::new(buf);
    if r.u32()? != RENDEZVOUS_FAILED {
        return decode_book(buf, size).map(|(b, n)| (RendezvousAnswer::Book(b), n));
    }
    r.need(6)?;
    let lost = r.u32()?;
    let len = usize::from(r.u16()?);
    if len > MAX_FAILURE_TEXT {
        return Err(DecodeError::Invalid(format!(
            "rendezvous failure notice of {len} bytes (at most {MAX_FAILURE_TEXT})"
        )));
    }
    // Printed, never parsed: lossy keeps a garbled reason readable.
    let reason = String::from_utf8_lossy(r.bytes(len)?).into_owned();
    Ok((RendezvousAnswer::Failed { lost, reason }, r.pos()))
}

/// Longest answer of rank 0 at the rendezvous for `size` ranks.
pub fn max_rendezvous_answer_len(size: usize) -> usize {
    max_book_len(size).max(10 + MAX_FAILURE_TEXT)
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// A payload of this many bytes follows.
    Data(u64),
    /// The sender gave up because it lost this rank; no payload follows.
    Abort {
        /// The rank whose loss made the sender give up.
        lost: u32,
    },
    /// A control frame this build does not know.
    Unknown(u64),
}

/// Encode a data header for a payload of `len` bytes.
pub fn data_header(len: u64) -> [u8; 8] {
    len.to_le_bytes()
}

/// Encode an abort notice naming the lost rank.
pub fn abort_header(lost: u32) -> [u8; 8] {
    (CONTROL_BIT | (CONTROL_ABORT << 56) | u64::from(lost)).to_le_bytes()
}

/// Decode a frame header.
pub fn decode_header(bytes: [u8; 8]) -> Header {
    let v = u64::from_le_bytes(bytes);
    if v & CONTROL_BIT == 0 {
        Header::Data(v)
    } else if (v >> 56) & 0x7f == CONTROL_ABORT {
        Header::Abort {
            lost: (v & 0xffff_ffff) as u32,
        }
    } else {
        Header::Unknown(v)
    }
}

/// Check a data header against the length the receiver expects, before touching the payload:
/// a frame of any other length (in particular a larger one) is an error, never an allocation.
pub fn check_data_len(header: u64, expected: usize) -> Result<(), String> {
    if header != expected as u64 {
        return Err(format!(
            "expected a message of {expected} bytes, the peer announced {header} bytes \
             (mismatched collective calls on different ranks?)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
