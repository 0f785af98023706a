//! A caller that waits for its own operation runs the negotiation round itself while the
//! control thread idles (`Config::caller_rounds`).
//!
//! A small synchronous collective (a metric, a loss, a flag) otherwise costs two thread
//! hand-offs besides its round: the submission wakes the control thread, and the round's end
//! wakes the caller. Where ranks share cores (several ranks on one host) those wake-ups are
//! most of the CPU such a collective costs, and the CPU is what its latency waits for: at 4
//! ranks on 2 cores, an 8-byte named allreduce took 35–48 µs of CPU per rank with the
//! hand-offs and 21–25 µs without them. So while the control thread idles it leaves its state
//! ([`Control`]) here, *parked*; a caller blocked in [`crate::Handle::wait`] whose operation is
//! still undispatched borrows it, runs one round on its own thread (the same code and the same
//! collectives in the same order: a rank's rounds are serialised by the borrow) and gives it
//! back.
//!
//! The control thread is woken for what it must do itself: a message (a shutdown, a join, a
//! lost result, a failure) at once; work a borrowed round left, the heartbeat, or an outcome
//! that stops the engine (its exit path then handles it as if its own round had returned it).
//! A *submission* wakes it at once too, unless the last round was a borrowed one: while callers
//! run the rounds (a loop of synchronous collectives), waking the control thread for every
//! submission would cost the very hand-off this saves, so it looks at the submissions on a
//! tick instead ([`LAZY_TICK`], backing off to [`LAZY_TICK_MAX`] while it finds none), and a
//! submission nobody waits for still starts within that tick.
//! Once the control thread runs a round itself (submissions that are not waited for at once,
//! such as gradients during a backward pass), submissions wake it at once again.
//!
//! A borrowed round is one collective that every rank enters on its own schedule, so it ends
//! when the others enter theirs (at the latest at their idle heartbeat, or when a lost rank
//! interrupts it); the borrower then gives the state back whatever happened, also when it
//! panics (the engine then stops with an internal error naming the cause).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Control;
use crate::handle::Assist;
use crate::stats::Counters;
use crate::SchedulerError;

/// How a stop of the engine came about: the round's result that ends the control loop.
type Exit = Result<String, SchedulerError>;

/// How soon the parked control thread first looks for submissions while callers run the
/// rounds (see the module); each look that finds none doubles the wait to the next, up to
/// [`LAZY_TICK_MAX`].
pub(crate) const LAZY_TICK: Duration = Duration::from_micros(200);

/// The longest wait between two looks of [`LAZY_TICK`]'s: the longest a submission that nobody
/// waits for waits to be seen while callers run the rounds. Each look is a wake-up of the
/// control thread, which costs the CPU the callers' rounds need where ranks share cores: at
/// 4 ranks on 2 cores an 8-byte allreduce back to back took 13–15 % less time (and CPU) with
/// looks backing off to 800 µs than every 200 µs (`examples/small_allreduce.rs`), and
/// little more with 2 ms.
pub(crate) const LAZY_TICK_MAX: Duration = Duration::from_micros(800);

/// How long after the last caller's round the control thread keeps looking every tick; then
/// submissions wake it again (an idle engine does not tick).
pub(crate) const LAZY_SPAN: Duration = Duration::from_millis(20);

/// The parking place of one engine's control state (see the module).
pub(crate) struct Helper {
    slot: Mutex<Slot>,
    cv: Condvar,
}

#[derive(Default)]
struct Slot {
    /// Whether callers may run rounds (decided once, when the control thread starts).
    enabled: bool,
    /// The control state while the control thread idles.
    parked: Option<Box<Control>>,
    /// A caller holds the state.
    lent: bool,
    /// Something for the control thread: a message arrived, or a borrower left work or an
    /// outcome behind.
    kicked: bool,
    /// The last round was a caller's: submissions do not wake the control thread, which
    /// looks on a tick instead ([`LAZY_TICK`] to [`LAZY_TICK_MAX`], for [`LAZY_SPAN`] after
    /// `helped_at`).
    lazy: bool,
    /// When a caller last ran a round.
    helped_at: Option<Instant>,
    /// The outcome a borrowed round ended the engine with.
    exit: Option<Exit>,
}

/// Why [`Helper::park`] gave the state back to the control thread.
pub(super) enum Unparked {
    /// The deadline passed (the heartbeat is due).
    Deadline,
    /// A message or a borrower's leftover work.
    Kicked,
    /// A borrowed round stopped the engine.
    Exit(Exit),
}

impl Helper {
    pub(crate) fn new() -> Self {
        Helper {
            slot: Mutex::new(Slot::default()),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Every update of the slot is a few assignments that cannot panic halfway.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Let callers run rounds from now on (the control thread, once, at its start).
    pub(super) fn enable(&self) {
        self.lock().enabled = true;
    }

    /// The control thread idles until `deadline`: park its state here, sleep until the
    /// deadline or a kick, and take the state back (waiting while a caller holds it).
    pub(super) fn park(
        &self,
        control: Box<Control>,
        deadline: Instant,
    ) -> (Box<Control>, Unparked) {
        let mut s = self.lock();
        s.parked = Some(control);
        let mut tick = LAZY_TICK;
        loop {
            if !s.lent {
                let why = if let Some(exit) = s.exit.take() {
                    Some(Unparked::Exit(exit))
                } else if s.kicked {
                    Some(Unparked::Kicked)
                } else if Instant::now() >= deadline {
                    Some(Unparked::Deadline)
                } else {
                    None
                };
                if let Some(why) = why {
                    s.kicked = false;
                    // This thread runs the next round: submissions wake it again.
                    s.lazy = false;
                    let control = s
                        .parked
                        .take()
                        .expect("the state is back whenever no caller holds it");
                    return (control, why);
                }
            }
            if s.lazy && s.helped_at.is_none_or(|t| t.elapsed() >= LAZY_SPAN) {
                // Callers stopped running rounds: submissions wake this thread again.
                s.lazy = false;
            }
            let mut timeout = deadline.saturating_duration_since(Instant::now());
            if s.lazy {
                timeout = timeout.min(tick);
                tick = (tick * 2).min(LAZY_TICK_MAX);
            }
            s = if timeout.is_zero() {
                // Lent past the deadline: the caller's give-back notifies.
                self.cv.wait(s).unwrap_or_else(|p| p.into_inner())
            } else {
                self.cv
                    .wait_timeout(s, timeout)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            };
        }
    }

    /// Borrow the parked state, if the control thread idles and no other caller holds it.
    fn borrow(&self) -> Option<Lent<'_>> {
        let mut s = self.lock();
        if !s.enabled || s.lent || s.exit.is_some() {
            return None;
        }
        let control = s.parked.take()?;
        s.lent = true;
        Some(Lent {
            helper: self,
            control: Some(control),
            ran: false,
        })
    }

    /// Note that a message is on its way; wake the control thread when `now` or while it runs
    /// the rounds itself, and only where it sleeps here with its state parked: a running
    /// control thread takes the message from its queue (whose send wakes it where it waits
    /// there), and a borrower's give-back wakes it where the message is left for it. (A
    /// condition variable's notify is a system call even with nobody asleep: once per
    /// gradient of a backward pass, where the control thread runs.)
    fn kick(&self, now: bool) {
        let mut s = self.lock();
        s.kicked = true;
        let wake = (now || !s.lazy) && s.parked.is_some();
        drop(s);
        if wake {
            self.cv.notify_all();
        }
    }
}

impl Assist for Helper {
    fn ring(&self) {
        self.kick(true);
    }

    fn ring_submitted(&self) {
        self.kick(false);
    }

    fn help(&self, name: &str) {
        let Some(mut lent) = self.borrow() else {
            return;
        };
        let control = lent.control.as_mut().expect("held until given back");
        control.drain();
        if !control.can_help(name) {
            return;
        }
        lent.ran = true;
        Counters::add(&control.inner.counters.caller_rounds, 1);
        let exit = match control.help_round() {
            Ok(None) => None,
            Ok(Some(reason)) => Some(Ok(reason)),
            Err(e) => Some(Err(e)),
        };
        lent.give_back(exit);
    }
}

/// The control state as this module sees it.
impl Control {
    /// Whether a caller waiting for `name` may run the next round (this module): the operation
    /// is still undispatched here and nothing but rounds is pending (no fault, shutdown or
    /// join to raise first).
    fn can_help(&self, name: &str) -> bool {
        self.fault.is_none()
            && !self.shutdown.asked
            && !self.join.active
            && self.work.by_name.contains_key(name)
            && self.inner.failure().is_none()
    }

    /// One round on a caller's thread (this module): what the loop does between its waits.
    fn help_round(&mut self) -> Result<Option<String>, SchedulerError> {
        self.check_orphans();
        self.round()
    }

    /// Whether the control thread must act after a caller's round: work left, or anything
    /// only it handles.
    fn needs_control_thread(&self) -> bool {
        !self.work.pending.is_empty()
            || !self.work.held.is_empty()
            || !self.work.join_cells.is_empty()
            || self.join.active
            || self.shutdown.asked
            || self.fault.is_some()
            || self.pacing.fresh
            || self.inner.failure().is_some()
            || self.inner.orphaned().is_some()
    }
}

/// The control state lent to a caller: given back on every path ([`Lent::give_back`], or the
/// drop, which a panic in the borrowed round also runs).
struct Lent<'a> {
    helper: &'a Helper,
    control: Option<Box<Control>>,
    /// The caller ran a round with it.
    ran: bool,
}

impl Lent<'_> {
    fn give_back(mut self, exit: Option<Exit>) {
        self.put_back(exit);
    }

    fn put_back(&mut self, exit: Option<Exit>) {
        let Some(control) = self.control.take() else {
            return;
        };
        // Before the slot's lock: this looks at the gate, whose holders ring (taking the slot's
        // lock). A message sent after the look at the queue below, made under the slot's lock,
        // rings after this returns, so none is missed.
        let busy = control.needs_control_thread();
        let mut s = self.helper.lock();
        s.kicked = exit.is_some() || busy || !control.rx.is_empty();
        if exit.is_some() {
            s.exit = exit;
        }
        s.parked = Some(control);
        s.lent = false;
        // The control thread sleeps until the heartbeat unless it must act, or it must start
        // looking every tick (the rounds became the callers').
        let wake = s.kicked || (self.ran && !s.lazy);
        if self.ran {
            s.lazy = true;
            s.helped_at = Some(Instant::now());
        }
        drop(s);
        if wake {
            self.helper.cv.notify_all();
        }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let exit = std::thread::panicking().then(|| {
            Err(SchedulerError::internal(
                "a caller's thread panicked while it ran the engine's negotiation round (a bug \
                 in FastHorovod: please report it)",
            ))
        });
        self.put_back(exit);
    }
}
