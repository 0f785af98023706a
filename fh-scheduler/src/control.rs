//! The control thread: the loop that runs negotiation rounds and dispatches fused groups to
//! the channels. The steps a round may take live in [`crate::negotiate`].
//!
//! Every rank runs the same sequence of negotiation rounds on the control communicator. A
//! round is: one bitwise-AND allreduce of the negotiation vector (status flags + cached slots
//! pending here), then, only when a flag asks for it, the optional steps in a fixed order —
//! agreed fault (stop), readiness report (gather to rank 0, while rank 0 writes a timeline),
//! joined-rank exchange, slot invalidation, coordinator step (gather to rank 0, broadcast),
//! stall report — and finally the agreed ready list is planned (channel load carried from
//! round to round) and dispatched. Because every decision is a function of
//! the rounds' collective results, every rank takes the same steps and forms the same groups.
//! Back-pressure only delays when a rank enters its next round.
//!
//! The hot path of a small collective: a plan that is one small group of host tensors
//! (`Config::inline_bytes`, agreed at start-up) takes one more step, a one-byte AND in which
//! every rank says it can run the group, and then runs on this thread when its channel has
//! nothing queued or running (otherwise on the channel's thread, after what is queued: the
//! group, its channel and the order on the channel stay the planner's). After a round that
//! completed work, this thread polls for the next submission briefly (`Config::control_spin`)
//! before it sleeps. Cached responses and names are shared (`Arc`), so a cache hit copies
//! nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use fh_core::bitvec::{BitVec, NegotiationVec, Status};
use fh_core::cache::{Lookup, ResponseCache};
use fh_core::fusion::{plan_round_on, runs_inline, ChannelLoad, PlanItem, PlanMode, PlanOptions};
use fh_core::message::{CollectiveKind, GroupTag, Request, Response};
use fh_core::{wire, DType, ReduceOp};
use fh_transport::Communicator;

use crate::exec::{Executor, Job, Op, OpState};
use crate::handle::Completion;
use crate::negotiate::coordinator::{joins_with_zeros, Table};
use crate::negotiate::readiness::ReadyTimes;
use crate::negotiate::{collect, fault, stall};
use crate::shared::{Entry, Inner, Msg};
use crate::stats::{Counters, GroupRecord};
use crate::{Preset, SchedulerError, Tensor};

/// Longest back-off between rounds while every rank waits on another.
const MAX_BACKOFF: Duration = Duration::from_micros(500);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Announce {
    /// Not yet sent to the coordinator.
    New,
    /// Sent to the coordinator; waiting for the response.
    Sent,
    /// Ready everywhere, held until the rest of its group is ready.
    Held,
}

struct Pending {
    entry: Entry,
    state: Announce,
    /// Already in a readiness report to rank 0 (timeline).
    reported: bool,
}

/// Where a dispatched operation's tensor comes from.
enum Source {
    /// Submitted on this rank (its pending sequence number and entry).
    Submitted(u64, Pending),
    /// Zeros a joined rank contributes.
    Zeros(Tensor),
}

enum Dispatch {
    Workers {
        queues: Vec<Sender<Job>>,
        threads: Vec<JoinHandle<()>>,
        /// Each channel's executor, shared with its worker thread (same index as `queues`).
        slots: Vec<Arc<ChannelSlot>>,
    },
    Inline(Box<Executor>),
}

/// A channel's executor, run by the channel's worker thread and, for a small single-group
/// round while the channel is idle, by the control thread itself (see `Config::inline_bytes`).
/// Either way the channel's groups run one at a time in the order the control thread
/// dispatched them: the control thread runs a group only when every group it handed to the
/// worker before has finished.
struct ChannelSlot {
    exec: Mutex<Executor>,
    /// Groups handed to the worker thread and not yet finished. The worker lowers it after it
    /// has released `exec`, so at zero the control thread takes `exec` without waiting.
    outstanding: AtomicUsize,
}

impl ChannelSlot {
    /// The executor, if nobody else holds it (a poisoned lock is taken anyway: `run` leaves
    /// the executor consistent between groups).
    fn try_exec(&self) -> Option<std::sync::MutexGuard<'_, Executor>> {
        match self.exec.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// How often a rank deferring its round under back-pressure looks at its channels again
/// (besides being woken by a channel that drains).
const BACKPRESSURE_POLL: Duration = Duration::from_millis(1);

/// A zero tensor of `sig`'s dtype and shape (a joined rank's contribution), or why it cannot
/// be made; allocation failure is an error, not an abort.
fn try_zeros(sig: &fh_core::message::Signature) -> Result<Tensor, String> {
    let shape: Vec<usize> = sig
        .shape
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
        .collect();
    let bytes = shape
        .iter()
        .try_fold(sig.dtype.size(), |a, &d| a.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| format!("a zero tensor of shape {shape:?} does not fit in memory"))?;
    let mut data = Vec::new();
    data.try_reserve_exact(bytes)
        .map_err(|e| format!("cannot allocate {bytes} bytes of zeros: {e}"))?;
    data.resize(bytes, 0);
    Tensor::new(sig.dtype, shape, data).map_err(|e| e.to_string())
}

/// Test hook: `(rank, name)` pairs for which dispatch behaves as if the tensor could not be
/// made on that rank. Names are unique per test, so tests running in parallel do not meet.
#[cfg(test)]
pub(crate) static INJECTED_FAULTS: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// Test hook: `(rank, name)` pairs whose groups that rank hands to a channel thread even when
/// they could run on the control thread.
#[cfg(test)]
pub(crate) static QUEUE_ANYWAY: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// An id for a tensor's timeline track (stable per submission).
fn e_id(name: &str, submitted: Instant) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    submitted.hash(&mut h);
    h.finish() >> 11
}

pub(crate) struct Control {
    inner: Arc<Inner>,
    comm: Box<dyn Communicator>,
    rx: Receiver<Msg>,
    cache: ResponseCache,
    pending: BTreeMap<u64, Pending>,
    by_name: HashMap<Arc<str>, u64>,
    seq: u64,
    table: Table,
    dispatch: Dispatch,
    local_shutdown: bool,
    join_cells: Vec<Arc<Completion>>,
    joined: bool,
    joined_set: Vec<bool>,
    /// The rank that joined last (highest rank among those that joined in the same round).
    last_joined: Option<usize>,
    fresh: bool,
    last_progress: bool,
    backoff: Duration,
    last_round: Instant,
    last_stall_check: Instant,
    plan_opts: PlanOptions,
    /// Bytes given to each channel so far (a function of the agreed rounds only).
    load: ChannelLoad,
    /// The channels idle on every rank when this round started (agreed in the round's bit
    /// vector): the planner puts the round's fused groups there.
    idle_channels: u64,
    /// Members of grouped submissions ready everywhere, waiting for the rest of their group.
    held: BTreeMap<String, Vec<Arc<Response>>>,
    /// Groups with a failed member: the error and the members still to come.
    failed_groups: HashMap<String, (SchedulerError, u32)>,
    /// A local inconsistency met while dispatching (tensor name, what went wrong): raised in
    /// the next round so that every rank stops with the same error.
    fault: Option<(String, String)>,
    /// Rank 0 while writing a timeline: for each tensor not yet agreed, when each rank had it
    /// ready (from the readiness reports). Empty when no timeline is written.
    ready_times: ReadyTimes,
}

impl Control {
    pub(crate) fn new(
        inner: Arc<Inner>,
        comm: Box<dyn Communicator>,
        data: Vec<Box<dyn Communicator>>,
        devices: Vec<crate::gpu::DeviceChannelSlot>,
        rx: Receiver<Msg>,
    ) -> Result<Self, SchedulerError> {
        let cfg = inner.config.clone();
        inner.counters.init_channels(data.len());
        #[cfg(feature = "cuda")]
        let mut devices = devices.into_iter();
        #[cfg(not(feature = "cuda"))]
        drop(devices);
        let executors: Vec<Executor> = data
            .into_iter()
            .enumerate()
            .map(|(channel, comm)| Executor {
                comm,
                buf: Vec::new(),
                channel,
                inner: Arc::clone(&inner),
                phases: None,
                #[cfg(feature = "cuda")]
                device: devices.next(),
            })
            .collect();
        let dispatch = match cfg.preset {
            Preset::Horovod => {
                let ex = executors.into_iter().next().ok_or_else(|| {
                    SchedulerError::InvalidArgument("no data channel was opened".into())
                })?;
                Dispatch::Inline(Box::new(ex))
            }
            Preset::FastHorovod => {
                let mut queues = Vec::new();
                let mut threads = Vec::new();
                let mut slots = Vec::new();
                for ex in executors {
                    let (tx, rx) = crossbeam_channel::unbounded::<Job>();
                    let name = format!("fh-channel-{}-{}", inner.rank, ex.channel);
                    let slot = Arc::new(ChannelSlot {
                        exec: Mutex::new(ex),
                        outstanding: AtomicUsize::new(0),
                    });
                    slots.push(Arc::clone(&slot));
                    let t = std::thread::Builder::new()
                        .name(name)
                        .spawn(move || {
                            while let Ok(job) = rx.recv() {
                                crate::shared::lock(&slot.exec).run(job);
                                slot.outstanding.fetch_sub(1, Ordering::Release);
                            }
                        })
                        .map_err(|e| {
                            SchedulerError::InvalidArgument(format!("cannot spawn a thread: {e}"))
                        })?;
                    queues.push(tx);
                    threads.push(t);
                }
                Dispatch::Workers {
                    queues,
                    threads,
                    slots,
                }
            }
        };
        let plan_opts = cfg.plan_options();
        let now = Instant::now();
        Ok(Control {
            cache: ResponseCache::new(cfg.cache_capacity),
            joined_set: vec![false; inner.size],
            last_joined: None,
            ready_times: ReadyTimes::new(inner.size),
            inner,
            comm,
            rx,
            pending: BTreeMap::new(),
            by_name: HashMap::new(),
            seq: 0,
            table: Table::default(),
            dispatch,
            local_shutdown: false,
            join_cells: Vec::new(),
            joined: false,
            fresh: false,
            last_progress: false,
            backoff: Duration::from_micros(10),
            last_round: now,
            last_stall_check: now,
            plan_opts,
            load: ChannelLoad::new(plan_opts.channels),
            idle_channels: 0,
            held: BTreeMap::new(),
            failed_groups: HashMap::new(),
            fault: None,
        })
    }

    /// The thread body.
    pub(crate) fn run(mut self) {
        let outcome = self.main_loop();
        let err = match outcome {
            Ok(reason) => SchedulerError::ShutDown { reason },
            Err(e) => {
                if !e.is_shutdown() {
                    tracing::error!(rank = self.inner.rank, error = %e, "engine stopped");
                }
                e
            }
        };
        self.inner.close(err.clone());
        // Whatever was submitted and not negotiated fails now, including submissions that
        // raced with the close.
        for (_, p) in std::mem::take(&mut self.pending) {
            self.inner
                .finish(&p.entry.req.name, &p.entry.cell, Err(err.clone()));
        }
        while let Ok(msg) = self.rx.try_recv() {
            match msg {
                Msg::Submit(e) => self.inner.finish(&e.req.name, &e.cell, Err(err.clone())),
                Msg::Join(c) => c.complete(Err(err.clone())),
                Msg::Shutdown | Msg::Wake => {}
            }
        }
        for c in self.join_cells.drain(..) {
            c.complete(Err(err.clone()));
        }
        // Let the channels finish what every rank dispatched, then stop them.
        if let Dispatch::Workers {
            queues, threads, ..
        } = std::mem::replace(
            &mut self.dispatch,
            Dispatch::Workers {
                queues: Vec::new(),
                threads: Vec::new(),
                slots: Vec::new(),
            },
        ) {
            drop(queues);
            for t in threads {
                if t.join().is_err() {
                    tracing::error!(rank = self.inner.rank, "a channel thread panicked");
                }
            }
        }
        tracing::debug!(rank = self.inner.rank, "control thread stopped");
    }

    fn main_loop(&mut self) -> Result<String, SchedulerError> {
        loop {
            if let Some(e) = self.inner.failure() {
                return Err(e);
            }
            self.wait();
            if let Some(e) = self.inner.failure() {
                return Err(e);
            }
            if let Some(reason) = self.round()? {
                return Ok(reason);
            }
        }
    }

    fn accept(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(entry) => {
                self.seq += 1;
                self.by_name.insert(Arc::clone(&entry.req.name), self.seq);
                self.pending.insert(
                    self.seq,
                    Pending {
                        entry: *entry,
                        state: Announce::New,
                        reported: false,
                    },
                );
                self.fresh = true;
            }
            Msg::Join(cell) => {
                self.joined = true;
                self.join_cells.push(cell);
                self.fresh = true;
            }
            Msg::Shutdown => {
                self.local_shutdown = true;
                self.fresh = true;
            }
            Msg::Wake => {}
        }
    }

    fn drain(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            self.accept(m);
        }
    }

    fn recv_until(&mut self, deadline: Instant) -> bool {
        let now = Instant::now();
        let timeout = deadline.saturating_duration_since(now);
        match self.rx.recv_timeout(timeout) {
            Ok(m) => {
                self.accept(m);
                self.drain();
                true
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => {
                self.local_shutdown = true;
                true
            }
        }
    }

    /// Decide when to run the next round: when there is work (or a heartbeat is due), then,
    /// under back-pressure, not while every channel still holds unfinished work (bounded).
    fn wait(&mut self) {
        self.wait_for_work();
        let pacing = self.inner.config.pacing(self.inner.size);
        if !pacing.enabled {
            return;
        }
        let channels = self.inner.counters.channels().len();
        let start = Instant::now();
        loop {
            // Announce the wait before looking, so that a channel draining in between wakes us.
            self.inner.pacing_wait.store(true, Ordering::Release);
            let (busy, bytes) = self.inner.counters.channel_load();
            if self.local_shutdown
                || self.inner.failure().is_some()
                || !pacing.defer(busy, channels, bytes, start.elapsed())
            {
                break;
            }
            // Accept submissions meanwhile: they fuse into the deferred round.
            let step = (start + pacing.max_defer).min(Instant::now() + BACKPRESSURE_POLL);
            self.recv_until(step);
        }
        self.inner.pacing_wait.store(false, Ordering::Release);
    }

    /// Wait until there is something to negotiate (or a heartbeat is due).
    fn wait_for_work(&mut self) {
        let cfg = &self.inner.config;
        let cycle = cfg.cycle_time;
        let window = cfg.batching_window;
        let heartbeat = cfg.idle_heartbeat;
        let spin = cfg.control_spin;
        self.drain();
        if !cycle.is_zero() {
            // Fixed polling cycle (the Horovod schedule): a round every cycle, busy or not.
            let deadline = self.last_round + cycle;
            while Instant::now() < deadline && !self.local_shutdown {
                if !self.recv_until(deadline) {
                    break;
                }
            }
            return;
        }
        if self.fresh {
            if !window.is_zero() {
                let deadline = Instant::now() + window;
                while Instant::now() < deadline && self.recv_until(deadline) {}
            }
            return;
        }
        if !self.pending.is_empty() || self.joined {
            // Announced work is pending here. Sit in the next round (a blocking collective)
            // so that a peer's submission completes it at once; back off briefly only while
            // rounds make no progress, so ranks waiting on each other do not spin.
            if self.last_progress {
                self.backoff = Duration::from_micros(10);
                return;
            }
            let deadline = Instant::now() + self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            self.recv_until(deadline);
            return;
        }
        // Idle. Right after a round that completed work the next submission is usually close
        // (the caller's next collective): poll for it briefly, then sleep until a submission,
        // or the heartbeat.
        if self.last_progress && !spin.is_zero() && self.poll_for_work(spin) {
            return;
        }
        let deadline = Instant::now() + heartbeat;
        self.recv_until(deadline);
    }

    /// Channel bits in the round's vector: one per data channel under the FastHorovod planner
    /// (the same count on every rank: it is part of the start-up agreement), none otherwise.
    fn channel_bits(&self) -> usize {
        match self.plan_opts.mode {
            PlanMode::Fast => self.plan_opts.channels,
            PlanMode::Horovod => 0,
        }
    }

    /// Poll the submission queue for at most `limit` (yielding the core between short bursts,
    /// since ranks may share cores); whether something arrived.
    fn poll_for_work(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match self.rx.try_recv() {
                Ok(m) => {
                    self.accept(m);
                    self.drain();
                    return true;
                }
                Err(TryRecvError::Disconnected) => {
                    self.local_shutdown = true;
                    return true;
                }
                Err(TryRecvError::Empty) => {}
            }
            polls = polls.wrapping_add(1);
            if polls % 16 == 0 {
                if start.elapsed() >= limit {
                    return false;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn add_bytes(&self, n: usize) {
        Counters::add(&self.inner.counters.negotiation_bytes_sent, n as u64);
    }

    /// One negotiation round. Returns `Some(reason)` when the job shuts down.
    fn round(&mut self) -> Result<Option<String>, SchedulerError> {
        let start = Instant::now();
        self.last_round = start;
        self.fresh = false;
        let size = self.inner.size;
        let span = tracing::trace_span!("round", rank = self.inner.rank);
        let _g = span.enter();

        // 1. Classify what is pending here.
        let cap = self.cache.capacity();
        let channel_bits = self.channel_bits();
        let mut vec = NegotiationVec::with_channels(cap, channel_bits);
        for (c, ch) in self.inner.counters.channels().iter().enumerate() {
            vec.set_idle(c, ch.queued.load(Ordering::Relaxed) == 0);
        }
        let mut uncached = false;
        let mut invalid = Vec::new();
        let mut oldest = Duration::ZERO;
        for p in self.pending.values() {
            oldest = oldest.max(start.saturating_duration_since(p.entry.submitted));
            if p.state == Announce::Held {
                continue;
            }
            match self.cache.lookup(
                &p.entry.req.name,
                &p.entry.req.sig,
                p.entry.req.group.as_ref(),
            ) {
                Lookup::Hit(slot) => vec.set_slot(slot, true),
                Lookup::Changed(slot) => invalid.push(slot),
                Lookup::Miss => uncached |= p.state == Announce::New,
            }
        }
        if self.joined {
            // A joined rank is ready for every cached allreduce its zeros are right for; the
            // others wait for it (the stall inspector names them) rather than go wrong.
            for slot in 0..cap {
                if self.cache.get(slot).is_some_and(|r| {
                    r.sig.kind == CollectiveKind::Allreduce && joins_with_zeros(r.sig.op)
                }) {
                    vec.set_slot(slot, true);
                }
            }
        }
        let stall_due = self.inner.config.stall_check.is_some_and(|d| {
            oldest >= d && start.saturating_duration_since(self.last_stall_check) >= d
        });
        vec.set_status(Status::Shutdown, self.local_shutdown);
        vec.set_status(Status::Uncached, uncached);
        vec.set_status(Status::Invalidated, !invalid.is_empty());
        vec.set_status(Status::Stalled, stall_due);
        vec.set_status(Status::Joined, self.joined);
        vec.set_status(Status::Pending, !self.pending.is_empty());
        vec.set_status(Status::Fault, self.fault.is_some());
        vec.set_status(Status::Trace, self.tracing());

        // 2. The bit-vector allreduce.
        let mut bytes = vec.to_bytes();
        self.add_bytes(bytes.len());
        self.comm
            .allreduce(&mut bytes, DType::U8, ReduceOp::BitAnd)?;
        let agreed = NegotiationVec::from_bytes_with_channels(&bytes, cap, channel_bits)
            .ok_or_else(|| {
                SchedulerError::InvalidArgument("internal error: negotiation vector length".into())
            })?;
        self.idle_channels = agreed.idle_mask();
        Counters::add(&self.inner.counters.rounds, 1);
        if agreed.status(Status::Fault) {
            let err = self.agree_on_fault()?;
            // Every rank records the agreed error before any rank stops its channels: a peer
            // still in a collective with a stopped rank then reports this error, not a lost
            // rank.
            self.inner.fail(err.clone());
            self.comm.barrier()?;
            return Err(err);
        }
        if agreed.status(Status::Shutdown) {
            return Ok(Some(if self.local_shutdown {
                "shutdown requested on this rank".into()
            } else {
                "shutdown requested by another rank".into()
            }));
        }

        // 3. Readiness reports for rank 0's timeline (only while it writes one).
        if agreed.status(Status::Trace) && agreed.status(Status::Pending) {
            self.report_readiness()?;
        }

        // 4. Joined ranks (nothing to do, and nothing allocated, while nobody has joined).
        let joined_changed = if agreed.status(Status::Joined) {
            let mut jv = BitVec::zeros(size);
            jv.set(self.inner.rank, self.joined);
            let mut b = jv.to_bytes();
            self.add_bytes(b.len());
            self.comm.allreduce(&mut b, DType::U8, ReduceOp::BitOr)?;
            let jv = BitVec::from_bytes(&b, size).ok_or_else(|| {
                SchedulerError::InvalidArgument("internal error: joined vector length".into())
            })?;
            let now: Vec<bool> = (0..size).map(|r| jv.get(r)).collect();
            // Every rank sees the same joined vectors, so every rank names the same last rank.
            if let Some(r) = (0..size)
                .rev()
                .find(|&r| now[r] && !self.joined_set.get(r).copied().unwrap_or(false))
            {
                self.last_joined = Some(r);
            }
            let changed = now != self.joined_set;
            self.joined_set = now;
            changed
        } else if self.joined_set.iter().any(|&j| j) {
            self.joined_set.iter_mut().for_each(|j| *j = false);
            true
        } else {
            false
        };
        let all_joined = self.joined_set.iter().all(|&j| j);

        // 5. Invalidated slots: dropped on every rank.
        let mut evicted = Vec::new();
        if agreed.status(Status::Invalidated) {
            let mut iv = BitVec::zeros(cap);
            for &s in &invalid {
                iv.set(s, true);
            }
            let mut b = iv.to_bytes();
            self.add_bytes(b.len());
            self.comm.allreduce(&mut b, DType::U8, ReduceOp::BitOr)?;
            let iv = BitVec::from_bytes(&b, cap).ok_or_else(|| {
                SchedulerError::InvalidArgument("internal error: invalidation vector length".into())
            })?;
            for s in iv.ones() {
                self.cache.evict(s);
                evicted.push(s);
            }
        }

        // 6. Ready from the cache, in slot order.
        // Cache hits share the cached response (a reference count, no copy).
        let mut ready: Vec<Arc<Response>> = Vec::new();
        if !all_joined {
            for slot in agreed.pending_slots() {
                if evicted.contains(&slot) {
                    continue;
                }
                if let Some(r) = self.cache.get(slot) {
                    ready.push(Arc::clone(r));
                    self.cache.touch(slot);
                }
            }
        }
        Counters::add(&self.inner.counters.cache_hits, ready.len() as u64);

        // 7. The coordinator, when some rank has uncached names (or the joined set changed).
        let coordinate = agreed.status(Status::Uncached) || !evicted.is_empty() || joined_changed;
        if coordinate {
            Counters::add(&self.inner.counters.coordinator_rounds, 1);
            let mut mine = Vec::new();
            for p in self.pending.values_mut() {
                if p.state == Announce::New
                    && self.cache.lookup(
                        &p.entry.req.name,
                        &p.entry.req.sig,
                        p.entry.req.group.as_ref(),
                    ) == Lookup::Miss
                {
                    mine.push(p.entry.req.clone());
                    p.state = Announce::Sent;
                }
            }
            let responses = self.coordinate(&mine)?;
            Counters::add(
                &self.inner.counters.coordinator_responses,
                responses.len() as u64,
            );
            for r in responses {
                if let Some(e) = &r.error {
                    self.ready_times.take(&r.name);
                    let err = SchedulerError::from_negotiation(&r.name, e);
                    self.fail_name(&r.name, err.clone());
                    if let Some(g) = &r.group {
                        self.fail_group(g, err);
                    }
                    continue;
                }
                let r = Arc::new(r);
                self.cache.insert(Arc::clone(&r));
                ready.push(r);
            }
        } else {
            Counters::add(&self.inner.counters.bitvector_rounds, 1);
        }

        // 8. Stall inspector.
        if agreed.status(Status::Stalled) {
            self.inspect_stall(start)?;
        }

        // 9. Join completes once everybody has joined.
        if all_joined {
            let last = self.last_joined.take().unwrap_or(self.inner.rank) as i64;
            for c in self.join_cells.drain(..) {
                c.complete(Ok(Tensor::from_slice(&[last])));
            }
            self.joined = false;
        }

        let neg_end = Instant::now();
        Counters::add(
            &self.inner.counters.negotiation_nanos,
            neg_end.duration_since(start).as_nanos() as u64,
        );
        if let Some(tl) = self.inner.timeline() {
            if !ready.is_empty() || coordinate {
                tl.round(coordinate, ready.len(), start, neg_end);
            }
            // Each tensor agreed this round: its span from the first rank's ready time.
            for r in &ready {
                if let Some(times) = self.ready_times.take(&r.name) {
                    tl.negotiated(r.name.to_string(), times, neg_end);
                }
            }
        }

        // 10. Grouped members wait for the rest of their group; plan and dispatch.
        self.last_progress = !ready.is_empty();
        let ready = self.release_groups(ready);
        if !ready.is_empty() {
            self.dispatch(ready)?;
        }
        Ok(None)
    }

    fn fail_name(&mut self, name: &str, err: SchedulerError) {
        if let Some(p) = self
            .by_name
            .remove(name)
            .and_then(|seq| self.pending.remove(&seq))
        {
            self.inner.finish(name, &p.entry.cell, Err(err));
        }
    }

    /// A member of `g` failed: fail the members already held, and remember the group so that
    /// the members still to come fail too.
    fn fail_group(&mut self, g: &GroupTag, err: SchedulerError) {
        let held = self.held.remove(&g.name).unwrap_or_default();
        let seen = match self.failed_groups.get(&g.name) {
            Some(_) => 0,
            None => 1 + held.len() as u32,
        };
        let reason = format!("another member of group '{}' failed: {err}", g.name);
        for r in held {
            self.fail_name(
                &r.name,
                SchedulerError::Negotiation {
                    name: r.name.to_string(),
                    reason: reason.clone(),
                },
            );
        }
        let entry = self
            .failed_groups
            .entry(g.name.clone())
            .or_insert((err, g.size));
        entry.1 = entry.1.saturating_sub(seen.max(1));
        if entry.1 == 0 {
            self.failed_groups.remove(&g.name);
        }
    }

    /// Hold grouped members until their whole group is ready; release complete groups in
    /// member order. Deterministic: the same on every rank.
    fn release_groups(&mut self, ready: Vec<Arc<Response>>) -> Vec<Arc<Response>> {
        let mut out = Vec::with_capacity(ready.len());
        for r in ready {
            let Some(g) = r.group.clone() else {
                out.push(r);
                continue;
            };
            if let Some((err, left)) = self.failed_groups.get_mut(&g.name) {
                let reason = format!("another member of group '{}' failed: {err}", g.name);
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.failed_groups.remove(&g.name);
                }
                self.fail_name(
                    &r.name,
                    SchedulerError::Negotiation {
                        name: r.name.to_string(),
                        reason,
                    },
                );
                continue;
            }
            if let Some(p) = self
                .by_name
                .get(&*r.name)
                .and_then(|s| self.pending.get_mut(s))
            {
                p.state = Announce::Held;
            }
            let members = self.held.entry(g.name.clone()).or_default();
            if members.iter().any(|m| m.name == r.name) {
                continue;
            }
            members.push(r);
            if members.len() as u32 >= g.size {
                let mut members = self.held.remove(&g.name).unwrap_or_default();
                members.sort_by_key(|m| m.group.as_ref().map_or(0, |t| t.index));
                out.extend(members);
            }
        }
        out
    }

    /// Whether this rank asks for readiness reports: rank 0 while it writes a timeline. A
    /// timeline that ended on a write error is dropped here; without one, rank 0 forgets the
    /// ready times it collected.
    fn tracing(&mut self) -> bool {
        if self.inner.rank != 0 {
            return false;
        }
        match self.inner.timeline() {
            Some(t) if t.is_live() => true,
            Some(t) => {
                self.inner.clear_timeline_if(&t);
                self.ready_times.clear();
                false
            }
            None => {
                self.ready_times.clear();
                false
            }
        }
    }

    /// The readiness report (rank 0 writes a timeline): every rank sends rank 0 the names it
    /// has newly pending (not reported before, not yet agreed) with how long ago each was
    /// submitted; rank 0 records, per name and rank, when it learned and that age. A gather to
    /// rank 0, as in the coordinator step.
    fn report_readiness(&mut self) -> Result<(), SchedulerError> {
        let now = Instant::now();
        let mut mine = Vec::new();
        for p in self.pending.values_mut() {
            if !p.reported && p.state != Announce::Held {
                p.reported = true;
                let age = now.saturating_duration_since(p.entry.submitted);
                let micros = u64::try_from(age.as_micros()).unwrap_or(u64::MAX);
                mine.push((p.entry.req.name.to_string(), micros));
            }
        }
        let bytes = wire::encode_names(&mine);
        if self.inner.rank != 0 {
            self.add_bytes(bytes.len() + 8);
        }
        let Some(lists) = collect::gather_to_root(self.comm.as_mut(), &bytes)? else {
            return Ok(());
        };
        let learned = Instant::now();
        for (r, b) in lists.iter().enumerate() {
            let report = wire::decode_names(b).map_err(|e| SchedulerError::Transport {
                lost_rank: Some(r),
                message: format!("rank {r} sent a malformed readiness report: {e}"),
                source: None,
            })?;
            self.ready_times.record(r, report, learned);
        }
        Ok(())
    }

    /// The coordinator step: every rank's new requests are gathered to rank 0 (O(N) bytes in
    /// all, not an allgather), which answers with the responses of the names now complete,
    /// broadcast to every rank.
    fn coordinate(&mut self, mine: &[Request]) -> Result<Vec<Response>, SchedulerError> {
        let bytes = wire::encode_requests(mine);
        if self.inner.rank != 0 {
            self.add_bytes(bytes.len() + 8);
        }
        let mut out = Vec::new();
        if let Some(lists) = collect::gather_to_root(self.comm.as_mut(), &bytes)? {
            for (r, list) in lists.iter().enumerate() {
                let reqs = wire::decode_requests(list).map_err(|e| SchedulerError::Transport {
                    lost_rank: Some(r),
                    message: format!("rank {r} sent a malformed request list: {e}"),
                    source: None,
                })?;
                for mut q in reqs {
                    q.rank = r as u32;
                    self.table.add(q);
                }
            }
            let responses = self.table.take_ready(&self.joined_set);
            out = wire::encode_responses(&responses);
            self.add_bytes(out.len() + 8);
        }
        let out = collect::broadcast_blob(self.comm.as_mut(), out)?;
        wire::decode_responses(&out).map_err(|e| SchedulerError::Transport {
            lost_rank: Some(0),
            message: format!("rank 0 sent a malformed response list: {e}"),
            source: None,
        })
    }

    /// This rank's tensor for a negotiated response, taken out of the pending set (or a
    /// joined rank's zeros); `Err` says why there is none.
    fn take_tensor(&mut self, r: &Response) -> Result<Source, String> {
        #[cfg(test)]
        if self.injected(&r.name) {
            return Err("injected allocation failure".into());
        }
        if let Some(seq) = self.by_name.remove(&*r.name) {
            if let Some(p) = self.pending.remove(&seq) {
                return Ok(Source::Submitted(seq, p));
            }
        }
        if self.joined && r.sig.kind == CollectiveKind::Allreduce {
            return try_zeros(&r.sig).map(Source::Zeros);
        }
        Err("this rank never submitted it".into())
    }

    #[cfg(test)]
    fn injected(&self, name: &str) -> bool {
        INJECTED_FAULTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(r, n)| *r == self.inner.rank && n == name)
    }

    /// Put tensors taken for a round that is not dispatched back into the pending set.
    fn put_back(&mut self, taken: Vec<Source>) {
        for src in taken {
            if let Source::Submitted(seq, p) = src {
                self.by_name.insert(Arc::clone(&p.entry.req.name), seq);
                self.pending.insert(seq, p);
            }
        }
    }

    /// Whether every rank can run the round (each says whether it can; one byte, AND).
    fn agree_can_run(&mut self, mine: bool) -> Result<bool, SchedulerError> {
        let mut b = [u8::from(mine)];
        self.add_bytes(b.len());
        self.comm.allreduce(&mut b, DType::U8, ReduceOp::BitAnd)?;
        Ok(b[0] == 1)
    }

    /// Test hook: a group holding a name listed for this rank in [`QUEUE_ANYWAY`] goes to its
    /// channel thread even when it could run here (ranks then differ in where a group runs).
    #[cfg(test)]
    fn queue_anyway(&self, job: &Job) -> bool {
        let list = QUEUE_ANYWAY.lock().unwrap_or_else(|p| p.into_inner());
        job.parts.iter().any(|(op, _, _)| {
            list.iter()
                .any(|(r, n)| *r == self.inner.rank && n == op.name())
        })
    }

    #[cfg(not(test))]
    fn queue_anyway(&self, _job: &Job) -> bool {
        false
    }

    /// Some rank raised the fault flag: every rank learns every rank's fault and stops with
    /// the same error, naming the lowest faulty rank, its tensor and what went wrong.
    fn agree_on_fault(&mut self) -> Result<SchedulerError, SchedulerError> {
        let mine = fault::encode(self.fault.as_ref());
        self.add_bytes(mine.len() + 8);
        let all = collect::allgather_blobs(self.comm.as_mut(), &mine)?;
        Ok(fault::agreed(&all))
    }

    /// Compare pending names across ranks and report those some ranks lack.
    fn inspect_stall(&mut self, now: Instant) -> Result<(), SchedulerError> {
        let mine: Vec<(String, u64)> = self
            .pending
            .values()
            .map(|p| {
                (
                    p.entry.req.name.to_string(),
                    now.saturating_duration_since(p.entry.submitted).as_millis() as u64,
                )
            })
            .collect();
        let bytes = wire::encode_names(&mine);
        self.add_bytes(bytes.len() + 8);
        let all = collect::allgather_blobs(self.comm.as_mut(), &bytes)?;
        let mut lists = Vec::with_capacity(all.len());
        for (r, b) in all.iter().enumerate() {
            lists.push(
                wire::decode_names(b).map_err(|e| SchedulerError::Transport {
                    lost_rank: Some(r),
                    message: format!("rank {r} sent a malformed name list: {e}"),
                    source: None,
                })?,
            );
        }
        self.last_stall_check = now;
        let threshold = self.inner.config.stall_check.unwrap_or(Duration::ZERO);
        let Some(report) = stall::find(&lists, &self.joined_set, threshold) else {
            return Ok(());
        };
        if self.inner.rank == 0 {
            tracing::warn!(
                missing_ranks = ?report.missing_ranks,
                names = ?report.names,
                waited = ?report.waited,
                "stall: ranks {:?} have not submitted {:?} that other ranks submitted {:?} ago",
                report.missing_ranks, report.names, report.waited
            );
        }
        self.inner.record_stall(report.clone());
        if let Some(limit) = self.inner.config.stall_shutdown {
            if report.waited >= limit {
                return Err(SchedulerError::Stalled {
                    names: report.names,
                    missing: report.missing_ranks,
                    after: report.waited,
                });
            }
        }
        Ok(())
    }

    /// Plan the round's ready responses into groups and hand them to the channels.
    ///
    /// Every tensor of the round is checked before any is dispatched: a rank that cannot run
    /// one of them (a name it never submitted, zeros it cannot allocate) dispatches none,
    /// keeps them pending and raises the fault flag in the next round, where every rank stops
    /// with the same error naming it. It never plans a different list from the other ranks.
    ///
    /// A plan that is a single small group of host tensors (see `Config::inline_bytes`, agreed
    /// at start-up) may run on this thread, which then cannot take part in the next round
    /// until the group's collective is done. So that a rank that cannot run it never leaves
    /// the others waiting in that collective, every rank first states whether it can (one
    /// byte, AND): when one cannot, no rank dispatches anything and the next round agrees on
    /// the fault. The plan itself depends on the agreed responses alone.
    fn dispatch(&mut self, ready: Vec<Arc<Response>>) -> Result<(), SchedulerError> {
        let active = self.joined_set.iter().filter(|j| !**j).count();
        // 1. The plan (a function of the agreed responses and the carried load only).
        let mut items: Vec<PlanItem> = Vec::with_capacity(ready.len());
        let mut group_ids: HashMap<&str, u32> = HashMap::new();
        for r in &ready {
            let mut item = PlanItem::from_response(r);
            if let Some(g) = &r.group {
                let next = group_ids.len() as u32;
                item.group = Some(*group_ids.entry(g.name.as_str()).or_insert(next));
            }
            items.push(item);
        }
        let groups = plan_round_on(&items, &self.plan_opts, &mut self.load, self.idle_channels);
        let inline_plan = matches!(self.dispatch, Dispatch::Workers { .. })
            && runs_inline(&groups, self.inner.config.inline_bytes, |i| {
                ready[i].sig.device == fh_core::message::Device::Cpu
            });
        // 2. Take every response's local tensor: the one submitted here, or a joined rank's
        //    zeros. On failure, put back what was taken and raise the fault.
        let mut taken: Vec<Source> = Vec::with_capacity(ready.len());
        let mut failed = None;
        for r in &ready {
            match self.take_tensor(r) {
                Ok(src) => taken.push(src),
                Err(what) => {
                    failed = Some((r.name.to_string(), what));
                    break;
                }
            }
        }
        let everyone_can = if inline_plan {
            self.agree_can_run(failed.is_none())?
        } else {
            failed.is_none()
        };
        if let Some((name, what)) = failed {
            tracing::error!(rank = self.inner.rank, %name, %what, "cannot run a negotiated tensor; stopping the engine on every rank");
            self.put_back(taken);
            self.fault = Some((name, what));
            return Ok(());
        }
        if !everyone_can {
            // Another rank cannot run this round: it raises the fault in the next round, where
            // every rank stops with its error.
            self.put_back(taken);
            return Ok(());
        }
        // 3. Build the operations.
        let mut ops: Vec<Arc<Op>> = Vec::with_capacity(ready.len());
        for (r, src) in ready.into_iter().zip(taken) {
            let (tensor, splits, cell) = match src {
                Source::Zeros(t) => (t, None, None),
                Source::Submitted(_, p) => {
                    let e = p.entry;
                    if let Some(tl) = self.inner.timeline() {
                        tl.tensor_span(
                            e_id(&r.name, e.submitted),
                            r.name.to_string(),
                            "queued",
                            e.submitted,
                            Instant::now(),
                        );
                    }
                    (e.tensor, e.splits, Some(e.cell))
                }
            };
            ops.push(Arc::new(Op {
                resp: r,
                state: Mutex::new(OpState {
                    tensor: Some(tensor),
                    splits,
                    error: None,
                }),
                remaining: AtomicUsize::new(0),
                cell,
                chunks: std::sync::OnceLock::new(),
            }));
        }
        let mut alone = vec![true; ops.len()];
        for g in &groups {
            for p in &g.parts {
                ops[p.item]
                    .remaining
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                alone[p.item] &= g.parts.len() == 1;
            }
        }
        // An allreduce split into chunks that each run alone: its chunks are reduced in place.
        for (op, alone) in ops.iter().zip(alone) {
            if alone
                && op.sig().kind == CollectiveKind::Allreduce
                && op.remaining.load(std::sync::atomic::Ordering::Relaxed) > 1
            {
                let mut st = op.lock();
                if let Some(t) = st.tensor.as_mut() {
                    let _ = op.chunks.set(crate::exec::ChunkedBuf::of(t));
                }
            }
        }
        let round = self
            .inner
            .counters
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed);
        for g in groups {
            if self.inner.config.record_groups {
                self.inner.record_group(GroupRecord {
                    round,
                    idle_channels: self.idle_channels,
                    channel: g.channel,
                    parts: g
                        .parts
                        .iter()
                        .map(|p| (ops[p.item].name().to_string(), p.offset, p.len))
                        .collect(),
                });
            }
            if let Some(c) = self.inner.counters.channels().get(g.channel) {
                Counters::add(&c.queued, g.bytes());
            }
            let job = Job {
                parts: g
                    .parts
                    .iter()
                    .map(|p| (Arc::clone(&ops[p.item]), p.offset as usize, p.len as usize))
                    .collect(),
                active,
            };
            let queue_anyway = self.queue_anyway(&job);
            match &mut self.dispatch {
                Dispatch::Inline(ex) => ex.run(job),
                Dispatch::Workers { queues, slots, .. } => {
                    let Some(slot) = slots.get(g.channel) else {
                        continue;
                    };
                    // A small single-group round while the channel is idle: run it here,
                    // after everything dispatched to the channel before (all finished).
                    let job = if inline_plan
                        && slot.outstanding.load(Ordering::Acquire) == 0
                        && !queue_anyway
                    {
                        match slot.try_exec() {
                            Some(mut ex) => {
                                Counters::add(&self.inner.counters.inline_groups, 1);
                                ex.run(job);
                                continue;
                            }
                            None => job,
                        }
                    } else {
                        job
                    };
                    slot.outstanding.fetch_add(1, Ordering::Relaxed);
                    if let Some(q) = queues.get(g.channel) {
                        if let Err(e) = q.send(job) {
                            slot.outstanding.fetch_sub(1, Ordering::Relaxed);
                            // The worker is gone: fail its parts.
                            if let Some(c) = self.inner.counters.channels().get(g.channel) {
                                c.queued
                                    .fetch_sub(g.bytes(), std::sync::atomic::Ordering::Relaxed);
                            }
                            for (op, _, _) in e.0.parts {
                                op.part_done(
                                    &self.inner,
                                    Some(SchedulerError::ShutDown {
                                        reason: "a channel thread stopped".into(),
                                    }),
                                );
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AllreduceOptions, Config, Engine};
    use fh_transport::local::LocalWorld;

    /// A rank that cannot run a negotiated tensor (here: an injected allocation failure on
    /// rank 1) stops the engine on every rank with the same error naming the rank and the
    /// tensor, within bounded time, instead of planning a different list than the others.
    /// With small rounds run on the control thread (the default) and without: the other ranks
    /// are not left waiting in a collective the faulty rank never joins.
    #[test]
    fn a_local_fault_stops_every_rank_with_the_same_error() {
        for (k, inline) in [(1usize, 1024u64), (3, 1024), (1, 0), (3, 0)] {
            let name = format!("faulty-{k}-{inline}");
            INJECTED_FAULTS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((1, name.clone()));
            let threads: Vec<_> = LocalWorld::with_timeout(3, Duration::from_secs(10))
                .into_iter()
                .map(|t| {
                    let name = name.clone();
                    std::thread::spawn(move || {
                        let cfg = Config::default().channels(k).inline_bytes(inline);
                        let e = Engine::start(Box::new(t), cfg).unwrap();
                        let opts = AllreduceOptions::with_op(ReduceOp::Sum);
                        let ok = e
                            .allreduce("fine", Tensor::from_slice(&[1.0f32; 4]), opts)
                            .unwrap()
                            .wait_timeout(Duration::from_secs(20))
                            .unwrap();
                        let bad = e
                            .allreduce(&name, Tensor::from_slice(&[1.0f32; 4]), opts)
                            .unwrap()
                            .wait_timeout(Duration::from_secs(20))
                            .unwrap_err();
                        let stopped = e.shutdown().unwrap_err();
                        (ok.to_vec::<f32>().unwrap(), bad, stopped)
                    })
                })
                .collect();
            let out: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            for (ok, bad, stopped) in &out {
                assert_eq!(ok, &[3.0; 4]);
                assert_eq!(bad, &out[0].1, "same error on every rank");
                assert_eq!(stopped, &out[0].1);
                let text = bad.to_string();
                assert!(
                    text.contains(&name)
                        && text.contains("rank 1 could not run")
                        && text.contains("injected allocation failure"),
                    "{text}"
                );
            }
        }
    }

    /// Ranks may differ in where a small group runs (here rank 1 always hands it to the
    /// channel thread, the others run it on the control thread): same results, same groups on
    /// the same channels in the same order on every rank.
    #[test]
    fn ranks_running_a_group_inline_or_on_its_channel_agree() {
        let names: Vec<String> = (0..4).map(|i| format!("mixed-inline-{i}")).collect();
        QUEUE_ANYWAY
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(names.iter().map(|n| (1, n.clone())));
        let threads: Vec<_> = LocalWorld::with_timeout(3, Duration::from_secs(10))
            .into_iter()
            .map(|t| {
                let names = names.clone();
                std::thread::spawn(move || {
                    let cfg = Config::default()
                        .channels(2)
                        .inline_bytes(1024)
                        .record_groups(true);
                    let e = Engine::start(Box::new(t), cfg).unwrap();
                    let r = e.rank() as f32;
                    let opts = AllreduceOptions::with_op(ReduceOp::Sum);
                    let mut out = Vec::new();
                    for step in 0..5 {
                        for (i, n) in names.iter().enumerate() {
                            let x = r + (step * 10 + i) as f32;
                            let got = e
                                .allreduce(n, Tensor::from_slice(&[x; 8]), opts)
                                .unwrap()
                                .wait_timeout(Duration::from_secs(20))
                                .unwrap();
                            out.push(got.to_vec::<f32>().unwrap());
                        }
                    }
                    let (log, stats) = (e.group_log(), e.stats());
                    e.shutdown().unwrap();
                    (out, log, stats.inline_groups)
                })
            })
            .collect();
        let out: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (rank, (results, log, inline)) in out.iter().enumerate() {
            for step in 0..5 {
                for i in 0..4 {
                    let x = 3.0 + 3.0 * (step * 10 + i) as f32;
                    assert_eq!(results[step * 4 + i], [x; 8], "rank {rank}");
                }
            }
            assert_eq!(log, &out[0].1, "rank {rank}: other groups than rank 0");
            assert_eq!(log.len(), 20);
            if rank == 1 {
                assert_eq!(*inline, 0, "rank 1 queued every group");
            } else {
                assert!(*inline > 0, "rank {rank} never ran a group inline");
            }
        }
    }

    #[test]
    fn zero_tensors_that_cannot_exist_are_errors() {
        let mut sig = fh_core::message::Signature {
            kind: CollectiveKind::Allreduce,
            dtype: DType::F32,
            shape: vec![2, 3],
            device: fh_core::message::Device::Cpu,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
        };
        assert_eq!(try_zeros(&sig).unwrap().data().len(), 24);
        sig.shape = vec![u64::MAX, 2];
        assert!(try_zeros(&sig).unwrap_err().contains("does not fit"));
    }
}
