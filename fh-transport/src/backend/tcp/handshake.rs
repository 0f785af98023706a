//! The connecting side of the TCP backend's door, and the deadline-bounded reads and writes
//! both sides use: one handshake ([`wire`](super::wire)) checks the listener's proof before
//! proving anything, and [`connect_handshake`] retries dropped or timed-out attempts until the
//! job's deadline.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{self, Answer, Hello, Reply};
use super::Key;
use crate::{Result, TransportError};
use fh_core::bytes::DecodeError;

/// Why reading a message failed.
pub(super) enum ReadFail {
    /// The peer closed the connection.
    Closed,
    /// The deadline passed.
    TimedOut,
    /// The bytes are not a valid message.
    Decode(DecodeError),
    /// Another I/O error.
    Io(io::Error),
    /// The watch of a [`read_msg_watched`] ended the wait with this error.
    Cancelled(TransportError),
}

/// Read one message with `decode` (which says how many bytes it needs, at most `max`) until
/// `deadline`, never reading past its end. Returns the message and its bytes.
pub(super) fn read_msg<T>(
    stream: &mut TcpStream,
    deadline: Instant,
    max: usize,
    decode: impl Fn(&[u8]) -> std::result::Result<(T, usize), DecodeError>,
) -> std::result::Result<(T, Vec<u8>), ReadFail> {
    read_msg_watched(stream, deadline, max, decode, &|| None)
}

/// How often a watched read ([`read_msg_watched`]) asks whether to give up.
const WATCH_SLICE: Duration = Duration::from_millis(100);

/// [`read_msg`] that asks `cancel` every [`WATCH_SLICE`] while it waits; an error from it
/// ends the read ([`ReadFail::Cancelled`]). Bytes read so far are kept across the slices.
pub(super) fn read_msg_watched<T>(
    stream: &mut TcpStream,
    deadline: Instant,
    max: usize,
    decode: impl Fn(&[u8]) -> std::result::Result<(T, usize), DecodeError>,
    cancel: &dyn Fn() -> Option<TransportError>,
) -> std::result::Result<(T, Vec<u8>), ReadFail> {
    let mut buf = Vec::new();
    loop {
        match decode(&buf) {
            Ok((msg, used)) => {
                buf.truncate(used);
                return Ok((msg, buf));
            }
            Err(DecodeError::NeedMore(n)) if n <= max => {
                let got = buf.len();
                buf.resize(n.max(got), 0);
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ReadFail::TimedOut);
                }
                if let Some(e) = cancel() {
                    return Err(ReadFail::Cancelled(e));
                }
                stream
                    .set_read_timeout(Some(left.min(WATCH_SLICE)))
                    .map_err(ReadFail::Io)?;
                match stream.read(&mut buf[got..]) {
                    Ok(0) => return Err(ReadFail::Closed),
                    Ok(k) => buf.truncate(got + k),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted
                                | io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                        ) =>
                    {
                        // Waited a slice (or a signal came): the deadline and the watch decide.
                        buf.truncate(got)
                    }
                    Err(e) => return Err(ReadFail::Io(e)),
                }
            }
            Err(DecodeError::NeedMore(n)) => {
                return Err(ReadFail::Decode(DecodeError::Invalid(format!(
                    "a message of {n} bytes exceeds the maximum of {max}"
                ))))
            }
            Err(e) => return Err(ReadFail::Decode(e)),
        }
    }
}

/// Write all of `bytes` before `deadline`.
pub(super) fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_write_timeout(Some(left))?;
    stream.write_all(bytes)
}

/// How one attempt at a handshake failed.
pub(super) enum Attempt {
    /// Worth another try: the connection was dropped (a busy listener sheds load), timed out or
    /// was reset.
    Retry(TransportError),
    /// Final: a refusal, a listener that cannot prove the token, a protocol error.
    Fatal(TransportError),
}

impl Attempt {
    pub(super) fn into_error(self) -> TransportError {
        match self {
            Attempt::Retry(e) | Attempt::Fatal(e) => e,
        }
    }
}

/// One handshake as the connector (see [`wire`]), all of it before `deadline`. The connector
/// checks the listener's proof before it proves anything itself.
pub(super) fn client_handshake(
    stream: &mut TcpStream,
    hello: Hello,
    key: &Key,
    peer: &str,
    deadline: Instant,
) -> std::result::Result<(), Attempt> {
    client_handshake_committed(stream, hello, key, peer, deadline, deadline, &|| None)
}

/// [`client_handshake`] whose last step, once this side has proved itself, waits for the
/// listener's reply until `committed_deadline` (asking `cancel` as it waits) rather than
/// `deadline`: a listener that checked the proof keeps the connection as this rank's, so
/// giving up on it then and connecting again would leave the two sides with different
/// connections (under packet loss a reply can take seconds).
pub(super) fn client_handshake_committed(
    stream: &mut TcpStream,
    mut hello: Hello,
    key: &Key,
    peer: &str,
    deadline: Instant,
    committed_deadline: Instant,
    cancel: &dyn Fn() -> Option<TransportError>,
) -> std::result::Result<(), Attempt> {
    let handshake = |reason: String| TransportError::Handshake {
        peer: peer.into(),
        reason,
    };
    let retry_io =
        |what: &str, e: io::Error| Attempt::Retry(TransportError::io(format!("{what} {peer}"), e));
    let read_fail = |what: &str, f: ReadFail| match f {
        ReadFail::Closed => Attempt::Retry(handshake(format!(
            "the connection was closed before the {what} arrived (a busy listener sheds \
             connections; retried until the timeout)"
        ))),
        ReadFail::TimedOut => Attempt::Retry(handshake(format!("no {what} before the deadline"))),
        ReadFail::Decode(e) => Attempt::Fatal(handshake(e.to_string())),
        ReadFail::Io(e) => retry_io(&format!("waiting for the {what} of"), e),
        ReadFail::Cancelled(e) => Attempt::Fatal(e),
    };
    hello.nonce = wire::fresh_nonce()
        .map_err(|e| Attempt::Fatal(TransportError::io("drawing a random nonce", e)))?;
    let hello_bytes = hello.encode();
    write_by(stream, &hello_bytes, deadline)
        .map_err(|e| retry_io("sending the handshake to", e))?;
    let (answer, _) = read_msg(
        stream,
        deadline,
        wire::CHALLENGE_LEN + wire::MAX_REASON_LEN,
        Answer::decode,
    )
    .map_err(|f| read_fail("challenge", f))?;
    let (nonce, proof) = match answer {
        Answer::Challenge { nonce, proof } => (nonce, proof),
        Answer::Reply(Reply::Refuse(reason)) => {
            tracing::error!(%peer, %reason, "our handshake was refused");
            return Err(Attempt::Fatal(handshake(reason)));
        }
        Answer::Reply(Reply::Accept) => {
            return Err(Attempt::Fatal(handshake(
                "the listener accepted without proving that it knows the job token; not a \
                 FastHorovod rank of this version"
                    .into(),
            )))
        }
    };
    if !wire::verify_acceptor_proof(key, &hello_bytes, &nonce, &proof) {
        tracing::error!(%peer, "the listener could not prove that it knows the job token");
        return Err(Attempt::Fatal(handshake(
            "wrong job token, or not this job's listener: the listener could not prove that it \
             knows this rank's FH_JOB_TOKEN (the tokens differ, or another process holds that \
             port); nothing was revealed to it"
                .into(),
        )));
    }
    let tag = wire::connector_proof(key, &hello_bytes, &nonce);
    let committed = committed_deadline.max(deadline);
    write_by(stream, &wire::encode_proof(&tag), committed)
        .map_err(|e| retry_io("sending the handshake proof to", e))?;
    let (reply, _) = read_msg_watched(
        stream,
        committed,
        wire::REPLY_FIXED_LEN + wire::MAX_REASON_LEN,
        Reply::decode,
        cancel,
    )
    .map_err(|f| read_fail("reply", f))?;
    match reply {
        Reply::Accept => Ok(()),
        Reply::Refuse(reason) => {
            tracing::error!(%peer, %reason, "our handshake was refused");
            Err(Attempt::Fatal(handshake(reason)))
        }
    }
}

/// Connect to `addrs` and complete a handshake, retrying until `deadline` while nobody listens
/// yet or an attempt fails in a way worth retrying (see [`Attempt`]). Each attempt's handshake
/// is bounded by `per_attempt`; `make_hello` builds the hello for each fresh connection. With
/// `refused_is_lost`, a refused connection means the peer's process is gone (its listener has
/// been up since the rendezvous) and fails at once. `cancel` is asked before every attempt: an
/// error from it (a verdict that the peer is lost) ends the attempts with that error.
#[allow(clippy::too_many_arguments)]
pub(super) fn connect_handshake(
    addrs: &[SocketAddr],
    mut make_hello: impl FnMut(&TcpStream) -> Result<Hello>,
    key: &Key,
    what: &str,
    deadline: Instant,
    per_attempt: Duration,
    refused_is_lost: Option<usize>,
    cancel: &dyn Fn() -> Option<TransportError>,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last: Option<TransportError> = None;
    loop {
        for addr in addrs {
            if let Some(e) = cancel() {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut s = match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    if let Some(rank) = refused_is_lost {
                        return Err(TransportError::PeerLost {
                            rank,
                            detail: format!(
                                "its listener at {addr} refused the connection for {what} (the \
                                 process is gone)"
                            ),
                        });
                    }
                    last = Some(TransportError::io(
                        format!("connecting to {what} at {addr}"),
                        e,
                    ));
                    continue;
                }
                Err(e) => {
                    last = Some(TransportError::io(
                        format!("connecting to {what} at {addr}"),
                        e,
                    ));
                    continue;
                }
            };
            let attempt_deadline = deadline.min(Instant::now() + per_attempt);
            let hello = make_hello(&s)?;
            match client_handshake_committed(
                &mut s,
                hello,
                key,
                what,
                attempt_deadline,
                deadline,
                cancel,
            ) {
                Ok(()) => return Ok(s),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    tracing::debug!(peer = what, error = %e, "handshake attempt failed; retrying");
                    last = Some(e);
                }
            }
        }
        if let Some(e) = cancel() {
            return Err(e);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let detail =
                last.map_or_else(|| "no attempt was possible".to_string(), |e| e.to_string());
            return Err(TransportError::Handshake {
                peer: what.into(),
                reason: format!(
                    "could not connect and complete a handshake at {addrs:?} before the timeout \
                     (FH_TIMEOUT_SECONDS); the last attempt: {detail}"
                ),
            });
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}
