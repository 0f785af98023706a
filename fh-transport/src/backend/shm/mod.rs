//! The shared-memory backend (Linux): ranks of one host exchange data through a segment in
//! `/dev/shm` at memory speed, without the kernel's network stack.
//!
//! ```no_run
//! use fh_transport::backend::shm::{ShmOptions, ShmTransport};
//! use fh_transport::{CollectivesExt, Transport};
//! use fh_core::ReduceOp;
//!
//! # fn main() -> fh_transport::Result<()> {
//! // In each of the `size` processes of the job (same token, distinct ranks):
//! let (token, rank, size) = ("5f1d0c3a9e8b7a6d5c4b3a2918070605", 0, 2);
//! let mut world = ShmTransport::join(token, rank, size, ShmOptions::default())?;
//! let mut data = world.open("data")?;
//! let mut v = vec![1.0f32; 1 << 20];
//! data.allreduce_typed(&mut v, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
//!
//! # Segments
//!
//! Each communicator ([`Transport::open`]) gets its own segment, named
//! `/dev/shm/fh-<tag>-<name>` ([`segment_name`]): `<tag>` is 128 bits of HMAC-SHA-256 keyed with
//! the job token (it groups a token's segments and tells nothing about the token), and `<name>`
//! another 128 bits keyed with the token over the job's world id (a random nonce rank 0 draws
//! and sends at the TCP rendezvous, [`ShmTransport::join_world`]) and the communicator's
//! sequence number. Each name is drawn independently: seeing one, or every earlier one, or those
//! of an earlier job with the same token, tells nothing about the next, so another user who
//! watches `/dev/shm` cannot create a name before rank 0 does (and one that guessed it would be
//! refused, naming its owner, on every rank at once, never waited on). Rank 0 creates it exclusively
//! (`O_EXCL`) with mode `0600`, reserves its memory (so a full `/dev/shm` is an error at open,
//! not a `SIGBUS` later), fills in a header with a keyed proof that it knows the token (HMAC
//! over the name, the layout and its own pid and start time) and publishes a magic number and
//! layout version last; the other ranks wait (bounded by [`ShmOptions::timeout`]) for a valid
//! header, check — before mapping anything — that the object belongs to their own user and
//! grants nobody else access (`fstat`), and that it is as large as the layout needs, check the
//! layout and the creator's proof, map the segment and record their pid and process start time.
//! A segment of another user under the job's name is refused with an error naming its owner
//! (never attached, never removed). Every ring counter read from shared memory is checked
//! against the ring's capacity: a peer that corrupts one gets a protocol error naming it, not a
//! wrap-around.
//! Truncation: no rank keeps a descriptor of a segment once it is mapped, and the name is
//! unlinked as soon as every rank has mapped it, so after `open` nobody but root can shrink a
//! segment under the ranks' mappings. During `open`, sizes are checked (`fstat`) before every
//! mapping; only a process of the same user — the only one that can open a `0600` segment —
//! racing an `ftruncate` between that check and the first access could still make a rank fault
//! (`SIGBUS`).
//!
//! Inside a segment every rank owns slots for the native collectives (see `comm.rs`, *Protocol*)
//! and there is a ring buffer per directed pair of ranks for point-to-point messages, so the
//! generic algorithms work too.
//!
//! Worlds joined through the rendezvous (`FH_TRANSPORT=shm`, `auto`, `hier`) never share a
//! name, even with the same token. A world joined directly with [`ShmTransport::join`] has no
//! world id: its names repeat when a job re-joins with the same token, which is fine one world
//! after another, but two such worlds with the same token must not open communicators at the
//! same time on one host.
//!
//! # Clean-up
//!
//! - **As soon as every rank has mapped a segment, its name is unlinked** (by the rank that
//!   completes the set). From then on the memory lives only in the ranks' mappings and the
//!   kernel frees it when the last of them unmaps it or exits, however it exits: a crash or a
//!   `SIGKILL` after `open` leaves nothing behind.
//! - If `open` fails (a rank never arrives, a layout mismatch), the ranks that got as far as
//!   the segment unlink its name before returning the error.
//! - The only window in which a name can be left behind is inside `open`, if *every* rank that
//!   had the segment is killed before the set is complete. For that case rank 0 of every new
//!   world ([`ShmTransport::join`]) scans `/dev/shm` for segments named by this scheme
//!   (`fh-<32 hex digits>-<seq>`), owned by the same user with mode `0600`, whose
//!   recorded processes are all dead (pid and start time, so a reused pid is not mistaken for
//!   the owner; the creator records itself before anything else) — or that are older than a
//!   minute without even a creator recorded — and removes them;
//!   [`cleanup_stale_segments`] does the same on demand.
//!
//! # Failures
//!
//! Waits poll briefly (yielding the core between polls, which matters when ranks outnumber
//! cores), then sleep on a futex in slices of [`ShmOptions::liveness_interval`];
//! between slices a rank checks its peers: a peer that gave up after an error or closed its
//! communicator while being waited for, or whose process is gone (or a zombie), is reported as
//! [`TransportError::PeerLost`] naming its rank; after [`ShmOptions::timeout`] without progress
//! the wait fails with [`TransportError::Timeout`]. A rank that fails marks itself aborted in
//! the segment so that its peers fail at once instead of timing out. Peers are recognised by
//! pid, so all ranks must share a pid namespace (they do when they share `/dev/shm` on one
//! host, except across containers with private pid namespaces).

mod comm;
mod segment;
mod sys;

use std::time::{Duration, Instant};

pub(crate) use comm::OutsideWord;
pub use comm::ShmComm;

use crate::backend::tcp::Key;
use crate::liveness::{Liveness, Watch};
use crate::{Communicator, Interrupt, Result, Topology, Transport, TransportError};
use fh_job::launch::LaunchInfo;
use segment::{Layout, Segment, NAME_PREFIX};

/// Settings of a shared-memory world. Every rank must use the same sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmOptions {
    /// How long any wait (opening, a receive, a collective step) may last without progress.
    pub timeout: Duration,
    /// Bytes of one collective slot (per rank and buffer); collectives larger than this are
    /// pipelined through the slots in rounds. Rounded up to a multiple of 4096 and to at least
    /// 64 bytes per rank.
    pub slot_bytes: usize,
    /// Number of slot buffers per rank (1..=8); with 2 or more a rank may fill the next round
    /// while its peers still read the previous one.
    pub buffers: usize,
    /// Capacity of each point-to-point ring (per directed pair), a power of two; 0 picks one
    /// from the world size (256 KiB for small worlds, less for large ones).
    pub ring_bytes: usize,
    /// How long a waiting rank polls (yielding the core between polls) before sleeping on a
    /// futex. Zero sleeps at once.
    pub spin: Duration,
    /// How often a sleeping rank wakes to check its peers' liveness and its deadline.
    pub liveness_interval: Duration,
    /// Allreduces up to this many bytes are reduced whole by every rank (one synchronisation
    /// instead of two); larger ones are reduce-scattered in shared memory.
    pub small_allreduce_bytes: usize,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            timeout: Duration::from_secs(30),
            slot_bytes: 1 << 20,
            buffers: 2,
            ring_bytes: 0,
            spin: Duration::from_micros(50),
            liveness_interval: Duration::from_millis(100),
            small_allreduce_bytes: 32 << 10,
        }
    }
}

impl ShmOptions {
    /// Default options with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        ShmOptions {
            timeout,
            ..Self::default()
        }
    }

    /// Default options adjusted by the environment: `FH_TIMEOUT_SECONDS` (the wait timeout,
    /// seconds, may be fractional) and `FH_SHM_SLOT_BYTES` (the slot size).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// As [`ShmOptions::from_env`], reading variables through `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut o = ShmOptions::default();
        if let Some(v) = get("FH_TIMEOUT_SECONDS").filter(|v| !v.trim().is_empty()) {
            o.timeout = fh_job::launch::parse_timeout_value(&v)?;
        }
        if let Some(v) = get("FH_SHM_SLOT_BYTES") {
            o.slot_bytes = v.trim().parse().map_err(|_| TransportError::Config {
                var: "FH_SHM_SLOT_BYTES".into(),
                reason: format!("'{v}' is not a number of bytes"),
            })?;
        }
        Ok(o)
    }

    fn layout(&self, size: usize) -> Result<Layout> {
        let bad = |reason: String| TransportError::Config {
            var: "ShmOptions".into(),
            reason,
        };
        if self.timeout.is_zero() || self.liveness_interval.is_zero() {
            return Err(bad(
                "timeout and liveness_interval must be positive (set FH_TIMEOUT_SECONDS > 0)"
                    .into(),
            ));
        }
        if !(1..=8).contains(&self.buffers) {
            return Err(bad(format!("buffers = {} is not in 1..=8", self.buffers)));
        }
        if self.slot_bytes == 0 || self.slot_bytes > 1 << 30 {
            return Err(bad(format!(
                "slot_bytes = {} is not in 1..=1 GiB",
                self.slot_bytes
            )));
        }
        let slot = self.slot_bytes.max(64 * size).div_ceil(4096) * 4096;
        let ring = if self.ring_bytes == 0 {
            ((32usize << 20) / (size * size))
                .clamp(4096, 256 << 10)
                .next_power_of_two()
                .min(256 << 10)
        } else if self.ring_bytes.is_power_of_two() && (64..=1 << 30).contains(&self.ring_bytes) {
            self.ring_bytes
        } else {
            return Err(bad(format!(
                "ring_bytes = {} is not a power of two in 64..=1 GiB",
                self.ring_bytes
            )));
        };
        Ok(Layout::new(size, slot, self.buffers, ring))
    }
}

/// The `/dev/shm` name prefix (`fh-<tag>-`) of the segments of the jobs with this token:
/// `<tag>` is 128 bits of HMAC-SHA-256 keyed with the token, so it tells nothing about the
/// token; it only groups a token's segments (useful to check that nothing is left behind).
/// The rest of each name is keyed independently ([`segment_name`]).
pub fn segment_prefix(job_token: &str) -> String {
    let mac = Key::new(job_token.as_bytes()).mac(&[b"fasthorovod shm v2 segment name"]);
    format!("{NAME_PREFIX}{}-", hex16(&mac))
}

fn hex16(mac: &[u8; 32]) -> String {
    mac[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The `/dev/shm` file name of communicator `seq`'s segment in the world `world` (the job's
/// nonce, [`TcpTransport::world_id`](crate::backend::tcp::TcpTransport::world_id); `None` for a world
/// joined without a rendezvous, [`ShmTransport::join`]) of the job with this token:
/// [`segment_prefix`] followed by 128 bits of HMAC-SHA-256 keyed with the token over the world
/// and `seq`. Each name is drawn independently: seeing one (or all earlier ones, or those of an
/// earlier job with the same token) tells nothing about the next, so nobody without the token
/// can create a segment's name before rank 0 does.
pub fn segment_name(
    job_token: &str,
    world: Option<&[u8; crate::backend::tcp::wire::WORLD_ID_LEN]>,
    seq: u64,
) -> String {
    name_of(&Key::new(job_token.as_bytes()), world, seq)
}

fn name_of(
    key: &Key,
    world: Option<&[u8; crate::backend::tcp::wire::WORLD_ID_LEN]>,
    seq: u64,
) -> String {
    let tag = key.mac(&[b"fasthorovod shm v2 segment name"]);
    let mac = key.mac(&[
        b"fasthorovod shm v3 segment",
        world.map_or(&[][..], |w| &w[..]),
        &seq.to_le_bytes(),
    ]);
    format!("{NAME_PREFIX}{}-{}", hex16(&tag), hex16(&mac))
}

/// Remove segments left in `/dev/shm` by jobs whose every process died (see *Clean-up* in the
/// [module documentation](self)); returns the file names removed. Rank 0 does this in
/// [`ShmTransport::join`]. Segments of live processes and of other users are never touched.
pub fn cleanup_stale_segments() -> Vec<String> {
    segment::cleanup_stale()
}

/// Whether shared memory suits this launch as its launcher describes it: several ranks, all on
/// this host, and room in `/dev/shm` for a few communicators. (`FH_TRANSPORT=auto` decides from
/// the hosts settled at the rendezvous instead, [`fh_job::hosts::choose`].)
pub fn suits(info: &LaunchInfo) -> bool {
    if info.size < 2 || info.cross_size != 1 || info.local_size != info.size {
        return false;
    }
    // Room for the control channel and a handful of data channels.
    has_room(info.size)
}

/// Whether `/dev/shm` has room for a few communicators of `size` ranks with the default sizes.
pub(crate) fn has_room(size: usize) -> bool {
    free_bytes().is_some_and(|free| free >= room_needed(size))
}

/// The room in `/dev/shm` that `FH_TRANSPORT=auto` wants before it takes shared memory among
/// `size` ranks: a few communicators with the default sizes (`u64::MAX` when none fits).
pub(crate) fn room_needed(size: usize) -> u64 {
    ShmOptions::default()
        .layout(size)
        .map_or(u64::MAX, |layout| 16 * layout.total as u64)
}

/// Free bytes in `/dev/shm`, if it can be read.
pub(crate) fn free_bytes() -> Option<u64> {
    fh_job::hosts::shm_free_bytes()
}

/// Refuse at once a launch whose launcher puts the ranks on several hosts: shared memory alone
/// cannot join them.
pub(crate) fn check_one_host(info: &LaunchInfo) -> Result<()> {
    if info.cross_size != 1 || info.local_size != info.size {
        return Err(TransportError::Config {
            var: "FH_TRANSPORT".into(),
            reason: format!(
                "'shm' needs every rank on one host, but this job has {} ranks on {} hosts \
                 ({} here); use 'auto' or 'tcp'",
                info.size, info.cross_size, info.local_size
            ),
        });
    }
    Ok(())
}

/// One rank's handle on a shared-memory world: the ranks of one host that share a job token.
#[derive(Debug)]
pub struct ShmTransport {
    /// The job's world id, when the world was joined through a rendezvous.
    world: Option<[u8; crate::backend::tcp::wire::WORLD_ID_LEN]>,
    /// The job token, as the key of the segments' proofs (redacted in `Debug`).
    key: Key,
    rank: usize,
    size: usize,
    opts: ShmOptions,
    layout: Layout,
    next: u64,
    /// Communicators opened so far over each member list ([`Transport::open_group`]).
    groups: std::collections::HashMap<Vec<usize>, u64>,
    /// The world's heartbeats, taken over from the TCP rendezvous that found every rank on
    /// this host ([`crate::liveness`]); a wait for a rank they declare lost ends at once.
    liveness: Option<Liveness>,
}

impl ShmTransport {
    /// Join the world of `size` ranks on this host identified by `job_token`, as `rank`.
    ///
    /// Nothing is mapped until [`Transport::open`]; rank 0 first removes stale segments of
    /// dead jobs. Every rank must pass the same token, size and options.
    pub fn join(job_token: &str, rank: usize, size: usize, opts: ShmOptions) -> Result<Self> {
        Self::join_in(job_token, None, rank, size, opts)
    }

    /// As [`ShmTransport::join`], in the world `world` (the job's nonce that rank 0 drew and
    /// sent at the TCP rendezvous, [`TcpTransport::world_id`](crate::backend::tcp::TcpTransport::world_id)):
    /// every segment's name is keyed with it too ([`segment_name`]), so segment names never
    /// repeat from one job to the next, even with the same token, and two jobs with the same
    /// token on one host never meet in shared memory.
    pub fn join_world(
        job_token: &str,
        world: [u8; crate::backend::tcp::wire::WORLD_ID_LEN],
        rank: usize,
        size: usize,
        opts: ShmOptions,
    ) -> Result<Self> {
        Self::join_in(job_token, Some(world), rank, size, opts)
    }

    fn join_in(
        job_token: &str,
        world: Option<[u8; crate::backend::tcp::wire::WORLD_ID_LEN]>,
        rank: usize,
        size: usize,
        opts: ShmOptions,
    ) -> Result<Self> {
        if job_token.is_empty() {
            return Err(TransportError::Config {
                var: "FH_JOB_TOKEN".into(),
                reason: "the shared-memory backend needs a non-empty job token shared by all \
                         ranks (fhrun sets one)"
                    .into(),
            });
        }
        if size == 0 || rank >= size {
            return Err(TransportError::InvalidArgument(format!(
                "shm join: rank {rank} is not in 0..{size}"
            )));
        }
        if size >= 1 << 20 {
            return Err(TransportError::InvalidArgument(format!(
                "shm join: {size} ranks are too many"
            )));
        }
        let layout = opts.layout(size)?;
        if rank == 0 {
            let removed = cleanup_stale_segments();
            if !removed.is_empty() {
                tracing::info!(
                    ?removed,
                    "removed stale shared-memory segments of dead jobs"
                );
            }
        }
        Ok(ShmTransport {
            world,
            key: Key::new(job_token.as_bytes()),
            rank,
            size,
            opts,
            layout,
            next: 0,
            groups: std::collections::HashMap::new(),
            liveness: None,
        })
    }

    /// Run the world's heartbeats (started at its TCP rendezvous) with this transport: a wait
    /// of its communicators for a rank they declare lost ends at once.
    pub(crate) fn set_liveness(&mut self, l: Option<Liveness>) {
        self.liveness = l;
    }

    fn watch(&self) -> Option<Watch> {
        self.liveness.as_ref().map(|l| l.watch().clone())
    }

    /// Join the world described by a launch (`FH_TRANSPORT=shm`): its rank, size, job token and
    /// timeout, with the default sizes. Every rank must run on this host.
    pub fn from_info(info: &LaunchInfo) -> Result<Self> {
        Self::from_info_in(info, None)
    }

    /// As [`ShmTransport::from_info`], in the world `world` of the TCP rendezvous
    /// ([`ShmTransport::join_world`]).
    pub fn from_info_in(
        info: &LaunchInfo,
        world: Option<[u8; crate::backend::tcp::wire::WORLD_ID_LEN]>,
    ) -> Result<Self> {
        check_one_host(info)?;
        // A single process has no token; any name private to it will do.
        let token = info
            .token
            .as_ref()
            .map(|t| t.expose().to_owned())
            .unwrap_or_else(|| format!("single-process-{}-{}", sys::pid(), sys::self_start_time()));
        let opts = ShmOptions {
            timeout: info.timeout,
            ..ShmOptions::default()
        };
        Self::join_in(&token, world, info.rank, info.size, opts)
    }

    /// Open the next communicator, as [`Transport::open`] does, returning the concrete type.
    pub fn open_shm(&mut self, label: &str) -> Result<ShmComm> {
        let watch = self.watch();
        self.open_shm_with(label, Interrupt::new(), None, watch)
    }

    /// [`ShmTransport::open_shm`] with the interrupt the communicator is to watch and, when
    /// this world's ranks stand for ranks of an enclosing world (a host of the hierarchical
    /// backend), those ranks (`world_ranks[r]` is rank `r`): the interrupt and the heartbeats'
    /// verdicts (`watch`, the enclosing world's) then name ranks of the enclosing world.
    pub(crate) fn open_shm_with(
        &mut self,
        label: &str,
        interrupt: Interrupt,
        world_ranks: Option<Vec<usize>>,
        watch: Option<Watch>,
    ) -> Result<ShmComm> {
        let seq = self.next;
        self.next += 1;
        let ranks = world_ranks.unwrap_or_else(|| (0..self.size).collect());
        let (rank, size, layout) = (self.rank, self.size, self.layout);
        self.open_segment(label, seq, rank, size, layout, (interrupt, ranks, watch))
    }

    /// Open the next communicator over the world ranks `members` (ascending, this rank among
    /// them), as [`Transport::open_group`] does: only the members take part, and its segment
    /// (sequence number `2^40 + 2^20 · hash(members) + n`) is watched by them alone.
    pub fn open_shm_group(&mut self, label: &str, members: &[usize]) -> Result<ShmComm> {
        let index = members
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| {
                TransportError::InvalidArgument(format!(
                    "rank {} is not among the members {members:?}",
                    self.rank
                ))
            })?;
        if members.iter().any(|&r| r >= self.size) || members.windows(2).any(|w| w[0] >= w[1]) {
            return Err(TransportError::InvalidArgument(format!(
                "a group's members must be ascending world ranks below {}, got {members:?}",
                self.size
            )));
        }
        let n = self.groups.entry(members.to_vec()).or_insert(0);
        let count = *n;
        *n += 1;
        if count >= 1 << 20 {
            return Err(TransportError::InvalidArgument(format!(
                "too many communicators over the group {members:?}"
            )));
        }
        // FNV-1a of the member list: the same on every member, distinct between lists but
        // for collisions, which end in a clear error (the segment exists already).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &r in members {
            for b in (r as u64).to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        let seq = (1u64 << 40) + ((h & 0xF_FFFF) << 20) + count;
        let layout = self.opts.layout(members.len())?;
        let watch = self.watch();
        let stops = (Interrupt::new(), members.to_vec(), watch);
        self.open_segment(label, seq, index, members.len(), layout, stops)
    }

    /// Open a communicator's segment; `stops` are what end its waits early: its interrupt, the
    /// world ranks its ranks are (for the interrupt's and the heartbeats' verdicts), and the
    /// world's heartbeats.
    fn open_segment(
        &mut self,
        label: &str,
        seq: u64,
        rank: usize,
        size: usize,
        layout: Layout,
        stops: (Interrupt, Vec<usize>, Option<Watch>),
    ) -> Result<ShmComm> {
        let (interrupt, world_ranks, watch) = stops;
        let name = format!("/{}", name_of(&self.key, self.world.as_ref(), seq));
        let start = Instant::now();
        let deadline = start + self.opts.timeout;
        let seg = if rank == 0 {
            let seg = Segment::create(&name, layout, &self.key)?;
            if size == 1 {
                sys::shm_unlink(&name)
                    .map_err(|e| TransportError::io(format!("shm_unlink of {name}"), e))?;
            }
            seg
        } else {
            // Rank 0 lost before it made the segment (the heartbeats' verdict, during the
            // world's formation), or an interrupt: no use waiting.
            let cancel = || {
                let (lost, why) = interrupt.cause().map(|c| (c.lost, c.why)).or_else(|| {
                    let v = watch.as_ref()?.verdict()?;
                    Some((Some(v.lost), v.detail))
                })?;
                Some(
                    match lost.and_then(|g| world_ranks.iter().position(|&w| w == g)) {
                        Some(r) => TransportError::PeerLost {
                            rank: r,
                            detail: why,
                        },
                        None => TransportError::Closed(why),
                    },
                )
            };
            Segment::attach(
                &name,
                rank,
                layout,
                &self.key,
                deadline,
                self.opts.timeout,
                &cancel,
            )?
        };
        let comm = ShmComm::new(
            seg,
            rank,
            label,
            &self.opts,
            (interrupt, world_ranks, watch),
        );
        comm.opened(&name).inspect_err(|_| {
            let _ = sys::shm_unlink(&name);
        })?;
        tracing::debug!(label, segment = %name, rank, "opened shm communicator");
        Ok(comm)
    }
}

impl Transport for ShmTransport {
    fn backend(&self) -> &'static str {
        "shm"
    }

    fn wire(&self) -> crate::WireKind {
        crate::WireKind::Memory
    }

    fn topology(&self) -> Topology {
        Topology::single_host(self.rank, self.size)
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.open_shm(label)?))
    }

    fn can_open_group(&self) -> bool {
        true
    }

    fn open_group(&mut self, label: &str, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.open_shm_group(label, members)?))
    }

    fn liveness(&self) -> Option<Watch> {
        self.liveness.as_ref().map(|l| l.watch().clone())
    }
}
