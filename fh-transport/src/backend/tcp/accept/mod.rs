//! The accepting side of the TCP backend's door: one background thread per listener serves
//! every handshake ([`wire`](super::wire)) itself, as a small state machine per connection over
//! nonblocking sockets and poll(2) — no thread per connection — and hands authenticated
//! connections to the transport, logging refusals at a bounded rate.
//!
//! **No stranger can hold the door.** An unauthenticated connection costs the listener one
//! descriptor and a few hundred bytes, and holds it only briefly:
//!
//! - it must send its first bytes within [`FIRST_BYTES_TIMEOUT`] and complete the whole
//!   handshake within the handshake timeout;
//! - at most [`AcceptRules::max_pending`] handshakes are in progress; when a new connection
//!   arrives while that many are, the listener evicts one to make room: a connection that has
//!   not yet sent a valid hello before one that has, from the source address that holds the
//!   most of them, the oldest first. A member sends its hello at once, so its handshake moves
//!   past the silent crowd in one round trip; a stranger who re-opens connections as fast as
//!   they are dropped only evicts other strangers;
//! - the listen backlog is as deep as the system allows ([`LISTEN_BACKLOG`]), and the loop
//!   drains it continuously, so a flood does not make the kernel drop a member's SYN;
//! - a member whose connection is dropped anyway retries with backoff until the job's timeout
//!   ([`super::handshake::connect_handshake`]).
//!
//! So the descriptors of a listener are bounded by `max_pending` + 1 and its threads by one,
//! however many strangers connect.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::wire::{self, Answer, ConnKind, Hello, Reply, WORLD_ID_LEN};
use super::{sys, AbortBoard, Key};
use crate::{Result, TransportError};
use fh_core::bytes::DecodeError;

/// How long a new connection may stay silent before it is dropped (its first bytes must come
/// sooner; a member sends its hello right after connecting).
pub(super) const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(1);
/// The listen backlog asked for (the kernel caps it at `net.core.somaxconn`).
pub(super) const LISTEN_BACKLOG: i32 = 4096;
/// Connections accepted per turn of the loop before the pending handshakes are served again.
const ACCEPTS_PER_TURN: usize = 256;

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

/// The job's world id as an acceptor knows it: set once rank 0 has drawn it (rank 0 at once;
/// the other ranks when the address book arrives). For the rendezvous listener, set once the
/// rendezvous is complete, after which late claimants are refused naming it.
pub(super) type WorldCell = Arc<OnceLock<[u8; WORLD_ID_LEN]>>;

/// What an acceptor checks in a handshake.
pub(super) struct AcceptRules {
    pub(super) kind: ConnKind,
    pub(super) key: Key,
    pub(super) size: usize,
    pub(super) rank: usize,
    pub(super) handshake_timeout: Duration,
    /// Handshakes in progress at once, at most (see the module documentation).
    pub(super) max_pending: usize,
    pub(super) board: Arc<AbortBoard>,
    pub(super) log: RefusalLog,
    /// The job's world id (data listeners), or the completed rendezvous's (rendezvous listener).
    pub(super) world: WorldCell,
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
        // A deeper backlog than std's default of 128: re-listening on a listening socket only
        // changes its backlog. Failure leaves the default, which still works.
        let _ = rustix::net::listen(&listener, LISTEN_BACKLOG);
        let (tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let name = match rules.kind {
            ConnKind::Rendezvous => "fh-tcp-rendezvous",
            ConnKind::Data | ConnKind::Abort | ConnKind::Probe => "fh-tcp-accept",
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || accept_loop(listener, &rules, &tx, &stop2))
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

    /// [`Acceptor::next`], looking at `stop` every `every` meanwhile: `None` also as soon as
    /// it returns true.
    pub(super) fn next_unless(
        &mut self,
        deadline: Instant,
        every: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Option<(Hello, TcpStream, SocketAddr)> {
        loop {
            if stop() {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let slice = deadline.min(now + every);
            let left = slice.saturating_duration_since(now);
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
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
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

/// Where one connection's handshake stands.
enum Stage {
    /// Waiting for the hello (`got` bytes so far in `buf`).
    Hello,
    /// The challenge went out; waiting for the connector's proof.
    Proof {
        hello: Hello,
        hello_bytes: Vec<u8>,
        nonce: [u8; wire::NONCE_LEN],
    },
    /// Authenticated and checked, but this rank does not know the job's world id yet (the
    /// connector got the address book first): held until it does, within the deadline.
    Held { hello: Hello },
}

/// One connection whose handshake is in progress.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
    stage: Stage,
}

impl Pending {
    /// Whether it has sent a valid hello (evicted only after every silent one).
    fn spoke(&self) -> bool {
        !matches!(self.stage, Stage::Hello)
    }
}

/// What became of a connection after some progress.
enum Step {
    /// Still in progress.
    Wait,
    /// Done with, one way or another (nothing more to do: dropped).
    Gone,
    /// Refused, with the reason (logged and reported).
    Refused(String),
    /// Authenticated: hand it over.
    Done(Hello),
}

/// Why reading stopped: the peer closed, or the socket failed.
enum Read0 {
    Closed,
    Failed,
}

/// Read what is there (nonblocking) until `buf` holds `want` bytes; `Ok(true)` when it does.
fn fill(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    want: usize,
) -> std::result::Result<bool, Read0> {
    while buf.len() < want {
        let got = buf.len();
        buf.resize(want, 0);
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                buf.truncate(got);
                return Err(Read0::Closed);
            }
            Ok(k) => buf.truncate(got + k),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => buf.truncate(got),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                buf.truncate(got);
                return Ok(false);
            }
            Err(_) => {
                buf.truncate(got);
                return Err(Read0::Failed);
            }
        }
    }
    Ok(true)
}

/// Write a small message at once (a fresh socket's buffer always takes it); anything less is
/// a failure.
fn put(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    match stream.write(bytes) {
        Ok(n) if n == bytes.len() => Ok(()),
        Ok(_) => Err(io::Error::other(
            "the socket took only part of a handshake message",
        )),
        Err(e) => Err(e),
    }
}

/// Make what progress the bytes at hand allow on `p`'s handshake.
fn advance(p: &mut Pending, rules: &AcceptRules) -> Step {
    loop {
        match &p.stage {
            Stage::Hello => {
                let want = match Hello::decode(&p.buf) {
                    Ok(_) => 0,
                    Err(DecodeError::NeedMore(n)) if n <= wire::MAX_HELLO_LEN => n,
                    Err(e) => return refuse_now(p, e.to_string()),
                };
                if want > 0 {
                    match fill(&mut p.stream, &mut p.buf, want) {
                        Ok(true) => continue,
                        Ok(false) => return Step::Wait,
                        Err(Read0::Closed | Read0::Failed) => return Step::Gone,
                    }
                }
                let Ok((hello, used)) = Hello::decode(&p.buf) else {
                    return Step::Gone;
                };
                let hello_bytes = p.buf[..used].to_vec();
                p.buf.clear();
                let Ok(nonce) = wire::fresh_nonce() else {
                    return Step::Refused("no random nonce for the challenge".into());
                };
                let proof = wire::acceptor_proof(&rules.key, &hello_bytes, &nonce);
                if put(&mut p.stream, &Answer::encode_challenge(&nonce, &proof)).is_err() {
                    return Step::Gone;
                }
                p.stage = Stage::Proof {
                    hello,
                    hello_bytes,
                    nonce,
                };
            }
            Stage::Proof {
                hello,
                hello_bytes,
                nonce,
            } => {
                match fill(&mut p.stream, &mut p.buf, wire::PROOF_LEN) {
                    Ok(true) => {}
                    Ok(false) => return Step::Wait,
                    Err(Read0::Closed) => {
                        return Step::Refused(format!(
                            "wrong job token, or a stranger: rank {} (claimed) hung up after our \
                             challenge (it could not verify this rank's proof of FH_JOB_TOKEN)",
                            hello.rank
                        ))
                    }
                    Err(Read0::Failed) => return Step::Gone,
                }
                let tag = match wire::decode_proof(&p.buf) {
                    Ok((tag, _)) => tag,
                    Err(e) => return refuse_now(p, e.to_string()),
                };
                if !wire::verify_connector_proof(&rules.key, hello_bytes, nonce, &tag) {
                    let reason = "wrong job token (or a replayed handshake): this connection \
                                  does not belong to this job (every rank must have the same \
                                  FH_JOB_TOKEN)";
                    let claimed = hello.rank;
                    return refuse_now(p, format!("rank {claimed} (claimed): {reason}"));
                }
                if let Some(reason) = check_hello(hello, rules) {
                    let claimed = hello.rank;
                    return refuse_now(p, format!("rank {claimed} (claimed): {reason}"));
                }
                let hello = hello.clone();
                p.stage = Stage::Held { hello };
            }
            Stage::Held { hello } => {
                let hello = hello.clone();
                if rules.kind == ConnKind::Rendezvous {
                    if let Some(world) = rules.world.get() {
                        let reason = format!(
                            "rank {} (claimed): the rendezvous of this job (world {}) is \
                             complete and rank {} joined it already: two processes claim \
                             that rank — is another job with the same FH_JOB_TOKEN and \
                             rendezvous address running? Give every job its own token \
                             (fhrun draws one per job)",
                            hello.rank,
                            wire::world_hex(world),
                            hello.rank
                        );
                        // Started together with this job, the claimant may be the job's own
                        // member and the world may hold a rank of the other job: it stops.
                        rules.board.late_claim(hello.rank, p.from);
                        return refuse_now(p, reason);
                    }
                } else {
                    let Some(world) = rules.world.get() else {
                        return Step::Wait;
                    };
                    if hello.world != *world {
                        return refuse_now(
                            p,
                            format!(
                                "rank {} (claimed) belongs to another job with the same \
                                 FH_JOB_TOKEN: it names world {}, this rank is in world {} \
                                 (two jobs share a token: give every job its own)",
                                hello.rank,
                                wire::world_hex(&hello.world),
                                wire::world_hex(world)
                            ),
                        );
                    }
                }
                if put(&mut p.stream, &Reply::Accept.encode()).is_err() {
                    return Step::Gone;
                }
                return Step::Done(hello);
            }
        }
    }
}

/// Refuse `p` with `reason` (sent if the socket takes it, then the connection is closed).
fn refuse_now(p: &mut Pending, reason: String) -> Step {
    let _ = put(&mut p.stream, &Reply::Refuse(reason.clone()).encode());
    let _ = p.stream.flush();
    let _ = p.stream.shutdown(std::net::Shutdown::Write);
    Step::Refused(reason)
}

/// The connection to drop to make room: a silent one before one that has spoken, from the
/// source holding the most of those, the oldest first.
fn victim(pending: &[Pending]) -> Option<usize> {
    let silent = pending.iter().any(|p| !p.spoke());
    let class = |p: &Pending| p.spoke() != silent;
    let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
    for p in pending.iter().filter(|p| class(p)) {
        *per_source.entry(p.from.ip()).or_default() += 1;
    }
    let (&busiest, _) = per_source.iter().max_by_key(|(_, &n)| n)?;
    pending
        .iter()
        .enumerate()
        .filter(|(_, p)| class(p) && p.from.ip() == busiest)
        .min_by_key(|(_, p)| p.since)
        .map(|(i, _)| i)
}

/// Counters of what the loop shed, logged at powers of two.
#[derive(Default)]
struct Shed {
    evicted: u64,
    silent: u64,
}

fn accept_loop(
    listener: TcpListener,
    rules: &AcceptRules,
    tx: &Sender<Incoming>,
    stop: &AtomicBool,
) {
    use std::os::fd::AsRawFd;
    let mut pending: Vec<Pending> = Vec::new();
    let mut shed = Shed::default();
    let first_bytes = FIRST_BYTES_TIMEOUT.min(rules.handshake_timeout);
    let mut fds = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        // Wait for the listener or any pending connection, at most until the nearest deadline.
        let now = Instant::now();
        let mut wait = ACCEPT_POLL;
        fds.clear();
        fds.push(sys::pollfd(listener.as_raw_fd(), sys::POLLIN));
        for p in &pending {
            let held = matches!(p.stage, Stage::Held { .. });
            // A held connection waits for the world id, not for bytes.
            fds.push(sys::pollfd(
                if held { -1 } else { p.stream.as_raw_fd() },
                sys::POLLIN,
            ));
            let limit = if p.buf.is_empty() && !p.spoke() {
                first_bytes
            } else {
                rules.handshake_timeout
            };
            wait = wait.min((p.since + limit).saturating_duration_since(now));
        }
        if let Err(e) = sys::poll(&mut fds, wait) {
            tracing::error!(error = %e, "poll on a TCP listener failed; it stops accepting");
            return;
        }
        // Serve the connections that have bytes (or were closed), and the held ones; from the
        // last, so that removing one (`swap_remove`) moves only an entry already served.
        let ready: Vec<usize> = fds[1..]
            .iter()
            .zip(&pending)
            .enumerate()
            .filter(|(_, (f, p))| f.revents != 0 || matches!(p.stage, Stage::Held { .. }))
            .map(|(i, _)| i)
            .collect();
        for &i in ready.iter().rev() {
            let step = advance(&mut pending[i], rules);
            settle(&mut pending, i, step, rules, tx);
        }
        // Drop the connections past their deadline.
        let now = Instant::now();
        let mut i = 0;
        while i < pending.len() {
            let p = &pending[i];
            let silent = p.buf.is_empty() && !p.spoke();
            let limit = if silent {
                first_bytes
            } else {
                rules.handshake_timeout
            };
            if now >= p.since + limit {
                let p = pending.swap_remove(i);
                shed.silent += 1;
                let reason = if silent {
                    format!("no bytes within {limit:?} (a silent connection)")
                } else {
                    format!(
                        "no complete handshake within {limit:?} (a slow, silent or half-open \
                         connection)"
                    )
                };
                report(rules, tx, p.from, reason);
                continue;
            }
            i += 1;
        }
        // Accept what the backlog holds (a bounded batch per turn), each new connection served
        // at once: a member's hello is usually there already.
        for _ in 0..ACCEPTS_PER_TURN {
            if stop.load(Ordering::Relaxed) {
                return;
            }
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
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if pending.len() >= rules.max_pending.max(1) {
                if let Some(v) = victim(&pending) {
                    pending.swap_remove(v);
                    shed.evicted += 1;
                    if shed.evicted.is_power_of_two() {
                        tracing::warn!(
                            %from,
                            evicted = shed.evicted,
                            limit = rules.max_pending,
                            "too many handshakes in progress; dropping the oldest silent \
                             connections (a flood of strangers? members retry)"
                        );
                    }
                }
            }
            pending.push(Pending {
                stream,
                from,
                since: Instant::now(),
                buf: Vec::new(),
                stage: Stage::Hello,
            });
            let last = pending.len() - 1;
            let step = advance(&mut pending[last], rules);
            settle(&mut pending, last, step, rules, tx);
        }
    }
}

/// Act on `step` for `pending[i]`; returns whether the entry was removed.
fn settle(
    pending: &mut Vec<Pending>,
    i: usize,
    step: Step,
    rules: &AcceptRules,
    tx: &Sender<Incoming>,
) -> bool {
    match step {
        Step::Wait => false,
        Step::Gone => {
            pending.swap_remove(i);
            true
        }
        Step::Refused(reason) => {
            let p = pending.swap_remove(i);
            report(rules, tx, p.from, reason);
            true
        }
        Step::Done(hello) => {
            let p = pending.swap_remove(i);
            match hello.kind {
                ConnKind::Abort if rules.kind == ConnKind::Data => {
                    tracing::warn!(
                        from = hello.rank,
                        lost = hello.lost,
                        seq = hello.seq,
                        "a peer gave up on a communicator"
                    );
                    rules
                        .board
                        .post(hello.seq, hello.rank as usize, hello.lost as usize);
                }
                // The completed handshake was the answer: this process is alive.
                ConnKind::Probe if rules.kind == ConnKind::Data => {}
                _ => {
                    let stream = p.stream;
                    if stream.set_nonblocking(false).is_ok() {
                        // The transport may be gone already; then nobody needs it.
                        let _ = tx.send(Incoming::Accepted {
                            hello,
                            stream,
                            from: p.from,
                        });
                    }
                }
            }
            true
        }
    }
}

/// Log a refusal (at a bounded rate) and keep it for the transport's error messages (unless
/// nobody reads them: under a flood of strangers memory stays bounded).
fn report(rules: &AcceptRules, tx: &Sender<Incoming>, from: SocketAddr, reason: String) {
    let _ = rules.log.log(from, &reason);
    if tx.len() < MAX_QUEUED_REFUSALS {
        let _ = tx.send(Incoming::Refused { from, reason });
    }
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

#[cfg(test)]
mod tests;
