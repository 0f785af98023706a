//! The Chrome-trace timeline (chrome://tracing, Perfetto), written by rank 0.
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
//! collectives of channel `c` (with their pack / collective / unpack phases). Each tensor has
//! asynchronous spans of its own: `queued` (category `tensor`: submitted on rank 0 until
//! dispatched) and its negotiation (category `negotiate`, named after the tensor): from the
//! first rank's ready time to the round in which every rank agreed it ready, with
//! `args.ready_us` = each rank's ready time (µs since the timeline's start, keyed by rank) and
//! `args.last_ready_rank` = the rank that held it back. Ready times come from the control
//! thread's readiness reports (`Status::Trace`, only while a timeline is written): each rank
//! tells rank 0 how long ago its newly pending tensors were submitted, and rank 0 places that
//! on its own clock (the moment it learned, less that age; transfer time is not corrected
//! for). A rank that has joined (contributing zeros) has no ready time, nor has a rank that
//! reported the tensor before a `stop_timeline` (rank 0 forgets the reports when it stops).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use fh_core::message::CollectiveKind;
use serde::Serialize;

/// How many events the writer may fall behind before new ones are dropped.
pub(crate) const QUEUE_CAPACITY: usize = 1 << 16;
/// How often the writer takes what has queued up while events keep coming (it sleeps in
/// between, so that handing it an event never has to wake a thread).
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// The writer's longest sleep while no events come (it sleeps longer the longer it is idle).
const IDLE_WAKE: Duration = Duration::from_secs(1);
/// Most bytes of events the writer collects before writing them out.
const MAX_BATCH_BYTES: usize = 1 << 20;
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
}

/// One Chrome trace event, as written to the file.
#[derive(Serialize, Debug)]
pub(crate) struct TraceEvent<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    ph: &'static str,
    pid: u32,
    tid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    /// Scope of an instant event (`g`: global).
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    #[serde(skip_serializing_if = "Args::is_none")]
    args: Args<'a>,
}

/// The `args` of a trace event.
#[derive(Serialize, Debug)]
#[serde(untagged)]
enum Args<'a> {
    None,
    /// Metadata: a process or lane name.
    Label {
        name: &'a str,
    },
    /// A negotiation round.
    Round {
        ready: usize,
    },
    /// A fused group.
    Group {
        names: &'a [String],
        bytes: usize,
    },
    /// A tensor's span.
    Tensor {
        tensor: &'a str,
    },
    /// A tensor's negotiation: each rank's ready time (µs, keyed by rank), the last ready
    /// rank, when it was agreed.
    Negotiated {
        tensor: &'a str,
        ready_us: BTreeMap<usize, f64>,
        last_ready_rank: Option<usize>,
        agreed_us: f64,
    },
    /// The drop notice.
    Dropped {
        dropped: u64,
    },
}

impl Args<'_> {
    fn is_none(&self) -> bool {
        matches!(self, Args::None)
    }
}

impl<'a> TraceEvent<'a> {
    fn new(name: &'a str, ph: &'static str, tid: usize) -> Self {
        TraceEvent {
            name,
            cat: None,
            ph,
            pid: 0,
            tid,
            ts: None,
            dur: None,
            id: None,
            s: None,
            args: Args::None,
        }
    }
}

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
    pub(crate) fn create(path: &Path, channels: usize) -> std::io::Result<Self> {
        Self::open(path, channels, QUEUE_CAPACITY, None)
    }

    /// [`Timeline::create`] with a queue of `capacity` events; with `gate`, the writer waits
    /// until the gate's sender is dropped (or sends) before writing anything (tests).
    pub(crate) fn open(
        path: &Path,
        channels: usize,
        capacity: usize,
        gate: Option<Receiver<()>>,
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
            next_id: 0,
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

/// The writer thread's side: the buffered file and the position in the array.
struct Writer {
    file: File,
    /// Offset of the file's closing `]`, where the next batch is written.
    end: u64,
    /// Events serialized since the last write to the file.
    buf: Vec<u8>,
    /// No event written yet (no separator before the next).
    first: bool,
    start: Instant,
    /// Next id of a negotiation span.
    next_id: u64,
}

/// Microseconds from `start` to `t` (0 before `start`), to the nanosecond.
fn micros(start: Instant, t: Instant) -> f64 {
    let us = t.saturating_duration_since(start).as_secs_f64() * 1e6;
    (us * 1e3).round() / 1e3
}

impl Writer {
    fn run(
        mut self,
        channels: usize,
        rx: &Receiver<Record>,
        stop_rx: &Receiver<()>,
        shared: &Shared,
    ) -> std::io::Result<()> {
        self.buf.push(b'[');
        let mut ev = TraceEvent::new("process_name", "M", 0);
        ev.args = Args::Label {
            name: "fasthorovod rank 0",
        };
        self.event(&ev)?;
        for lane in 0..=channels {
            let label = if lane == 0 {
                "negotiation".to_string()
            } else {
                format!("channel {}", lane - 1)
            };
            let mut ev = TraceEvent::new("thread_name", "M", lane);
            ev.args = Args::Label { name: &label };
            self.event(&ev)?;
        }
        self.checkpoint()?;
        let mut warned = false;
        let mut sleep = FLUSH_EVERY;
        // Sleep rather than wait on the queue: an engine thread's `try_send` then never has to
        // wake this thread. A stop (or the timeline dropped) wakes it at once.
        while let Err(RecvTimeoutError::Timeout) = stop_rx.recv_timeout(sleep) {
            // Take what has queued up, writing at least every 1 MiB.
            let mut took = false;
            while let Ok(r) = rx.try_recv() {
                took = true;
                self.record(r)?;
                if self.buf.len() >= MAX_BATCH_BYTES {
                    self.checkpoint()?;
                }
            }
            sleep = if took {
                FLUSH_EVERY
            } else {
                (sleep * 2).min(IDLE_WAKE)
            };
            if !warned && shared.dropped.load(Ordering::Relaxed) > 0 {
                warned = true;
                tracing::warn!(
                    "the timeline writer fell behind; events are being dropped (the count is \
                     written at the end of the timeline)"
                );
            }
            self.checkpoint()?;
        }
        // Finishing: whatever is queued still goes in, then the drop count and the `]`.
        while let Ok(r) = rx.try_recv() {
            self.record(r)?;
        }
        let dropped = shared.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            let name = format!("timeline: {dropped} events dropped (the writer fell behind)");
            let mut ev = TraceEvent::new(&name, "i", 0);
            ev.ts = Some(micros(self.start, Instant::now()));
            ev.s = Some("g");
            ev.args = Args::Dropped { dropped };
            self.event(&ev)?;
        }
        self.checkpoint()
    }

    /// Write one event after a separator.
    fn event(&mut self, ev: &TraceEvent<'_>) -> std::io::Result<()> {
        if !self.first {
            self.buf.extend_from_slice(b",\n");
        }
        serde_json::to_writer(&mut self.buf, ev)?;
        self.first = false;
        Ok(())
    }

    /// Write the collected events with the closing `]` over the previous `]`, in one write:
    /// the file is a valid JSON array before and after it.
    fn checkpoint(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.buf.push(b']');
        self.file.seek(SeekFrom::Start(self.end))?;
        self.file.write_all(&self.buf)?;
        self.end += self.buf.len() as u64 - 1;
        self.buf.clear();
        Ok(())
    }

    fn record(&mut self, r: Record) -> std::io::Result<()> {
        let start = self.start;
        let us = |t| micros(start, t);
        match r {
            Record::Span {
                lane,
                name,
                begin,
                end,
            } => {
                let mut ev = TraceEvent::new(name, "X", lane);
                ev.ts = Some(us(begin));
                ev.dur = Some((us(end) - us(begin)).max(0.0));
                self.event(&ev)
            }
            Record::Round {
                coordinator,
                ready,
                begin,
                end,
            } => {
                let name = if coordinator {
                    "negotiate (coordinator)"
                } else {
                    "negotiate"
                };
                let mut ev = TraceEvent::new(name, "X", 0);
                ev.ts = Some(us(begin));
                ev.dur = Some((us(end) - us(begin)).max(0.0));
                ev.args = Args::Round { ready };
                self.event(&ev)
            }
            Record::Group {
                lane,
                kind,
                names,
                bytes,
                begin,
                end,
            } => {
                let name = format!("{kind} x{}", names.len());
                let mut ev = TraceEvent::new(&name, "X", lane);
                ev.ts = Some(us(begin));
                ev.dur = Some((us(end) - us(begin)).max(0.0));
                ev.args = Args::Group {
                    names: &names,
                    bytes,
                };
                self.event(&ev)
            }
            Record::Tensor {
                id,
                name,
                phase,
                begin,
                end,
            } => {
                let mut b = TraceEvent::new(phase, "b", 0);
                b.cat = Some("tensor");
                b.id = Some(id);
                b.ts = Some(us(begin));
                b.args = Args::Tensor { tensor: &name };
                self.event(&b)?;
                let mut e = TraceEvent::new(phase, "e", 0);
                e.cat = Some("tensor");
                e.id = Some(id);
                e.ts = Some(us(end).max(us(begin)));
                self.event(&e)
            }
            Record::Negotiated {
                name,
                ready,
                agreed,
            } => {
                let end = us(agreed);
                let mut ready_us = BTreeMap::new();
                let mut first = end;
                let mut last: Option<(usize, f64)> = None;
                for (rank, at) in ready.iter().enumerate() {
                    let Some(at) = at else { continue };
                    let t = (us(at.learned) - at.age.as_secs_f64() * 1e6).clamp(0.0, end);
                    let t = (t * 1e3).round() / 1e3;
                    ready_us.insert(rank, t);
                    first = first.min(t);
                    if last.is_none_or(|(_, l)| t >= l) {
                        last = Some((rank, t));
                    }
                }
                let id = self.next_id;
                self.next_id += 1;
                let mut b = TraceEvent::new(&name, "b", 0);
                b.cat = Some("negotiate");
                b.id = Some(id);
                b.ts = Some(first);
                b.args = Args::Negotiated {
                    tensor: &name,
                    ready_us,
                    last_ready_rank: last.map(|(r, _)| r),
                    agreed_us: end,
                };
                self.event(&b)?;
                let mut e = TraceEvent::new(&name, "e", 0);
                e.cat = Some("negotiate");
                e.id = Some(id);
                e.ts = Some(end);
                self.event(&e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fh-tl-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("t.json")
    }

    fn parse(path: &Path) -> Vec<Value> {
        let text = std::fs::read_to_string(path).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        v.as_array().expect("an array").clone()
    }

    /// Waits (bounded) until the file parses with `n` events or more.
    fn wait_for_events(path: &Path, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if let Ok(Value::Array(a)) = serde_json::from_str::<Value>(&text) {
                if a.len() >= n {
                    return a;
                }
            }
            assert!(Instant::now() < deadline, "never got {n} events: {text}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn file_is_valid_json_while_written_and_after_finish() {
        let path = temp("valid");
        let t = Timeline::create(&path, 2).unwrap();
        // Metadata: the process and three lanes.
        assert_eq!(wait_for_events(&path, 4).len(), 4);
        let now = Instant::now();
        t.span(1, "pack", now, now + Duration::from_micros(5));
        // Flushed by the writer on its own while the timeline runs: valid in between.
        let events = wait_for_events(&path, 5);
        assert_eq!(events[4]["name"], "pack");
        assert_eq!(events[4]["dur"], 5.0);
        let odd = "a \"quoted\" \\ name\n\t\u{1}é";
        t.group(
            2,
            CollectiveKind::Allreduce,
            vec![odd.to_string(), "b,c".into()],
            64,
            now,
            now,
        );
        t.round(true, 2, now, now);
        assert!(t.finish(STOP_WAIT));
        assert!(t.finish(STOP_WAIT), "idempotent");
        t.span(0, "late", now, now); // after finish: ignored
        let events = parse(&path);
        assert_eq!(events.len(), 7);
        assert_eq!(events[5]["args"]["names"], json!([odd, "b,c"]));
        assert_eq!(events[5]["name"], "allreduce x2");
        assert_eq!(events[6]["name"], "negotiate (coordinator)");
        assert_eq!(events[6]["args"]["ready"], 2);
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    #[test]
    fn negotiation_span_names_every_ranks_ready_time_and_the_last() {
        let path = temp("neg");
        let t = Timeline::create(&path, 1).unwrap();
        let learned = Instant::now() + Duration::from_millis(50);
        let at = |ms| {
            Some(ReadyAt {
                learned,
                age: Duration::from_millis(ms),
            })
        };
        // Rank 1 became ready last (the smallest age); rank 2 is unknown (e.g. joined).
        t.negotiated("w".into(), vec![at(30), at(2), None], learned);
        assert!(t.finish(STOP_WAIT));
        let events = parse(&path);
        let b = events.iter().find(|e| e["ph"] == "b").unwrap();
        let e = events.iter().find(|e| e["ph"] == "e").unwrap();
        assert_eq!(
            (b["name"].as_str(), b["cat"].as_str()),
            (Some("w"), Some("negotiate"))
        );
        assert_eq!(b["id"], e["id"]);
        assert_eq!(b["args"]["last_ready_rank"], 1);
        let ready = b["args"]["ready_us"].as_object().unwrap();
        assert_eq!(ready.len(), 2, "{ready:?}");
        let (r0, r1) = (ready["0"].as_f64().unwrap(), ready["1"].as_f64().unwrap());
        assert!((r1 - r0 - 28_000.0).abs() < 1.0, "{r0} {r1}");
        assert_eq!(
            b["ts"].as_f64().unwrap(),
            r0,
            "the span starts at the first ready time"
        );
        assert!(e["ts"].as_f64().unwrap() >= r1);
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    /// A writer that cannot keep up makes the engine's threads drop events, never wait.
    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let path = temp("full");
        let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(0);
        let t = Arc::new(Timeline::open(&path, 1, 4, Some(gate_rx)).unwrap());
        // The writer is held at its gate: the queue fills after 4 events. The emitting thread
        // must finish all 100 calls without the writer ever running.
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let t2 = Arc::clone(&t);
        std::thread::spawn(move || {
            let now = Instant::now();
            for _ in 0..100 {
                t2.span(1, "pack", now, now);
            }
            let _ = done_tx.send(());
        });
        done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("emitting blocked on a full queue");
        assert_eq!(t.dropped(), 96);
        drop(gate_tx);
        assert!(t.finish(STOP_WAIT));
        let events = parse(&path);
        assert_eq!(events.iter().filter(|e| e["name"] == "pack").count(), 4);
        let notice = events.last().unwrap();
        assert_eq!(notice["args"]["dropped"], 96, "{notice}");
        assert!(notice["name"]
            .as_str()
            .unwrap()
            .contains("96 events dropped"));
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    /// A file that cannot be written ends the timeline: events are refused from then on.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_write_error_ends_the_timeline() {
        let Ok(t) = Timeline::create(Path::new("/dev/full"), 1) else {
            return; // no /dev/full here: nothing to test
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while t.is_live() {
            assert!(
                Instant::now() < deadline,
                "a write error did not end the timeline"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(t.shared.dead.load(Ordering::Relaxed));
        assert!(t.finish(STOP_WAIT));
    }
}
