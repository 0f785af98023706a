//! The TCP backend, the default for jobs of several processes.
//!
//! **Rendezvous.** Rank 0 listens on the rendezvous address (`FH_RENDEZVOUS_ADDR`); every other
//! rank connects to it (retrying while rank 0 is not up yet, within the timeout), binds its own
//! data listener on the interface it used to reach rank 0 (loopback for local jobs; never the
//! wildcard address), and sends a handshake with its listener's port. Once all ranks are in,
//! rank 0 sends everybody the address book and closes the rendezvous listener.
//!
//! With its address every rank sends its [`fh_job::hosts::Place`] — its host identity
//! and what its launcher claimed of its host — and receives everybody's with the book; every
//! rank settles the same list into the same host layout ([`fh_job::hosts::settle`]), so the
//! world's [`Topology`] comes from facts, and a launcher whose local ranks contradict them
//! stops every rank at once with the same error.
//!
//! **Communicators.** Each [`Transport::open`] builds a fresh full mesh: every rank connects
//! to each lower rank's data listener, with a handshake naming the communicator's sequence
//! number, so connections of different communicators can never be mixed up. Listeners are
//! served by a background acceptor thread, so a rank answers handshakes even while it is busy.
//!
//! **Parallel streams.** Clouds cap each TCP flow well below a VM's link. To a peer on another
//! host (by the settled layout) a communicator holds `FH_TCP_STREAMS` connections, each
//! handshake naming its stream index; a message of at least `FH_TCP_STRIPE_MIN` bytes to that
//! peer goes as one contiguous stripe per connection, all moved by the communicator's one poll
//! loop, with no thread or copy of its own ([`streams`]). Peers on the same host keep one
//! connection, so loopback-only worlds and shared memory are unaffected. The settings shape
//! every frame, so every member sends its settings to rank 0 at the rendezvous, and a rank
//! whose settings differ stops every rank with an error naming both values. Under `auto`, a
//! world spanning hosts measures at its start how many streams a cross-host pair needs
//! (`TcpTransport::measure_streams` in `streams.rs`, over the world's first communicator) and rank 0 sends
//! every rank the choice. Fault handling
//! covers every stream: a closed or reset stream names its peer at once, an abort notice goes
//! in band on every stream of a peer (out of band where a frame to it is half sent), and a
//! rank that only sends watches the incoming side of each stream it does not read. The
//! connections to other hosts keep Linux's autotuned socket buffers unless `FH_TCP_BUFFERS`
//! asks for larger ones (`max`: what the kernel allows where autotuning stops short).
//!
//! **A closed door, both ways.** Every connection starts with a mutual challenge–response
//! ([`wire`]): each side proves that it knows the job token with HMAC-SHA-256 over the other
//! side's fresh nonce, so the token never crosses the network, a recorded handshake cannot be
//! replayed, and a rank never trusts (or proves anything to) a listener that cannot prove the
//! token first — a process that grabs the rendezvous port learns nothing. A peer that gets
//! anything wrong receives a refusal stating why and is disconnected; refusals are logged on
//! the accepting side at a bounded rate (and quoted in its error if the expected peer never
//! comes). Frame lengths are checked against what the receiver expects before a byte of
//! payload is accepted.
//!
//! **A door no crowd can hold.** Each listener is served by one thread that runs every
//! handshake itself over nonblocking sockets (no thread per connection): a stranger's
//! connection costs one descriptor and a few hundred bytes. It must send its first bytes
//! within a second and finish the handshake within the handshake deadline; when
//! [`max_pending_handshakes`] are in progress, each new connection evicts a silent one (from
//! the source holding the most, the oldest first) — a member sends its hello at once and so
//! moves past the silent crowd in one round trip; the listen backlog is deep and drained
//! continuously; and a member whose attempt is dropped anyway retries with backoff until the
//! job's timeout. So a listener holds at most `max_pending_handshakes + 1` descriptors and one
//! thread however many strangers connect, and a flood of silent connections re-opened as fast
//! as they are dropped, at the rendezvous port and at every data port, only delays the start
//! (`tests/tcp_flood.rs` measures it).
//!
//! **One world per job.** Rank 0 draws a random world id for every job and sends it with the
//! address book; every later connection names it in its hello (which both proofs cover), so a
//! rank of another job with the same token is refused, the refusal naming both world ids.
//! Rank 0 keeps the rendezvous port for the life of the transport: a second job started on the
//! same address cannot listen there, and two claimants of one rank during the rendezvous stop
//! it on every rank that joined. With one token and one address (a derived token comes from
//! the address) the ranks of two jobs started together cannot be told apart, and a member of
//! one may have taken a place in the other's world: so a second claim of a rank within
//! `TWIN_WINDOW` (3 s) of the rendezvous' end also stops the world — every communicator's next
//! operation fails with the cause and tells its peers — rather than let two jobs mix; a claim
//! after that comes from a job started later and is only refused, naming this world. (A
//! collective run in a mixed world before the second claim arrives cannot be undone; give every
//! job its own token, as fhrun does.) The shared-memory backends key their segment names with the world id
//! ([`crate::backend::shm::segment_name`]).
//!
//! Connections are authenticated, not encrypted: someone who can watch the network sees the
//! data (but never the token).
//!
//! **Descriptors.** Every communicator is a full mesh, so a rank holds about
//! `communicators × (size − 1)` sockets (each peer on another host counting `FH_TCP_STREAMS`). Before each mesh is built the soft `RLIMIT_NOFILE` is
//! raised as far as needed (up to the hard limit); beyond the hard limit opening fails with an
//! error that names the limit and the fix.

mod accept;
mod comm;
mod frame;
mod handshake;
mod link;
mod mesh;
mod options;
mod rendezvous;
pub mod settings;
pub mod streams;
mod sys;
pub mod wire;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;

use accept::{AcceptRules, Acceptor, RefusalLog, WorldCell};
pub use comm::{TcpComm, SPIN_MAX_BYTES};
pub(crate) use fh_job::token::Key;
pub(crate) use link::{AbortBoard, Link};
pub use options::{TcpOptions, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_FRAME, DEFAULT_SPIN};
use rendezvous::resolve;
pub use settings::{StreamCount, StreamSettings};
pub use streams::{MeasuredRates, StreamChoice};
use wire::ConnKind;

use crate::liveness::{self, Liveness, Watch};
use crate::{Communicator, Result, Topology, Transport, TransportError};
use fh_job::hosts::{self, Layout, Place};
use fh_job::launch::LaunchInfo;

/// Handshakes in progress at once on a listener of a world of `size` ranks: room for every
/// rank to connect at once, twice over, plus a margin. Beyond it the listener evicts a silent
/// connection (a stranger's) for each new one, so strangers never keep a member out (see
/// *A door no crowd can hold* in the module documentation).
pub fn max_pending_handshakes(size: usize) -> usize {
    128 + 2 * size
}
/// Descriptors kept free beyond what a mesh needs (logs, libraries, the user's files).
const FD_MARGIN: u64 = 64;

/// Make room for `extra` more descriptors than this process has open now: raise the soft
/// `RLIMIT_NOFILE` (up to the hard limit) if needed, or fail naming the limit and the fix.
fn ensure_descriptors(extra: usize, what: &str) -> Result<()> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let open = std::fs::read_dir("/proc/self/fd")
        .or_else(|_| std::fs::read_dir("/dev/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0);
    let need = open + extra as u64 + FD_MARGIN;
    let lim = getrlimit(Resource::Nofile);
    let soft = lim.current.unwrap_or(u64::MAX);
    if need <= soft {
        return Ok(());
    }
    let hard = lim.maximum.unwrap_or(u64::MAX);
    if need > hard {
        return Err(TransportError::Config {
            var: "RLIMIT_NOFILE".into(),
            reason: format!(
                "{what} needs about {need} open descriptors ({open} open now), but the hard \
                 limit is {hard}: raise it (`ulimit -Hn`, systemd LimitNOFILE=, docker --ulimit \
                 nofile=N:N, or /etc/security/limits.conf), or use fewer ranks or channels"
            ),
        });
    }
    // Leave headroom for the next communicators too.
    let new = need.saturating_mul(2).min(hard);
    setrlimit(
        Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(new),
            maximum: lim.maximum,
        },
    )
    .map_err(|e| TransportError::Config {
        var: "RLIMIT_NOFILE".into(),
        reason: format!(
            "{what} needs about {need} open descriptors, the soft limit is {soft} and raising it \
             to {new} failed ({e}): raise it with `ulimit -n {need}` before starting the job"
        ),
    })?;
    tracing::debug!(from = soft, to = new, "raised the soft RLIMIT_NOFILE");
    Ok(())
}

/// The TCP world of one rank.
pub struct TcpTransport {
    topology: Topology,
    opts: TcpOptions,
    key: Key,
    /// Every rank's data-listener address (this rank's own included).
    book: Vec<SocketAddr>,
    next_seq: u64,
    acceptor: Option<Acceptor>,
    /// Connections that arrived for communicators not opened yet: (seq, rank, stream index)
    /// → connection.
    stash: HashMap<(u64, usize, usize), TcpStream>,
    board: Arc<AbortBoard>,
    link: Option<Arc<Link>>,
    /// Every rank's place, by rank, as exchanged at the rendezvous.
    places: Vec<Place>,
    /// The host layout settled from [`TcpTransport::places`].
    layout: Layout,
    /// The job's world id, drawn by rank 0 ([`wire::Hello::world`]); all zeros for one rank.
    world: [u8; wire::WORLD_ID_LEN],
    /// The world id as the data listener's acceptor knows it (set once known).
    world_cell: WorldCell,
    /// Rank 0: the rendezvous listener, kept for the life of the transport so that the port
    /// stays taken (another job with the same address cannot start a second world on it) and
    /// a late claimant of a rank is refused naming this world.
    rendezvous: Option<Acceptor>,
    /// The heartbeat socket, bound with the data listener, until the heartbeats start.
    beat_socket: Option<UdpSocket>,
    /// The world's heartbeats, from the end of the rendezvous.
    liveness: Option<Liveness>,
    /// The setting of the stream count before `auto` was resolved, and what `auto` measured.
    stream_setting: StreamCount,
    measured_streams: Option<streams::MeasuredRates>,
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
    /// Join the job described by `info`: rendezvous through rank 0, learn every rank's
    /// address and place, and settle the host layout from them ([`hosts::settle`]: the
    /// transport's topology is the settled one). Blocks until every rank has arrived, at most
    /// about the timeout. Fails on every rank alike with [`TransportError::Config`] when the
    /// launcher's local ranks contradict the hosts the ranks run on.
    pub fn connect(info: &LaunchInfo, opts: TcpOptions) -> Result<TcpTransport> {
        opts.streams.check()?;
        let topology = info.topology();
        let me = Place::of(info);
        let stream_setting = opts.streams.count;
        let mut t = TcpTransport {
            topology,
            opts,
            key: Key::new(&[]),
            book: Vec::new(),
            next_seq: 0,
            acceptor: None,
            stash: HashMap::new(),
            board: Arc::new(AbortBoard::default()),
            link: None,
            places: Vec::new(),
            layout: Layout::single(),
            world: [0; wire::WORLD_ID_LEN],
            world_cell: WorldCell::default(),
            rendezvous: None,
            beat_socket: None,
            liveness: None,
            stream_setting,
            measured_streams: None,
        };
        if info.size == 1 {
            t.topology = Topology::single_host(0, 1);
            t.places = vec![me];
            return Ok(t);
        }
        t.key = Key::new(
            info.token
                .as_ref()
                .ok_or_else(|| TransportError::Config {
                    var: "FH_JOB_TOKEN".into(),
                    reason: "a job of several ranks needs a job token".into(),
                })?
                .as_bytes(),
        );
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
        if !info.allow_wildcard {
            if let Some(a) = addrs.iter().find(|a| a.ip().is_unspecified()) {
                return Err(TransportError::Config {
                    var: "FH_RENDEZVOUS_ADDR".into(),
                    reason: format!(
                        "{rdv:?} resolves to the wildcard address {a}: rank 0 would listen on \
                         every interface. Give an address of rank 0's host, or set \
                         FH_ALLOW_WILDCARD=1 if that is really intended"
                    ),
                });
            }
        }
        // The rendezvous listener, its handshakes and the first communicator.
        ensure_descriptors(
            max_pending_handshakes(info.size) + 2 * info.size,
            "the TCP rendezvous",
        )?;
        t.places = if info.rank == 0 {
            t.rendezvous_root(&addrs, rdv, me)?
        } else {
            t.rendezvous_member(&addrs, rdv, me)?
        };
        t.layout = hosts::settle(&t.places).map_err(fh_job::JobError::from)?;
        t.topology = t.layout.topology(info.rank);
        // From now on every rank is watched: a rank lost while the world forms (opening its
        // communicators, the engine's start) is named within the heartbeats' silence.
        if let (Some(settings), Some(socket)) = (t.opts.liveness, t.beat_socket.take()) {
            let peers = liveness::Peers {
                rank: info.rank,
                addrs: t.book.clone(),
                key: t.key.clone(),
                world: t.world,
            };
            t.liveness = Some(Liveness::start(socket, peers, settings)?);
        }
        t.link = Some(Arc::new(Link {
            book: t.book.clone(),
            key: t.key.clone(),
            board: Arc::clone(&t.board),
            handshake_timeout: t.opts.handshake_timeout,
            world: t.world,
            watch: t.liveness.as_ref().map(|l| l.watch().clone()),
        }));
        tracing::debug!(rank = info.rank, book = ?t.book, hosts = ?t.layout.hosts(), "TCP rendezvous complete");
        if t.layout.hosts().len() > 1 && t.opts.streams.count == StreamCount::Auto {
            // Every rank alike (the layout and the settings are the same everywhere).
            let (chosen, measured) = t.measure_streams()?;
            t.opts.streams.count = StreamCount::Fixed(chosen);
            t.measured_streams = measured;
        } else if info.rank == 0 && (t.layout.hosts().len() > 1 || t.opts.streams.every_peer) {
            let s = &t.opts.streams;
            tracing::info!(
                streams = s.count.resolve(),
                setting = %s.count,
                stripe_min = s.stripe_min,
                every_peer = s.every_peer,
                "TCP streams to each peer on another host (FH_TCP_STREAMS)"
            );
        }
        Ok(t)
    }

    /// Every rank's data-listener address, by rank (empty for a single process).
    pub fn peer_addresses(&self) -> &[SocketAddr] {
        &self.book
    }

    /// Every rank's place (host identity, launcher's claims), by rank, as exchanged at the
    /// rendezvous.
    pub fn places(&self) -> &[Place] {
        &self.places
    }

    /// The world's stream settings, agreed at the rendezvous (with the stream count measured
    /// under `auto`).
    pub fn stream_settings(&self) -> &StreamSettings {
        &self.opts.streams
    }

    /// The host layout settled from [`TcpTransport::places`].
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Hand the world's heartbeats over (to a backend that replaces this transport after the
    /// rendezvous, e.g. shared memory on one host); this transport's communicators keep the
    /// verdicts they had.
    pub(crate) fn take_liveness(&mut self) -> Option<Liveness> {
        self.liveness.take()
    }

    /// The job's world id: random bytes rank 0 draws for each job and sends with the address
    /// book. Every connection after the rendezvous names it (a rank of another job with the
    /// same token is refused), and the shared-memory backends key their segment names with it.
    /// All zeros in a world of one rank.
    pub fn world_id(&self) -> [u8; wire::WORLD_ID_LEN] {
        self.world
    }

    fn rules(&self, kind: ConnKind) -> AcceptRules {
        AcceptRules {
            kind,
            key: self.key.clone(),
            size: self.topology.size,
            rank: self.topology.rank,
            handshake_timeout: self.opts.handshake_timeout,
            max_pending: max_pending_handshakes(self.topology.size),
            board: Arc::clone(&self.board),
            log: RefusalLog::new(),
            world: match kind {
                ConnKind::Rendezvous => WorldCell::default(),
                _ => Arc::clone(&self.world_cell),
            },
        }
    }

    /// How many connections a communicator holds to `peer`: the agreed stream count to a
    /// peer on another host (or to every peer, with [`StreamSettings::every_peer`]), else 1.
    fn streams_to(&self, peer: usize) -> usize {
        let same_host = self.layout.topology(peer).cross_rank == self.topology.cross_rank;
        self.opts.streams.streams_to(same_host)
    }
}

impl Transport for TcpTransport {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn wire(&self) -> crate::WireKind {
        crate::WireKind::Network
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.open_tcp(label)?))
    }

    fn liveness(&self) -> Option<Watch> {
        self.liveness.as_ref().map(|l| l.watch().clone())
    }

    fn stream_choice(&self) -> Option<streams::StreamChoice> {
        let s = &self.opts.streams;
        let spans_hosts = self.layout.hosts().len() > 1;
        (spans_hosts || s.every_peer).then(|| streams::StreamChoice {
            streams: s.count.resolve(),
            setting: self.stream_setting,
            measured: self.measured_streams,
        })
    }
}
