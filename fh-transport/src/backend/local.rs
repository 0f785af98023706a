//! The in-process backend: one thread per rank, messages through crossbeam channels.
//!
//! Used by tests and for single-process use. Sends never block (channels are unbounded);
//! receives wait at most the world's timeout. When a rank's communicator is dropped, its peers'
//! pending and later receives from it fail with [`TransportError::PeerLost`].
//!
//! ```
//! use fh_transport::{backend::local::LocalWorld, CollectivesExt, Transport};
//! use fh_core::ReduceOp;
//!
//! let handles: Vec<_> = LocalWorld::new(3)
//!     .into_iter()
//!     .map(|mut t| std::thread::spawn(move || {
//!         let mut comm = t.open("data").unwrap();
//!         let mut v = [t.rank() as f32 + 1.0; 4];
//!         comm.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
//!         v
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), [6.0; 4]);
//! }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use crate::{Communicator, Interrupt, Result, Topology, Transport, TransportError};

/// Default receive timeout of the in-process backend.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

type Pending = HashMap<u64, Vec<Option<LocalComm>>>;

/// Factory for a world of in-process ranks.
#[derive(Debug)]
pub struct LocalWorld;

impl LocalWorld {
    /// Create `size` connected transports, one per rank, with the default timeout.
    #[allow(clippy::new_ret_no_self)] // a factory: one transport per rank
    pub fn new(size: usize) -> Vec<LocalTransport> {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// Create `size` connected transports whose receives give up after `timeout`.
    pub fn with_timeout(size: usize, timeout: Duration) -> Vec<LocalTransport> {
        let shared = Arc::new(Mutex::new(Pending::new()));
        (0..size)
            .map(|rank| LocalTransport {
                rank,
                size,
                timeout,
                next: 0,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

/// One rank's handle on an in-process world.
#[derive(Debug)]
pub struct LocalTransport {
    rank: usize,
    size: usize,
    timeout: Duration,
    next: u64,
    shared: Arc<Mutex<Pending>>,
}

impl Transport for LocalTransport {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn wire(&self) -> crate::WireKind {
        crate::WireKind::Memory
    }

    fn topology(&self) -> Topology {
        Topology::single_host(self.rank, self.size)
    }

    fn open(&mut self, _label: &str) -> Result<Box<dyn Communicator>> {
        let seq = self.next;
        self.next += 1;
        let mut pending = self
            .shared
            .lock()
            .map_err(|_| TransportError::Closed("in-process world poisoned by a panic".into()))?;
        let slot = pending
            .entry(seq)
            .or_insert_with(|| build_group(self.size, self.timeout));
        let comm = slot[self.rank]
            .take()
            .ok_or_else(|| TransportError::InvalidArgument("communicator opened twice".into()))?;
        if slot.iter().all(Option::is_none) {
            pending.remove(&seq);
        }
        Ok(Box::new(comm))
    }
}

fn build_group(size: usize, timeout: Duration) -> Vec<Option<LocalComm>> {
    let blame: Arc<[AtomicUsize]> = (0..size).map(|_| AtomicUsize::new(0)).collect();
    // chans[src][dst]
    let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = Vec::with_capacity(size);
    let mut receivers: Vec<Vec<Option<Receiver<Vec<u8>>>>> = (0..size)
        .map(|_| (0..size).map(|_| None).collect())
        .collect();
    for src in 0..size {
        let mut row = Vec::with_capacity(size);
        for dst_row in receivers.iter_mut() {
            let (tx, rx) = unbounded();
            row.push(Some(tx));
            dst_row[src] = Some(rx);
        }
        senders.push(row);
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (tx, rx))| {
            Some(LocalComm {
                rank,
                size,
                timeout,
                to: tx.into_iter().map(|s| s.expect("filled above")).collect(),
                from: rx.into_iter().map(|r| r.expect("filled above")).collect(),
                blame: Arc::clone(&blame),
                interrupt: Interrupt::new(),
            })
        })
        .collect()
}

/// A communicator of the in-process backend.
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    size: usize,
    timeout: Duration,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
    /// For each rank of the communicator, `1 + ` the rank it blamed when it gave up
    /// ([`Communicator::abort`]), or 0.
    blame: Arc<[AtomicUsize]>,
    /// Ends a wait from another thread ([`Communicator::interrupter`]); looked at every
    /// [`INTERRUPT_POLL`] while a receive waits.
    interrupt: Interrupt,
}

/// How often a waiting receive looks at its interrupt.
const INTERRUPT_POLL: Duration = Duration::from_millis(20);

impl LocalComm {
    /// The error for `peer` having left: the rank it blamed when it gave up (followed along
    /// a chain of ranks that gave up), else `peer` itself.
    fn lost(&self, peer: usize) -> TransportError {
        let mut cause = peer;
        for _ in 0..self.size {
            match self.blame[cause].load(Ordering::Acquire) {
                0 => break,
                b if b - 1 == cause || b - 1 == self.rank => break,
                b => cause = b - 1,
            }
        }
        TransportError::PeerLost {
            rank: cause,
            detail: if cause == peer {
                "its in-process communicator was dropped".into()
            } else {
                format!(
                    "rank {peer} gave up on its in-process communicator after losing rank {cause}"
                )
            },
        }
    }

    /// Fail because the interrupt was raised: give up as [`Communicator::abort`] does (peers
    /// waiting for this rank learn whom to blame) and return the cause's error.
    fn check_interrupt(&mut self) -> Result<()> {
        let Some(cause) = self.interrupt.cause() else {
            return Ok(());
        };
        if let Some(lost) = cause.lost {
            self.abort(lost);
        }
        Err(cause.error())
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "peer {peer} out of range 0..{}",
                self.size
            )));
        }
        Ok(())
    }
}

impl Communicator for LocalComm {
    fn allreduce_agreeing(
        &mut self,
        buf: &mut [u8],
        dtype: fh_core::DType,
        op: fh_core::ReduceOp,
        mine: bool,
    ) -> Result<bool> {
        // The allreduce runs over this communicator's own messages: the flag rides in them.
        crate::algorithms::allreduce_agreeing(self, buf, dtype, op, mine)
    }

    fn agrees_in_band(&self) -> bool {
        true
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.check_interrupt()?;
        self.to[peer]
            .send(data.to_vec())
            .map_err(|_| self.lost(peer))
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.check_peer(peer)?;
        let deadline = Instant::now() + self.timeout;
        let msg = loop {
            self.check_interrupt()?;
            let left = deadline.saturating_duration_since(Instant::now());
            match self.from[peer].recv_timeout(left.min(INTERRUPT_POLL)) {
                Ok(m) => break m,
                Err(RecvTimeoutError::Timeout) if !left.is_zero() => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(TransportError::Timeout {
                        rank: peer,
                        op: "recv",
                        after: self.timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.lost(peer)),
            }
        };
        if msg.len() != buf.len() {
            return Err(TransportError::Protocol {
                rank: peer,
                detail: format!(
                    "expected a message of {} bytes, received {}",
                    buf.len(),
                    msg.len()
                ),
            });
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        // Sends never block here, so sending first cannot deadlock.
        self.send(to, send)?;
        self.recv(from, recv)
    }

    fn abort(&mut self, lost: usize) {
        if lost < self.size {
            self.blame[self.rank].store(lost + 1, Ordering::Release);
        }
        // Peers waiting for this rank see it leave now, and read the blame.
        let (to, from) = (self.to.len(), self.from.len());
        self.to = (0..to).map(|_| unbounded().0).collect();
        self.from = (0..from).map(|_| unbounded().1).collect();
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}
