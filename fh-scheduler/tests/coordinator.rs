//! The coordinator round gathers requests to rank 0 and broadcasts the responses: the bytes a
//! coordinator round puts on the control communicator grow linearly with the rank count, not
//! quadratically (as an allgather of every rank's request list would).
//!
//! `cargo test -p fh-scheduler --test coordinator -- --nocapture` prints the figures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, Tensor};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Communicator, Result as TResult, Topology, Transport};

/// Counts the bytes sent on the communicator labelled `fh-control`.
struct Counting {
    inner: Box<dyn Transport>,
    sent: Arc<AtomicU64>,
}

struct CountingComm {
    inner: Box<dyn Communicator>,
    sent: Option<Arc<AtomicU64>>,
}

impl Transport for Counting {
    fn backend(&self) -> &'static str {
        "counting"
    }

    fn wire(&self) -> fh_transport::WireKind {
        self.inner.wire()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn open(&mut self, label: &str) -> TResult<Box<dyn Communicator>> {
        let inner = self.inner.open(label)?;
        Ok(Box::new(CountingComm {
            inner,
            sent: (label == "fh-control").then(|| self.sent.clone()),
        }))
    }
}

impl CountingComm {
    fn count(&self, n: usize) {
        if let Some(s) = &self.sent {
            s.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

impl Communicator for CountingComm {
    fn backend(&self) -> &'static str {
        "counting"
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> TResult<()> {
        self.count(data.len());
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> TResult<()> {
        self.inner.recv(peer, buf)
    }
    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> TResult<()> {
        self.count(send.len());
        self.inner.send_recv(to, send, from, recv)
    }
}

/// Control-plane bytes per coordinator round (all ranks together) with `n` ranks, each
/// submitting `names` new names per step, every round through the coordinator (no cache).
fn bytes_per_coordinator_round(n: usize, names: usize) -> f64 {
    let sent = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = LocalWorld::with_timeout(n, Duration::from_secs(60))
        .into_iter()
        .map(|t| {
            let sent = sent.clone();
            std::thread::spawn(move || {
                let t = Counting {
                    inner: Box::new(t),
                    sent,
                };
                let cfg = Config::default().channels(1).cache_capacity(0);
                let e = Engine::start(Box::new(t), cfg).unwrap();
                let opts = AllreduceOptions::with_op(ReduceOp::Sum);
                let before = e.stats();
                for step in 0..3 {
                    let hs: Vec<_> = (0..names)
                        .map(|i| {
                            e.allreduce(
                                &format!("layer{i}.weight.step{step}"),
                                Tensor::from_slice(&[1.0f32; 4]),
                                opts,
                            )
                            .unwrap()
                        })
                        .collect();
                    for mut h in hs {
                        let v = h.wait_timeout(Duration::from_secs(60)).unwrap();
                        assert_eq!(v.to_vec::<f32>().unwrap(), [n as f32; 4]);
                    }
                }
                let after = e.stats();
                let rounds = after.coordinator_rounds - before.coordinator_rounds;
                e.shutdown().unwrap();
                rounds
            })
        })
        .collect();
    let rounds: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        rounds.iter().all(|&r| r == rounds[0] && r > 0),
        "{rounds:?}"
    );
    sent.load(Ordering::Relaxed) as f64 / rounds[0] as f64
}

#[test]
fn coordinator_bytes_grow_linearly_with_ranks() {
    let mut per_rank = Vec::new();
    for n in [4usize, 16, 64] {
        let b = bytes_per_coordinator_round(n, 8);
        eprintln!(
            "coordinator: {n:>3} ranks: {b:>10.0} control bytes per coordinator round ({:.0} per rank)",
            b / n as f64
        );
        per_rank.push(b / n as f64);
    }
    // Per rank, the bytes of a round stay bounded as ranks grow (the bit-vector allreduce and
    // the response broadcast add a logarithmic factor at most); an allgather of the request
    // lists would make them grow with the rank count (×16 from 4 to 64 ranks).
    assert!(
        per_rank[2] < 4.0 * per_rank[0],
        "bytes per rank and round: {per_rank:?}"
    );
}
