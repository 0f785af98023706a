//! State shared by the public API (engine), the control thread (control) and the channel
//! workers (exec): submissions on their way in, the gate that closes on shutdown, counters,
//! reports and the timeline. It imports none of those modules, so they form no cycle.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Instant, SystemTime};

use crossbeam_channel::Sender;
use fh_core::message::Request;

use crate::flight::dump::{self, Dump, StallDump};
use crate::flight::Recorder;
use crate::handle::{Assist, Completion, OpResult};
use crate::stats::{Counters, GroupRecord, StallReport};
use crate::timeline::Timeline;
use crate::{Config, SchedulerError, Tensor};

/// A submitted operation before negotiation.
pub(crate) struct Entry {
    pub req: Request,
    pub tensor: Tensor,
    pub splits: Option<Vec<usize>>,
    pub cell: Resolver,
    pub submitted: Instant,
}

pub(crate) enum Msg {
    Submit(Box<Entry>),
    Join(Resolver),
    /// Shut down, with the reason the others are told (`None`: none given).
    Shutdown(Option<String>),
    Wake,
}

pub(crate) struct Gate {
    pub(crate) closed: Option<SchedulerError>,
    pub(crate) tx: Sender<Msg>,
    /// Completions dropped unresolved while the engine was running: resolved with the stop
    /// reason when the gate closes ([`Inner::close`]); the control thread stops the engine
    /// as soon as it sees one (a lost result is an internal error, never a silent wait).
    pub(crate) orphans: Vec<(Arc<str>, Arc<Completion>)>,
    /// The resolvers of groups whose ranks agreed, in the group's own allreduce, that one of
    /// them cannot run it ([`crate::job::Job::agree`]): the agreed fault is on its way and
    /// stops the engine; they resolve with its error when the gate closes.
    pub(crate) held: Vec<Resolver>,
}

/// The engine's side of one submitted operation: whoever holds it owns the operation's
/// completion, and it resolves the caller's [`crate::Handle`] exactly once.
///
/// [`Resolver::resolve`] delivers the result. A resolver dropped unresolved (work taken for a
/// round that failed, a job dropped by a channel that stopped or panicked, an entry left in a
/// queue) resolves its handle with the engine's stop reason: at once when the engine has
/// stopped, else when it stops, which the control thread brings about as soon as it sees the
/// orphan. So no path, early return or panic between submission and completion can leave a
/// `wait` blocked.
pub(crate) struct Resolver {
    name: Arc<str>,
    cell: Option<Arc<Completion>>,
    inner: Weak<Inner>,
    /// Whether the name is in [`Inner::in_flight`] and counts as a completed operation (not so
    /// for `join`).
    tracked: bool,
    /// Handed to the control thread ([`Resolver::arm`]): from then on a drop unresolved is an
    /// orphan. Before, the submission is being built or refused and its handle never reaches
    /// the caller.
    armed: bool,
    /// The operation's flight-recorder number (0: none), whose end the resolution records.
    rec: u64,
}

impl Resolver {
    /// The resolver of `cell` for an operation named `name` on the engine `inner`.
    pub(crate) fn new(inner: &Arc<Inner>, name: Arc<str>, cell: Arc<Completion>) -> Self {
        Resolver {
            name,
            cell: Some(cell),
            inner: Arc::downgrade(inner),
            tracked: true,
            armed: false,
            rec: 0,
        }
    }

    /// A resolver for an operation that has no name in flight (`join`).
    pub(crate) fn untracked(inner: &Arc<Inner>, name: Arc<str>, cell: Arc<Completion>) -> Self {
        let mut r = Resolver::new(inner, name, cell);
        r.tracked = false;
        r
    }

    /// Mark the submission as handed to the control thread (see `armed`).
    pub(crate) fn arm(&mut self) {
        self.armed = true;
    }

    /// The operation's flight-recorder number (0: none).
    pub(crate) fn record(&self) -> u64 {
        self.rec
    }

    /// Set the operation's flight-recorder number (the control thread, on accepting it).
    pub(crate) fn set_record(&mut self, rec: u64) {
        self.rec = rec;
    }

    /// Deliver the result (the name leaves the in-flight set first).
    pub(crate) fn resolve(mut self, result: OpResult) {
        if let Some(cell) = self.cell.take() {
            deliver(
                self.inner.upgrade().as_deref(),
                &self.name,
                &cell,
                (self.tracked, self.rec),
                result,
            );
        }
    }
}

impl Resolver {
    /// Complete a submission that was refused (its handle never reached the caller, and its
    /// name was not put in flight for it): the cell gets `err`, the in-flight set is left
    /// alone.
    pub(crate) fn refuse(mut self, err: SchedulerError) {
        if let Some(cell) = self.cell.take() {
            cell.complete(Err(err));
        }
    }
}

/// `(tracked, rec)`: whether the name is in flight, and its flight-recorder number.
fn deliver(
    inner: Option<&Inner>,
    name: &str,
    cell: &Completion,
    (tracked, rec): (bool, u64),
    r: OpResult,
) {
    match inner {
        Some(inner) if tracked => inner.finish(name, cell, rec, r),
        _ => cell.complete(r),
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        let Some(cell) = self.cell.take() else {
            return;
        };
        if !self.armed {
            cell.complete(Err(SchedulerError::InvalidArgument(format!(
                "'{}' was never submitted",
                self.name
            ))));
            return;
        }
        let Some(inner) = self.inner.upgrade() else {
            cell.complete(Err(SchedulerError::ShutDown {
                reason: format!("the engine is gone; '{}' was never run", self.name),
            }));
            return;
        };
        let mut g = lock(&inner.gate);
        match g.closed.clone() {
            Some(err) => {
                drop(g);
                deliver(
                    Some(&inner),
                    &self.name,
                    &cell,
                    (self.tracked, self.rec),
                    Err(err),
                );
            }
            None => {
                // The engine still runs: park it; the control thread stops the engine and
                // the close resolves it with the stop reason.
                g.orphans.push((Arc::clone(&self.name), cell));
                inner.wake(&g);
            }
        }
    }
}

/// State shared by the public API, the control thread and the channel workers.
pub(crate) struct Inner {
    pub rank: usize,
    pub size: usize,
    /// Each rank's world rank, for an engine over a process set (errors name world ranks).
    pub world_ranks: Option<Arc<[usize]>>,
    /// The pacing policy (back-pressure) this world runs under, resolved once at start-up
    /// from the configuration, the world size and the data channels' wire (agreed).
    pub pacing: fh_core::fusion::Pacing,
    pub config: Config,
    pub(crate) gate: Mutex<Gate>,
    /// Names submitted and not yet finished (shared with their requests: no copies).
    pub(crate) in_flight: Mutex<HashSet<Arc<str>>>,
    pub counters: Counters,
    pub(crate) stalls: Mutex<Vec<StallReport>>,
    pub(crate) barrier_seq: AtomicU64,
    pub(crate) groups: Mutex<Vec<GroupRecord>>,
    pub(crate) timeline: RwLock<Option<Arc<Timeline>>>,
    /// The GPU path: the device the channels drive, or why there is none.
    pub(crate) gpu: crate::gpu::GpuState,
    /// The control thread is deferring a round under back-pressure: a channel that drains
    /// wakes it ([`Inner::channel_drained`]).
    pub(crate) pacing_wait: AtomicBool,
    /// What a stop because of a lost rank sets off at once ([`Inner::fail`], [`Inner::close`]).
    pub(crate) on_loss: OnLoss,
    /// Called on the control thread when a stall names this rank as missing tensors.
    pub(crate) culprit_hook: RwLock<Option<CulpritHook>>,
    /// The flight recorder: this rank's last operations.
    pub(crate) flight: Recorder,
    /// Rank 0 has said where the flight records go (once per engine).
    pub(crate) flight_told: AtomicBool,
    /// This rank and its clock's offset from rank 0's, for the timelines it writes.
    pub(crate) clock: crate::timeline::Identity,
    /// Where the control thread idles, so that a waiting caller may run its round
    /// (`control::helper`); rung after every message sent to the control thread.
    pub(crate) assist: Arc<dyn Assist>,
}

/// What the engine does the moment it stops because a rank was lost, from whichever thread
/// finds it: every channel (and the control thread) blocked on a peer is interrupted, so
/// that its error comes now rather than a timeout later; and the world's engine tells the
/// other ranks through the heartbeats, so that every rank names the same rank.
#[derive(Default)]
pub(crate) struct OnLoss {
    /// The interrupts of the control communicator and of every data channel's.
    pub(crate) interrupts: Vec<fh_transport::Interrupt>,
    /// The world's liveness watch (the world's engine only; a process set's engine names its
    /// losses through the world's).
    pub(crate) watch: Option<fh_transport::liveness::Watch>,
}

impl OnLoss {
    fn fire(&self, err: &SchedulerError) {
        let Some(lost) = err.lost_rank() else {
            return;
        };
        let why = format!("the engine stopped: {err}");
        for i in &self.interrupts {
            i.raise(Some(lost), why.clone());
        }
        if let Some(w) = &self.watch {
            w.declare(lost, err.to_string());
        }
    }
}

/// What a rank runs when the stall inspector names it as missing tensors (see
/// [`crate::Engine::set_culprit_hook`]).
pub type CulpritHook = Arc<dyn Fn(&StallReport) + Send + Sync>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    /// Wake the control thread (`g`: this engine's gate, locked): a [`Msg::Wake`] on its queue
    /// for a thread asleep on it, and the helper's bell for one parked there while callers run
    /// the rounds (`control::helper`).
    fn wake(&self, g: &Gate) {
        let _ = g.tx.send(Msg::Wake);
        self.assist.ring();
    }

    /// The job's (world) rank of this engine's rank `r`: itself, except in a process set's
    /// engine, whose ranks are its members numbered `0..n`. Messages name world ranks.
    pub(crate) fn world_rank(&self, r: usize) -> usize {
        self.world_ranks
            .as_ref()
            .and_then(|w| w.get(r).copied())
            .unwrap_or(r)
    }

    /// Write this rank's flight record (see [`crate::flight`]) for `reason`; returns where.
    /// A process set's engine writes in its set's subdirectory ([`dump::set_dir_name`]), as
    /// its world rank. Nothing is written when the recorder is off. Rank 0 (of the world, or
    /// of the set) says once where the records go.
    pub(crate) fn write_flight(&self, reason: &str) -> std::io::Result<Option<PathBuf>> {
        if !self.flight.enabled() {
            return Ok(None);
        }
        let (dir, private) = match &self.config.flight_dir {
            Some(d) => (d.clone(), false),
            None => (dump::default_dir(), true),
        };
        let members: Option<Vec<usize>> = self.world_ranks.as_ref().map(|w| {
            let mut m = w.to_vec();
            m.sort_unstable();
            m
        });

        let (recorded, ops) = self.flight.records(|r| self.world_rank(r));
        let stall = lock(&self.stalls).last().map(|r| StallDump {
            lacking: r.lacking.clone(),
            waited_ms: u64::try_from(r.waited.as_millis()).unwrap_or(u64::MAX),
        });
        let d = Dump {
            format: dump::FORMAT.into(),
            rank: self.world_rank(self.rank),
            size: self.size,
            reason: reason.to_string(),
            written_unix_us: crate::flight::unix_micros(SystemTime::now()),
            capacity: self.config.flight_records,
            recorded,
            stall,
            stopped: self.failure().map(|e| e.to_string()),
            ops,
            members,
        };
        let path = dump::write(&dir, private, &d)?;
        if self.rank == 0 && !self.flight_told.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "flight records (a file per rank) are written to {}; `fhrun --explain {}` or \
                 `python -m fasthorovod.explain {}` names the first divergence across ranks",
                dir.display(),
                dir.display(),
                dir.display()
            );
        }
        Ok(Some(path))
    }

    /// [`Inner::write_flight`], a failure said in the log (never an error of the caller's).
    pub(crate) fn dump_flight(&self, reason: &str) {
        if let Err(e) = self.write_flight(reason) {
            tracing::warn!(rank = self.rank, error = %e, "cannot write the flight record");
        }
    }

    /// The culprit hook, if one is set.
    pub(crate) fn culprit_hook(&self) -> Option<CulpritHook> {
        self.culprit_hook
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The timeline being written, if any (rank 0 only).
    pub(crate) fn timeline(&self) -> Option<Arc<Timeline>> {
        self.timeline
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Put `t` in place of the timeline being written and return the one it replaces (for
    /// the caller to [`Timeline::finish`]).
    pub(crate) fn replace_timeline(&self, t: Option<Arc<Timeline>>) -> Option<Arc<Timeline>> {
        std::mem::replace(
            &mut *self.timeline.write().unwrap_or_else(|p| p.into_inner()),
            t,
        )
    }

    /// Drop the timeline `t` if it is still the one being written (it ended on a write
    /// error); a timeline started meanwhile stays.
    pub(crate) fn clear_timeline_if(&self, t: &Arc<Timeline>) {
        let mut cur = self.timeline.write().unwrap_or_else(|p| p.into_inner());
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, t)) {
            *cur = None;
        }
    }

    /// Stop writing the timeline, if one is written: drain its queue, close the file and
    /// join its writer (bounded by [`crate::timeline::STOP_WAIT`]).
    pub(crate) fn finish_timeline(&self) {
        if let Some(t) = self.replace_timeline(None) {
            t.finish(crate::timeline::STOP_WAIT);
        }
    }

    /// The reason the engine stopped, if it has.
    pub(crate) fn failure(&self) -> Option<SchedulerError> {
        lock(&self.gate).closed.clone()
    }

    /// Stop the engine with `err` (first reason wins) and wake the control thread; a first
    /// reason that names a lost rank interrupts every communicator of the engine at once
    /// ([`OnLoss`]).
    pub(crate) fn fail(&self, err: SchedulerError) {
        let (orphans, first, held) = {
            let mut g = lock(&self.gate);
            let first = g.closed.is_none().then(|| err.clone());
            if first.is_some() {
                g.closed = Some(err);
            }
            self.wake(&g);
            (
                std::mem::take(&mut g.orphans),
                first,
                std::mem::take(&mut g.held),
            )
        };
        if let Some(err) = first {
            self.on_loss.fire(&err);
        }
        self.resolve_orphans(orphans);
        // Outside the lock: each resolves its handle with the stop reason as it drops.
        drop(held);
    }

    /// Keep `resolvers` until the engine stops (see [`Gate::held`]); at once resolved with the
    /// stop reason when it has stopped already.
    pub(crate) fn hold(&self, resolvers: impl IntoIterator<Item = Resolver>) {
        let resolvers: Vec<Resolver> = resolvers.into_iter().collect();
        let mut g = lock(&self.gate);
        if g.closed.is_none() {
            g.held.extend(resolvers);
            return;
        }
        drop(g);
        // Outside the lock: each resolves its handle with the stop reason as it drops.
        drop(resolvers);
    }

    /// The first completion dropped unresolved while the engine runs, if any (the control
    /// thread then stops the engine).
    pub(crate) fn orphaned(&self) -> Option<Arc<str>> {
        lock(&self.gate).orphans.first().map(|(n, _)| Arc::clone(n))
    }

    fn resolve_orphans(&self, orphans: Vec<(Arc<str>, Arc<Completion>)>) {
        if orphans.is_empty() {
            return;
        }
        let err = self.failure().unwrap_or_else(|| SchedulerError::ShutDown {
            reason: "the engine stopped".into(),
        });
        for (name, cell) in orphans {
            self.finish(&name, &cell, 0, Err(err.clone()));
        }
    }

    /// A channel has just finished all its queued work: wake the control thread if it defers
    /// a round until a channel is free.
    pub(crate) fn channel_drained(&self) {
        // Pairs with the fence in the control thread's pacing wait: either it sees this
        // channel's drained counter, or this sees its announcement and wakes it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.pacing_wait.swap(false, Ordering::SeqCst) {
            self.wake(&lock(&self.gate));
        }
    }

    /// Deliver a result: the name leaves the in-flight set first, so that it can be submitted
    /// again as soon as the caller has the result.
    pub(crate) fn finish(&self, name: &str, cell: &Completion, rec: u64, result: OpResult) {
        if rec != 0 {
            self.flight
                .finished(rec, Instant::now(), result.as_ref().err());
        }
        lock(&self.in_flight).remove(name);
        Counters::add(&self.counters.completed, 1);
        cell.complete(result);
    }

    pub(crate) fn record_stall(&self, r: StallReport) {
        Counters::add(&self.counters.stall_warnings, 1);
        lock(&self.stalls).push(r);
    }

    pub(crate) fn record_group(&self, g: GroupRecord) {
        lock(&self.groups).push(g);
    }

    /// Submit entries atomically: either every one is accepted (in order) or none is, so that
    /// a refused member of a grouped submission leaves no other member in flight.
    pub(crate) fn submit(&self, entries: Vec<Entry>) -> Result<(), SchedulerError> {
        let g = lock(&self.gate);
        let refused = match &g.closed {
            Some(e) => Some(e.clone()),
            None => self.reserve_names(&entries).err(),
        };
        if let Some(err) = refused {
            // Resolvers take the gate's lock when dropped: let go of it first.
            drop(g);
            for e in entries {
                e.cell.refuse(err.clone());
            }
            return Err(err);
        }
        let mut rest = entries.into_iter();
        let mut sent: Vec<Arc<str>> = Vec::new();
        while let Some(mut e) = rest.next() {
            e.cell.arm();
            let name = Arc::clone(&e.req.name);
            if let Err(failed) = g.tx.send(Msg::Submit(Box::new(e))) {
                // The control thread is gone: nothing sent will ever run.
                drop(g);
                let err = SchedulerError::ShutDown {
                    reason: "the control thread is gone".into(),
                };
                let mut in_flight = lock(&self.in_flight);
                for n in sent.iter().chain(std::iter::once(&name)) {
                    in_flight.remove(&**n);
                }
                for e in rest.by_ref() {
                    in_flight.remove(&*e.req.name);
                    e.cell.refuse(err.clone());
                }
                drop(in_flight);
                if let Msg::Submit(e) = failed.0 {
                    e.cell.refuse(err.clone());
                }
                return Err(err);
            }
            sent.push(name);
        }
        self.assist.ring_submitted();
        Ok(())
    }

    /// Put the entries' names in flight, or refuse them all when one is in flight already
    /// (or named twice among them).
    fn reserve_names(&self, entries: &[Entry]) -> Result<(), SchedulerError> {
        let mut in_flight = lock(&self.in_flight);
        for (i, e) in entries.iter().enumerate() {
            let name = &e.req.name;
            if in_flight.contains(name) || entries[..i].iter().any(|o| &o.req.name == name) {
                return Err(SchedulerError::DuplicateName {
                    name: name.to_string(),
                });
            }
        }
        for e in entries {
            in_flight.insert(Arc::clone(&e.req.name));
        }
        Ok(())
    }

    pub(crate) fn send(&self, msg: Msg) -> Result<(), SchedulerError> {
        let g = lock(&self.gate);
        if let Some(e) = &g.closed {
            return Err(e.clone());
        }
        let failed = g.tx.send(msg).err();
        self.assist.ring();
        // A message that holds a resolver is dropped only after the gate's lock (its drop
        // takes the lock).
        drop(g);
        match failed {
            None => Ok(()),
            Some(m) => {
                drop(m);
                Err(SchedulerError::ShutDown {
                    reason: "the control thread is gone".into(),
                })
            }
        }
    }

    /// Close the gate (no more submissions) and resolve every completion parked as an
    /// orphan with the stop reason (the first reason wins).
    pub(crate) fn close(&self, err: SchedulerError) {
        let (orphans, first, held) = {
            let mut g = lock(&self.gate);
            let first = g.closed.is_none().then(|| err.clone());
            if first.is_some() {
                g.closed = Some(err);
            }
            (
                std::mem::take(&mut g.orphans),
                first,
                std::mem::take(&mut g.held),
            )
        };
        if let Some(err) = first {
            self.on_loss.fire(&err);
        }
        self.resolve_orphans(orphans);
        // Outside the lock: each resolves its handle with the stop reason as it drops.
        drop(held);
    }
}
