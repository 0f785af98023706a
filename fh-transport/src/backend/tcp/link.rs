//! What reaches a rank's peers outside a communicator's own connections: the job token as the
//! handshake's key, and abort notices (sent over fresh connections, collected on a board).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::handshake::client_handshake;
use super::wire::{self, ConnKind, Hello};
use super::Key;

/// The longest a liveness probe ([`Link::probe`]) waits for the peer's answer.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Slack for a loaded machine, on top of a peer's timeout and probe, in the one extension a
/// wait gets for a peer that still answers.
pub(crate) const PROBE_MARGIN: Duration = Duration::from_millis(500);

/// How long [`Link::refuses`] waits for a peer's listener to answer or refuse.
pub(crate) const GONE_CHECK: Duration = Duration::from_millis(50);

/// The longest the delivery of abort notices out of band may take ([`Link::send_aborts`]),
/// however many peers there are.
pub(crate) const NOTICE_TIMEOUT: Duration = Duration::from_secs(2);

/// Abort notices received out of band: communicator sequence number → (reporting rank, lost
/// rank). Only authenticated peers write here, at most one entry per communicator.
#[derive(Debug, Default)]
pub(crate) struct AbortBoard {
    notices: Mutex<HashMap<u64, (usize, usize)>>,
    /// Peers that did not answer a liveness probe: later timeouts on them (on any
    /// communicator) blame them at once instead of probing again.
    silent: Mutex<Vec<usize>>,
    /// Set when this world can no longer be trusted to hold only this job's ranks (rank 0 saw
    /// a second process with the job's token claim a rank after the rendezvous): every
    /// communicator's next operation fails with this reason, telling its peers.
    world_fault: Mutex<Option<String>>,
    /// When rank 0's rendezvous completed (rank 0 only).
    rendezvous_done: OnceLock<Instant>,
}

/// A second claim of a rank this soon after the rendezvous completed comes from a process
/// started together with the job: it may be the job's own member, whose place another job's
/// rank took, so the world stops ([`AbortBoard::late_claim`]). A claim after that is a job
/// started later, refused without disturbing this one.
pub(crate) const TWIN_WINDOW: Duration = Duration::from_secs(3);

impl AbortBoard {
    pub(crate) fn post(&self, seq: u64, from: usize, lost: usize) {
        if let Ok(mut n) = self.notices.lock() {
            n.entry(seq).or_insert((from, lost));
        }
    }

    /// Remember that `peer` did not answer a liveness probe.
    pub(crate) fn mark_silent(&self, peer: usize) {
        if let Ok(mut s) = self.silent.lock() {
            if !s.contains(&peer) {
                s.push(peer);
            }
        }
    }

    /// Whether `peer` failed a liveness probe already.
    pub(crate) fn is_silent(&self, peer: usize) -> bool {
        self.silent.lock().is_ok_and(|s| s.contains(&peer))
    }

    /// Record that this world holds, or may hold, a rank of another job (the first reason
    /// stays).
    pub(crate) fn post_world_fault(&self, reason: String) {
        if let Ok(mut f) = self.world_fault.lock() {
            f.get_or_insert(reason);
        }
    }

    /// Note that rank 0's rendezvous completed now.
    pub(crate) fn rendezvous_completed(&self) {
        let _ = self.rendezvous_done.set(Instant::now());
    }

    /// A process with the job's token claimed `rank`, which joined already, from `from`: within
    /// [`TWIN_WINDOW`] of the rendezvous' end the world may hold the other job's rank and
    /// stops; later the claimant is only refused. Returns whether the world stops.
    pub(crate) fn late_claim(&self, rank: u32, from: SocketAddr) -> bool {
        let recent = self
            .rendezvous_done
            .get()
            .is_none_or(|t| t.elapsed() < TWIN_WINDOW);
        if recent {
            self.post_world_fault(format!(
                "a second process with this job's FH_JOB_TOKEN claimed rank {rank}, from {from}, \
                 as the rendezvous completed: another job with the same token and rendezvous \
                 address started together with this one, and this world may hold one of its \
                 ranks, so it stops rather than mix two jobs; give every job its own \
                 FH_JOB_TOKEN (fhrun draws one per job)"
            ));
        }
        recent
    }

    /// Why this world can no longer be trusted, if it cannot.
    pub(crate) fn world_fault(&self) -> Option<String> {
        self.world_fault.lock().ok().and_then(|f| f.clone())
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
    pub(crate) key: Key,
    pub(crate) board: Arc<AbortBoard>,
    pub(crate) handshake_timeout: Duration,
    /// The job's world id, named in every hello.
    pub(crate) world: [u8; wire::WORLD_ID_LEN],
    /// The world's liveness watch, when heartbeats run.
    pub(crate) watch: Option<crate::liveness::Watch>,
}

impl Link {
    /// Tell every rank in `peers`, each over a fresh connection and all at once, that this rank
    /// gave up on communicator `seq` because it lost rank `lost`. Best effort, bounded by the
    /// handshake timeout (at most 2 s) in all, however many peers there are.
    pub(crate) fn send_aborts(&self, rank: usize, peers: &[usize], seq: u64, lost: usize) {
        match peers {
            [] => {}
            [peer] => self.send_abort(rank, *peer, seq, lost),
            _ => std::thread::scope(|s| {
                for &peer in peers {
                    let spawned = std::thread::Builder::new()
                        .name("fh-tcp-abort".into())
                        .spawn_scoped(s, move || self.send_abort(rank, peer, seq, lost));
                    if spawned.is_err() {
                        // No thread to spare: tell this one in line.
                        self.send_abort(rank, peer, seq, lost);
                    }
                }
            }),
        }
    }

    /// [`Link::send_aborts`] to those of `peers` the heartbeats still hear: a peer quiet for a
    /// while (cut off with the lost rank) would hold a notice's connection until its timeout,
    /// and hears the verdict in the heartbeats if at all.
    pub(crate) fn send_aborts_to_heard(
        &self,
        rank: usize,
        mut peers: Vec<usize>,
        seq: u64,
        lost: usize,
    ) {
        if let Some(watch) = &self.watch {
            peers.retain(|&p| !watch.is_quiet(p));
        }
        self.send_aborts(rank, &peers, seq, lost);
    }

    /// Whether `peer`'s process is certainly gone: its data listener refuses a connection.
    /// The kernel of a live host refuses for a process that has died; a host that is gone or
    /// cut off does not answer at all, which proves nothing (`false` after [`GONE_CHECK`]).
    /// A connection that is accepted is dropped at once (the acceptor cuts it off as silent).
    pub(crate) fn refuses(&self, peer: usize) -> bool {
        let Some(addr) = self.book.get(peer) else {
            return false;
        };
        matches!(
            TcpStream::connect_timeout(addr, GONE_CHECK),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }

    /// Whether `peer`'s process still answers: a handshake over a fresh connection, which its
    /// acceptor thread completes even while its ranks wait in a collective, but which nothing
    /// answers in a stopped or frozen process. Bounded by [`PROBE_TIMEOUT`].
    pub(crate) fn probe(&self, rank: usize, peer: usize) -> bool {
        let Some(addr) = self.book.get(peer) else {
            return false;
        };
        if self.board.is_silent(peer) {
            return false;
        }
        let timeout = self.handshake_timeout.min(PROBE_TIMEOUT);
        let deadline = Instant::now() + timeout;
        let Ok(mut s) = TcpStream::connect_timeout(addr, timeout) else {
            self.board.mark_silent(peer);
            return false;
        };
        let hello = Hello {
            version: wire::PROTOCOL_VERSION,
            kind: ConnKind::Probe,
            size: self.book.len() as u32,
            rank: rank as u32,
            seq: 0,
            port: 0,
            lost: 0,
            world: self.world,
            nonce: [0; wire::NONCE_LEN],
        };
        let alive =
            client_handshake(&mut s, hello, &self.key, &format!("rank {peer}"), deadline).is_ok();
        if !alive {
            self.board.mark_silent(peer);
        }
        alive
    }

    /// Tell `peer`, over a fresh connection, that this rank gave up on communicator `seq`
    /// because it lost rank `lost`. Best effort, bounded by the handshake timeout (≤ 2 s).
    fn send_abort(&self, rank: usize, peer: usize, seq: u64, lost: usize) {
        let Some(addr) = self.book.get(peer) else {
            return;
        };
        let timeout = self.handshake_timeout.min(NOTICE_TIMEOUT);
        let deadline = Instant::now() + timeout;
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
            world: self.world,
            nonce: [0; wire::NONCE_LEN],
        };
        if let Err(e) =
            client_handshake(&mut s, hello, &self.key, &format!("rank {peer}"), deadline)
        {
            tracing::debug!(peer, error = %e.into_error(), "could not deliver an abort notice");
        }
    }
}
