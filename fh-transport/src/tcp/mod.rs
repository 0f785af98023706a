//! The TCP backend, the default for jobs of several processes.
//!
//! **Rendezvous.** Rank 0 listens on the rendezvous address (`FH_RENDEZVOUS_ADDR`); every other
//! rank connects to it (retrying while rank 0 is not up yet, within the timeout), binds its own
//! data listener on the interface it used to reach rank 0 (loopback for local jobs; never the
//! wildcard address), and sends a handshake with its listener's port. Once all ranks are in,
//! rank 0 sends everybody the address book and closes the rendezvous listener.
//!
//! **Communicators.** Each [`Transport::open`] builds a fresh full mesh: every rank connects
//! to each lower rank's data listener, with a handshake naming the communicator's sequence
//! number, so connections of different communicators can never be mixed up. Listeners are
//! served by a background acceptor thread, so a rank answers handshakes even while it is busy.
//!
//! **A closed door.** Every connection starts with a handshake carrying a magic, the protocol
//! version, the job token (compared in constant time), the world size and the rank; a peer
//! that gets anything wrong receives a refusal stating why and is disconnected, and the refusal
//! is logged on the accepting side (and quoted in its error if the expected peer never comes).
//! Strangers — garbage, wrong tokens, connections that never say anything — are dropped after a
//! short handshake timeout without disturbing the job. Frame lengths are checked against what
//! the receiver expects before a byte of payload is accepted.
//!
//! The token keeps other jobs and casual strangers out; it travels in clear text, so this is
//! not protection against an attacker who can watch the network.

mod comm;
mod sys;
pub mod wire;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

pub use comm::TcpComm;
use wire::{ConnKind, DecodeError, Hello, Reply};

use crate::bootstrap::LaunchInfo;
use crate::{Communicator, Result, Topology, Transport, TransportError};

/// Default largest message the backend sends or accepts (16 GiB).
pub const DEFAULT_MAX_FRAME: usize = 16 << 30;
/// Default time a connecting stranger has to complete its handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most handshakes served at once; further connections are dropped until some finish.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Refusals queued for the transport beyond which further ones are only logged.
const MAX_QUEUED_REFUSALS: usize = 256;
/// How often acceptor threads check whether they should stop.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

/// Tunables of the TCP backend.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Longest wait without progress for a peer (`FH_TIMEOUT_SECONDS`): connecting, the
    /// rendezvous, opening a communicator, and every send/receive.
    pub timeout: Duration,
    /// How long an accepted connection has to present its handshake.
    pub handshake_timeout: Duration,
    /// Largest single message, in bytes.
    pub max_frame: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: crate::bootstrap::DEFAULT_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

impl TcpOptions {
    /// Options with the launch's timeout and default everything else.
    pub fn from_info(info: &LaunchInfo) -> Self {
        TcpOptions {
            timeout: info.timeout,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT.min(info.timeout),
            ..TcpOptions::default()
        }
    }
}

/// What the acceptor thread hands to the transport.
enum Incoming {
    /// A peer passed the handshake.
    Accepted {
        hello: Hello,
        stream: TcpStream,
        from: SocketAddr,
    },
    /// A connection was refused (logged already); kept to explain a later timeout.
    Refused { from: SocketAddr, reason: String },
}

/// What an acceptor checks in a handshake.
struct AcceptRules {
    kind: ConnKind,
    token: Vec<u8>,
    size: usize,
    rank: usize,
    handshake_timeout: Duration,
    board: Arc<AbortBoard>,
}

/// Abort notices received out of band: communicator sequence number → (reporting rank, lost
/// rank). Only authenticated peers write here, at most one entry per communicator.
#[derive(Debug, Default)]
pub(crate) struct AbortBoard {
    notices: Mutex<HashMap<u64, (usize, usize)>>,
}

impl AbortBoard {
    fn post(&self, seq: u64, from: usize, lost: usize) {
        if let Ok(mut n) = self.notices.lock() {
            n.entry(seq).or_insert((from, lost));
        }
    }

    /// The notice about communicator `seq`, if one arrived.
    pub(crate) fn get(&self, seq: u64) -> Option<(usize, usize)> {
        self.notices.lock().ok().and_then(|n| n.get(&seq).copied())
    }
}

/// What a communicator needs to reach its peers outside its own connections.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) book: Vec<SocketAddr>,
    pub(crate) token: Vec<u8>,
    pub(crate) board: Arc<AbortBoard>,
    pub(crate) handshake_timeout: Duration,
}

impl Link {
    /// Tell `peer`, over a fresh connection, that this rank gave up on communicator `seq`
    /// because it lost rank `lost`. Best effort, bounded by the handshake timeout.
    pub(crate) fn send_abort(&self, rank: usize, peer: usize, seq: u64, lost: usize) {
        let Some(addr) = self.book.get(peer) else {
            return;
        };
        let timeout = self.handshake_timeout.min(Duration::from_secs(2));
        let Ok(mut s) = TcpStream::connect_timeout(addr, timeout) else {
            return;
        };
        let hello = Hello {
            version: wire::PROTOCOL_VERSION,
            kind: ConnKind::Abort,
            size: self.book.len() as u32,
            rank: rank as u32,
            seq,
            port: 0,
            lost: lost as u32,
            token: self.token.clone(),
        };
        if let Err(e) = client_handshake(&mut s, &hello, &format!("rank {peer}"), timeout) {
            tracing::debug!(peer, error = %e, "could not deliver an abort notice");
        }
    }
}

/// A background thread serving one listener.
struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    incoming: Receiver<Incoming>,
    /// Recent refusals, quoted when an expected peer never arrives.
    refusals: Vec<String>,
}

impl Acceptor {
    fn spawn(listener: TcpListener, rules: AcceptRules) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| TransportError::io("making a listener nonblocking", e))?;
        let (tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let name = match rules.kind {
            ConnKind::Rendezvous => "fh-tcp-rendezvous",
            ConnKind::Data | ConnKind::Abort => "fh-tcp-accept",
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
    fn next(&mut self, deadline: Instant) -> Option<(Hello, TcpStream, SocketAddr)> {
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

    fn refusal_note(&self) -> String {
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
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [sys::pollfd(listener.as_raw_fd(), sys::POLLIN)];
        if let Err(e) = sys::poll(&mut fds, ACCEPT_POLL) {
            tracing::error!(error = %e, "poll on a TCP listener failed; it stops accepting");
            return;
        }
        loop {
            let (stream, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // ECONNABORTED, EMFILE and the like: log, back off a little, keep going.
                    tracing::warn!(error = %e, "accepting a TCP connection failed");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if pending.load(Ordering::Relaxed) >= MAX_PENDING_HANDSHAKES {
                tracing::warn!(%from, "too many handshakes in progress; dropping a connection");
                continue;
            }
            pending.fetch_add(1, Ordering::Relaxed);
            let (rules, tx, pending2) = (Arc::clone(&rules), tx.clone(), Arc::clone(&pending));
            let spawned = std::thread::Builder::new()
                .name("fh-tcp-handshake".into())
                .spawn(move || {
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
                        Ok((hello, stream)) => Incoming::Accepted {
                            hello,
                            stream,
                            from,
                        },
                        Err(reason) => {
                            tracing::warn!(
                                %from,
                                %reason,
                                "refused a TCP connection (a stranger, another job, or a \
                                 misconfigured rank)"
                            );
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
                tracing::warn!(error = %e, "could not spawn a handshake thread; connection dropped");
            }
        }
    }
}

/// Read a handshake (bounded in time and size), check it, and answer.
fn serve_handshake(
    mut stream: TcpStream,
    rules: &AcceptRules,
) -> std::result::Result<(Hello, TcpStream), String> {
    let _ = stream.set_nonblocking(false);
    let timeout = Some(rules.handshake_timeout);
    if stream.set_read_timeout(timeout).is_err() || stream.set_write_timeout(timeout).is_err() {
        return Err("could not set socket timeouts".into());
    }
    let mut buf = [0u8; wire::MAX_HELLO_LEN];
    let mut got = 0usize;
    // The whole handshake, not each read, is bounded: a stranger dripping a byte at a time
    // does not hold a thread for long.
    let deadline = Instant::now() + rules.handshake_timeout;
    let hello = loop {
        match Hello::decode(&buf[..got]) {
            Ok((hello, _)) => break hello,
            Err(DecodeError::NeedMore(n)) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
                    return Err(format!(
                        "no complete handshake within {:?} (a slow or silent connection)",
                        rules.handshake_timeout
                    ));
                }
                let n = n.min(buf.len());
                match stream.read(&mut buf[got..n]) {
                    Ok(0) => {
                        return Err(format!(
                            "connection closed after {got} bytes, before a complete handshake"
                        ))
                    }
                    Ok(k) => got += k,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Err(format!(
                            "no complete handshake within {:?} (half-open or silent connection)",
                            rules.handshake_timeout
                        ))
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(format!("reading the handshake failed: {e}")),
                }
            }
            Err(e) => {
                let reason = e.to_string();
                refuse(&mut stream, &reason);
                return Err(reason);
            }
        }
    };
    let reason = check_hello(&hello, rules);
    if let Some(reason) = reason {
        refuse(&mut stream, &reason);
        return Err(format!("rank {} (claimed): {reason}", hello.rank));
    }
    stream
        .write_all(&Reply::Accept.encode())
        .map_err(|e| format!("sending the acceptance failed: {e}"))?;
    Ok((hello, stream))
}

fn check_hello(hello: &Hello, rules: &AcceptRules) -> Option<String> {
    if !wire::constant_time_eq(&hello.token, &rules.token) {
        return Some(
            "wrong job token: this connection does not belong to this job (every rank must \
             have the same FH_JOB_TOKEN)"
                .into(),
        );
    }
    let abort_at_data = hello.kind == ConnKind::Abort && rules.kind == ConnKind::Data;
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
        ConnKind::Abort => false,
    };
    if !ok_rank {
        return Some(format!(
            "rank {rank} may not connect here (this is rank {} of {})",
            rules.rank, rules.size
        ));
    }
    None
}

fn refuse(stream: &mut TcpStream, reason: &str) {
    let _ = stream.write_all(&Reply::Refuse(reason.into()).encode());
    let _ = stream.flush();
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Connect to `addrs` (trying each), retrying until `deadline` while nobody listens yet.
fn connect_retry(addrs: &[SocketAddr], deadline: Instant, what: &str) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last_err: Option<io::Error> = None;
    loop {
        for addr in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                Err(e) => last_err = Some(e),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let e = last_err.unwrap_or_else(|| io::Error::from(io::ErrorKind::TimedOut));
            return Err(TransportError::io(
                format!("could not connect to {what} at {addrs:?} before the timeout"),
                e,
            ));
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Send a handshake and read the reply; a refusal becomes a clear [`TransportError::Handshake`].
fn client_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
    peer: &str,
    timeout: Duration,
) -> Result<()> {
    let io_err = |what: &str, e: io::Error| TransportError::io(format!("{what} {peer}"), e);
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|_| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| io_err("configuring the connection to", e))?;
    stream
        .write_all(&hello.encode())
        .map_err(|e| io_err("sending the handshake to", e))?;
    let mut buf = [0u8; wire::REPLY_FIXED_LEN + wire::MAX_REASON_LEN];
    let mut got = 0usize;
    loop {
        match Reply::decode(&buf[..got]) {
            Ok((Reply::Accept, _)) => return Ok(()),
            Ok((Reply::Refuse(reason), _)) => {
                tracing::error!(%peer, %reason, "our handshake was refused");
                return Err(TransportError::Handshake {
                    peer: peer.into(),
                    reason,
                });
            }
            Err(DecodeError::NeedMore(n)) => {
                let n = n.min(buf.len());
                match stream.read(&mut buf[got..n]) {
                    Ok(0) => {
                        return Err(TransportError::Handshake {
                            peer: peer.into(),
                            reason: "the connection was closed before the handshake was answered"
                                .into(),
                        })
                    }
                    Ok(k) => got += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err("waiting for the handshake reply of", e)),
                }
            }
            Err(e) => {
                return Err(TransportError::Handshake {
                    peer: peer.into(),
                    reason: e.to_string(),
                })
            }
        }
    }
}

fn resolve(addr: &str) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| TransportError::Config {
            var: "FH_RENDEZVOUS_ADDR".into(),
            reason: format!("cannot resolve {addr:?}: {e}"),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(TransportError::Config {
            var: "FH_RENDEZVOUS_ADDR".into(),
            reason: format!("{addr:?} resolves to no address"),
        });
    }
    Ok(addrs)
}

/// The TCP world of one rank.
pub struct TcpTransport {
    topology: Topology,
    opts: TcpOptions,
    token: Vec<u8>,
    /// Every rank's data-listener address (this rank's own included).
    book: Vec<SocketAddr>,
    next_seq: u64,
    acceptor: Option<Acceptor>,
    /// Connections that arrived for communicators not opened yet: (seq, rank) → stream.
    stash: HashMap<(u64, usize), TcpStream>,
    board: Arc<AbortBoard>,
    link: Option<Arc<Link>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("topology", &self.topology)
            .field("book", &self.book)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Join the job described by `info`: rendezvous through rank 0 and learn every rank's
    /// address. Blocks until every rank has arrived, at most about the timeout.
    pub fn connect(info: &LaunchInfo, opts: TcpOptions) -> Result<TcpTransport> {
        let topology = info.topology();
        let mut t = TcpTransport {
            topology,
            opts,
            token: Vec::new(),
            book: Vec::new(),
            next_seq: 0,
            acceptor: None,
            stash: HashMap::new(),
            board: Arc::new(AbortBoard::default()),
            link: None,
        };
        if info.size == 1 {
            return Ok(t);
        }
        t.token = info
            .token
            .as_ref()
            .ok_or_else(|| TransportError::Config {
                var: "FH_JOB_TOKEN".into(),
                reason: "a job of several ranks needs a job token".into(),
            })?
            .as_bytes()
            .to_vec();
        let rdv = info
            .rendezvous
            .as_deref()
            .ok_or_else(|| TransportError::Config {
                var: "FH_RENDEZVOUS_ADDR".into(),
                reason: "a job of several ranks needs a rendezvous address (host:port where \
                         rank 0 listens); launch with fhrun or set FH_RENDEZVOUS_ADDR"
                    .into(),
            })?;
        let addrs = resolve(rdv)?;
        if info.rank == 0 {
            t.rendezvous_root(&addrs, rdv)?;
        } else {
            t.rendezvous_member(&addrs, rdv)?;
        }
        t.link = Some(Arc::new(Link {
            book: t.book.clone(),
            token: t.token.clone(),
            board: Arc::clone(&t.board),
            handshake_timeout: t.opts.handshake_timeout,
        }));
        tracing::debug!(rank = info.rank, book = ?t.book, "TCP rendezvous complete");
        Ok(t)
    }

    /// Every rank's data-listener address, by rank (empty for a single process).
    pub fn peer_addresses(&self) -> &[SocketAddr] {
        &self.book
    }

    fn rules(&self, kind: ConnKind) -> AcceptRules {
        AcceptRules {
            kind,
            token: self.token.clone(),
            size: self.topology.size,
            rank: self.topology.rank,
            handshake_timeout: self.opts.handshake_timeout,
            board: Arc::clone(&self.board),
        }
    }

    fn rendezvous_root(&mut self, addrs: &[SocketAddr], rdv: &str) -> Result<()> {
        let size = self.topology.size;
        let mut bind_errors = Vec::new();
        let mut bound = None;
        for a in addrs {
            match TcpListener::bind(a) {
                Ok(l) => {
                    bound = Some((l, *a));
                    break;
                }
                Err(e) => bind_errors.push(format!("{a}: {e}")),
            }
        }
        let Some((rdv_listener, rdv_addr)) = bound else {
            return Err(TransportError::Config {
                var: "FH_RENDEZVOUS_ADDR".into(),
                reason: format!(
                    "rank 0 cannot listen on {rdv} ({}); it must be a free port on an address \
                     of rank 0's host",
                    bind_errors.join(", ")
                ),
            });
        };
        let data = TcpListener::bind(SocketAddr::new(rdv_addr.ip(), 0)).map_err(|e| {
            TransportError::io(format!("binding a data listener on {}", rdv_addr.ip()), e)
        })?;
        let my_addr = data
            .local_addr()
            .map_err(|e| TransportError::io("reading the data listener's address", e))?;
        self.acceptor = Some(Acceptor::spawn(data, self.rules(ConnKind::Data))?);
        let mut rdv_acceptor = Acceptor::spawn(rdv_listener, self.rules(ConnKind::Rendezvous))?;
        tracing::info!(%rdv_addr, size, "rank 0 waiting for the other ranks");

        let deadline = Instant::now() + self.opts.timeout;
        let mut members: Vec<Option<(TcpStream, SocketAddr)>> = (0..size).map(|_| None).collect();
        let mut missing = size - 1;
        while missing > 0 {
            let Some((hello, stream, from)) = rdv_acceptor.next(deadline) else {
                let absent: Vec<usize> = (1..size).filter(|&r| members[r].is_none()).collect();
                return Err(TransportError::Handshake {
                    peer: format!("rank(s) {absent:?}"),
                    reason: format!(
                        "they did not join the rendezvous at {rdv_addr} within {:?} (did they \
                         start, with the same FH_RENDEZVOUS_ADDR and FH_JOB_TOKEN?){}",
                        self.opts.timeout,
                        rdv_acceptor.refusal_note()
                    ),
                });
            };
            let r = hello.rank as usize;
            if members[r].is_some() {
                tracing::warn!(rank = r, %from, "a second connection claims an already joined rank; dropped");
                continue;
            }
            members[r] = Some((stream, SocketAddr::new(from.ip(), hello.port)));
            missing -= 1;
        }
        drop(rdv_acceptor);

        let mut book = vec![my_addr];
        let mut entries = vec![format!(":{}", my_addr.port())];
        for m in members.iter().skip(1) {
            let (_, addr) = m
                .as_ref()
                .ok_or_else(|| TransportError::Closed("rendezvous bookkeeping".into()))?;
            book.push(*addr);
            entries.push(addr.to_string());
        }
        let encoded = wire::encode_book(&entries);
        for (r, m) in members.iter_mut().enumerate().skip(1) {
            if let Some((stream, _)) = m {
                stream
                    .set_write_timeout(Some(self.opts.timeout))
                    .and_then(|_| stream.write_all(&encoded))
                    .map_err(|e| TransportError::PeerLost {
                        rank: r,
                        detail: format!("sending the address book failed: {e}"),
                    })?;
            }
        }
        self.book = book;
        Ok(())
    }

    fn rendezvous_member(&mut self, addrs: &[SocketAddr], rdv: &str) -> Result<()> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let deadline = Instant::now() + self.opts.timeout;
        let mut stream = connect_retry(addrs, deadline, "rank 0's rendezvous")?;
        let _ = stream.set_nodelay(true);
        let local_ip = stream
            .local_addr()
            .map_err(|e| TransportError::io("reading the rendezvous connection's address", e))?
            .ip();
        let root_ip: IpAddr = stream
            .peer_addr()
            .map_err(|e| TransportError::io("reading rank 0's address", e))?
            .ip();
        let data = TcpListener::bind(SocketAddr::new(local_ip, 0))
            .map_err(|e| TransportError::io(format!("binding a data listener on {local_ip}"), e))?;
        let port = data
            .local_addr()
            .map_err(|e| TransportError::io("reading the data listener's address", e))?
            .port();
        self.acceptor = Some(Acceptor::spawn(data, self.rules(ConnKind::Data))?);
        let hello = Hello {
            version: wire::PROTOCOL_VERSION,
            kind: ConnKind::Rendezvous,
            size: size as u32,
            rank: rank as u32,
            seq: 0,
            port,
            lost: 0,
            token: self.token.clone(),
        };
        let peer = format!("rank 0 (rendezvous at {rdv})");
        client_handshake(&mut stream, &hello, &peer, self.opts.handshake_timeout)?;

        // Rank 0 answers once everybody is in: wait up to its timeout, plus a margin.
        stream
            .set_read_timeout(Some(self.opts.timeout + self.opts.handshake_timeout))
            .map_err(|e| TransportError::io("configuring the rendezvous connection", e))?;
        let max = wire::max_book_len(size);
        let mut buf = vec![0u8; 4];
        let mut got = 0usize;
        let entries = loop {
            match wire::decode_book(&buf[..got], size) {
                Ok((entries, _)) => break entries,
                Err(DecodeError::NeedMore(n)) if n <= max => {
                    if buf.len() < n {
                        buf.resize(n, 0);
                    }
                    match stream.read(&mut buf[got..n]) {
                        Ok(0) => {
                            return Err(TransportError::PeerLost {
                                rank: 0,
                                detail: "rank 0 closed the rendezvous before sending the address \
                                         book (see rank 0's log)"
                                    .into(),
                            })
                        }
                        Ok(k) => got += k,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                            ) =>
                        {
                            return Err(TransportError::Timeout {
                                rank: 0,
                                op: "rendezvous (waiting for the address book)",
                                after: self.opts.timeout,
                            })
                        }
                        Err(e) => {
                            return Err(TransportError::PeerLost {
                                rank: 0,
                                detail: format!("reading the address book failed: {e}"),
                            })
                        }
                    }
                }
                Err(e) => {
                    return Err(TransportError::Protocol {
                        rank: 0,
                        detail: format!("bad address book: {e}"),
                    })
                }
            }
        };
        let mut book = Vec::with_capacity(size);
        for (r, e) in entries.iter().enumerate() {
            let addr = if r == 0 {
                e.strip_prefix(':')
                    .and_then(|p| p.parse::<u16>().ok())
                    .map(|p| SocketAddr::new(root_ip, p))
            } else {
                e.parse::<SocketAddr>().ok()
            };
            book.push(addr.ok_or_else(|| TransportError::Protocol {
                rank: 0,
                detail: format!("bad address book entry for rank {r}: {e:?}"),
            })?);
        }
        self.book = book;
        Ok(())
    }

    fn open_mesh(&mut self, label: &str, seq: u64) -> Result<Vec<Option<TcpStream>>> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let deadline = Instant::now() + self.opts.timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Connect to every lower rank.
        for (r, slot) in peers.iter_mut().enumerate().take(rank) {
            let what = format!("rank {r} (communicator '{label}')");
            // Every data listener has been up since the rendezvous: a refused connection
            // means that rank's process is gone, not that it is late.
            let left = deadline.saturating_duration_since(Instant::now());
            let mut s =
                match TcpStream::connect_timeout(&self.book[r], left.max(Duration::from_millis(1)))
                {
                    Ok(s) => s,
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        return Err(TransportError::PeerLost {
                            rank: r,
                            detail: format!(
                                "its listener at {} refused the connection for communicator \
                             '{label}' (the process is gone)",
                                self.book[r]
                            ),
                        })
                    }
                    Err(_) => connect_retry(&[self.book[r]], deadline, &what)?,
                };
            let hello = Hello {
                version: wire::PROTOCOL_VERSION,
                kind: ConnKind::Data,
                size: size as u32,
                rank: rank as u32,
                seq,
                port: 0,
                lost: 0,
                token: self.token.clone(),
            };
            client_handshake(
                &mut s,
                &hello,
                &what,
                self.opts.handshake_timeout.max(self.opts.timeout),
            )?;
            *slot = Some(s);
        }
        // Accept every higher rank (possibly stashed while an earlier communicator was opened).
        let acceptor = self
            .acceptor
            .as_mut()
            .ok_or_else(|| TransportError::Closed("the TCP transport has no listener".into()))?;
        for (r, slot) in peers.iter_mut().enumerate().skip(rank + 1) {
            if let Some(s) = self.stash.remove(&(seq, r)) {
                *slot = Some(s);
            }
        }
        while let Some(missing) = (rank + 1..size).find(|&r| peers[r].is_none()) {
            let Some((hello, stream, from)) = acceptor.next(deadline) else {
                return Err(TransportError::Handshake {
                    peer: format!("rank {missing}"),
                    reason: format!(
                        "it did not connect for communicator '{label}' (#{seq}) within {:?}{}",
                        self.opts.timeout,
                        acceptor.refusal_note()
                    ),
                });
            };
            let r = hello.rank as usize;
            if hello.seq < seq || (hello.seq == seq && peers[r].is_some()) {
                tracing::warn!(rank = r, seq = hello.seq, %from, "dropping a stale or duplicate connection");
            } else if hello.seq == seq {
                peers[r] = Some(stream);
            } else {
                self.stash.insert((hello.seq, r), stream);
            }
        }
        for s in peers.iter().flatten() {
            s.set_nodelay(true)
                .and_then(|_| s.set_nonblocking(true))
                .and_then(|_| s.set_read_timeout(None))
                .and_then(|_| s.set_write_timeout(None))
                .map_err(|e| TransportError::io("configuring a data connection", e))?;
        }
        Ok(peers)
    }
}

impl Transport for TcpTransport {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let (rank, size) = (self.topology.rank, self.topology.size);
        let peers = if size == 1 {
            vec![None]
        } else {
            self.open_mesh(label, seq)?
        };
        tracing::debug!(rank, seq, label, "TCP communicator open");
        Ok(Box::new(TcpComm::new(
            label.to_owned(),
            seq,
            rank,
            size,
            peers,
            &self.opts,
            self.link.clone(),
        )))
    }
}
