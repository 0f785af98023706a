//! Unit tests of the control thread: agreed faults and joined ranks' zero tensors.

use super::dispatch::try_zeros;
use super::*;
use crate::{AllreduceOptions, Config, Engine, Preset, Tensor};
use fh_core::message::CollectiveKind;
use fh_core::{DType, ReduceOp};
use fh_transport::backend::local::LocalWorld;

/// A rank that cannot run a negotiated tensor (here: an injected allocation failure on
/// rank 1) stops the engine on every rank with the same error naming the rank and the
/// tensor, within bounded time, instead of planning a different list than the others.
/// With small rounds run on the control thread (the default: the group's own allreduce then
/// says that rank 1 cannot, in place of a separate agreement) and without, and under the
/// `horovod` preset, which runs every group on the control thread: the other ranks are not
/// left waiting in a collective the faulty rank never joins, and none delivers a result
/// that lacks rank 1's part.
#[test]
fn a_local_fault_stops_every_rank_with_the_same_error() {
    let cases = [
        (1usize, 1024u64, Preset::FastHorovod),
        (3, 1024, Preset::FastHorovod),
        (1, 0, Preset::FastHorovod),
        (3, 0, Preset::FastHorovod),
        (1, 0, Preset::Horovod),
    ];
    for (k, inline, preset) in cases {
        fault_on_rank_1(
            &format!("faulty-{k}-{inline}-{preset:?}"),
            k,
            inline,
            preset,
            true,
        );
    }
    // Channels that cannot carry the flag in the allreduce (as over shared memory): the
    // one-byte step on the negotiation communicator.
    fault_on_rank_1("faulty-not-in-band", 1, 1024, Preset::FastHorovod, false);
    fault_on_rank_1("faulty-not-in-band-hvd", 1, 0, Preset::Horovod, false);
}

/// The same when ranks differ in where the faulty round's small group runs: rank 1 (the
/// faulty one) and rank 0 hand it to the channel thread, rank 2 runs it on the control
/// thread; the held result resolves with the agreed error on every thread.
#[test]
fn a_local_fault_in_a_group_run_on_a_channel_thread_stops_every_rank_alike() {
    let name = "faulty-queued".to_string();
    QUEUE_ANYWAY
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend([(0, name.clone()), (1, name.clone())]);
    fault_on_rank_1(&name, 2, 1024, Preset::FastHorovod, true);
}

/// Three ranks allreduce `fine`, then `name`, which rank 1 cannot take (injected): `fine`
/// is right everywhere, `name` and the shutdown fail with one error naming rank 1, the
/// tensor and the cause. `in_band`: whether the channels carry the flag in the allreduce.
fn fault_on_rank_1(name: &str, k: usize, inline: u64, preset: Preset, in_band: bool) {
    crate::inject::arm(1, crate::inject::Point::TakeTensor, name);
    let threads: Vec<_> = LocalWorld::with_timeout(3, Duration::from_secs(10))
        .into_iter()
        .map(|t| {
            let name = name.to_string();
            std::thread::spawn(move || {
                let cfg = Config::preset(preset).channels(k).inline_bytes(inline);
                let world: Box<dyn fh_transport::Transport> = if in_band {
                    Box::new(t)
                } else {
                    Box::new(NotInBand(t))
                };
                let e = Engine::start(world, cfg).unwrap();
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
        assert_eq!(bad, &out[0].1, "{name}: same error on every rank");
        assert_eq!(stopped, &out[0].1);
        let text = bad.to_string();
        assert!(
            text.contains(name)
                && text.contains("rank 1 could not run")
                && text.contains("injected allocation failure"),
            "{text}"
        );
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
                // Every step's groups run (none rides in the negotiation round).
                let cfg = Config::default()
                    .channels(2)
                    .inline_bytes(1024)
                    .eager_bytes(0)
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

/// A world whose communicators keep the trait's default `allreduce_agreeing` (a flag first, as
/// shared memory, hierarchical and MPI do), over the in-process one.
struct NotInBand(fh_transport::backend::local::LocalTransport);

impl fh_transport::Transport for NotInBand {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn topology(&self) -> fh_transport::Topology {
        self.0.topology()
    }
    fn wire(&self) -> fh_transport::WireKind {
        self.0.wire()
    }
    fn open(&mut self, label: &str) -> fh_transport::Result<Box<dyn fh_transport::Communicator>> {
        Ok(Box::new(Plain(self.0.open(label)?)))
    }
}

/// A communicator that forwards everything but `allreduce_agreeing` and `agrees_in_band`.
struct Plain(Box<dyn fh_transport::Communicator>);

impl fh_transport::Communicator for Plain {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> fh_transport::Result<()> {
        self.0.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> fh_transport::Result<()> {
        self.0.recv(peer, buf)
    }
    fn send_recv(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
    ) -> fh_transport::Result<()> {
        self.0.send_recv(to, send, from, recv)
    }
    fn abort(&mut self, lost: usize) {
        self.0.abort(lost)
    }
    fn interrupter(&self) -> Option<fh_transport::Interrupt> {
        self.0.interrupter()
    }
}
