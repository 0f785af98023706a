//! Handles: the caller's side of a submitted operation.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{SchedulerError, Tensor};

/// The result an operation completes with.
pub type OpResult = Result<Tensor, SchedulerError>;

type Callback = Box<dyn FnOnce(OpResult) + Send + 'static>;

enum State {
    Pending(Option<Callback>),
    Done(OpResult),
    Taken,
}

/// Shared completion cell between a handle and the engine.
pub(crate) struct Completion {
    state: Mutex<State>,
    cv: Condvar,
    /// Threads asleep on `cv`, counted under `state`'s lock (a sleeper counts itself before
    /// the wait releases the lock and uncounts itself once it holds it again), so that
    /// [`Completion::complete`] only wakes where somebody sleeps: a wake-up is a system call
    /// even with nobody to wake, and the common case — the waiter ran the round itself or
    /// was still polling — has nobody.
    sleepers: AtomicUsize,
}

impl Completion {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Completion {
            state: Mutex::new(State::Pending(None)),
            cv: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state inconsistent (every update is
        // a single assignment), so recover from poisoning.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deliver the result (first call wins).
    pub(crate) fn complete(&self, result: OpResult) {
        let mut st = self.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Pending(Some(cb)) => {
                drop(st);
                cb(result);
            }
            State::Pending(None) => {
                *st = State::Done(result);
                // Read under the lock: a sleeper counted itself under it before sleeping.
                let wake = self.sleepers.load(Ordering::Relaxed) > 0;
                drop(st);
                if wake {
                    self.cv.notify_all();
                }
            }
            other => *st = other,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        !matches!(*self.lock(), State::Pending(_))
    }

    /// Poll for completion for at most `limit`, yielding the core between looks: a result
    /// that arrives meanwhile costs no sleep and wake-up on the condition variable.
    fn settle(&self, limit: Duration) {
        if limit.is_zero() {
            return;
        }
        let t0 = Instant::now();
        while !self.is_done() && t0.elapsed() < limit {
            std::thread::yield_now();
        }
    }

    /// Sleep on the condition variable until woken, or for at most `limit` (`st`: this
    /// cell's lock, held), counted in `sleepers` meanwhile.
    fn sleep<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        limit: Option<Duration>,
    ) -> MutexGuard<'a, State> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let st = match limit {
            None => self.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
            Some(d) => {
                self.cv
                    .wait_timeout(st, d)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        st
    }
}

/// The control thread's side of a caller that waits ([`Handle::wait`]): the control module's
/// parking place (`control::helper`), seen from here through this trait so that this module
/// imports none of the engine's.
pub(crate) trait Assist: Send + Sync {
    /// A message is on its way to the control thread: wake it if it idles.
    fn ring(&self);
    /// A submission is on its way to the control thread: wake it if it idles, unless callers
    /// run the rounds (it then looks for submissions on a short tick).
    fn ring_submitted(&self);
    /// A caller waits for the operation `name`: run a negotiation round on this thread when
    /// the control thread idles and the operation is still undispatched; else nothing.
    fn help(&self, name: &str);
}

/// How long a wait polls before it sleeps ([`Completion::settle`]): on this project's 2-core,
/// 4-rank loopback measurement a step of 16 or 256 small named allreduces took about a fifth
/// less with 20 µs than with none.
const WAIT_SPIN: Duration = Duration::from_micros(20);

/// The shortest bounded wait ([`Handle::wait_for`], [`Handle::wait_timeout`]) that may run a
/// negotiation round on the caller's thread: such a round ends when every rank has entered it,
/// at the latest at the others' idle heartbeat, which a short wait should not sit through.
const CALLER_ROUND_MIN_WAIT: Duration = Duration::from_millis(100);

/// A pending operation. Obtain its result with [`Handle::wait`] (blocking, after polling for up to
/// 20 µs with the core yielded between looks),
/// [`Handle::wait_timeout`], or [`Handle::on_complete`]; check it with [`Handle::poll`].
///
/// A wait on an operation not yet dispatched may run the engine's next negotiation round on the
/// waiting thread while the engine's own thread idles (`Config::caller_rounds`): the same round,
/// without two thread hand-offs. [`Handle::on_complete`] callbacks of other operations that
/// round completes then run on the waiting thread.
///
/// Dropping a handle does not cancel the operation (the other ranks rely on it); its result is
/// dropped when it completes.
#[must_use = "an operation's result is only available through its handle"]
pub struct Handle {
    name: std::sync::Arc<str>,
    cell: Arc<Completion>,
    /// The engine's control thread, for a wait that may run the round itself
    /// (`Config::caller_rounds`).
    assist: Option<Arc<dyn Assist>>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("name", &self.name)
            .field("done", &self.poll())
            .finish()
    }
}

impl Handle {
    pub(crate) fn new(
        name: Arc<str>,
        cell: Arc<Completion>,
        assist: Option<Arc<dyn Assist>>,
    ) -> Self {
        Handle { name, cell, assist }
    }

    /// While the operation is pending and still undispatched, and the control thread idles,
    /// run the next negotiation round on this thread (`Config::caller_rounds`).
    fn help(&self) {
        if let Some(a) = &self.assist {
            if !self.cell.is_done() {
                a.help(&self.name);
            }
        }
    }

    /// The operation's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the operation has completed (successfully or not).
    pub fn poll(&self) -> bool {
        self.cell.is_done()
    }

    /// Block until the operation completes; return the result tensor (the submitted buffer,
    /// now holding the result) or the error. May run a negotiation round on this thread (see
    /// [`Handle`]).
    pub fn wait(self) -> OpResult {
        self.help();
        self.cell.settle(WAIT_SPIN);
        let mut st = self.cell.lock();
        loop {
            match std::mem::replace(&mut *st, State::Taken) {
                State::Done(r) => return r,
                pending @ State::Pending(_) => {
                    *st = pending;
                    st = self.cell.sleep(st, None);
                }
                State::Taken => {
                    return Err(SchedulerError::InvalidArgument(format!(
                        "the result of '{}' was already taken",
                        self.name
                    )))
                }
            }
        }
    }

    /// Block until the operation completes or `timeout` passes. On completion the result is
    /// taken (a later call returns an error saying so); on timeout
    /// [`SchedulerError::WaitTimeout`] is returned and the handle stays pending: the operation
    /// goes on in the background and its tensor is given back by a later wait. A `timeout` of
    /// 100 ms or more may run a negotiation round on this thread (see [`Handle`]); such a round
    /// ends when every rank has entered it, at the latest at the others' idle heartbeat, so the
    /// wait may then outlast `timeout` by that much.
    pub fn wait_timeout(&mut self, timeout: Duration) -> OpResult {
        if self.wait_for(timeout) {
            self.take()
        } else {
            Err(SchedulerError::WaitTimeout {
                name: self.name.to_string(),
                after: timeout,
            })
        }
    }

    /// Take the result of a completed operation (`None` while it is pending).
    pub fn try_take(&mut self) -> Option<OpResult> {
        if self.poll() {
            Some(self.take())
        } else {
            None
        }
    }

    fn take(&mut self) -> OpResult {
        let mut st = self.cell.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => r,
            pending @ State::Pending(_) => {
                *st = pending;
                Err(SchedulerError::internal(format!(
                    "'{}' is still pending",
                    self.name
                )))
            }
            State::Taken => Err(SchedulerError::InvalidArgument(format!(
                "the result of '{}' was already taken",
                self.name
            ))),
        }
    }

    /// Block until the operation completes or `timeout` passes, without taking the result;
    /// returns whether it completed. Runs rounds as [`Handle::wait_timeout`] does.
    pub fn wait_for(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        if timeout >= CALLER_ROUND_MIN_WAIT {
            self.help();
        }
        self.cell.settle(WAIT_SPIN.min(timeout));
        let mut st = self.cell.lock();
        while matches!(*st, State::Pending(_)) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.cell.sleep(st, Some(deadline - now));
        }
        true
    }

    /// Run `f` with the result when the operation completes: on the engine's thread that
    /// completes it, or right now on this thread if it already has. `f` should be quick.
    pub fn on_complete(self, f: impl FnOnce(OpResult) + Send + 'static) {
        let mut st = self.cell.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Pending(_) => *st = State::Pending(Some(Box::new(f))),
            State::Done(r) => {
                drop(st);
                f(r);
            }
            State::Taken => {}
        }
    }
}

/// The handles of a grouped submission.
#[derive(Debug)]
#[must_use = "an operation's result is only available through its handle"]
pub struct GroupHandle {
    handles: Vec<Handle>,
}

impl GroupHandle {
    pub(crate) fn new(handles: Vec<Handle>) -> Self {
        GroupHandle { handles }
    }

    /// Whether every member has completed.
    pub fn poll(&self) -> bool {
        self.handles.iter().all(Handle::poll)
    }

    /// Wait for every member; the first error wins.
    pub fn wait(self) -> Result<Vec<Tensor>, SchedulerError> {
        let results: Vec<OpResult> = self.handles.into_iter().map(Handle::wait).collect();
        results.into_iter().collect()
    }

    /// Wait for every member, at most `timeout` in all. On timeout
    /// [`SchedulerError::WaitTimeout`] is returned and the group stays pending (nothing is
    /// taken), so it can be waited for again.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Vec<Tensor>, SchedulerError> {
        let deadline = Instant::now() + timeout;
        for h in &self.handles {
            if !h.wait_for(deadline.saturating_duration_since(Instant::now())) {
                return Err(SchedulerError::WaitTimeout {
                    name: h.name.to_string(),
                    after: timeout,
                });
            }
        }
        let results: Vec<OpResult> = self.handles.iter_mut().map(Handle::take).collect();
        results.into_iter().collect()
    }

    /// The member handles.
    pub fn into_handles(self) -> Vec<Handle> {
        self.handles
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(cell: &Arc<Completion>) -> Handle {
        Handle::new(Arc::from("t"), Arc::clone(cell), None)
    }

    /// Until a waiter sleeps on `cell`'s condition variable (past its 20 µs of polling).
    fn until_asleep(cell: &Completion) {
        let t0 = Instant::now();
        while cell.sleepers.load(Ordering::Relaxed) == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the waiter never slept"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn done() -> OpResult {
        Ok(Tensor::from_slice(&[7.0f32]))
    }

    #[test]
    fn a_sleeping_wait_is_woken_by_the_completion() {
        let cell = Completion::new();
        let h = handle(&cell);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(h.wait()));
        until_asleep(&cell);
        cell.complete(done());
        // Bounded: a lost wake-up fails here instead of hanging the test.
        let got = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the waiter was not woken")
            .unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), [7.0]);
        assert_eq!(cell.sleepers.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_bounded_wait_is_woken_by_the_completion_and_times_out_without_it() {
        let cell = Completion::new();
        let mut h = handle(&cell);
        assert!(matches!(
            h.wait_timeout(Duration::from_millis(20)),
            Err(SchedulerError::WaitTimeout { .. })
        ));
        assert_eq!(cell.sleepers.load(Ordering::Relaxed), 0);
        let waiter = std::thread::spawn(move || h.wait_timeout(Duration::from_secs(20)));
        let t0 = Instant::now();
        until_asleep(&cell);
        cell.complete(done());
        assert!(waiter.join().unwrap().is_ok());
        // Woken by the completion, not at its 20 s deadline (which also returns the result).
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "woken only by the deadline"
        );
    }

    #[test]
    fn a_completion_nobody_waits_for_is_kept_for_the_wait() {
        let cell = Completion::new();
        cell.complete(done());
        assert!(handle(&cell).poll());
        assert!(handle(&cell).wait().is_ok());
        // Taken once: a second wait says so.
        let err = handle(&cell).wait().unwrap_err().to_string();
        assert!(err.contains("already taken"), "{err}");
    }
}
