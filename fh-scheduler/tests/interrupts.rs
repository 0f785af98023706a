//! A stopping engine interrupts every channel blocked on a peer at once (issue 38): the error
//! comes when the fault is known, not when the blocked channel's own wait times out.
//!
//! Three ranks on the in-process transport, whose waits time out after 60 s. Rank 2's data
//! channels stall (as a frozen peer's would) as soon as they carry a collective, until their
//! communicator is interrupted; while they stall, rank 2's control communicator fails. So the
//! fault is known on rank 2 at once, and on ranks 0 and 1 at their next negotiation round —
//! while their channels wait in the collective for rank 2's data. Every rank's handle must
//! resolve with an error naming rank 2 well within the 60 s, which only happens when each
//! engine interrupts its channels as it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, Tensor};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Communicator, Interrupt, Result, Topology, Transport, TransportError};

/// The in-process transport's timeout: far longer than the test waits.
const TRANSPORT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a rank may take to see its handle fail.
const BOUND: Duration = Duration::from_secs(20);

/// Rank 2's world: data channels stall once they carry a collective; then the control
/// communicator fails.
struct Stalling {
    inner: Box<dyn Transport>,
    stalled: Arc<AtomicBool>,
}

impl Transport for Stalling {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn wire(&self) -> fh_transport::WireKind {
        self.inner.wire()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(StallingComm {
            inner: self.inner.open(label)?,
            control: label == "fh-control",
            stalled: Arc::clone(&self.stalled),
        }))
    }
}

struct StallingComm {
    inner: Box<dyn Communicator>,
    control: bool,
    stalled: Arc<AtomicBool>,
}

impl StallingComm {
    fn step(&mut self) -> Result<()> {
        if self.control {
            if self.stalled.load(Ordering::SeqCst) {
                let err = TransportError::Protocol {
                    rank: 2,
                    detail: "injected: rank 2's control communicator broke".into(),
                };
                return Err(err);
            }
            return Ok(());
        }
        // A data channel: stall (as a frozen rank does) until interrupted, or far longer than
        // the test waits.
        self.stalled.store(true, Ordering::SeqCst);
        let interrupt: Interrupt = self.inner.interrupter().expect("local comms interrupt");
        let until = Instant::now() + TRANSPORT_TIMEOUT;
        while Instant::now() < until {
            if let Some(c) = interrupt.cause() {
                return Err(c.error());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Err(TransportError::Timeout {
            rank: 0,
            op: "stalled on purpose",
            after: TRANSPORT_TIMEOUT,
        })
    }
}

impl Communicator for StallingComm {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.step()?;
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.step()?;
        self.inner.recv(peer, buf)
    }
    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.step()?;
        self.inner.send_recv(to, send, from, recv)
    }
    fn abort(&mut self, lost: usize) {
        self.inner.abort(lost);
    }
    fn interrupter(&self) -> Option<Interrupt> {
        self.inner.interrupter()
    }
}

#[test]
fn a_stopping_engine_interrupts_its_channels_blocked_on_a_peer() {
    let stalled = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = LocalWorld::with_timeout(3, TRANSPORT_TIMEOUT)
        .into_iter()
        .map(|t| {
            let stalled = Arc::clone(&stalled);
            std::thread::spawn(move || {
                let rank = t.rank();
                let world: Box<dyn Transport> = if rank == 2 {
                    Box::new(Stalling {
                        inner: Box::new(t),
                        stalled,
                    })
                } else {
                    Box::new(t)
                };
                // One channel, and no inline small groups: the collective runs on the channel.
                let cfg = Config::default().channels(1).inline_bytes(0);
                let engine = Engine::start(world, cfg).expect("start");
                let start = Instant::now();
                // Large enough to be a fused group run by the channel, not the control thread.
                let x = Tensor::from_slice(&vec![1.0f32; 100_000]);
                let res = engine
                    .allreduce("x", x, AllreduceOptions::with_op(ReduceOp::Sum))
                    .and_then(|h| h.wait());
                let took = start.elapsed();
                let _ = engine.shutdown();
                (rank, res.err(), took)
            })
        })
        .collect();
    let deadline = Instant::now() + BOUND + TRANSPORT_TIMEOUT;
    for t in threads {
        let (rank, err, took) = t.join().expect("rank thread");
        let err = err.unwrap_or_else(|| panic!("rank {rank}: the allreduce succeeded"));
        assert_eq!(err.lost_rank(), Some(2), "rank {rank}: {err}");
        assert!(
            took < BOUND,
            "rank {rank} failed only after {took:?} (its channel waited for its timeout): {err}"
        );
        assert!(Instant::now() < deadline);
    }
}
