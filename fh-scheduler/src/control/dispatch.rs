//! Plan and hand over: the agreed ready list is planned by fh-core's planner (channel load
//! carried from round to round, fused groups on the channels idle everywhere) and each group goes
//! to its channel's worker thread, or, when small and its channel is idle, runs on this thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use fh_core::fusion::{plan_round_on, runs_inline, Group, PlanItem};
use fh_core::message::{CollectiveKind, Response};
use fh_core::ReduceOp;
use fh_transport::Communicator;

use crate::config::Preset;
use crate::exec::Executor;
use crate::inject::{self, Point};
use crate::job::{Job, Op, OpState};
use crate::shared::Inner;
use crate::shared::Resolver;
use crate::stats::{Counters, GroupRecord};
use crate::{SchedulerError, Tensor};

use super::waiting::Pending;
use super::Control;

/// Where a dispatched operation's tensor comes from.
pub(super) enum Source {
    /// Submitted on this rank (its pending sequence number and entry).
    Submitted(u64, Box<Pending>),
    /// Zeros a joined rank contributes.
    Zeros(Tensor),
}

pub(super) enum Dispatch {
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
pub(super) struct ChannelSlot {
    pub(super) exec: Mutex<Executor>,
    /// Groups handed to the worker thread and not yet finished. The worker lowers it after it
    /// has released `exec`, so at zero the control thread takes `exec` without waiting.
    pub(super) outstanding: AtomicUsize,
}

impl Dispatch {
    /// The channels' executors over the data communicators `data` (and their device twins),
    /// run as the preset asks: one worker thread per channel (FastHorovod), or on the control
    /// thread itself (Horovod).
    pub(super) fn start(
        preset: Preset,
        inner: &Arc<Inner>,
        data: Vec<Box<dyn Communicator>>,
        devices: Vec<crate::gpu::DeviceChannelSlot>,
    ) -> Result<Dispatch, SchedulerError> {
        #[cfg(feature = "cuda")]
        let mut devices = devices.into_iter();
        #[cfg(not(feature = "cuda"))]
        drop(devices);
        let executors = data.into_iter().enumerate().map(|(channel, comm)| {
            Executor::new(
                comm,
                channel,
                Arc::clone(inner),
                #[cfg(feature = "cuda")]
                devices.next(),
            )
        });
        if preset == Preset::Horovod {
            let ex = executors
                .into_iter()
                .next()
                .ok_or_else(|| SchedulerError::internal("no data channel was opened"))?;
            return Ok(Dispatch::Inline(Box::new(ex)));
        }
        let (mut queues, mut threads, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for ex in executors {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let name = format!("fh-channel-{}-{}", inner.rank, ex.channel());
            let slot = Arc::new(ChannelSlot {
                exec: Mutex::new(ex),
                outstanding: AtomicUsize::new(0),
            });
            slots.push(Arc::clone(&slot));
            let rank = inner.rank;
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || worker_loop(rank, &slot, &rx))
                .map_err(|e| SchedulerError::internal(format!("cannot spawn a thread: {e}")))?;
            queues.push(tx);
            threads.push(t);
        }
        Ok(Dispatch::Workers {
            queues,
            threads,
            slots,
        })
    }
}

/// A channel's worker thread: runs the groups handed to its channel, in order, until the
/// control thread drops the queue.
fn worker_loop(rank: usize, slot: &ChannelSlot, rx: &Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        if inject::hit(rank, Point::ChannelPanic, job_name(&job)) {
            panic!("injected panic on a channel thread");
        }
        crate::shared::lock(&slot.exec).run(job);
        slot.outstanding.fetch_sub(1, Ordering::Release);
    }
}

impl ChannelSlot {
    /// The executor, if nobody else holds it (a poisoned lock is taken anyway: `run` leaves
    /// the executor consistent between groups).
    pub(super) fn try_exec(&self) -> Option<std::sync::MutexGuard<'_, Executor>> {
        match self.exec.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// A zero tensor of `sig`'s dtype and shape (a joined rank's contribution), or why it cannot
/// be made; allocation failure is an error, not an abort.
pub(super) fn try_zeros(sig: &fh_core::message::Signature) -> Result<Tensor, String> {
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

/// Test hook: `(rank, name)` pairs whose groups that rank hands to a channel thread even when
/// they could run on the control thread.
#[cfg(test)]
pub(crate) static QUEUE_ANYWAY: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// The name of a job's first tensor (what the fault-injection seam matches).
pub(super) fn job_name(job: &Job) -> &str {
    job.parts.first().map_or("", |(op, _, _)| op.name())
}

/// An id for a tensor's timeline track (stable per submission).
pub(super) fn e_id(name: &str, submitted: Instant) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    submitted.hash(&mut h);
    h.finish() >> 11
}

impl Control {
    /// This rank's tensor for a negotiated response, taken out of the pending set (or a
    /// joined rank's zeros); `Err` says why there is none.
    pub(super) fn take_tensor(&mut self, r: &Response) -> Result<Source, String> {
        if inject::hit(self.inner.rank, Point::TakeTensor, &r.name) {
            return Err("injected allocation failure".into());
        }
        if let Some(seq) = self.work.by_name.remove(&*r.name) {
            if let Some(p) = self.work.pending.remove(&seq) {
                return Ok(Source::Submitted(seq, Box::new(p)));
            }
        }
        if self.join.active && r.sig.kind == CollectiveKind::Allreduce {
            return try_zeros(&r.sig).map(Source::Zeros);
        }
        Err("this rank never submitted it".into())
    }

    /// Put tensors taken for a round that is not dispatched back into the pending set.
    pub(super) fn put_back(&mut self, taken: Vec<Source>) {
        for src in taken {
            if let Source::Submitted(seq, p) = src {
                let p = *p;
                self.work.by_name.insert(Arc::clone(&p.entry.req.name), seq);
                self.work.pending.insert(seq, p);
            }
        }
    }

    /// Whether every rank can run the round (each says whether it can; one byte, AND).
    pub(super) fn agree_can_run(&mut self, mine: bool) -> Result<bool, SchedulerError> {
        let mut b = vec![u8::from(mine)];
        self.add_bytes(b.len() + 16);
        crate::negotiate::collect::reduce_bits(
            self.comm.as_mut(),
            &mut b,
            ReduceOp::BitAnd,
            self.incarnation,
        )?;
        Ok(b[0] == 1)
    }

    /// Test hook: a group holding a name listed for this rank in [`QUEUE_ANYWAY`] goes to its
    /// channel thread even when it could run here (ranks then differ in where a group runs).
    #[cfg(test)]
    pub(super) fn queue_anyway(&self, job: &Job) -> bool {
        let list = QUEUE_ANYWAY.lock().unwrap_or_else(|p| p.into_inner());
        job.parts.iter().any(|(op, _, _)| {
            list.iter()
                .any(|(r, n)| *r == self.inner.rank && n == op.name())
        })
    }

    #[cfg(not(test))]
    pub(super) fn queue_anyway(&self, _job: &Job) -> bool {
        false
    }

    /// Plan the round's ready responses into groups and hand them to the channels.
    ///
    /// Every tensor of the round is checked before any is dispatched: a rank that cannot run
    /// one of them (a name it never submitted, zeros it cannot allocate) dispatches none,
    /// keeps them pending and raises the fault flag in the next round, where every rank stops
    /// with the same error naming it. It never plans a different list from the other ranks.
    ///
    /// A plan that is a single small group of host tensors (see `Config::inline_bytes`, agreed
    /// at start-up) may run on this thread, as every group does under the `horovod` preset;
    /// this thread then cannot take part in the next round until the collective is done. So
    /// that a rank that cannot run it never leaves the others waiting in that collective,
    /// every rank first states whether it can (one byte, AND): when one cannot, no rank
    /// dispatches anything and the next round agrees on the fault. A plan that is one
    /// allreduce group of host tensors over channels that carry a flag in the reduction's own
    /// messages (TCP, [`fh_transport::Communicator::agrees_in_band`]) skips that step: its
    /// allreduce carries the same AND ([`Job::agree`]; a small allreduce costs one collective
    /// less), a rank that cannot run it joins with zeros, and when one could not, no rank
    /// delivers the result and the next round agrees on the fault. The plan itself depends on
    /// the agreed responses alone.
    pub(super) fn dispatch(&mut self, ready: Vec<Arc<Response>>) -> Result<(), SchedulerError> {
        let groups = self.plan_ready(&ready);
        let inline_plan = matches!(self.dispatch, Dispatch::Workers { .. })
            && runs_inline(&groups, self.inner.config.inline_bytes, |i| {
                ready[i].sig.device == fh_core::message::Device::Cpu
            });
        let runs_here = inline_plan || matches!(self.dispatch, Dispatch::Inline(_));
        // From the agreed plan, responses and backend only: the same on every rank. Where
        // the flag would be a collective of its own anyway (shared memory, hierarchical, MPI),
        // the one-byte step on the negotiation communicator is the cheaper place for it.
        let agreeing = runs_here
            && self.agree_in_band
            && groups.len() == 1
            && ready.iter().all(|r| {
                r.sig.kind == CollectiveKind::Allreduce
                    && r.sig.device == fh_core::message::Device::Cpu
            });
        let Some((taken, mine)) = self.take_tensors(&ready, runs_here, agreeing)? else {
            return Ok(());
        };
        let agree = agreeing.then_some(mine);
        let round = self
            .inner
            .counters
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed);
        let ops = self.build_ops(ready, taken, &groups, round);
        for g in groups {
            self.hand_over(g, &ops, round, inline_plan, agree);
        }
        Ok(())
    }

    /// Step 1: the plan, a function of the agreed responses and the carried load only.
    fn plan_ready(&mut self, ready: &[Arc<Response>]) -> Vec<Group> {
        let mut items: Vec<PlanItem> = Vec::with_capacity(ready.len());
        let mut group_ids: HashMap<&str, u32> = HashMap::new();
        for r in ready {
            let mut item = PlanItem::from_response(r);
            if let Some(g) = &r.group {
                let next = group_ids.len() as u32;
                item.group = Some(*group_ids.entry(g.name.as_str()).or_insert(next));
            }
            items.push(item);
        }
        plan_round_on(
            &items,
            &self.plan.opts,
            &mut self.plan.load,
            self.plan.idle_channels,
        )
    }

    /// Step 2: every response's local tensor, the one submitted here or a joined rank's
    /// zeros, and whether this rank can run them all; `None` when this rank or another cannot
    /// run the round (what was taken is put back; this rank's failure becomes the fault the
    /// next round raises on every rank). Groups that run on this thread (`runs_here`; under
    /// the `horovod` preset, every round's) are agreed first, unless the plan is `agreeing`:
    /// then a tensor this rank cannot take is replaced by zeros, so that it joins the group's
    /// allreduce and says there that it cannot.
    fn take_tensors(
        &mut self,
        ready: &[Arc<Response>],
        runs_here: bool,
        agreeing: bool,
    ) -> Result<Option<(Vec<Source>, bool)>, SchedulerError> {
        let mut taken: Vec<Source> = Vec::with_capacity(ready.len());
        let mut failed = None;
        for r in ready {
            match self.take_tensor(r) {
                Ok(src) => taken.push(src),
                Err(what) => {
                    let rank = self.inner.world_rank(self.inner.rank);
                    if agreeing {
                        // Zeros in its place: the allreduce every rank runs says it failed.
                        match try_zeros(&r.sig) {
                            Ok(zeros) => taken.push(Source::Zeros(zeros)),
                            Err(e) => {
                                // What was taken stays pending: the stop resolves it.
                                self.put_back(taken);
                                return Err(SchedulerError::internal(format!(
                                    "rank {rank} cannot run '{}' ({what}) and cannot stand \
                                     in for it: {e}",
                                    r.name
                                )));
                            }
                        }
                    }
                    if failed.is_none() {
                        failed = Some((r.name.to_string(), what));
                    }
                    if !agreeing {
                        break;
                    }
                }
            }
        }
        if agreeing {
            let mine = failed.is_none();
            if let Some((name, what)) = failed {
                tracing::error!(rank = self.inner.rank, %name, %what, "cannot run a negotiated tensor; stopping the engine on every rank");
                self.fault = Some((name, what));
            }
            return Ok(Some((taken, mine)));
        }
        let everyone_can = if runs_here {
            self.agree_can_run(failed.is_none())?
        } else {
            failed.is_none()
        };
        if let Some((name, what)) = failed {
            tracing::error!(rank = self.inner.rank, %name, %what, "cannot run a negotiated tensor; stopping the engine on every rank");
            self.put_back(taken);
            self.fault = Some((name, what));
            return Ok(None);
        }
        if !everyone_can {
            // Another rank cannot run this round: it raises the fault in the next round, where
            // every rank stops with its error.
            self.put_back(taken);
            return Ok(None);
        }
        Ok(Some((taken, true)))
    }

    /// Step 3: the operations, one per response, each counting the groups it is part of; an
    /// allreduce split into chunks that each run alone reduces its chunks in place.
    fn build_ops(
        &mut self,
        ready: Vec<Arc<Response>>,
        taken: Vec<Source>,
        groups: &[Group],
        round: u64,
    ) -> Vec<Arc<Op>> {
        let now = Instant::now();
        let mut ops: Vec<Arc<Op>> = Vec::with_capacity(ready.len());
        for (r, src) in ready.into_iter().zip(taken) {
            let (tensor, splits, cell) = match src {
                Source::Zeros(t) => (t, None, None),
                Source::Submitted(_, p) => {
                    let e = p.entry;
                    self.inner.flight.negotiated(e.cell.record(), round, now);
                    if let Some(tl) = self.inner.timeline() {
                        tl.tensor_span(
                            e_id(&r.name, e.submitted),
                            r.name.to_string(),
                            "queued",
                            e.submitted,
                            now,
                        );
                    }
                    (e.tensor, e.splits, Some(e.cell))
                }
            };
            ops.push(Arc::new(Op {
                rec: cell.as_ref().map_or(0, Resolver::record),
                resp: r,
                state: Mutex::new(OpState {
                    tensor: Some(tensor),
                    splits,
                    error: None,
                    resolver: cell,
                }),
                remaining: AtomicUsize::new(0),
                chunks: std::sync::OnceLock::new(),
            }));
        }
        let mut alone = vec![true; ops.len()];
        for g in groups {
            for p in &g.parts {
                ops[p.item]
                    .remaining
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                alone[p.item] &= g.parts.len() == 1;
            }
        }
        for (op, alone) in ops.iter().zip(alone) {
            if alone
                && op.sig().kind == CollectiveKind::Allreduce
                && op.remaining.load(std::sync::atomic::Ordering::Relaxed) > 1
            {
                let mut st = op.lock();
                if let Some(t) = st.tensor.as_mut() {
                    let _ = op.chunks.set(crate::job::ChunkedBuf::of(t));
                }
            }
        }
        ops
    }

    /// Step 4: one fused group to its channel: run here when the round is small and the
    /// channel idle, else queued to the channel's worker; a worker that is gone fails the
    /// group's parts and raises the fault on every rank.
    fn hand_over(
        &mut self,
        g: Group,
        ops: &[Arc<Op>],
        round: u64,
        inline_plan: bool,
        agree: Option<bool>,
    ) {
        // Horovod's convention: an average divides by every rank, a joined one included.
        let divisor = self.inner.size;
        if self.inner.config.record_groups {
            self.inner.record_group(GroupRecord {
                round,
                idle_channels: self.plan.idle_channels,
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
            divisor,
            agree,
        };
        let queue_anyway = self.queue_anyway(&job);
        let rank = self.inner.rank;
        let (queues, slots) = match &mut self.dispatch {
            Dispatch::Inline(ex) => return ex.run(job),
            Dispatch::Workers { queues, slots, .. } => (queues, slots),
        };
        let Some(slot) = slots.get(g.channel) else {
            return;
        };
        // A small single-group round while the channel is idle: run it here, after everything
        // dispatched to the channel before (all finished).
        if inline_plan && slot.outstanding.load(Ordering::Acquire) == 0 && !queue_anyway {
            if let Some(mut ex) = slot.try_exec() {
                Counters::add(&self.inner.counters.inline_groups, 1);
                if inject::hit(rank, Point::InlinePanic, job_name(&job)) {
                    panic!("injected panic on the control thread");
                }
                return ex.run(job);
            }
        }
        slot.outstanding.fetch_add(1, Ordering::Relaxed);
        let Some(q) = queues.get(g.channel) else {
            return;
        };
        let sent = if inject::hit(rank, Point::ChannelQueue, job_name(&job)) {
            Err(crossbeam_channel::SendError(job))
        } else {
            q.send(job)
        };
        let Err(e) = sent else {
            return;
        };
        slot.outstanding.fetch_sub(1, Ordering::Relaxed);
        if let Some(c) = self.inner.counters.channels().get(g.channel) {
            c.queued
                .fetch_sub(g.bytes(), std::sync::atomic::Ordering::Relaxed);
        }
        // The worker is gone: this rank cannot run the channel's groups, so every rank stops
        // through the agreed fault.
        let rank = self.inner.world_rank(self.inner.rank);
        for (op, _, _) in e.0.parts {
            let what = format!(
                "rank {rank} could not hand it to channel {} (the channel's thread is gone)",
                g.channel
            );
            if self.fault.is_none() {
                self.fault = Some((op.name().to_string(), what.clone()));
            }
            op.part_done(Some(SchedulerError::Negotiation {
                name: op.name().to_string(),
                reason: what,
            }));
        }
    }
}
