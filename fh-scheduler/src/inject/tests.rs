//! Every fallible step between submission and completion fails in turn on one rank of three:
//! every handle on every rank resolves (none waits forever), and every error names that rank.
//!
//! Communicator calls are failed by index through [`FaultyTransport`]: a clean run counts the
//! calls each rank makes, then each call is failed in turn (so a new negotiation step or
//! collective is covered without being listed). The other steps are [`Point`]s, each armed in
//! turn; [`every_point_is_placed_in_the_code`] checks the list against the code.

use std::collections::HashSet;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fh_core::{DType, ReduceOp};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Communicator, Result as TResult, Topology, Transport, TransportError};

use super::{arm, Point};
use crate::{AllreduceOptions, Config, Engine, Preset, Tensor};

const SIZE: usize = 3;
/// The longest a survivor may wait: the in-process transport's timeout is 3 s.
const WAIT: Duration = Duration::from_secs(20);

/// Which communicator call fails on which rank, and what calls were made.
#[derive(Default)]
struct Plan {
    /// `(rank, n)`: the n-th call (from 1) on `rank` fails, and every later one.
    fail: Option<(usize, u64)>,
    /// Calls made so far, per rank.
    calls: [AtomicU64; SIZE],
    /// `(label, operation)` of each call on each rank, in order (the clean run's record).
    log: Mutex<Vec<Vec<(String, &'static str)>>>,
}

impl Plan {
    fn new(fail: Option<(usize, u64)>) -> Arc<Self> {
        Arc::new(Plan {
            fail,
            log: Mutex::new(vec![Vec::new(); SIZE]),
            ..Plan::default()
        })
    }

    fn tick(&self, rank: usize, label: &str, op: &'static str) -> TResult<()> {
        let n = self.calls[rank].fetch_add(1, Ordering::SeqCst) + 1;
        self.log.lock().unwrap()[rank].push((label.to_string(), op));
        match self.fail {
            Some((r, at)) if r == rank && n >= at => Err(TransportError::Protocol {
                rank,
                detail: format!("injected failure of call {n} ({op} on '{label}') on rank {rank}"),
            }),
            _ => Ok(()),
        }
    }
}

/// A transport whose communicators fail as the plan says.
struct FaultyTransport {
    inner: Box<dyn Transport>,
    plan: Arc<Plan>,
}

impl Transport for FaultyTransport {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn wire(&self) -> fh_transport::WireKind {
        self.inner.wire()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn open(&mut self, label: &str) -> TResult<Box<dyn Communicator>> {
        Ok(Box::new(FaultyComm {
            inner: self.inner.open(label)?,
            label: label.to_string(),
            plan: Arc::clone(&self.plan),
        }))
    }
}

struct FaultyComm {
    inner: Box<dyn Communicator>,
    label: String,
    plan: Arc<Plan>,
}

impl FaultyComm {
    fn tick(&self, op: &'static str) -> TResult<()> {
        self.plan.tick(self.inner.rank(), &self.label, op)
    }
}

impl Communicator for FaultyComm {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> TResult<()> {
        self.tick("send")?;
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> TResult<()> {
        self.tick("recv")?;
        self.inner.recv(peer, buf)
    }
    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> TResult<()> {
        self.tick("send_recv")?;
        self.inner.send_recv(to, send, from, recv)
    }
    fn vectored_io(&self) -> bool {
        self.inner.vectored_io()
    }
    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> TResult<()> {
        self.tick("send_recv_vectored")?;
        self.inner.send_recv_vectored(to, send, from, recv)
    }
    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> TResult<()> {
        self.tick("allreduce")?;
        self.inner.allreduce(buf, dtype, op)
    }
    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> TResult<()> {
        self.tick("allgatherv")?;
        self.inner.allgatherv(send, recv, counts)
    }
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> TResult<()> {
        self.tick("broadcast")?;
        self.inner.broadcast(buf, root)
    }
    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> TResult<()> {
        self.tick("alltoallv")?;
        self.inner.alltoallv(send, send_counts, recv, recv_counts)
    }
    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> TResult<()> {
        self.tick("reduce_scatter")?;
        self.inner.reduce_scatter(send, recv, counts, dtype, op)
    }
    fn barrier(&mut self) -> TResult<()> {
        self.tick("barrier")?;
        self.inner.barrier()
    }
    fn abort(&mut self, lost: usize) {
        self.inner.abort(lost);
    }
}

/// What one rank saw: each step's outcome (`Err` text), in order.
type Outcomes = Vec<(String, Result<(), String>)>;

/// The workload: a small allreduce (run on the control thread), a large one (split over both
/// channels), a grouped allreduce, allgather, broadcast, alltoall, reduce-scatter, a barrier,
/// joins, then the agreed shutdown. Names carry `tag` (unique per test). A step whose
/// submission is refused counts as its outcome, and the next steps still run.
fn workload(e: &Engine, tag: &str) -> Outcomes {
    let rank = e.rank();
    let f = |n: usize| Tensor::from_slice(&vec![rank as f32 + 1.0; n]);
    let sum = AllreduceOptions::with_op(ReduceOp::Sum);
    let mut out: Outcomes = Vec::new();
    let mut step = |what: &str, h: Result<crate::Handle, crate::SchedulerError>| {
        let r = h.and_then(|mut h| h.wait_timeout(WAIT)).map(|_| ());
        out.push((what.to_string(), r.map_err(|e| e.to_string())));
    };
    step("small", e.allreduce(&format!("{tag}small"), f(4), sum));
    step("big", e.allreduce(&format!("{tag}big"), f(300_000), sum));
    let grouped = e
        .grouped_allreduce(&format!("{tag}group"), vec![f(8), f(16), f(32)], sum)
        .and_then(|mut g| g.wait_timeout(WAIT))
        .map(|_| ());
    out.push(("group".into(), grouped.map_err(|e| e.to_string())));
    let mut step = |what: &str, h: Result<crate::Handle, crate::SchedulerError>| {
        let r = h.and_then(|mut h| h.wait_timeout(WAIT)).map(|_| ());
        out.push((what.to_string(), r.map_err(|e| e.to_string())));
    };
    step("allgather", e.allgather(&format!("{tag}gather"), f(6)));
    step("broadcast", e.broadcast(&format!("{tag}bcast"), f(6), 2));
    step("alltoall", e.alltoall(&format!("{tag}a2a"), f(6), None));
    step(
        "reduce_scatter",
        e.reduce_scatter(&format!("{tag}rs"), f(6), ReduceOp::Sum),
    );
    step("barrier", e.barrier());
    step("join", e.join());
    out
}

/// Run the workload on three ranks with `plan`; each rank's outcomes, ending with its shutdown.
fn run(plan: &Arc<Plan>, tag: &str, preset: Preset) -> Vec<Outcomes> {
    let threads: Vec<_> = LocalWorld::with_timeout(SIZE, Duration::from_secs(3))
        .into_iter()
        .map(|t| {
            let plan = Arc::clone(plan);
            let tag = tag.to_string();
            std::thread::spawn(move || {
                let transport = FaultyTransport {
                    inner: Box::new(t),
                    plan,
                };
                let cfg = Config::preset(preset).channels(2).inline_bytes(1024);
                let e = match Engine::start(Box::new(transport), cfg) {
                    Ok(e) => e,
                    Err(err) => return vec![("start".to_string(), Err(err.to_string()))],
                };
                let mut out = workload(&e, &tag);
                out.push(("shutdown".into(), e.shutdown().map_err(|e| e.to_string())));
                out
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("a rank's test thread panicked"))
        .collect()
}

/// Every outcome succeeded or failed naming `rank`; when the fault was met, some outcome
/// failed.
fn check(all: &[Outcomes], rank: usize, met: bool, what: &str) {
    let named = format!("rank {rank}");
    let mut failed_somewhere = false;
    for (r, outcomes) in all.iter().enumerate() {
        for (step, res) in outcomes {
            if let Err(e) = res {
                failed_somewhere = true;
                assert!(
                    e.contains(&named),
                    "{what}: rank {r}'s '{step}' failed without naming rank {rank}: {e}\n{all:#?}"
                );
            }
        }
    }
    assert_eq!(
        failed_somewhere, met,
        "{what}: the fault was met: {met}: {all:#?}"
    );
}

fn ok(all: &[Outcomes]) -> bool {
    all.iter().all(|o| o.iter().all(|(_, r)| r.is_ok()))
}

/// A clean run completes every step, and records the communicator calls to fail.
#[test]
fn every_communicator_call_fails_in_turn_and_every_handle_names_the_rank() {
    // Both presets: `horovod` runs every group on the control thread.
    for preset in [Preset::FastHorovod, Preset::Horovod] {
        let clean = Plan::new(None);
        let all = run(&clean, &format!("clean-{preset:?}-"), preset);
        assert!(ok(&all), "the clean run failed: {all:#?}");
        let log = clean.log.lock().unwrap().clone();
        for (rank, calls) in log.iter().enumerate() {
            assert!(
                calls.len() > 10,
                "rank {rank} made only {} communicator calls",
                calls.len()
            );
            // Every call: each negotiation step, agreement and collective of the workload, in
            // every phase of it (start-up, rounds, groups, joins, shutdown).
            for (i, call) in calls.iter().enumerate() {
                let n = i as u64 + 1;
                let plan = Plan::new(Some((rank, n)));
                let all = run(&plan, &format!("comm-{preset:?}-{rank}-{n}-"), preset);
                // Rounds depend on timing: a run may make fewer calls than the clean one.
                let met = plan.calls[rank].load(Ordering::SeqCst) >= n;
                check(
                    &all,
                    rank,
                    met,
                    &format!("{preset:?}: call {n} ({call:?}) failing on rank {rank}"),
                );
            }
        }
    }
}

/// Each named point fails in turn on rank 1: every handle resolves, naming rank 1.
#[test]
fn every_named_point_fails_in_turn_and_every_handle_names_the_rank() {
    for point in Point::ALL {
        // The step the point is met in: small groups run on the control thread, the large
        // allreduce on the channels.
        let (tag, name) = match point {
            Point::TakeTensor | Point::InlinePanic => ("point-a-", "small"),
            Point::ChannelQueue | Point::ChannelPanic => ("point-b-", "big"),
        };
        let tag = format!("{tag}{point:?}-");
        arm(1, point, &format!("{tag}{name}"));
        let plan = Plan::new(None);
        let all = run(&plan, &tag, Preset::FastHorovod);
        check(&all, 1, true, &format!("{point:?} on rank 1"));
    }
}

/// The points the tests fail are exactly the points placed in the engine's code (a point
/// added to the list must be placed, and a placed one listed).
#[test]
fn every_point_is_placed_in_the_code() {
    let sources = [
        include_str!("../control/mod.rs"),
        include_str!("../control/dispatch.rs"),
        include_str!("../control/round.rs"),
        include_str!("../control/groups.rs"),
        include_str!("../exec.rs"),
        include_str!("../job.rs"),
        include_str!("../shared.rs"),
        include_str!("../engine/submit.rs"),
        include_str!("../engine/mod.rs"),
    ];
    let mut placed = HashSet::new();
    for src in sources {
        for (i, _) in src.match_indices("Point::") {
            let rest = &src[i + "Point::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric()).collect();
            placed.insert(name);
        }
    }
    let listed: HashSet<String> = Point::ALL.iter().map(|p| format!("{p:?}")).collect();
    assert_eq!(placed, listed, "placed in the code vs listed in Point::ALL");
}
