//! The accepting side of the TCP backend's door: a background thread per listener that serves
//! each connection's handshake ([`wire`](super::wire)) on a thread of its own, within the
//! handshake deadline and up to a number of handshakes at once that grows with the world size,
//! hands authenticated connections to the transport, and logs refusals at a bounded rate.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::handshake::{read_msg, write_by, ReadFail};
use super::wire::{self, Answer, ConnKind, Hello, Reply};
use super::{sys, AbortBoard, Key};
use crate::{Result, TransportError};

/// Refusals queued for the transport beyond which further ones are only logged.
const MAX_QUEUED_REFUSALS: usize = 256;
/// How often acceptor threads check whether they should stop.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Refusals logged per [`REFUSAL_LOG_WINDOW`]; the rest are counted and summarised.
const REFUSAL_LOGS_PER_WINDOW: u32 = 5;
/// Window of the refusal-log rate limit.
const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// What the acceptor thread hands to the transport.
pub(super) enum Incoming {
    /// A peer passed the handshake.
    Accepted {
        hello: Hello,
        stream: TcpStream,
        from: SocketAddr,
    },
    /// A connection was refused (logged already); kept to explain a later timeout.
    Refused { from: SocketAddr, reason: String },
}

/// Logs refusals at a bounded rate: a flood of strangers must not flood the log.
#[derive(Debug)]
pub(super) struct RefusalLog {
    state: Mutex<(Instant, u32, u64)>,
}

impl RefusalLog {
    pub(super) fn new() -> Self {
        RefusalLog {
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    /// Log a refusal unless this window's quota is used up; returns whether it was logged.
    fn log(&self, from: SocketAddr, reason: &str) -> bool {
        let Ok(mut st) = self.state.lock() else {
            return false;
        };
        let (start, logged, suppressed) = &mut *st;
        if start.elapsed() >= REFUSAL_LOG_WINDOW {
            if *suppressed > 0 {
                tracing::warn!(
                    count = *suppressed,
                    "further TCP connections were refused in the last {:?} (not logged one by one)",
                    REFUSAL_LOG_WINDOW
                );
            }
            (*start, *logged, *suppressed) = (Instant::now(), 0, 0);
        }
        if *logged < REFUSAL_LOGS_PER_WINDOW {
            *logged += 1;
            tracing::warn!(
                %from,
                %reason,
                "refused a TCP connection (a stranger, another job, or a misconfigured rank)"
            );
            true
        } else {
            *suppressed += 1;
            false
        }
    }
}

/// What an acceptor checks in a handshake.
pub(super) struct AcceptRules {
    pub(super) kind: ConnKind,
    pub(super) key: Key,
    pub(super) size: usize,
    pub(super) rank: usize,
    pub(super) handshake_timeout: Duration,
    pub(super) max_pending: usize,
    pub(super) board: Arc<AbortBoard>,
    pub(super) log: RefusalLog,
}

/// A background thread serving one listener.
pub(super) struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    incoming: Receiver<Incoming>,
    /// Recent refusals, quoted when an expected peer never arrives.
    refusals: Vec<String>,
}

impl Acceptor {
    pub(super) fn spawn(listener: TcpListener, rules: AcceptRules) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| TransportError::io("making a listener nonblocking", e))?;
        let (tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let name = match rules.kind {
            ConnKind::Rendezvous => "fh-tcp-rendezvous",
            ConnKind::Data | ConnKind::Abort | ConnKind::Probe => "fh-tcp-accept",
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || accept_loop(listener, Arc::new(rules), tx, stop2))
            .map_err(|e| TransportError::io("spawning the TCP acceptor thread", e))?;
        Ok(Acceptor {
            stop,
            thread: Some(thread),
            incoming: rx,
            refusals: Vec::new(),
        })
    }

    /// Wait for the next accepted connection until `deadline`; refusals are remembered.
    pub(super) fn next(&mut self, deadline: Instant) -> Option<(Hello, TcpStream, SocketAddr)> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.incoming.recv_timeout(left) {
                Ok(Incoming::Accepted {
                    hello,
                    stream,
                    from,
                }) => return Some((hello, stream, from)),
                Ok(Incoming::Refused { from, reason }) => {
                    if self.refusals.len() >= 8 {
                        self.refusals.remove(0);
                    }
                    self.refusals.push(format!("{from}: {reason}"));
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    return None
                }
            }
        }
    }

    pub(super) fn refusal_note(&self) -> String {
        if self.refusals.is_empty() {
            String::new()
        } else {
            format!(
                "; meanwhile these connections were refused: {}",
                self.refusals.join("; ")
            )
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the TCP acceptor thread panicked");
            }
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    rules: Arc<AcceptRules>,
    tx: Sender<Incoming>,
    stop: Arc<AtomicBool>,
) {
    use std::os::fd::AsRawFd;
    let pending = Arc::new(AtomicUsize::new(0));
    let mut dropped = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [sys::pollfd(listener.as_raw_fd(), sys::POLLIN)];
        if let Err(e) = sys::poll(&mut fds, ACCEPT_POLL) {
            tracing::error!(error = %e, "poll on a TCP listener failed; it stops accepting");
            return;
        }
        // Under a flood the listener is always readable: check `stop` for every connection.
        while !stop.load(Ordering::Relaxed) {
            let (stream, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // ECONNABORTED, EMFILE and the like: note it, back off a little, go on.
                    let _ = rules.log.log(
                        SocketAddr::from(([0, 0, 0, 0], 0)),
                        &format!("accepting a TCP connection failed: {e}"),
                    );
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if pending.load(Ordering::Relaxed) >= rules.max_pending {
                dropped += 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(
                        %from,
                        dropped,
                        limit = rules.max_pending,
                        "too many handshakes in progress; dropping connections (ranks retry)"
                    );
                }
                continue;
            }
            pending.fetch_add(1, Ordering::Relaxed);
            let (rules2, tx, pending2) = (Arc::clone(&rules), tx.clone(), Arc::clone(&pending));
            let spawned = std::thread::Builder::new()
                .name("fh-tcp-handshake".into())
                .spawn(move || {
                    let rules = rules2;
                    let msg = match serve_handshake(stream, &rules) {
                        Ok((hello, _)) if hello.kind == ConnKind::Abort => {
                            tracing::warn!(
                                from = hello.rank,
                                lost = hello.lost,
                                seq = hello.seq,
                                "a peer gave up on a communicator"
                            );
                            rules
                                .board
                                .post(hello.seq, hello.rank as usize, hello.lost as usize);
                            pending2.fetch_sub(1, Ordering::Relaxed);
                            return;
                        }
                        // The completed handshake was the answer: this process is alive.
                        Ok((hello, _)) if hello.kind == ConnKind::Probe => {
                            pending2.fetch_sub(1, Ordering::Relaxed);
                            return;
                        }
                        Ok((hello, stream)) => Incoming::Accepted {
                            hello,
                            stream,
                            from,
                        },
                        Err(reason) => {
                            let _ = rules.log.log(from, &reason);
                            Incoming::Refused { from, reason }
                        }
                    };
                    pending2.fetch_sub(1, Ordering::Relaxed);
                    // Under a flood of strangers, keep memory bounded: refusals are only
                    // explanations (and were logged), so drop them when nobody is reading.
                    if matches!(msg, Incoming::Refused { .. }) && tx.len() >= MAX_QUEUED_REFUSALS {
                        return;
                    }
                    // The transport may be gone already; then nobody needs the connection.
                    let _ = tx.send(msg);
                });
            if let Err(e) = spawned {
                pending.fetch_sub(1, Ordering::Relaxed);
                let _ = rules
                    .log
                    .log(from, &format!("could not spawn a handshake thread: {e}"));
            }
        }
    }
}

/// Serve one handshake (see [`wire`]), all of it within the handshake timeout: read the
/// hello, answer with a challenge and this side's proof, check the connector's proof and the
/// hello, accept or refuse.
fn serve_handshake(
    mut stream: TcpStream,
    rules: &AcceptRules,
) -> std::result::Result<(Hello, TcpStream), String> {
    let deadline = Instant::now() + rules.handshake_timeout;
    let _ = stream.set_nonblocking(false);
    let silent = || {
        format!(
            "no complete handshake within {:?} (a slow, silent or half-open connection)",
            rules.handshake_timeout
        )
    };
    let (hello, hello_bytes) = match read_msg(&mut stream, deadline, wire::MAX_HELLO_LEN, |b| {
        Hello::decode(b)
    }) {
        Ok(x) => x,
        Err(ReadFail::Decode(e)) => {
            let reason = e.to_string();
            refuse(&mut stream, &reason, deadline);
            return Err(reason);
        }
        Err(ReadFail::Closed(got)) => {
            return Err(format!(
                "connection closed after {got} bytes, before a complete handshake"
            ))
        }
        Err(ReadFail::TimedOut) => return Err(silent()),
        Err(ReadFail::Io(e)) => return Err(format!("reading the handshake failed: {e}")),
    };
    let nonce = wire::fresh_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let proof = wire::acceptor_proof(rules.key.bytes(), &hello_bytes, &nonce);
    write_by(
        &mut stream,
        &Answer::encode_challenge(&nonce, &proof),
        deadline,
    )
    .map_err(|e| format!("sending the challenge failed: {e}"))?;
    let tag = match read_msg(&mut stream, deadline, wire::PROOF_LEN, wire::decode_proof) {
        Ok((tag, _)) => tag,
        Err(ReadFail::Decode(e)) => {
            let reason = e.to_string();
            refuse(&mut stream, &reason, deadline);
            return Err(reason);
        }
        Err(ReadFail::Closed(_)) => {
            return Err(format!(
                "wrong job token, or a stranger: rank {} (claimed) hung up after our challenge \
                 (it could not verify this rank's proof of FH_JOB_TOKEN)",
                hello.rank
            ))
        }
        Err(ReadFail::TimedOut) => return Err(silent()),
        Err(ReadFail::Io(e)) => return Err(format!("reading the handshake proof failed: {e}")),
    };
    if !wire::verify_connector_proof(rules.key.bytes(), &hello_bytes, &nonce, &tag) {
        let reason = "wrong job token (or a replayed handshake): this connection does not \
                      belong to this job (every rank must have the same FH_JOB_TOKEN)";
        refuse(&mut stream, reason, deadline);
        return Err(format!("rank {} (claimed): {reason}", hello.rank));
    }
    if let Some(reason) = check_hello(&hello, rules) {
        refuse(&mut stream, &reason, deadline);
        return Err(format!("rank {} (claimed): {reason}", hello.rank));
    }
    write_by(&mut stream, &Reply::Accept.encode(), deadline)
        .map_err(|e| format!("sending the acceptance failed: {e}"))?;
    Ok((hello, stream))
}

fn check_hello(hello: &Hello, rules: &AcceptRules) -> Option<String> {
    let abort_at_data =
        matches!(hello.kind, ConnKind::Abort | ConnKind::Probe) && rules.kind == ConnKind::Data;
    if hello.kind != rules.kind && !abort_at_data {
        return Some(format!(
            "a {:?} handshake arrived at the {:?} listener",
            hello.kind, rules.kind
        ));
    }
    if hello.size as usize != rules.size {
        return Some(format!(
            "world size mismatch: the connecting rank says {}, this rank has {} (check FH_SIZE)",
            hello.size, rules.size
        ));
    }
    let rank = hello.rank as usize;
    let ok_rank = match rules.kind {
        ConnKind::Rendezvous => rank != 0 && rank < rules.size,
        ConnKind::Data if abort_at_data => rank != rules.rank && rank < rules.size,
        ConnKind::Data => rank > rules.rank && rank < rules.size,
        ConnKind::Abort | ConnKind::Probe => false,
    };
    if !ok_rank {
        return Some(format!(
            "rank {rank} may not connect here (this is rank {} of {})",
            rules.rank, rules.size
        ));
    }
    None
}

fn refuse(stream: &mut TcpStream, reason: &str, deadline: Instant) {
    let _ = write_by(stream, &Reply::Refuse(reason.into()).encode(), deadline);
    let _ = stream.flush();
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_at_a_bounded_rate() {
        let log = RefusalLog::new();
        let from = SocketAddr::from(([127, 0, 0, 1], 9));
        let logged = (0..1000).filter(|_| log.log(from, "garbage")).count();
        assert_eq!(logged, REFUSAL_LOGS_PER_WINDOW as usize);
        // A new window logs again (and summarises the suppressed ones).
        if let Ok(mut st) = log.state.lock() {
            st.0 = Instant::now() - REFUSAL_LOG_WINDOW;
        }
        assert!(log.log(from, "garbage"));
        assert_eq!(log.state.lock().map(|s| s.2).unwrap_or(1), 0);
    }
}
