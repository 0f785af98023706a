//! The control thread: the loop that runs negotiation rounds and dispatches fused groups to
//! the channels. The steps a round may take live in [`crate::negotiate`].
//!
//! Every rank runs the same sequence of negotiation rounds on the control communicator. A
//! round is: one bitwise-AND allreduce of the negotiation vector (status flags + cached slots
//! pending here; the data of the small cached allreduces that ride travels in the same
//! collective), then, only when a flag asks for it, the optional steps in a fixed order —
//! agreed fault (stop), readiness report (gather to rank 0, while rank 0 writes a timeline),
//! joined-rank exchange, slot invalidation, coordinator step (gather to rank 0, broadcast),
//! stall report — and finally the agreed ready list is planned (channel load carried from
//! round to round) and dispatched. Because every decision is a function of
//! the rounds' collective results, every rank takes the same steps and forms the same groups.
//! Back-pressure only delays when a rank enters its next round.
//!
//! The hot path of a small cached allreduce: it rides in the round itself ([`eager`],
//! `Config::eager_bytes`): its data travels beside the bit vector in the round's one
//! collective, and completes there when every rank had it ready.
//!
//! The hot path of another small collective: a plan that is one small group of host tensors
//! (`Config::inline_bytes`, agreed at start-up) needs every rank to say it can run the group:
//! an allreduce group carries that AND in its own allreduce (over TCP in the same messages,
//! [`fh_transport::Communicator::allreduce_agreeing`]), any other kind takes a one-byte AND
//! first. The group runs on this thread when its channel has
//! nothing queued or running (otherwise on the channel's thread, after what is queued: the
//! group, its channel and the order on the channel stay the planner's). After a round that
//! completed work, this thread polls for the next submission briefly (`Config::control_spin`)
//! before it sleeps. Cached responses and names are shared (`Arc`), so a cache hit copies
//! nothing.
//!
//! One gradient walks the modules of this directory in order: `mod.rs` is the thin loop
//! (accept submissions, decide when to run the next round, back-pressure); [`round`] runs one
//! negotiation round (the bit-vector AND and the optional steps, drawing on
//! [`crate::negotiate`]; [`eager`]: the small allreduces riding in it), of which the stall inspector's is in [`stall_check`]; [`groups`] holds grouped submissions back until every member is
//! ready and fails them together; [`dispatch`] plans the agreed list (fh-core's planner) and
//! hands the groups to the channels (`crate::exec`), or runs a small one itself.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};
use fh_core::cache::ResponseCache;
use fh_core::fusion::{ChannelLoad, PlanOptions};
use fh_transport::Communicator;

use crate::negotiate::coordinator::Table;
use crate::negotiate::readiness::ReadyTimes;
use crate::shared::{Inner, Msg};
use crate::SchedulerError;

mod dispatch;
mod eager;
mod groups;
mod helper;
mod round;
mod stall_check;
#[cfg(test)]
mod tests;
mod waiting;

use dispatch::Dispatch;
#[cfg(test)]
pub(crate) use dispatch::QUEUE_ANYWAY;
pub(crate) use helper::Helper;
use helper::Unparked;
use waiting::Waiting;

/// Longest back-off between rounds while every rank waits on another.
const MAX_BACKOFF: Duration = Duration::from_micros(500);

/// Closes the engine's gate when the control thread ends, however it ends (see
/// [`Control::run`]).
struct CloseOnExit(Arc<Inner>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            format!(
                "the engine's control thread on rank {} panicked (a bug in FastHorovod: please \
                 report it)",
                self.0.world_rank(self.0.rank)
            )
        } else {
            "the engine stopped".into()
        };
        self.0.close(SchedulerError::ShutDown { reason });
    }
}

/// How often a rank deferring its round under back-pressure looks at its channels again
/// (besides being woken by a channel that drains).
const BACKPRESSURE_POLL: Duration = Duration::from_millis(1);

pub(crate) struct Control {
    inner: Arc<Inner>,
    comm: Box<dyn Communicator>,
    rx: Receiver<Msg>,
    cache: ResponseCache,
    /// What this rank submitted and this thread has not dispatched yet: its one owner.
    work: Waiting,
    table: Table,
    dispatch: Dispatch,
    /// This rank's request to shut down.
    shutdown: ShutdownState,
    /// `join()`: this rank's, and the agreed set.
    join: JoinState,
    /// When to run the next round.
    pacing: Pacing,
    /// What the planner carries from round to round.
    plan: PlanState,
    /// A local inconsistency met while dispatching (tensor name, what went wrong): raised in
    /// the next round so that every rank stops with the same error.
    fault: Option<(String, String)>,
    /// The data channels carry a flag inside a small allreduce's own messages
    /// ([`fh_transport::Communicator::agrees_in_band`]): a round of one small allreduce group
    /// run on this thread's behalf agrees there that every rank can run it, not in a one-byte
    /// step of its own.
    agree_in_band: bool,
    /// The small cached allreduces that ride in the rounds (`Config::eager_bytes`; none where
    /// the negotiation communicator cannot reduce a message of mixed parts in one collective).
    eager: eager::EagerLayout,
    /// Rank 0 while writing a timeline: for each tensor not yet agreed, when each rank had it
    /// ready (from the readiness reports). Empty when no timeline is written.
    ready_times: ReadyTimes,
    /// This engine's incarnation (agreed at start-up), carried by every control message.
    incarnation: u64,
    /// The names the last stall report said this rank lacks (the culprit hook ran for them).
    culprit_of: Option<Vec<String>>,
    /// When the flight record was last written for tensors the ranks disagreed on.
    last_mismatch_record: Option<Instant>,
    /// Where this state waits while the control thread idles, for a waiting caller to run a
    /// round with it ([`helper`]).
    helper: Arc<Helper>,
    /// Whether callers may run rounds (`Config::caller_rounds`, where this engine allows it).
    caller_rounds: bool,
}

/// This rank's request to shut down (raised in the next round's vector).
struct ShutdownState {
    /// Whether this rank asked.
    asked: bool,
    /// Why, told to the others in the agreed shutdown.
    reason: Option<String>,
}

/// `join()` on this rank and across the ranks (agreed in the rounds that carry the joined
/// status).
struct JoinState {
    /// Whether this rank has joined and waits for the others.
    active: bool,
    /// Which ranks have joined, as last agreed (the same on every rank).
    set: Vec<bool>,
    /// The rank that joined last (highest rank among those that joined in the same round).
    last: Option<usize>,
}

/// When the control thread runs its next round.
struct Pacing {
    /// Work arrived since the last round.
    fresh: bool,
    /// The last round made progress (something was dispatched).
    last_progress: bool,
    /// How long to wait before an idle round; grows while nothing happens.
    backoff: Duration,
    /// When the last round started.
    last_round: Instant,
    /// When the stall inspector last looked.
    last_stall_check: Instant,
}

/// What the planner carries from round to round: a function of the agreed rounds only, hence
/// the same on every rank.
struct PlanState {
    /// The planner's options (agreed at start-up).
    opts: PlanOptions,
    /// Bytes given to each channel so far.
    load: ChannelLoad,
    /// The channels idle on every rank when this round started (agreed in the round's bit
    /// vector): the planner puts the round's fused groups there.
    idle_channels: u64,
}

impl Control {
    pub(crate) fn new(
        inner: Arc<Inner>,
        comm: Box<dyn Communicator>,
        data: Vec<Box<dyn Communicator>>,
        devices: Vec<crate::gpu::DeviceChannelSlot>,
        rx: Receiver<Msg>,
        incarnation: u64,
        helper: Arc<Helper>,
    ) -> Result<Self, SchedulerError> {
        let cfg = inner.config.clone();
        inner.counters.init_channels(data.len());
        // Every rank opened its channels on the same backend: an agreed fact.
        let agree_in_band = !data.is_empty() && data.iter().all(|c| c.agrees_in_band());
        // Agreed facts too: the setting (start-up agreement) and the negotiation backend.
        let eager_budget = match cfg.preset {
            crate::config::Preset::FastHorovod if comm.parts_in_band() => {
                usize::try_from(cfg.eager_bytes).unwrap_or(usize::MAX)
            }
            _ => 0,
        };
        // Callers run rounds only where the rounds' timing is this thread's alone to choose
        // (no cycle, batching window or back-pressure), no GPU channel needs this thread, and
        // the negotiation communicator is one of this process's own (not MPI's, whose calls
        // stay on the thread that made them).
        let caller_rounds = cfg.caller_rounds
            && cfg.preset == crate::config::Preset::FastHorovod
            && comm.parts_in_band()
            && cfg.cycle_time.is_zero()
            && cfg.batching_window.is_zero()
            && !inner.pacing.enabled
            && devices.is_empty();
        let dispatch = Dispatch::start(cfg.preset, &inner, data, devices)?;
        let plan_opts = cfg.plan_options();
        let now = Instant::now();
        let table = Table::with_world_ranks(inner.world_ranks.clone());
        Ok(Control {
            cache: ResponseCache::new(cfg.cache_capacity),
            join: JoinState {
                active: false,
                set: vec![false; inner.size],
                last: None,
            },
            ready_times: ReadyTimes::new(inner.size),
            eager: eager::EagerLayout::new(eager_budget),
            incarnation,
            agree_in_band,
            inner,
            comm,
            rx,
            table,
            dispatch,
            work: Waiting::default(),
            shutdown: ShutdownState {
                asked: false,
                reason: None,
            },
            pacing: Pacing {
                fresh: false,
                last_progress: false,
                backoff: Duration::from_micros(10),
                last_round: now,
                last_stall_check: now,
            },
            plan: PlanState {
                opts: plan_opts,
                load: ChannelLoad::new(plan_opts.channels),
                idle_channels: 0,
            },
            fault: None,
            culprit_of: None,
            last_mismatch_record: None,
            helper,
            caller_rounds,
        })
    }

    /// The thread body.
    pub(crate) fn run(self) {
        // The state lives here, beside the loop, except while it is parked ([`helper`]).
        let mut state = Some(Box::new(self));
        let this = state.as_ref().expect("just made");
        // Dropped before `state` (declared after it), also when the loop panics: the gate is
        // closed first, so that every resolver the state still holds resolves its handle with
        // the stop reason as it drops.
        let _close = CloseOnExit(Arc::clone(&this.inner));
        if this.caller_rounds {
            this.helper.enable();
        }
        let outcome = Self::main_loop(&mut state);
        state
            .as_mut()
            .expect("the loop ends holding the state")
            .stop(outcome);
    }

    /// The exit path, with the outcome that ended the loop.
    fn stop(&mut self, outcome: Result<String, SchedulerError>) {
        let err = match outcome {
            Ok(reason) => SchedulerError::ShutDown { reason },
            Err(e) => {
                if !e.is_shutdown() {
                    tracing::error!(rank = self.inner.rank, error = %e, "engine stopped");
                }
                e
            }
        };
        // The launcher hears of a lost rank before any handle resolves: a program that exits
        // on the error (at once, as most do) has written the notice by then, and fhrun names
        // the lost rank rather than this rank's exit.
        self.notify_launcher(&err);
        self.inner.close(err.clone());
        // The flight record is written at the end when the engine stopped on an error, or
        // while this rank still had work (another rank left: the job did not end well).
        let record = !err.is_shutdown() || !self.work.pending.is_empty();
        self.abort_communicators(&err);
        // Whatever was submitted and not negotiated fails now, including submissions that
        // raced with the close.
        while let Ok(msg) = self.rx.try_recv() {
            self.accept(msg);
        }
        self.work.fail_all(&err);
        // Let the channels finish what every rank dispatched, then stop them.
        if let Dispatch::Workers {
            queues,
            threads,
            slots,
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
            // The channels that were busy above are free now.
            if let Some(lost) = err.lost_rank() {
                for slot in &slots {
                    if let Some(mut ex) = slot.try_exec() {
                        ex.abort(lost);
                    }
                }
            }
        }
        if record {
            self.inner.dump_flight(&format!("engine stopped: {err}"));
        }
        tracing::debug!(rank = self.inner.rank, "control thread stopped");
    }

    /// Stopping because a rank was lost: tell the peers on every communicator this rank can
    /// reach (a channel busy in a collective fails on its own), so that a rank that stops
    /// because of another is never blamed for it.
    fn abort_communicators(&mut self, err: &SchedulerError) {
        let Some(lost) = err.lost_rank() else {
            return;
        };
        self.comm.abort(lost);
        match &mut self.dispatch {
            Dispatch::Inline(ex) => ex.abort(lost),
            Dispatch::Workers { slots, .. } => {
                for slot in slots.iter() {
                    if let Some(mut ex) = slot.try_exec() {
                        ex.abort(lost);
                    }
                }
            }
        }
    }

    /// Stopping because a rank was lost: tell the launcher (fhrun) now, naming that rank, so
    /// that it stops the job at once rather than when the first process has finished exiting.
    /// Only the world's engine does (a process set's losses reach the world's engine too).
    fn notify_launcher(&self, err: &SchedulerError) {
        let Some(lost) = err.lost_rank() else {
            return;
        };
        if self.inner.world_ranks.is_some() {
            return;
        }
        let reason = if lost == self.inner.rank {
            format!("failed: {err}")
        } else {
            format!("was lost (rank {} reports: {err})", self.inner.rank)
        };
        fh_job::notice::notify_launcher(lost, &reason);
    }

    /// Rounds until one ends the engine. The state goes to the [`helper`] while the thread
    /// idles (where callers may run rounds), hence the `Option`; it is back whenever this
    /// returns.
    fn main_loop(state: &mut Option<Box<Self>>) -> Result<String, SchedulerError> {
        const HERE: &str = "the control state is back whenever the thread runs";
        loop {
            let this = state.as_mut().expect(HERE);
            if let Some(e) = this.inner.failure() {
                return Err(e);
            }
            this.check_orphans();
            if let Some(deadline) = this.wait() {
                let parked = state.take().expect(HERE);
                let helper = Arc::clone(&parked.helper);
                let (back, why) = helper.park(parked, deadline);
                let this = state.insert(back);
                match why {
                    // The heartbeat is due.
                    Unparked::Deadline => {}
                    // Look again at what there is to do (a caller may have done it).
                    Unparked::Kicked => {
                        this.drain();
                        continue;
                    }
                    Unparked::Exit(outcome) => return outcome,
                }
            }
            let this = state.as_mut().expect(HERE);
            if let Some(e) = this.inner.failure() {
                return Err(e);
            }
            if let Some(reason) = this.round()? {
                return Ok(reason);
            }
        }
    }

    /// A completion dropped unresolved while the engine runs (a result lost: a bug) stops the
    /// engine on every rank through the agreed fault, naming this rank and the tensor; the
    /// close then resolves the orphan's handle with that error.
    fn check_orphans(&mut self) {
        if self.fault.is_none() {
            if let Some(name) = self.inner.orphaned() {
                tracing::error!(rank = self.inner.rank, %name, "an operation's result was lost; stopping the engine on every rank");
                self.fault = Some((
                    name.to_string(),
                    "internal error: its result was lost before it completed".into(),
                ));
            }
        }
    }

    fn accept(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(mut entry) => {
                let rec = self.inner.flight.submitted(&entry.req, entry.submitted);
                entry.cell.set_record(rec);
                self.work.add(*entry);
                self.pacing.fresh = true;
            }
            Msg::Join(cell) => {
                self.join.active = true;
                self.work.join_cells.push(cell);
                self.pacing.fresh = true;
            }
            Msg::Shutdown(reason) => {
                self.shutdown.asked = true;
                if self.shutdown.reason.is_none() {
                    self.shutdown.reason = reason;
                }
                self.pacing.fresh = true;
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
                self.shutdown.asked = true;
                true
            }
        }
    }

    /// Decide when to run the next round: when there is work (or a heartbeat is due), then,
    /// under back-pressure, not while every channel still holds unfinished work (bounded).
    /// `Some(deadline)`: idle, nothing to do before `deadline` (the heartbeat) unless something
    /// arrives; the caller parks the state ([`helper`]) meanwhile.
    fn wait(&mut self) -> Option<Instant> {
        if let Some(deadline) = self.wait_for_work() {
            return Some(deadline);
        }
        let pacing = self.inner.pacing;
        if !pacing.enabled {
            return None;
        }
        let channels = self.inner.counters.channels().len();
        let start = Instant::now();
        loop {
            // Announce the wait before looking, so that a channel draining in between wakes us.
            self.inner.pacing_wait.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            let (busy, bytes) = self.inner.counters.channel_load();
            if self.shutdown.asked
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
        None
    }

    /// Wait until there is something to negotiate (or a heartbeat is due); `Some(deadline)`:
    /// idle until then, where callers may run rounds ([`helper`]) and this thread parks.
    fn wait_for_work(&mut self) -> Option<Instant> {
        let cfg = &self.inner.config;
        let cycle = cfg.cycle_time;
        let window = cfg.batching_window;
        let heartbeat = cfg.idle_heartbeat;
        let spin = cfg.control_spin;
        self.drain();
        if !cycle.is_zero() {
            // Fixed polling cycle (the Horovod schedule): a round every cycle, busy or not.
            let deadline = self.pacing.last_round + cycle;
            while Instant::now() < deadline && !self.shutdown.asked {
                if !self.recv_until(deadline) {
                    break;
                }
            }
            return None;
        }
        if self.pacing.fresh {
            if !window.is_zero() {
                let deadline = Instant::now() + window;
                while Instant::now() < deadline && self.recv_until(deadline) {}
            }
            return None;
        }
        if !self.work.pending.is_empty() || self.join.active {
            // Announced work is pending here. Sit in the next round (a blocking collective)
            // so that a peer's submission completes it at once; back off briefly only while
            // rounds make no progress, so ranks waiting on each other do not spin.
            if self.pacing.last_progress {
                self.pacing.backoff = Duration::from_micros(10);
                return None;
            }
            let deadline = Instant::now() + self.pacing.backoff;
            self.pacing.backoff = (self.pacing.backoff * 2).min(MAX_BACKOFF);
            self.recv_until(deadline);
            return None;
        }
        // Idle. Where callers run rounds, park at once: the caller that waits for the next
        // submission runs its round itself.
        if self.caller_rounds {
            return Some(Instant::now() + heartbeat);
        }
        // Right after a round that completed work the next submission is usually close (the
        // caller's next collective): poll for it briefly, then sleep until a submission, or the
        // heartbeat.
        if self.pacing.last_progress && !spin.is_zero() && self.poll_for_work(spin) {
            return None;
        }
        let deadline = Instant::now() + heartbeat;
        self.recv_until(deadline);
        None
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
                    self.shutdown.asked = true;
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
}
