//! One communicator's shared-memory segment: its layout, creation by rank 0, attachment by the
//! others, and the removal of stale segments left by jobs whose every process died.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sys::{self, Fd, Mapping};
use crate::backend::tcp::Key;
use crate::{Result, TransportError};

/// Identifies a FastHorovod segment ("FHSHMSEG").
pub(crate) const MAGIC: u64 = 0x4648_5348_4d53_4547;
/// Layout version; bump on any change to the layout or protocol.
pub(crate) const VERSION: u32 = 2;
/// File-name prefix of every segment in `/dev/shm`.
pub(crate) const NAME_PREFIX: &str = "fh-";

/// Rank state: attached and working.
pub(crate) const ST_ATTACHED: u32 = 1;
/// Rank state: dropped its communicator normally.
pub(crate) const ST_CLOSED: u32 = 2;
/// Rank state: gave up after an error; its peers must not wait for it.
pub(crate) const ST_ABORTED: u32 = 3;

const LINE: usize = 64;
const PAGE: usize = 4096;

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Fixed header at offset 0. Every field is atomic so that a rank may read it while rank 0 is
/// still filling it in; `magic` is stored last (release) and read first (acquire).
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU32,
    pub(crate) size: AtomicU32,
    pub(crate) slot_bytes: AtomicU64,
    pub(crate) nbuf: AtomicU32,
    pub(crate) ring_bytes: AtomicU32,
    pub(crate) total_bytes: AtomicU64,
    /// Number of ranks that have mapped the segment; the one that brings it to `size` unlinks
    /// the name.
    pub(crate) attached: AtomicU32,
    /// The creator's proof that it knows the job token: HMAC-SHA-256 keyed with the token over
    /// the name, the layout and the creator's identity ([`segment_proof`]), written before the
    /// magic.
    pub(crate) proof: [AtomicU64; 4],
}

/// The keyed proof a segment's creator writes into its header.
fn segment_proof(key: &Key, name: &str, layout: &Layout, pid: u32, start: u64) -> [u8; 32] {
    key.mac(&[
        b"fasthorovod shm v2 segment",
        name.as_bytes(),
        &(layout.size as u64).to_le_bytes(),
        &(layout.slot_bytes as u64).to_le_bytes(),
        &(layout.nbuf as u64).to_le_bytes(),
        &(layout.ring_bytes as u64).to_le_bytes(),
        &pid.to_le_bytes(),
        &start.to_le_bytes(),
    ])
}

/// Whether a shared-memory object is safe to use: owned by this user and not accessible to
/// anyone else (group or other). Returns why not.
fn check_owner(name: &str, uid: u32, mode: u32) -> Result<()> {
    let me = sys::euid();
    if uid != me || mode & 0o077 != 0 {
        return Err(TransportError::Handshake {
            peer: format!("shared-memory segment /dev/shm{name}"),
            reason: format!(
                "it is owned by uid {uid} with mode {:03o}, but this job (uid {me}) creates its \
                 segments owner-only (0600): another user or program created it, so it is not \
                 used. Remove it, or give the job another FH_JOB_TOKEN (segment names derive \
                 from it)",
                mode & 0o777
            ),
        });
    }
    Ok(())
}

/// Per-rank identity, one cache line each, following the header.
#[repr(C, align(64))]
pub(crate) struct RankInfo {
    pub(crate) pid: AtomicU32,
    pub(crate) state: AtomicU32,
    pub(crate) start_time: AtomicU64,
    /// After an abort: 1 + the rank this one blamed for its failure (0: nobody).
    pub(crate) blame: AtomicU32,
    /// While the rank waits outside this communicator (in an enclosing communicator's step, see
    /// `ShmComm::waiting_outside`): non-zero, with the rank it waits for; 0 otherwise. Fits in
    /// the line's padding: the layout is unchanged.
    pub(crate) outside: AtomicU32,
}

/// Per-rank synchronisation words, each on its own cache line.
#[repr(C, align(64))]
pub(crate) struct Line {
    pub(crate) word: AtomicU32,
    pub(crate) aux: AtomicU32,
}

/// Per-rank control block: doorbell (`word`: counter, `aux`: sleeping flag), and the round
/// counters of the collective protocol.
#[repr(C)]
pub(crate) struct RankCtl {
    pub(crate) bell: Line,
    pub(crate) posted: Line,
    pub(crate) reduced: Line,
    pub(crate) consumed: Line,
}

/// Control of one directed ring: `head` written by the producer, `tail` by the consumer.
#[repr(C)]
pub(crate) struct RingCtl {
    pub(crate) head: Line,
    pub(crate) tail: Line,
}

/// Where everything lives in a segment of `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) size: usize,
    pub(crate) slot_bytes: usize,
    pub(crate) nbuf: usize,
    pub(crate) ring_bytes: usize,
    pub(crate) meta_words: usize,
    info_off: usize,
    ctl_off: usize,
    meta_off: usize,
    ringctl_off: usize,
    ring_off: usize,
    slot_off: usize,
    pub(crate) total: usize,
}

impl Layout {
    pub(crate) fn new(size: usize, slot_bytes: usize, nbuf: usize, ring_bytes: usize) -> Layout {
        let meta_words = 4 + size;
        let info_off = align_up(std::mem::size_of::<Header>(), LINE);
        let ctl_off = align_up(info_off + size * std::mem::size_of::<RankInfo>(), LINE);
        let meta_off = align_up(ctl_off + size * std::mem::size_of::<RankCtl>(), LINE);
        let ringctl_off = align_up(meta_off + size * nbuf * meta_words * 8, LINE);
        let ring_off = align_up(
            ringctl_off + size * size * std::mem::size_of::<RingCtl>(),
            PAGE,
        );
        let slot_off = align_up(ring_off + size * size * ring_bytes, PAGE);
        let total = align_up(slot_off + size * nbuf * slot_bytes, PAGE);
        Layout {
            size,
            slot_bytes,
            nbuf,
            ring_bytes,
            meta_words,
            info_off,
            ctl_off,
            meta_off,
            ringctl_off,
            ring_off,
            slot_off,
            total,
        }
    }
}

/// A 32-bit word of a segment, held with the mapping it lies in (see
/// [`Segment::outside_word`]).
#[derive(Debug, Clone)]
pub(crate) struct SharedWord {
    map: Arc<Mapping>,
    /// Offset of the word in the mapping (4-byte aligned, within it).
    off: usize,
}

impl SharedWord {
    pub(crate) fn get(&self) -> &AtomicU32 {
        // SAFETY: `off` is the offset of an `AtomicU32` field of a `RankInfo` within the
        // mapping (taken from a reference to it), which `map` keeps alive; atomics only.
        unsafe { &*self.map.base().add(self.off).cast::<AtomicU32>() }
    }
}

/// A mapped segment.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Shared with the [`super::comm::OutsideWord`]s handed out, which outlive borrows of the
    /// communicator (the hierarchical backend's TCP thread writes one while the segment is in
    /// use on another thread).
    map: Arc<Mapping>,
    pub(crate) layout: Layout,
}

impl Segment {
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: offset 0 of a page-aligned mapping of at least `layout.total` bytes holds a
        // `Header` made only of atomics (any bit pattern is valid), shared by design.
        unsafe { &*self.map.base().cast::<Header>() }
    }

    /// Rank `rank`'s `outside` word, as a handle that keeps the mapping alive: it can be
    /// written from another thread while the communicator owning the segment is borrowed.
    pub(crate) fn outside_word(&self, rank: usize) -> SharedWord {
        let word: *const AtomicU32 = &self.info(rank).outside;
        SharedWord {
            off: word as usize - self.map.base() as usize,
            map: Arc::clone(&self.map),
        }
    }

    pub(crate) fn info(&self, rank: usize) -> &RankInfo {
        debug_assert!(rank < self.layout.size);
        // SAFETY: in bounds by the layout; 64-byte aligned; atomics only.
        unsafe {
            &*self
                .map
                .base()
                .add(self.layout.info_off + rank * std::mem::size_of::<RankInfo>())
                .cast::<RankInfo>()
        }
    }

    pub(crate) fn ctl(&self, rank: usize) -> &RankCtl {
        debug_assert!(rank < self.layout.size);
        // SAFETY: in bounds by the layout; 64-byte aligned; atomics only.
        unsafe {
            &*self
                .map
                .base()
                .add(self.layout.ctl_off + rank * std::mem::size_of::<RankCtl>())
                .cast::<RankCtl>()
        }
    }

    /// Word `w` of rank `rank`'s metadata for buffer `buf`.
    pub(crate) fn meta(&self, rank: usize, buf: usize, w: usize) -> &AtomicU64 {
        let l = &self.layout;
        debug_assert!(rank < l.size && buf < l.nbuf && w < l.meta_words);
        let idx = (rank * l.nbuf + buf) * l.meta_words + w;
        // SAFETY: in bounds by the layout; 8-byte aligned; atomics only.
        unsafe {
            &*self
                .map
                .base()
                .add(l.meta_off + idx * 8)
                .cast::<AtomicU64>()
        }
    }

    pub(crate) fn ring_ctl(&self, src: usize, dst: usize) -> &RingCtl {
        let l = &self.layout;
        debug_assert!(src < l.size && dst < l.size);
        // SAFETY: in bounds by the layout; 64-byte aligned; atomics only.
        unsafe {
            &*self
                .map
                .base()
                .add(l.ringctl_off + (src * l.size + dst) * std::mem::size_of::<RingCtl>())
                .cast::<RingCtl>()
        }
    }

    /// Start of the data of ring `src -> dst` (`ring_bytes` long).
    pub(crate) fn ring_data(&self, src: usize, dst: usize) -> *mut u8 {
        let l = &self.layout;
        debug_assert!(src < l.size && dst < l.size);
        // SAFETY: in bounds by the layout (pointer arithmetic only, nothing dereferenced).
        unsafe {
            self.map
                .base()
                .add(l.ring_off + (src * l.size + dst) * l.ring_bytes)
        }
    }

    /// Start of rank `rank`'s slot for buffer `buf` (`slot_bytes` long, page aligned).
    pub(crate) fn slot(&self, rank: usize, buf: usize) -> *mut u8 {
        let l = &self.layout;
        debug_assert!(rank < l.size && buf < l.nbuf);
        // SAFETY: in bounds by the layout (pointer arithmetic only, nothing dereferenced).
        unsafe {
            self.map
                .base()
                .add(l.slot_off + (rank * l.nbuf + buf) * l.slot_bytes)
        }
    }

    fn record_self(&self, rank: usize) {
        let info = self.info(rank);
        info.start_time
            .store(sys::self_start_time(), Ordering::Relaxed);
        info.state.store(ST_ATTACHED, Ordering::Relaxed);
        info.pid.store(sys::pid(), Ordering::Release);
    }

    /// Rank 0: create, size, map and initialise the segment `name`, with the proof that it
    /// knows `key`.
    pub(crate) fn create(name: &str, layout: Layout, key: &Key) -> Result<Segment> {
        let fd = match sys::shm_create(name) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // Someone else's object under our name is never touched, nor used.
                if let Ok(other) = sys::shm_open_existing(name, false) {
                    let st = other.stat().map_err(|e| io_err(name, "fstat", e))?;
                    check_owner(name, st.uid, st.mode)?;
                }
                // A leftover of a dead job with the same token and sequence? Remove it if so.
                if is_stale(name, Duration::ZERO)? {
                    tracing::warn!(segment = name, "removing stale shared-memory segment");
                    sys::shm_unlink(name).map_err(|e| io_err(name, "shm_unlink", e))?;
                    sys::shm_create(name).map_err(|e| io_err(name, "shm_open(O_CREAT)", e))?
                } else {
                    return Err(TransportError::Handshake {
                        peer: name.to_string(),
                        reason: format!(
                            "shared-memory segment /dev/shm{name} already exists and belongs to a \
                             live process: is another job running with the same FH_JOB_TOKEN?"
                        ),
                    });
                }
            }
            Err(e) => return Err(io_err(name, "shm_open(O_CREAT)", e)),
        };
        let init = || -> Result<Segment> {
            fd.set_len(layout.total)
                .map_err(|e| io_err(name, "ftruncate", e))?;
            let map = Mapping::new(&fd, layout.total, true).map_err(|e| io_err(name, "mmap", e))?;
            let seg = Segment {
                map: Arc::new(map),
                layout,
            };
            // Record the creator first, so that a creator killed during initialisation leaves a
            // segment that the next start recognises as stale.
            seg.record_self(0);
            fd.reserve(layout.total).map_err(|e| {
                if e.kind() == io::ErrorKind::StorageFull {
                    TransportError::BackendUnavailable {
                        backend: "shm",
                        reason: format!(
                            "/dev/shm has no room for a {} byte segment: enlarge it (e.g. \
                             docker --shm-size) or lower the shared-memory slot size",
                            layout.total
                        ),
                    }
                } else {
                    io_err(name, "reserving shared memory", e)
                }
            })?;
            let h = seg.header();
            h.version.store(VERSION, Ordering::Relaxed);
            h.size.store(layout.size as u32, Ordering::Relaxed);
            h.slot_bytes
                .store(layout.slot_bytes as u64, Ordering::Relaxed);
            h.nbuf.store(layout.nbuf as u32, Ordering::Relaxed);
            h.ring_bytes
                .store(layout.ring_bytes as u32, Ordering::Relaxed);
            h.total_bytes.store(layout.total as u64, Ordering::Relaxed);
            h.attached.store(1, Ordering::Relaxed);
            let creator = seg.info(0);
            let proof = segment_proof(
                key,
                name,
                &layout,
                creator.pid.load(Ordering::Relaxed),
                creator.start_time.load(Ordering::Relaxed),
            );
            for (w, chunk) in h.proof.iter().zip(proof.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(chunk);
                w.store(u64::from_le_bytes(b), Ordering::Relaxed);
            }
            h.magic.store(MAGIC, Ordering::Release);
            Ok(seg)
        };
        init().inspect_err(|_| {
            let _ = sys::shm_unlink(name);
        })
    }

    /// Ranks other than 0: wait (until `deadline`) for rank 0 to create and initialise `name`,
    /// check that its layout matches `layout`, map it and register.
    pub(crate) fn attach(
        name: &str,
        rank: usize,
        layout: Layout,
        key: &Key,
        deadline: Instant,
        timeout: Duration,
        cancel: &dyn Fn() -> Option<TransportError>,
    ) -> Result<Segment> {
        let mut pause = Duration::from_micros(200);
        loop {
            // A verdict that a rank (rank 0, which creates it) is lost ends the wait.
            if let Some(e) = cancel() {
                return Err(e);
            }
            if let Some(seg) = Self::try_attach(name, layout, key)? {
                seg.record_self(rank);
                let h = seg.header();
                if h.attached.fetch_add(1, Ordering::AcqRel) + 1 == layout.size as u32 {
                    // Everyone has it mapped: the name is no longer needed.
                    sys::shm_unlink(name).map_err(|e| io_err(name, "shm_unlink", e))?;
                }
                return Ok(seg);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    rank: 0,
                    op: "shm open (waiting for rank 0 to create the segment)",
                    after: timeout,
                });
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn try_attach(name: &str, layout: Layout, key: &Key) -> Result<Option<Segment>> {
        let fd = match sys::shm_open_existing(name, true) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(name, "shm_open", e)),
        };
        // Owner and mode first: a segment that another user could have made or written is
        // never mapped. The size is checked against every mapping below (no SIGBUS on a
        // short object).
        let st = fd.stat().map_err(|e| io_err(name, "fstat", e))?;
        check_owner(name, st.uid, st.mode)?;
        let len = st.len;
        // Look at the header and the creator's entry first: the layout is checked before the
        // length, so that a rank expecting another world size fails instead of waiting.
        let first = layout.info_off + std::mem::size_of::<RankInfo>();
        if len < first as u64 {
            return Ok(None); // rank 0 has not sized it yet
        }
        let head = Segment {
            map: Arc::new(Mapping::new(&fd, first, true).map_err(|e| io_err(name, "mmap", e))?),
            layout,
        };
        let h = head.header();
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Ok(None); // not initialised yet
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(TransportError::Handshake {
                peer: "rank 0".into(),
                reason: format!(
                    "shared-memory layout version {version}, this rank speaks {VERSION}: run \
                     the same FastHorovod build on every rank"
                ),
            });
        }
        let creator = head.info(0);
        let (pid, start) = (
            creator.pid.load(Ordering::Acquire),
            creator.start_time.load(Ordering::Relaxed),
        );
        if !sys::process_alive(pid, start) {
            return Ok(None); // stale leftover; rank 0 will replace it
        }
        let theirs = (
            h.size.load(Ordering::Relaxed) as usize,
            h.slot_bytes.load(Ordering::Relaxed) as usize,
            h.nbuf.load(Ordering::Relaxed) as usize,
            h.ring_bytes.load(Ordering::Relaxed) as usize,
        );
        let ours = (
            layout.size,
            layout.slot_bytes,
            layout.nbuf,
            layout.ring_bytes,
        );
        if theirs != ours {
            return Err(TransportError::Handshake {
                peer: "rank 0".into(),
                reason: format!(
                    "shared-memory segment has (size, slot bytes, buffers, ring bytes) = \
                     {theirs:?} but this rank expects {ours:?}: every rank must use the same \
                     world size and shm options"
                ),
            });
        }
        let mut theirs_proof = [0u8; 32];
        for (chunk, w) in theirs_proof.chunks_exact_mut(8).zip(&h.proof) {
            chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        let want = segment_proof(key, name, &layout, pid, start);
        // The layout matched: now the creator must prove that it knows the token.
        if !crate::backend::tcp::wire::constant_time_eq(&theirs_proof, &want) {
            return Err(TransportError::Handshake {
                peer: format!("shared-memory segment /dev/shm{name}"),
                reason: "its creator cannot prove that it knows this job's token (another job \
                         with another FH_JOB_TOKEN, or a forged segment): not attached"
                    .into(),
            });
        }
        if len < layout.total as u64 {
            return Ok(None);
        }
        let seg = Segment {
            map: Arc::new(
                Mapping::new(&fd, layout.total, true).map_err(|e| io_err(name, "mmap", e))?,
            ),
            layout,
        };
        Ok(Some(seg))
    }
}

fn io_err(name: &str, what: &str, e: io::Error) -> TransportError {
    TransportError::io(format!("{what} of shared-memory segment /dev/shm{name}"), e)
}

/// Whether the segment `name` (with leading '/') is a FastHorovod segment whose recorded
/// processes are all dead, or one whose creator died before initialising it at least
/// `uninit_age` ago.
fn is_stale(name: &str, uninit_age: Duration) -> Result<bool> {
    let fd = match sys::shm_open_existing(name, false) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(name, "shm_open", e)),
    };
    Ok(stale_fd(&fd, uninit_age).unwrap_or(false))
}

fn stale_fd(fd: &Fd, uninit_age: Duration) -> io::Result<bool> {
    let st = fd.stat()?;
    let (len, ctime) = (st.len, st.ctime);
    // Only our own, owner-only segments are ever judged (and removed).
    if st.uid != sys::euid() || st.mode & 0o077 != 0 {
        return Ok(false);
    }
    let age = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64 - ctime)
        .unwrap_or(0);
    let old_enough = age >= 0 && age as u64 >= uninit_age.as_secs();
    let info0 = Layout::new(1, 0, 0, 0).info_off;
    let first = info0 + std::mem::size_of::<RankInfo>();
    if (len as usize) < first {
        return Ok(old_enough);
    }
    let head = Mapping::new(fd, first, false)?;
    // SAFETY: the mapping holds a header and the first RankInfo; atomics only, any bit pattern
    // is valid.
    let (h, creator) = unsafe {
        (
            &*head.base().cast::<Header>(),
            &*head.base().add(info0).cast::<RankInfo>(),
        )
    };
    if h.magic.load(Ordering::Acquire) != MAGIC {
        // Not initialised: stale if its recorded creator is dead; if the creator had not even
        // recorded itself, only once it is old.
        let pid = creator.pid.load(Ordering::Acquire);
        return Ok(if pid == 0 {
            old_enough
        } else {
            !sys::process_alive(pid, creator.start_time.load(Ordering::Relaxed))
        });
    }
    let size = h.size.load(Ordering::Relaxed) as usize;
    let layout = Layout::new(size, 0, 0, 0);
    let need = layout.info_off + size * std::mem::size_of::<RankInfo>();
    if size == 0 || (len as usize) < need {
        return Ok(old_enough);
    }
    drop(head);
    let map = Mapping::new(fd, need, false)?;
    let any_alive = (0..size).any(|r| {
        // SAFETY: `need` covers every RankInfo; 64-byte aligned; atomics only.
        let info = unsafe {
            &*map
                .base()
                .add(layout.info_off + r * std::mem::size_of::<RankInfo>())
                .cast::<RankInfo>()
        };
        sys::process_alive(
            info.pid.load(Ordering::Acquire),
            info.start_time.load(Ordering::Relaxed),
        )
    });
    Ok(!any_alive)
}

/// Whether `file` is a name this scheme makes: `fh-`, 32 hex digits (the job's tag), `-`, and
/// either 32 hex digits (the segment's own keyed name) or a sequence number (the names of
/// earlier versions, still cleaned up).
pub(crate) fn is_scheme_name(file: &str) -> bool {
    let Some(rest) = file.strip_prefix(NAME_PREFIX) else {
        return false;
    };
    let Some((hash, seq)) = rest.split_once('-') else {
        return false;
    };
    let lower_hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    hash.len() == 32
        && lower_hex(hash)
        && ((seq.len() == 32 && lower_hex(seq))
            || (!seq.is_empty() && seq.len() <= 20 && seq.bytes().all(|b| b.is_ascii_digit())))
}

/// Remove FastHorovod segments in `/dev/shm` left by jobs whose every process died (e.g. all
/// ranks SIGKILLed while a communicator was being opened). Returns the names removed.
pub(crate) fn cleanup_stale() -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(dir) = std::fs::read_dir(sys::SHM_DIR) else {
        return removed;
    };
    for entry in dir.flatten() {
        let Some(file) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !is_scheme_name(&file) {
            continue;
        }
        let name = format!("/{file}");
        // Uninitialised segments may be being created right now: only remove old ones.
        match is_stale(&name, Duration::from_secs(60)) {
            Ok(true) => {
                if sys::shm_unlink(&name).is_ok() {
                    tracing::info!(segment = %name, "removed stale shared-memory segment");
                    removed.push(file);
                }
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(segment = %name, error = %e, "cannot inspect segment"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheme_names() {
        assert!(is_scheme_name("fh-0123456789abcdef0123456789abcdef-0"));
        assert!(is_scheme_name(
            "fh-0123456789abcdef0123456789abcdef-fedcba9876543210fedcba9876543210"
        ));
        assert!(!is_scheme_name(
            "fh-0123456789abcdef0123456789abcdef-fedcba9876543210fedcba987654321"
        ));
        assert!(is_scheme_name("fh-0123456789abcdef0123456789abcdef-17"));
        assert!(
            !is_scheme_name("fh-0123456789ab-0"),
            "old 48-bit names are not ours"
        );
        assert!(!is_scheme_name("fh-0123456789abcdef0123456789ABCDEF-0"));
        assert!(!is_scheme_name("fh-0123456789abcdef0123456789abcdef-x"));
        assert!(!is_scheme_name("fh-0123456789abcdef0123456789abcdef-"));
        assert!(!is_scheme_name("fh-something-else"));
        assert!(!is_scheme_name("sem.fh-0123456789abcdef0123456789abcdef-0"));
    }

    #[test]
    fn a_segment_without_the_creators_proof_is_refused() {
        let name = format!(
            "/{}0",
            crate::backend::shm::segment_prefix(&format!(
                "proof-test-{}-0123456789",
                std::process::id()
            ))
        );
        let layout = Layout::new(2, 4096, 1, 4096);
        let seg = Segment::create(&name, layout, &Key::new(b"the-creators-token-0123")).unwrap();
        // Same user, same name, a valid header, a live creator: only the proof is wrong.
        let other = Key::new(b"another-token-0123456789");
        let err = Segment::try_attach(&name, layout, &other).unwrap_err();
        assert!(err.to_string().contains("cannot prove"), "{err}");
        // The right key attaches.
        let ok = Segment::try_attach(&name, layout, &Key::new(b"the-creators-token-0123"));
        assert!(matches!(ok, Ok(Some(_))), "{ok:?}");
        drop(seg);
        sys::shm_unlink(&name).unwrap();
    }
}
