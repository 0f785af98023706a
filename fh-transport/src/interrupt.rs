//! Stopping a communicator's blocked operation from another thread.
//!
//! A communicator is driven by one thread at a time (`&mut self`), and its waits are bounded by
//! the backend's timeout. When the fault is known elsewhere first — another channel lost a rank,
//! the liveness watch ([`crate::liveness`]) found a peer frozen or cut off — a wait for that
//! peer should not run out its timeout: [`Interrupt::raise`] ends it at once, from any thread.
//! The communicator's operation then fails as if it had lost the named rank itself (it tells
//! its peers whom to blame, as on any failure), and so does every later operation.
//!
//! An [`Interrupt`] is a cheap, cloneable handle; [`Communicator::interrupter`] gives the one a
//! communicator watches. A backend whose waits poll descriptors (TCP) polls
//! [`Interrupt::wake_fd`] with them; others look at [`Interrupt::cause`] between the slices of
//! their sleeps (shared memory: every liveness interval, 100 ms by default).
//!
//! [`Communicator::interrupter`]: crate::Communicator::interrupter

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::TransportError;

/// Why an [`Interrupt`] was raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// The rank whose loss stops the communicator, numbered in the world (the job's ranks; a
    /// process set's communicators and a host's shared-memory half of a hierarchical
    /// communicator translate to their own numbering); `None` when no rank is to blame (the
    /// communicator is only closed).
    pub lost: Option<usize>,
    /// What happened, for the error's text.
    pub why: String,
}

impl Cause {
    /// The error an interrupted operation returns: [`TransportError::PeerLost`] naming the
    /// lost rank, or [`TransportError::Closed`].
    pub fn error(&self) -> TransportError {
        match self.lost {
            Some(rank) => TransportError::PeerLost {
                rank,
                detail: self.why.clone(),
            },
            None => TransportError::Closed(self.why.clone()),
        }
    }
}

#[derive(Debug)]
struct Shared {
    raised: AtomicBool,
    cause: Mutex<Option<Cause>>,
    /// Written once when raised; the other end is what waits poll (readable from then on).
    wake_tx: Option<UnixStream>,
    wake_rx: Option<UnixStream>,
}

/// A handle that ends a communicator's blocked operation from any thread (see the
/// [module documentation](self)). Clones share one state: raising any clone raises them all,
/// and the first cause raised is the one kept.
#[derive(Debug, Clone)]
pub struct Interrupt(Arc<Shared>);

impl Default for Interrupt {
    fn default() -> Self {
        Interrupt::new()
    }
}

impl Interrupt {
    /// A fresh, unraised interrupt.
    pub fn new() -> Interrupt {
        // Without a socket pair (descriptors exhausted) the waits that poll only notice the
        // interrupt at their next wake-up; they still notice it.
        let (tx, rx) = match UnixStream::pair() {
            Ok((tx, rx)) => {
                let _ = tx.set_nonblocking(true);
                let _ = rx.set_nonblocking(true);
                (Some(tx), Some(rx))
            }
            Err(e) => {
                tracing::warn!(error = %e, "no socket pair for an interrupt; waits notice it late");
                (None, None)
            }
        };
        Interrupt(Arc::new(Shared {
            raised: AtomicBool::new(false),
            cause: Mutex::new(None),
            wake_tx: tx,
            wake_rx: rx,
        }))
    }

    /// Stop the communicator because rank `lost` (in the communicator's numbering) was lost, or
    /// close it without blame (`None`): its blocked operation, and every later one, fails with
    /// [`Cause::error`]. The first raise wins; later ones change nothing. Never blocks.
    pub fn raise(&self, lost: Option<usize>, why: impl Into<String>) {
        {
            let mut c = self.0.cause.lock().unwrap_or_else(|p| p.into_inner());
            if c.is_some() {
                return;
            }
            *c = Some(Cause {
                lost,
                why: why.into(),
            });
        }
        self.0.raised.store(true, Ordering::Release);
        if let Some(tx) = &self.0.wake_tx {
            // One byte makes the other end readable for good (nobody reads it); a full buffer
            // means it is readable already.
            let _ = (&*tx).write(&[1]);
        }
    }

    /// Whether the interrupt was raised (one atomic load).
    pub fn is_raised(&self) -> bool {
        self.0.raised.load(Ordering::Acquire)
    }

    /// Why the interrupt was raised, if it was.
    pub fn cause(&self) -> Option<Cause> {
        if !self.is_raised() {
            return None;
        }
        self.0
            .cause
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A descriptor that becomes readable when the interrupt is raised (and stays so), for
    /// waits that poll descriptors; `None` when none could be made.
    pub fn wake_fd(&self) -> Option<RawFd> {
        self.0.wake_rx.as_ref().map(|s| s.as_raw_fd())
    }

    /// Whether `self` and `other` are clones of one interrupt.
    pub fn same(&self, other: &Interrupt) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::BorrowedFd;
    use std::time::{Duration, Instant};

    /// Whether `fd` turns readable within `wait`.
    fn readable(fd: RawFd, wait: Duration) -> bool {
        // SAFETY: the interrupt under test owns `fd` and outlives the call.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let mut p = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: wait.as_secs() as _,
            tv_nsec: wait.subsec_nanos() as _,
        };
        rustix::event::poll(&mut p, Some(&ts)).unwrap_or(0) == 1
    }

    #[test]
    fn the_first_cause_wins_and_the_wake_fd_turns_readable() {
        let i = Interrupt::new();
        assert!(i.cause().is_none());
        let fd = i.wake_fd().expect("a socket pair");
        assert!(!readable(fd, Duration::ZERO));
        let other = i.clone();
        std::thread::spawn(move || other.raise(Some(3), "rank 3 froze"))
            .join()
            .unwrap();
        i.raise(Some(1), "later");
        let c = i.cause().unwrap();
        assert_eq!(c.lost, Some(3));
        assert!(matches!(
            c.error(),
            TransportError::PeerLost { rank: 3, .. }
        ));
        let t = Instant::now();
        assert!(readable(fd, Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
