//! The Chrome-trace timeline (chrome://tracing, Perfetto): rank 0's (`FH_TIMELINE=PATH`, as
//! Horovod's), or every rank's own (`FH_TIMELINE=PATH` holding `{rank}`; `fhrun
//! --timeline-filename` does this and [`merge`]s them into one trace with a track per rank on
//! rank 0's clock).
//!
//! **Off the critical path.** The engine's threads (the control thread, the channel workers)
//! only build a small [`Record`] — names, lane, `Instant`s, a few numbers — and hand it to the
//! timeline's own writer thread over a bounded queue with `try_send`: they never format JSON,
//! never touch the file, never wait, and never wake a thread (the writer sleeps between batches
//! rather than waiting on the queue). When the writer falls [`QUEUE_CAPACITY`] events behind,
//! new events are dropped and counted; the writer says so once in the log (`tracing`) and, at
//! the end of the file, in an instant event `"timeline: N events dropped"`.
//!
//! **The file.** Every [`FLUSH_EVERY`] while events come (backing off to 1 s while none do),
//! the writer takes what has queued up, serializes it ([`TraceEvent`], `serde_json`) into a
//! batch — `[` first, events separated by `,\n` — and writes the batch followed by `]` in one
//! write at the offset of the previous closing `]` (at least every 1 MiB). So the file is a
//! valid JSON array (which chrome://tracing and Perfetto load) before and after every write,
//! and certainly after [`Timeline::finish`]
//! ([`Engine::stop_timeline`](crate::Engine::stop_timeline), a `start_timeline` that replaces
//! it, engine shutdown), which wakes the writer, lets it write what is queued and joins it
//! within a bounded wait. A write error is logged once and ends the timeline; it never fails a
//! collective.
//!
//! **What it shows.** Lane (`tid`) 0 shows negotiation rounds; lane `c + 1` the fused
//! collectives of channel `c` (with their pack / collective / unpack phases, and each group's
//! bytes and rate); the lane after the channels, `python`, the framework's side (`submit`,
//! `synchronize`, `optimizer.step`, from `fasthorovod.torch`). Each tensor has asynchronous
//! spans of its own: `queued` (category `tensor`: submitted on this rank until dispatched: when
//! it became ready here) and, on rank 0, its negotiation (category `negotiate`, named after the
//! tensor and the rank it waited on last): from the first rank's ready time to the round in
//! which every rank agreed it ready, with
//! `args.ready_us` = each rank's ready time (µs since the timeline's start, keyed by rank) and
//! `args.last_ready_rank` = the rank that held it back. Ready times come from the control
//! thread's readiness reports (`Status::Trace`, only while a timeline is written): each rank
//! tells rank 0 how long ago its newly pending tensors were submitted, and rank 0 places that
//! on its own clock (the moment it learned, less that age; transfer time is not corrected
//! for). A rank that has joined (contributing zeros) has no ready time, nor has a rank that
//! reported the tensor before a `stop_timeline` (rank 0 forgets the reports when it stops).

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use fh_core::message::CollectiveKind;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod merge;
#[cfg(test)]
mod tests;
mod writer;

use writer::Writer;

/// How many events the writer may fall behind before new ones are dropped.
pub(crate) const QUEUE_CAPACITY: usize = 1 << 16;

/// Longest [`Timeline::finish`] waits for the writer to drain its queue and close the file.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(10);

/// When rank 0 learned that a rank had a tensor ready, and how long before that the rank had
/// submitted it (as the rank reported).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadyAt {
    /// When rank 0 received the report (rank 0's clock).
    pub learned: Instant,
    /// How long before sending the report the rank had submitted the tensor.
    pub age: Duration,
}

/// What an engine thread hands to the writer: cheap to build, no formatting, no I/O.
pub(crate) enum Record {
    /// A complete span on a lane.
    Span {
        lane: usize,
        name: &'static str,
        begin: Instant,
        end: Instant,
    },
    /// A negotiation round (lane 0) that agreed `ready` tensors.
    Round {
        coordinator: bool,
        ready: usize,
        begin: Instant,
        end: Instant,
    },
    /// A fused group that ran on a channel.
    Group {
        lane: usize,
        kind: CollectiveKind,
        names: Vec<String>,
        bytes: usize,
        begin: Instant,
        end: Instant,
    },
    /// An asynchronous span of one tensor on rank 0 (e.g. queued before dispatch).
    Tensor {
        id: u64,
        name: String,
        phase: &'static str,
        begin: Instant,
        end: Instant,
    },
    /// A tensor agreed ready on every rank, with each rank's ready time where known.
    Negotiated {
        name: String,
        ready: Vec<Option<ReadyAt>>,
        agreed: Instant,
    },
    /// A span of the framework's side (`submit`, `synchronize`, `optimizer.step`), on the
    /// Python lane.
    Framework {
        name: String,
        detail: String,
        begin: Instant,
        end: Instant,
    },
}

/// Which rank writes a timeline, and its clock: the file's first event (`process_name`)
/// carries them, so that [`merge`] puts every rank's file on rank 0's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The rank (world rank).
    pub rank: usize,
    /// This rank's wall clock minus rank 0's, in microseconds, as measured at start-up (zero
    /// on rank 0's host).
    pub offset_us: i64,
}

/// The path rank `rank` writes its timeline to, given `FH_TIMELINE`'s value: a path holding
/// `{rank}` names a file per rank (every rank writes); any other path is rank 0's alone.
pub(crate) fn path_for(pattern: &Path, rank: usize) -> Option<PathBuf> {
    let text = pattern.to_string_lossy();
    if text.contains(RANK_PLACEHOLDER) {
        Some(PathBuf::from(
            text.replace(RANK_PLACEHOLDER, &rank.to_string()),
        ))
    } else {
        (rank == 0).then(|| pattern.to_path_buf())
    }
}

/// Create the timeline of rank `who.rank` for `FH_TIMELINE`'s value `pattern` (`None`: this
/// rank writes none). A file per rank may go where its directory does not exist yet (on
/// another host than the launcher's): that directory is created; rank 0's one file is not.
pub(crate) fn create_rank_timeline(
    pattern: &Path,
    channels: usize,
    who: Identity,
) -> Result<Option<Timeline>, (PathBuf, std::io::Error)> {
    let Some(path) = path_for(pattern, who.rank) else {
        return Ok(None);
    };
    if pattern.to_string_lossy().contains(RANK_PLACEHOLDER) {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| (path.clone(), e))?;
        }
    }
    match Timeline::create_for(&path, channels, who) {
        Ok(t) => Ok(Some(t)),
        Err(e) => Err((path, e)),
    }
}

/// What a timeline path holds where each rank's own file differs: `{rank}`.
pub const RANK_PLACEHOLDER: &str = "{rank}";

/// State the engine's threads and the writer share.
#[derive(Default)]
struct Shared {
    /// Set by [`Timeline::finish`]: no new events are accepted.
    stopping: AtomicBool,
    /// Set by the writer when it could not write: the timeline has ended.
    dead: AtomicBool,
    /// Events dropped because the queue was full.
    dropped: AtomicU64,
}

/// A timeline being written: the sending side of the writer's queue, shared by the engine's
/// threads.
pub(crate) struct Timeline {
    tx: Sender<Record>,
    stop_tx: Sender<()>,
    /// Disconnected when the writer has finished.
    done_rx: Receiver<()>,
    writer: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    path: PathBuf,
}

impl Timeline {
    /// Create (truncate) the file, name the lanes (negotiation and `channels` channels) and
    /// start the writer thread. Errors creating the file are returned.
    #[cfg(test)]
    pub(crate) fn create(path: &Path, channels: usize) -> std::io::Result<Self> {
        Self::open(path, channels, QUEUE_CAPACITY, None, Identity::default())
    }

    /// [`Timeline::create`] for rank `who.rank`, whose clock is `who.offset_us` from rank 0's.
    pub(crate) fn create_for(path: &Path, channels: usize, who: Identity) -> std::io::Result<Self> {
        Self::open(path, channels, QUEUE_CAPACITY, None, who)
    }

    /// [`Timeline::create`] with a queue of `capacity` events; with `gate`, the writer waits
    /// until the gate's sender is dropped (or sends) before writing anything (tests).
    pub(crate) fn open(
        path: &Path,
        channels: usize,
        capacity: usize,
        gate: Option<Receiver<()>>,
        who: Identity,
    ) -> std::io::Result<Self> {
        let file = File::create(path)?;
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        let shared = Arc::new(Shared::default());
        let writer = Writer {
            file,
            end: 0,
            buf: Vec::with_capacity(1 << 16),
            first: true,
            start: Instant::now(),
            origin_unix_us: crate::flight::unix_micros(std::time::SystemTime::now()),
            who,
            python_named: false,
            next_id: 0,
            channels,
        };
        let (sh, p) = (Arc::clone(&shared), path.to_path_buf());
        let handle = std::thread::Builder::new()
            .name("fh-timeline".into())
            .spawn(move || {
                let _done = done_tx;
                if let Some(g) = gate {
                    let _ = g.recv_timeout(Duration::from_secs(60));
                }
                if let Err(e) = writer.run(channels, &rx, &stop_rx, &sh) {
                    sh.dead.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        path = %p.display(),
                        error = %e,
                        "cannot write the timeline; it stops here (collectives are not affected)"
                    );
                }
            })?;
        Ok(Timeline {
            tx,
            stop_tx,
            done_rx,
            writer: Mutex::new(Some(handle)),
            shared,
            path: path.to_path_buf(),
        })
    }

    /// Whether events are still accepted (not finished, no write error).
    pub(crate) fn is_live(&self) -> bool {
        !self.shared.stopping.load(Ordering::Relaxed) && !self.shared.dead.load(Ordering::Relaxed)
    }

    /// Events dropped so far because the writer fell behind.
    #[cfg(test)]
    pub(crate) fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Hand `r` to the writer; never blocks (a full queue drops it and counts the drop).
    fn emit(&self, r: Record) {
        if !self.is_live() {
            return;
        }
        match self.tx.try_send(r) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A complete span on a lane (0 = negotiation, c + 1 = channel c).
    pub(crate) fn span(&self, lane: usize, name: &'static str, begin: Instant, end: Instant) {
        self.emit(Record::Span {
            lane,
            name,
            begin,
            end,
        });
    }

    /// A negotiation round on lane 0 that agreed `ready` tensors.
    pub(crate) fn round(&self, coordinator: bool, ready: usize, begin: Instant, end: Instant) {
        self.emit(Record::Round {
            coordinator,
            ready,
            begin,
            end,
        });
    }

    /// A fused group of `kind` over `names` (`bytes` in all) on channel lane `lane`.
    pub(crate) fn group(
        &self,
        lane: usize,
        kind: CollectiveKind,
        names: Vec<String>,
        bytes: usize,
        begin: Instant,
        end: Instant,
    ) {
        self.emit(Record::Group {
            lane,
            kind,
            names,
            bytes,
            begin,
            end,
        });
    }

    /// An asynchronous span of one tensor (e.g. its time queued before dispatch), shown as a
    /// track of its own.
    pub(crate) fn tensor_span(
        &self,
        id: u64,
        name: String,
        phase: &'static str,
        begin: Instant,
        end: Instant,
    ) {
        self.emit(Record::Tensor {
            id,
            name,
            phase,
            begin,
            end,
        });
    }

    /// Tensor `name` was agreed ready on every rank at `agreed`; `ready[r]` is when rank 0
    /// learned that rank `r` had it ready, where known.
    pub(crate) fn negotiated(&self, name: String, ready: Vec<Option<ReadyAt>>, agreed: Instant) {
        self.emit(Record::Negotiated {
            name,
            ready,
            agreed,
        });
    }

    /// A span of the framework's side (`submit`, `synchronize`, `optimizer.step`) on the
    /// Python lane, with a detail (a tensor's name, a count).
    pub(crate) fn framework(&self, name: String, detail: String, begin: Instant, end: Instant) {
        self.emit(Record::Framework {
            name,
            detail,
            begin,
            end,
        });
    }

    /// Stop accepting events, let the writer drain its queue and close the array, and join it,
    /// waiting at most `wait`. Returns whether the writer finished in time (it is left to
    /// finish on its own otherwise). Idempotent.
    pub(crate) fn finish(&self, wait: Duration) -> bool {
        self.shared.stopping.store(true, Ordering::Relaxed);
        let _ = self.stop_tx.try_send(());
        match self.done_rx.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    path = %self.path.display(),
                    "the timeline writer did not finish within {wait:?}; the file may lack its \
                     last events"
                );
                false
            }
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let handle = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(h) = handle {
                    if h.join().is_err() {
                        tracing::error!("the timeline writer panicked");
                    }
                }
                true
            }
        }
    }
}

impl Drop for Timeline {
    /// Dropped without [`Timeline::finish`]: tell the writer to close the file, without waiting.
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        let _ = self.stop_tx.try_send(());
    }
}
