//! The timeline's writer thread: turns event records into Chrome trace events with
//! `serde_json` and writes them in batches, keeping the file a valid JSON array.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use serde::Serialize;

use super::{Identity, Record, Shared};

/// How often the writer takes what has queued up while events keep coming (it sleeps in
/// between, so that handing it an event never has to wake a thread).
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// The writer's longest sleep while no events come (it sleeps longer the longer it is idle).
pub(super) const IDLE_WAKE: Duration = Duration::from_secs(1);

/// Most bytes of events the writer collects before writing them out.
pub(super) const MAX_BATCH_BYTES: usize = 1 << 20;

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
pub(super) enum Args<'a> {
    None,
    /// Metadata: a lane name.
    Label {
        name: &'a str,
    },
    /// Metadata: the process (the rank) and its clock, for [`super::merge`].
    Process {
        name: &'a str,
        rank: usize,
        origin_unix_us: i64,
        offset_us: i64,
    },
    /// A negotiation round.
    Round {
        ready: usize,
    },
    /// A fused group: its tensors, bytes, and the rate it moved them at (GB/s of payload).
    Group {
        names: &'a [String],
        bytes: usize,
        gb_per_s: f64,
    },
    /// A span of the framework's side.
    Framework {
        detail: &'a str,
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

/// The writer thread's side: the buffered file and the position in the array.
pub(super) struct Writer {
    pub(super) file: File,
    /// Offset of the file's closing `]`, where the next batch is written.
    pub(super) end: u64,
    /// Events serialized since the last write to the file.
    pub(super) buf: Vec<u8>,
    /// No event written yet (no separator before the next).
    pub(super) first: bool,
    pub(super) start: Instant,
    /// The wall clock at `start`, in µs since the Unix epoch.
    pub(super) origin_unix_us: i64,
    /// The rank that writes, and its clock's offset from rank 0's.
    pub(super) who: Identity,
    /// The Python lane has been named (on its first span).
    pub(super) python_named: bool,
    /// Next id of a negotiation span.
    pub(super) next_id: u64,
    /// Data channels (the Python lane comes after them).
    pub(super) channels: usize,
}

/// Microseconds from `start` to `t` (0 before `start`), to the nanosecond.
pub(super) fn micros(start: Instant, t: Instant) -> f64 {
    let us = t.saturating_duration_since(start).as_secs_f64() * 1e6;
    (us * 1e3).round() / 1e3
}

/// Microseconds from `begin` to `end` (0 if `end` is earlier), to the nanosecond. Taken from
/// the interval itself, not as a difference of two [`micros`] (which is off in the last bits).
pub(super) fn span_micros(begin: Instant, end: Instant) -> f64 {
    let ns = end.saturating_duration_since(begin).as_nanos();
    ns as f64 / 1e3
}

impl Writer {
    pub(super) fn run(
        mut self,
        channels: usize,
        rx: &Receiver<Record>,
        stop_rx: &Receiver<()>,
        shared: &Shared,
    ) -> std::io::Result<()> {
        self.channels = channels;
        self.buf.push(b'[');
        let mut ev = TraceEvent::new("process_name", "M", 0);
        let name = format!("fasthorovod rank {}", self.who.rank);
        ev.args = Args::Process {
            name: &name,
            rank: self.who.rank,
            origin_unix_us: self.origin_unix_us,
            offset_us: self.who.offset_us,
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
                ev.dur = Some(span_micros(begin, end));
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
                ev.dur = Some(span_micros(begin, end));
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
                let dur = span_micros(begin, end);
                ev.dur = Some(dur);
                let gb_per_s = if dur > 0.0 {
                    ((bytes as f64 / dur / 1e3) * 1e3).round() / 1e3
                } else {
                    0.0
                };
                ev.args = Args::Group {
                    names: &names,
                    bytes,
                    gb_per_s,
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
            Record::Framework {
                name,
                detail,
                begin,
                end,
            } => {
                let lane = self.channels + 1;
                if !self.python_named {
                    self.python_named = true;
                    let mut ev = TraceEvent::new("thread_name", "M", lane);
                    ev.args = Args::Label { name: "python" };
                    self.event(&ev)?;
                }
                let mut ev = TraceEvent::new(&name, "X", lane);
                ev.ts = Some(us(begin));
                ev.dur = Some(span_micros(begin, end));
                ev.args = Args::Framework { detail: &detail };
                self.event(&ev)
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
                // Named for the rank it waited on last (the one that held it back).
                let label = match last {
                    Some((r, _)) => format!("{name} (waits on rank {r})"),
                    None => name.clone(),
                };
                let mut b = TraceEvent::new(&label, "b", 0);
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
                let mut e = TraceEvent::new(&label, "e", 0);
                e.cat = Some("negotiate");
                e.id = Some(id);
                e.ts = Some(end);
                self.event(&e)
            }
        }
    }
}
