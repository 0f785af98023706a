//! The driver's side of the elastic sessions: one listener thread, one thread per session.
//!
//! The session threads turn what workers send into [`Event`]s, which the driver takes with
//! [`Server::next_event`] (bounded); the driver answers a Register with [`Server::answer`].
//! Host-update queries are answered by the session thread itself from the changes the driver
//! records with [`Server::set_hosts`], so a query never waits for the driver's loop.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{self, Msg, ReadError};
use super::{HostUpdate, Membership};
use crate::token::{fresh_nonce, JobToken};
use crate::{JobError, Result};

/// How long a connecting worker may take to complete the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most sessions (and handshakes in progress) held at once; more connections are closed.
pub const MAX_SESSIONS: usize = 4096;
/// Bound on writing one answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a worker did, as the driver sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `worker` opened an authenticated session (one that replaces an earlier session of the
    /// same id ends that one without a [`Event::Closed`]).
    Connected {
        /// The worker's id.
        worker: String,
    },
    /// `worker` asks for the next world; answer it with [`Server::answer`].
    Registered {
        /// The worker's id.
        worker: String,
        /// Where it would listen as rank 0.
        candidate: String,
    },
    /// `worker` asked for host updates after `since` (already answered).
    HostUpdatesAsked {
        /// The worker's id.
        worker: String,
        /// The stamp it asked about.
        since: u64,
    },
    /// `worker`'s session ended.
    Closed {
        /// The worker's id.
        worker: String,
        /// How it ended (closed by the worker, a protocol error, ...).
        reason: String,
    },
}

struct Session {
    serial: u64,
    stream: TcpStream,
}

struct Shared {
    token: JobToken,
    elastic_timeout: Duration,
    stop: AtomicBool,
    sessions: Mutex<HashMap<String, Session>>,
    next_serial: AtomicU64,
    open: AtomicUsize,
    /// Every change of the usable host set: (stamp, added, removed).
    changes: Mutex<Vec<(u64, bool, bool)>>,
    events: Mutex<mpsc::Sender<Event>>,
}

impl Shared {
    fn emit(&self, e: Event) {
        if let Ok(tx) = self.events.lock() {
            let _ = tx.send(e);
        }
    }

    fn host_update(&self, since: u64) -> HostUpdate {
        let changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let mut u = HostUpdate {
            stamp: changes.iter().map(|c| c.0).max().unwrap_or(0),
            added: false,
            removed: false,
        };
        for &(stamp, added, removed) in changes.iter().filter(|c| c.0 > since) {
            u.stamp = u.stamp.max(stamp);
            u.added |= added;
            u.removed |= removed;
        }
        u
    }
}

/// The driver's listener for worker sessions.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    events: mpsc::Receiver<Event>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Listen on `addr` (port 0: any free port) for workers proving `token`; every worker is
    /// told `elastic_timeout`, which bounds its wait for an answer to a Register.
    pub fn bind(addr: SocketAddr, token: JobToken, elastic_timeout: Duration) -> Result<Server> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            JobError::io(
                format!("binding the elastic driver's listener on {addr}"),
                e,
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| JobError::io("reading the elastic listener's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| JobError::io("making the elastic listener nonblocking", e))?;
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            token,
            elastic_timeout,
            stop: AtomicBool::new(false),
            sessions: Mutex::new(HashMap::new()),
            next_serial: AtomicU64::new(1),
            open: AtomicUsize::new(0),
            changes: Mutex::new(Vec::new()),
            events: Mutex::new(tx),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("elastic-accept".into())
            .spawn(move || accept_loop(&listener, &s))
            .map_err(|e| JobError::io("starting the elastic listener thread", e))?;
        Ok(Server {
            addr,
            shared,
            events: rx,
            acceptor: Some(acceptor),
        })
    }

    /// The address workers connect to (`FH_ELASTIC_ADDR`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next event, waiting at most `timeout`; `None` when none came.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        self.events.recv_timeout(timeout).ok()
    }

    /// Answer `worker`'s Register.
    pub fn answer(&self, worker: &str, membership: &Membership) -> Result<()> {
        let mut stream = {
            let sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let s = sessions
                .get(worker)
                .ok_or_else(|| JobError::Closed(format!("worker {worker} has no session")))?;
            s.stream
                .try_clone()
                .map_err(|e| JobError::io(format!("answering worker {worker}"), e))?
        };
        wire::write_frame(
            &mut stream,
            &Msg::Answer(membership.clone()).encode(),
            WRITE_TIMEOUT,
        )
        .map_err(|e| JobError::io(format!("answering worker {worker}"), e))
    }

    /// Record a change of the usable host set at `stamp` (hosts added, removed); host-update
    /// queries about an earlier stamp report it.
    pub fn set_hosts(&self, stamp: u64, added: bool, removed: bool) {
        self.shared
            .changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((stamp, added, removed));
    }

    /// What a host-update query about `since` gets now.
    pub fn host_update(&self, since: u64) -> HostUpdate {
        self.shared.host_update(since)
    }

    /// End `worker`'s session (it sees its session close).
    pub fn close_session(&self, worker: &str) {
        let s = self
            .shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(worker);
        if let Some(s) = s {
            let _ = s.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let mut sessions = self
            .shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (_, s) in sessions.drain() {
            let _ = s.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if shared.open.load(Ordering::SeqCst) >= MAX_SESSIONS {
                    tracing::warn!(%peer, "elastic driver: too many sessions; closing a connection");
                    continue;
                }
                shared.open.fetch_add(1, Ordering::SeqCst);
                let s = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("elastic-session".into())
                    .spawn(move || {
                        serve(stream, peer, &s);
                        s.open.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    shared.open.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "elastic driver: accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The driver's side of the handshake; returns the worker's id.
fn handshake(stream: &mut TcpStream, peer: SocketAddr, shared: &Shared) -> Result<String, String> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let stop = || shared.stop.load(Ordering::SeqCst);
    let body = wire::read_frame(stream, Some(deadline), &stop).map_err(|e| e.to_string())?;
    let refuse = |s: &mut TcpStream, why: String| {
        let _ = wire::write_frame(s, &Msg::Refuse(why.clone()).encode(), WRITE_TIMEOUT);
        why
    };
    let worker = match Msg::decode(&body) {
        Ok(Msg::Hello { worker, .. }) => worker,
        Ok(other) => return Err(refuse(stream, format!("expected a hello, got {other:?}"))),
        Err(e) => return Err(refuse(stream, e.to_string())),
    };
    if worker.is_empty() || !worker.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(refuse(
            stream,
            format!("a worker id {worker:?} that is empty or not printable ASCII"),
        ));
    }
    let nonce = fresh_nonce().map_err(|e| e.to_string())?;
    let proof = wire::driver_proof(&shared.token.key(), &body, &nonce);
    wire::write_frame(
        stream,
        &Msg::Challenge { nonce, proof }.encode(),
        WRITE_TIMEOUT,
    )
    .map_err(|e| e.to_string())?;
    let answer = wire::read_frame(stream, Some(deadline), &stop).map_err(|e| e.to_string())?;
    match Msg::decode(&answer) {
        Ok(Msg::Proof(tag)) if wire::verify(false, &shared.token.key(), &body, &nonce, &tag) => {}
        Ok(Msg::Proof(_)) => {
            return Err(refuse(
                stream,
                format!(
                    "worker {worker} (from {peer}) could not prove the job token (FH_JOB_TOKEN \
                     differs from the driver's)"
                ),
            ))
        }
        Ok(other) => return Err(refuse(stream, format!("expected a proof, got {other:?}"))),
        Err(e) => return Err(refuse(stream, e.to_string())),
    }
    let timeout_ms = u64::try_from(shared.elastic_timeout.as_millis()).unwrap_or(u64::MAX);
    wire::write_frame(stream, &Msg::Welcome { timeout_ms }.encode(), WRITE_TIMEOUT)
        .map_err(|e| e.to_string())?;
    Ok(worker)
}

fn serve(mut stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_nonblocking(false);
    let worker = match handshake(&mut stream, peer, shared) {
        Ok(w) => w,
        Err(why) => {
            tracing::warn!(%peer, reason = %why, "elastic driver: refused a connection");
            return;
        }
    };
    let serial = shared.next_serial.fetch_add(1, Ordering::SeqCst);
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let replaced = shared
        .sessions
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(
            worker.clone(),
            Session {
                serial,
                stream: clone,
            },
        );
    if let Some(old) = replaced {
        let _ = old.stream.shutdown(std::net::Shutdown::Both);
    }
    shared.emit(Event::Connected {
        worker: worker.clone(),
    });
    let stop = || shared.stop.load(Ordering::SeqCst);
    let reason = loop {
        let body = match wire::read_frame(&mut stream, None, &stop) {
            Ok(b) => b,
            Err(ReadError::Closed) => break "the worker closed its session".to_string(),
            Err(e) => break e.to_string(),
        };
        match Msg::decode(&body) {
            Ok(Msg::Register { candidate }) => shared.emit(Event::Registered {
                worker: worker.clone(),
                candidate,
            }),
            Ok(Msg::HostUpdates { since }) => {
                let u = shared.host_update(since);
                if let Err(e) =
                    wire::write_frame(&mut stream, &Msg::Update(u).encode(), WRITE_TIMEOUT)
                {
                    break format!("answering a host-update query: {e}");
                }
                shared.emit(Event::HostUpdatesAsked {
                    worker: worker.clone(),
                    since,
                });
            }
            Ok(other) => break format!("an unexpected message {other:?}"),
            Err(e) => break e.to_string(),
        }
    };
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let mut sessions = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
    // A session replaced by a newer one of the same id ends without a word.
    if sessions.get(&worker).is_some_and(|s| s.serial == serial) {
        sessions.remove(&worker);
        drop(sessions);
        shared.emit(Event::Closed { worker, reason });
    } else if !sessions.contains_key(&worker) {
        // Closed by the driver (close_session): still tell it.
        drop(sessions);
        shared.emit(Event::Closed { worker, reason });
    }
}
