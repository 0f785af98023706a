//! Liveness apart from progress: every rank's world sends each peer a small heartbeat every
//! [`Settings::interval`] from a thread of its own, and a peer not heard for
//! [`Settings::silence`] is declared lost — a frozen (stopped) process, a host cut off or
//! partitioned — by every rank within about that silence, whatever `FH_TIMEOUT_SECONDS` is.
//!
//! The heartbeats come from the transport's own thread, never from the caller's (Python's), so
//! a rank that computes for minutes between collectives keeps beating and is never blamed;
//! `FH_TIMEOUT_SECONDS` keeps its meaning for a peer that is alive and makes no progress.
//!
//! **Datagrams, not a stream.** The heartbeats travel as UDP datagrams, to the port number of
//! each rank's TCP data listener (each rank binds both): a lost datagram costs one interval, not
//! a TCP retransmission timeout that doubles with every loss and holds back every later beat
//! behind it, so packet loss on a link does not look like a dead peer. Each datagram carries a
//! MAC keyed with the job token's key (`beat.rs`), the job's world id and a sequence number: a
//! stranger can neither forge nor replay one.
//!
//! **Verdicts.** A rank that declares a peer lost — or whose world stops because it lost a
//! rank, [`Watch::declare`] — says so in every heartbeat from then on, and a rank that hears it
//! adopts it: every rank stops naming the same rank, also a rank that was not itself waiting
//! for the lost one. When a host is cut off, its ranks' silences are judged together
//! (`tracker.rs`): every rank across the cut names the same (lowest) rank of it. A rank that
//! leaves in order says goodbye ([`Liveness`]'s drop) and is never blamed for its silence.
//!
//! **What a verdict does.** Every wait of the world's communicators for the lost rank ends at
//! once with an error naming it instead of at its timeout (TCP polls [`Watch::wake_fd`],
//! shared memory looks between the slices of its sleeps); a wait for another rank goes on —
//! that rank, if it waits for the lost one, fails and says whom it lost — so a process set
//! whose members are all alive keeps working. And the verdict calls the subscribers
//! ([`Watch::subscribe`]): the world's engine stops at once, also when idle, and interrupts
//! every channel it runs.
//!
//! **Settings.** `FH_HEARTBEAT_TIMEOUT_SECONDS` (the silence, default
//! [`DEFAULT_SILENCE`]; `0` turns heartbeats off) and `FH_HEARTBEAT_INTERVAL_MS` (default
//! [`DEFAULT_INTERVAL`]); every rank must use the same values (the engine checks them at
//! start-up), and a rank tolerates at least the silence its peer says it tolerates.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fh_job::token::Key;
use fh_job::world::WORLD_ID_LEN;

use crate::{Result, TransportError};

pub(crate) mod beat;
mod tracker;

use beat::{Beat, Kind};
use tracker::Tracker;

pub use fh_job::heartbeat::{
    Settings, DEFAULT_INTERVAL, DEFAULT_SILENCE, INTERVAL_VAR, SILENCE_VAR,
};

/// A rank declared lost, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The rank lost (world numbering).
    pub lost: usize,
    /// What was found, for the error's text.
    pub detail: String,
}

impl Verdict {
    /// The error a world's operations fail with: [`TransportError::PeerLost`] naming the rank.
    pub fn error(&self) -> TransportError {
        TransportError::PeerLost {
            rank: self.lost,
            detail: self.detail.clone(),
        }
    }
}

type Subscriber = Box<dyn Fn(&Verdict) + Send + Sync>;

struct Shared {
    rank: usize,
    settings: Settings,
    verdict: Mutex<Option<Verdict>>,
    subscribers: Mutex<Vec<Subscriber>>,
    /// Made readable (for good) when the verdict comes: for waits that poll descriptors.
    wake: Option<(
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    )>,
    /// Peers silent for half the tolerated silence (suspects), for [`Watch::is_quiet`].
    quiet: Mutex<Vec<bool>>,
    /// The longest gap between two heartbeats from each peer, for [`Watch::longest_gaps`].
    gaps: Mutex<Vec<Duration>>,
    stop: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("rank", &self.rank)
            .field("settings", &self.settings)
            .field("verdict", &self.verdict)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Record `v` unless a verdict stands already; raise every interrupt and tell every
    /// subscriber. Returns whether `v` is now the verdict.
    fn settle(&self, v: Verdict) -> bool {
        {
            let mut cur = self.verdict.lock().unwrap_or_else(|p| p.into_inner());
            if cur.is_some() {
                return false;
            }
            *cur = Some(v.clone());
        }
        tracing::error!(rank = self.rank, lost = v.lost, detail = %v.detail, "liveness: a rank is lost");
        if let Some((tx, _)) = &self.wake {
            let _ = std::io::Write::write(&mut &*tx, &[1]);
        }
        let subs = std::mem::take(&mut *self.subscribers.lock().unwrap_or_else(|p| p.into_inner()));
        for s in &subs {
            s(&v);
        }
        true
    }
}

/// A handle on a world's liveness verdict (cheap to clone; see the
/// [module documentation](self)).
#[derive(Debug, Clone)]
pub struct Watch(Arc<Shared>);

impl Watch {
    /// The rank declared lost, if one was (by this rank, or by a peer that told this one).
    pub fn verdict(&self) -> Option<Verdict> {
        self.0
            .verdict
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Call `f` once with the verdict: from the heartbeat thread when it comes, at once (on
    /// this thread) when it came already. `f` must not block.
    pub fn subscribe(&self, f: impl Fn(&Verdict) + Send + Sync + 'static) {
        let now = {
            let v = self.0.verdict.lock().unwrap_or_else(|p| p.into_inner());
            match &*v {
                Some(v) => Some(v.clone()),
                None => {
                    self.0
                        .subscribers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Box::new(f));
                    return;
                }
            }
        };
        if let Some(v) = now {
            f(&v);
        }
    }

    /// This rank stops because it lost rank `lost` (itself, when it fails on its own), found
    /// some other way (a closed connection, a timeout): make it the verdict unless one stands,
    /// and tell every peer in the heartbeats, so that every rank names the same rank promptly.
    pub fn declare(&self, lost: usize, detail: impl Into<String>) {
        self.0.settle(Verdict {
            lost,
            detail: detail.into(),
        });
    }

    /// A descriptor that turns readable (and stays so) when the verdict comes, for waits that
    /// poll descriptors; `None` when none could be made (such waits then look at
    /// [`Watch::verdict`] at their next wake-up).
    pub fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.0.wake.as_ref().map(|(_, rx)| rx.as_raw_fd())
    }

    /// The verdict, when a wait for `rank` should end with it: it names `rank` or this rank,
    /// or `rank` has been silent too (another rank of a host that is cut off: the verdict
    /// names the lowest, and waits for the others end as well).
    pub fn verdict_on(&self, rank: usize) -> Option<Verdict> {
        self.verdict()
            .filter(|v| v.lost == rank || v.lost == self.0.rank || self.is_quiet(rank))
    }

    /// Whether `peer` has not been heard for half the tolerated silence: a notice to it may
    /// wait long for nothing.
    pub fn is_quiet(&self, peer: usize) -> bool {
        self.0
            .quiet
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .copied()
            .unwrap_or(false)
    }

    /// The settings the heartbeats run with.
    pub fn settings(&self) -> Settings {
        self.0.settings
    }

    /// For each rank, the longest time between two heartbeats heard from it so far (zero for
    /// this rank, and for a peer heard at most once): how close the world came to a false
    /// alarm. `examples/heartbeat_gaps.rs` reports it under load.
    pub fn longest_gaps(&self) -> Vec<Duration> {
        self.0
            .gaps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What a world's heartbeats need: this rank, where each peer's heartbeat socket is, the job
/// token's key and the world id.
pub(crate) struct Peers {
    pub(crate) rank: usize,
    /// Every rank's heartbeat address (this rank's own included), by rank.
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) key: Key,
    pub(crate) world: [u8; WORLD_ID_LEN],
}

/// A world's running heartbeats: owned by the transport, which hands out [`Watch`]es. Dropping
/// it says goodbye to every peer (this rank leaves in order) and joins its thread.
#[derive(Debug)]
pub struct Liveness {
    watch: Watch,
    thread: Option<JoinHandle<()>>,
}

impl Liveness {
    /// Start beating on `socket` (bound to this rank's heartbeat address).
    pub(crate) fn start(socket: UdpSocket, peers: Peers, settings: Settings) -> Result<Liveness> {
        let size = peers.addrs.len();
        let shared = Arc::new(Shared {
            rank: peers.rank,
            settings,
            verdict: Mutex::new(None),
            subscribers: Mutex::new(Vec::new()),
            wake: std::os::unix::net::UnixStream::pair()
                .and_then(|(tx, rx)| {
                    tx.set_nonblocking(true)?;
                    Ok((tx, rx))
                })
                .ok(),
            quiet: Mutex::new(vec![false; size]),
            gaps: Mutex::new(vec![Duration::ZERO; size]),
            stop: AtomicBool::new(false),
        });
        socket
            .set_nonblocking(true)
            .map_err(|e| TransportError::io("configuring the heartbeat socket", e))?;
        // Room for a stall's worth of heartbeats from every peer.
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&socket, 1 << 20);
        let shared2 = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("fh-heartbeat-{}", peers.rank))
            .spawn(move || Pulse::new(socket, peers, settings, shared2).run())
            .map_err(|e| TransportError::io("starting the heartbeat thread", e))?;
        Ok(Liveness {
            watch: Watch(shared),
            thread: Some(thread),
        })
    }

    /// A handle on the verdict.
    pub fn watch(&self) -> &Watch {
        &self.watch
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.watch.0.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The heartbeat thread's state.
struct Pulse {
    socket: UdpSocket,
    peers: Peers,
    settings: Settings,
    shared: Arc<Shared>,
    tracker: Tracker,
    seq: u64,
}

impl Pulse {
    fn new(socket: UdpSocket, peers: Peers, settings: Settings, shared: Arc<Shared>) -> Pulse {
        let tracker = Tracker::new(
            peers.rank,
            peers.addrs.len(),
            settings.interval,
            settings.silence,
            Instant::now(),
        );
        Pulse {
            socket,
            peers,
            settings,
            shared,
            tracker,
            seq: 0,
        }
    }

    fn run(mut self) {
        let look_every = (self.settings.interval / 2).max(Duration::from_millis(1));
        let mut next_send = Instant::now();
        let mut buf = [0u8; beat::LEN + 1];
        while !self.shared.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= next_send {
                self.send_all(self.kind());
                next_send = (next_send + self.settings.interval).max(now);
            }
            let wait = next_send
                .saturating_duration_since(Instant::now())
                .min(look_every);
            self.wait_readable(wait);
            self.drain(&mut buf);
            let now = Instant::now();
            if self
                .shared
                .verdict
                .lock()
                .map(|v| v.is_none())
                .unwrap_or(false)
            {
                if let Some(s) = self.tracker.look(now) {
                    let v = Verdict {
                        lost: s.rank,
                        detail: format!(
                            "no heartbeat from rank {} for {:.1} s ({SILENCE_VAR}={}): its \
                             process is frozen (stopped), its host is cut off or partitioned, or \
                             its engine's threads cannot run",
                            s.rank,
                            s.for_.as_secs_f64(),
                            self.settings.silence.as_secs_f64()
                        ),
                    };
                    if self.shared.settle(v) {
                        // Tell everybody at once, not an interval later.
                        self.send_all(self.kind());
                    }
                }
            }
            if let Ok(mut q) = self.shared.quiet.lock() {
                for (r, slot) in q.iter_mut().enumerate() {
                    *slot = self.tracker.is_quiet(r, now);
                }
            }
            if let Ok(mut g) = self.shared.gaps.lock() {
                g.copy_from_slice(self.tracker.gaps());
            }
        }
        // Leaving in order: twice, for a lost datagram.
        self.send_all(Kind::Bye);
        self.send_all(Kind::Bye);
    }

    /// What this rank's heartbeats say now.
    fn kind(&self) -> Kind {
        match &*self
            .shared
            .verdict
            .lock()
            .unwrap_or_else(|p| p.into_inner())
        {
            Some(v) => Kind::Lost(v.lost as u32),
            None => Kind::Alive,
        }
    }

    fn send_all(&mut self, kind: Kind) {
        self.seq += 1;
        let silence_ms = self.settings.silence.as_millis().min(u32::MAX as u128) as u32;
        for (r, addr) in self.peers.addrs.iter().enumerate() {
            if r == self.peers.rank {
                continue;
            }
            let b = Beat {
                from: self.peers.rank as u32,
                to: r as u32,
                seq: self.seq,
                kind,
                silence_ms,
                world: self.peers.world,
            }
            .encode(&self.peers.key);
            // Best effort: a full buffer or an unreachable network is a lost heartbeat.
            let _ = self.socket.send_to(&b, addr);
        }
    }

    fn wait_readable(&self, wait: Duration) {
        let fd = self.socket.as_fd();
        let mut p = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: wait.as_secs() as _,
            tv_nsec: wait.subsec_nanos() as _,
        };
        let _ = rustix::event::poll(&mut p, Some(&ts));
    }

    fn drain(&mut self, buf: &mut [u8]) {
        let me = self.peers.rank;
        loop {
            let n = match self.socket.recv_from(buf) {
                Ok((n, _)) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock, or an ICMP error of an earlier send: nothing more now.
                Err(_) => return,
            };
            let Some(b) = Beat::decode(&buf[..n], &self.peers.key, &self.peers.world, me as u32)
            else {
                continue;
            };
            let from = b.from as usize;
            let tolerates = Duration::from_millis(u64::from(b.silence_ms));
            if !self.tracker.heard(from, b.seq, tolerates, Instant::now()) {
                continue;
            }
            match b.kind {
                Kind::Alive => {}
                Kind::Bye => self.tracker.departed(from),
                Kind::Lost(lost) => {
                    let lost = lost as usize;
                    if lost >= self.peers.addrs.len() {
                        continue;
                    }
                    let detail = if lost == me {
                        format!(
                            "rank {from} declared this rank (rank {me}) lost: it heard no \
                             heartbeat from it for too long (this process was stopped, or its \
                             host cut off)"
                        )
                    } else if lost == from {
                        format!("rank {from} failed and stopped its world")
                    } else {
                        format!("rank {from} reported that it lost rank {lost}")
                    };
                    if self.shared.settle(Verdict { lost, detail }) {
                        self.send_all(self.kind());
                    }
                }
            }
        }
    }
}
