//! The flight recorder: every rank keeps its last operations (a few thousand: name, kind,
//! dtype, shape and bytes, when each was submitted, negotiated, started on its channel and
//! done, the channel, the ranks it waited on in a stall, the outcome) in memory, always, and
//! writes them out when something goes wrong: a stall warning, the engine stopping on an
//! error (a fault, a lost rank, a timeout), or on request (`fasthorovod` on `SIGUSR1`,
//! [`crate::Engine::write_flight_record`]).
//!
//! **Cost.** The ring is allocated once, at start-up (`Recorder::new`): a slot per operation,
//! reused round the ring, with the shape kept inline (up to [`MAX_DIMS`] dimensions) and the
//! name shared with the request (`Arc<str>`, a reference count). Recording an operation
//! allocates nothing (only a failed one keeps its error's text); each step takes an uncontended
//! lock for a few stores. `FH_FLIGHT_RECORDS=0` turns it off.
//!
//! **Files.** [`dump`] writes one JSON file per rank, `rank-R.json`, in the flight directory
//! (`FH_FLIGHT_DIR`; fhrun sets one per job and gathers them; else a private directory under
//! the system's temporary directory), replacing the rank's previous one; [`explain`] reads a
//! directory of them and names the first divergence across ranks.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use fh_core::message::{CollectiveKind, Request};
use fh_core::DType;

use crate::SchedulerError;

pub mod dump;
pub mod explain;

pub use dump::{Dump, OpRecord};

/// Dimensions of a shape kept per record (the rest are left out, and the record says how many
/// dimensions there were).
pub const MAX_DIMS: usize = 6;

/// Operations kept per rank unless `FH_FLIGHT_RECORDS` says otherwise.
pub const DEFAULT_RECORDS: usize = 4096;

/// How an operation ended, so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Outcome {
    #[default]
    Pending,
    Ok,
    Failed {
        message: Arc<str>,
        lost_rank: Option<usize>,
    },
}

/// One operation's record.
#[derive(Clone)]
struct Slot {
    /// The operation's sequence number on this rank (from 1; 0: empty slot).
    seq: u64,
    name: Option<Arc<str>>,
    kind: CollectiveKind,
    dtype: DType,
    shape: [u64; MAX_DIMS],
    ndim: usize,
    bytes: u64,
    submitted: Instant,
    negotiated: Option<Instant>,
    /// The negotiation round that agreed it (the same on every rank).
    round: Option<u64>,
    started: Option<Instant>,
    done: Option<Instant>,
    channel: Option<u16>,
    /// The ranks a stall found lacking it, while it waited for them (engine ranks).
    waiting_on: Option<Arc<[u32]>>,
    outcome: Outcome,
}

impl Slot {
    fn empty(at: Instant) -> Self {
        Slot {
            seq: 0,
            name: None,
            kind: CollectiveKind::Allreduce,
            dtype: DType::U8,
            shape: [0; MAX_DIMS],
            ndim: 0,
            bytes: 0,
            submitted: at,
            negotiated: None,
            round: None,
            started: None,
            done: None,
            channel: None,
            waiting_on: None,
            outcome: Outcome::Pending,
        }
    }
}

struct Ring {
    slots: Box<[Slot]>,
    /// The sequence number the next operation gets.
    next: u64,
}

impl Ring {
    /// The slot of operation `seq`, while the ring still holds it.
    fn get(&mut self, seq: u64) -> Option<&mut Slot> {
        if seq == 0 || self.slots.is_empty() {
            return None;
        }
        let i = (seq % self.slots.len() as u64) as usize;
        self.slots.get_mut(i).filter(|s| s.seq == seq)
    }
}

/// A rank's flight recorder (see the module). Shared by the engine's threads.
pub(crate) struct Recorder {
    ring: Mutex<Ring>,
    /// `Instant` and wall clock read together, to turn one into the other in a dump.
    origin: Instant,
    origin_unix_us: i64,
}

/// Microseconds since the Unix epoch, now.
pub(crate) fn unix_micros(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

impl Recorder {
    /// A recorder keeping the last `capacity` operations (0: records nothing).
    pub(crate) fn new(capacity: usize) -> Self {
        let origin = Instant::now();
        let origin_unix_us = unix_micros(SystemTime::now());
        Recorder {
            ring: Mutex::new(Ring {
                slots: vec![Slot::empty(origin); capacity].into_boxed_slice(),
                next: 1,
            }),
            origin,
            origin_unix_us,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether it records anything.
    pub(crate) fn enabled(&self) -> bool {
        !self.lock().slots.is_empty()
    }

    /// An operation was submitted at `at`: its record number (0 when nothing is recorded).
    pub(crate) fn submitted(&self, req: &Request, at: Instant) -> u64 {
        let mut ring = self.lock();
        let cap = ring.slots.len() as u64;
        if cap == 0 {
            return 0;
        }
        let seq = ring.next;
        ring.next += 1;
        let slot = &mut ring.slots[(seq % cap) as usize];
        slot.seq = seq;
        slot.name = Some(Arc::clone(&req.name));
        slot.kind = req.sig.kind;
        slot.dtype = req.sig.dtype;
        slot.ndim = req.sig.shape.len();
        slot.shape = [0; MAX_DIMS];
        for (d, &n) in slot.shape.iter_mut().zip(&req.sig.shape) {
            *d = n;
        }
        slot.bytes = req.sig.bytes();
        slot.submitted = at;
        slot.negotiated = None;
        slot.round = None;
        slot.started = None;
        slot.done = None;
        slot.channel = None;
        slot.waiting_on = None;
        slot.outcome = Outcome::Pending;
        seq
    }

    /// Operation `seq` was agreed ready on every rank in negotiation round `round`.
    pub(crate) fn negotiated(&self, seq: u64, round: u64, at: Instant) {
        if let Some(s) = self.lock().get(seq) {
            s.negotiated = Some(at);
            s.round = Some(round);
        }
    }

    /// A fused group holding operations `seqs` started on `channel` at `at` (an operation
    /// split over several groups keeps its first start).
    pub(crate) fn started(&self, seqs: impl Iterator<Item = u64>, channel: usize, at: Instant) {
        let mut ring = self.lock();
        for seq in seqs {
            if let Some(s) = ring.get(seq) {
                if s.started.is_none() {
                    s.started = Some(at);
                    s.channel = u16::try_from(channel).ok();
                }
            }
        }
    }

    /// Operation `seq` ended at `at`, well or with `err`.
    pub(crate) fn finished(&self, seq: u64, at: Instant, err: Option<&SchedulerError>) {
        if seq == 0 {
            return;
        }
        // The error's text is made before taking the lock (the one allocation, on failure).
        let outcome = match err {
            None => Outcome::Ok,
            Some(e) => Outcome::Failed {
                message: e.to_string().into(),
                lost_rank: e.lost_rank(),
            },
        };
        if let Some(s) = self.lock().get(seq) {
            s.done = Some(at);
            s.outcome = outcome;
        }
    }

    /// A stall found the ranks `ranks` lacking operation `seq`, which waits for them.
    pub(crate) fn waiting_on(&self, seq: u64, ranks: &[usize]) {
        let ranks: Arc<[u32]> = ranks.iter().map(|&r| r as u32).collect();
        if let Some(s) = self.lock().get(seq) {
            s.waiting_on = Some(ranks);
        }
    }

    /// The records, oldest first, as written to a dump (`world_rank` maps engine ranks).
    pub(crate) fn records(&self, world_rank: impl Fn(usize) -> usize) -> (u64, Vec<OpRecord>) {
        let slots: Vec<Slot> = {
            let ring = self.lock();
            let mut v: Vec<Slot> = ring.slots.iter().filter(|s| s.seq != 0).cloned().collect();
            drop(ring);
            v.sort_by_key(|s| s.seq);
            v
        };
        let total = slots.last().map_or(0, |s| s.seq);
        let us = |t: Instant| {
            let d = |a: Instant, b: Instant| {
                i64::try_from(a.saturating_duration_since(b).as_micros()).unwrap_or(i64::MAX)
            };
            if t >= self.origin {
                self.origin_unix_us.saturating_add(d(t, self.origin))
            } else {
                self.origin_unix_us.saturating_sub(d(self.origin, t))
            }
        };
        let records = slots
            .into_iter()
            .map(|s| {
                let (outcome, error, lost_rank) = match s.outcome {
                    Outcome::Pending => ("pending", None, None),
                    Outcome::Ok => ("ok", None, None),
                    Outcome::Failed { message, lost_rank } => {
                        ("error", Some(message.to_string()), lost_rank)
                    }
                };
                OpRecord {
                    seq: s.seq,
                    name: s.name.as_deref().unwrap_or("").to_string(),
                    kind: s.kind.name().to_string(),
                    dtype: s.dtype.to_string(),
                    shape: s.shape[..s.ndim.min(MAX_DIMS)].to_vec(),
                    ndim: s.ndim,
                    bytes: s.bytes,
                    submitted_us: us(s.submitted),
                    negotiated_us: s.negotiated.map(us),
                    round: s.round,
                    started_us: s.started.map(us),
                    done_us: s.done.map(us),
                    channel: s.channel,
                    waiting_on: s
                        .waiting_on
                        .map(|w| w.iter().map(|&r| world_rank(r as usize)).collect())
                        .unwrap_or_default(),
                    outcome: outcome.to_string(),
                    error,
                    lost_rank: lost_rank.map(&world_rank),
                }
            })
            .collect();
        (total, records)
    }
}

/// What recording costs: the mean time of one operation's four recorded steps (submitted,
/// negotiated, started on a channel, done) on this thread, over `ops` operations through a
/// recorder of the default size. For `fh-bench --flight-cost`; the engine pays it once per
/// operation, on three threads.
pub fn recording_cost(ops: usize) -> std::time::Duration {
    use fh_core::message::{Device, Signature};
    let rec = Recorder::new(DEFAULT_RECORDS);
    let reqs: Vec<Request> = (0..64)
        .map(|i| Request {
            name: Arc::from(format!("layer{i}.weight.grad")),
            rank: 0,
            sig: Signature {
                kind: CollectiveKind::Allreduce,
                dtype: DType::F32,
                shape: vec![1024, 64],
                device: Device::Cpu,
                op: fh_core::ReduceOp::Average,
                root: 0,
                prescale: 1.0,
                postscale: 1.0,
            },
            priority: 0,
            group: None,
        })
        .collect();
    let start = Instant::now();
    for i in 0..ops.max(1) {
        let now = Instant::now();
        let seq = rec.submitted(&reqs[i % reqs.len()], now);
        rec.negotiated(seq, i as u64, now);
        rec.started(std::iter::once(seq), i % 4, now);
        rec.finished(seq, Instant::now(), None);
    }
    start.elapsed() / ops.max(1) as u32
}

#[cfg(test)]
mod tests;
