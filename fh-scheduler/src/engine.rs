//! The engine: public submission API and the state shared by its threads.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::unbounded;
use fh_core::message::{CollectiveKind, GroupTag, Request, Signature};
use fh_core::{kernels, DType, ReduceOp};
use fh_transport::subset::SubsetTransport;
use fh_transport::{Topology, Transport};

use crate::control::Control;
use crate::handle::{Completion, GroupHandle, Handle};
use crate::options::no_reduction;
pub use crate::options::{AllreduceOptions, CollectiveOptions};
use crate::shared::{lock, Entry, Gate, Inner, Msg};
use crate::stats::{Counters, EngineStats, GroupRecord, StallReport};
use crate::timeline::Timeline;
use crate::{Config, SchedulerError, Tensor};

/// The FastHorovod engine of one rank: submit named collectives, get handles.
///
/// `Engine` is `Send + Sync`; share it by reference (or in an `Arc`) between the threads
/// that submit. Every rank of the world must start an engine with a compatible configuration;
/// the engine negotiates which names are ready everywhere and runs the collectives.
///
/// ```
/// use fh_scheduler::{AllreduceOptions, Config, Engine, Tensor};
/// use fh_core::ReduceOp;
/// use fh_transport::local::LocalWorld;
///
/// let threads: Vec<_> = LocalWorld::new(2).into_iter().map(|t| std::thread::spawn(move || {
///     let engine = Engine::start(Box::new(t), Config::default().channels(2)).unwrap();
///     let x = Tensor::from_slice(&[engine.rank() as f32 + 1.0; 3]);
///     let h = engine.allreduce("x", x, AllreduceOptions::with_op(ReduceOp::Sum)).unwrap();
///     let y = h.wait().unwrap().to_vec::<f32>().unwrap();
///     engine.shutdown().unwrap();
///     y
/// })).collect();
/// for t in threads {
///     assert_eq!(t.join().unwrap(), [3.0; 3]);
/// }
/// ```
pub struct Engine {
    inner: Arc<Inner>,
    topology: Topology,
    control: Mutex<Option<JoinHandle<()>>>,
    transport: Mutex<Option<Box<dyn Transport>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("preset", &self.inner.config.preset)
            .finish()
    }
}

impl Engine {
    /// Start an engine on a world. Collective: every rank must call it (it opens the control
    /// communicator and one communicator per data channel, and checks that the ranks'
    /// configurations agree).
    pub fn start(
        mut transport: Box<dyn Transport>,
        config: Config,
    ) -> Result<Engine, SchedulerError> {
        config.validate()?;
        let topo = transport.topology();
        let mut control = transport.open("fh-control")?;
        crate::config::agree(control.as_mut(), &config)?;
        let k = config.effective_channels();
        let mut data = Vec::with_capacity(k);
        for c in 0..k {
            data.push(transport.open(&format!("fh-channel-{c}"))?);
        }
        let (gpu, devices) =
            crate::gpu::open(transport.as_mut(), control.as_mut(), &config, topo, k)?;
        let timeline = match (&config.timeline, topo.rank) {
            (Some(path), 0) => match Timeline::create(path, k) {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    return Err(SchedulerError::config(
                        "FH_TIMELINE",
                        format!("cannot create {}: {e}", path.display()),
                    ))
                }
            },
            _ => None,
        };
        let (tx, rx) = unbounded();
        let inner = Arc::new(Inner {
            rank: topo.rank,
            size: topo.size,
            config: config.clone(),
            gate: Mutex::new(Gate { closed: None, tx }),
            in_flight: Mutex::new(HashSet::new()),
            counters: Counters::default(),
            stalls: Mutex::new(Vec::new()),
            barrier_seq: AtomicU64::new(0),
            groups: Mutex::new(Vec::new()),
            timeline: RwLock::new(timeline),
            gpu,
            pacing_wait: AtomicBool::new(false),
        });
        let ctl = Control::new(Arc::clone(&inner), control, data, devices, rx)?;
        let handle = std::thread::Builder::new()
            .name(format!("fh-control-{}", topo.rank))
            .spawn(move || ctl.run())
            .map_err(|e| SchedulerError::InvalidArgument(format!("cannot spawn a thread: {e}")))?;
        tracing::debug!(
            rank = topo.rank,
            size = topo.size,
            preset = config.preset.name(),
            channels = k,
            backend = transport.backend(),
            "engine started"
        );
        Ok(Engine {
            inner,
            topology: topo,
            control: Mutex::new(Some(handle)),
            transport: Mutex::new(Some(transport)),
        })
    }

    /// Collectively (every rank of this engine's world) open communicators over the world
    /// ranks `members`, one per label, on the world this engine was started on; see
    /// [`fh_transport::subset::open_subset`]. Used by [`crate::ProcessSets`].
    pub fn open_subset(
        &self,
        members: &[usize],
        labels: &[String],
    ) -> Result<SubsetTransport, SchedulerError> {
        let mut guard = lock(&self.transport);
        let world = guard.as_mut().ok_or_else(|| SchedulerError::ShutDown {
            reason: "the engine's world is closed".into(),
        })?;
        Ok(fh_transport::subset::open_subset(
            world.as_mut(),
            members,
            labels,
        )?)
    }

    /// Shut the engine down through a shared reference (as [`Engine::shutdown`]; for an
    /// engine held in an `Arc`). Later submissions fail with [`SchedulerError::ShutDown`].
    pub fn close(&self) -> Result<(), SchedulerError> {
        self.stop()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// This rank's place among the ranks of its host.
    pub fn local_rank(&self) -> usize {
        self.topology.local_rank
    }

    /// Number of ranks on this rank's host.
    pub fn local_size(&self) -> usize {
        self.topology.local_size
    }

    /// Index of this rank's host among the hosts.
    pub fn cross_rank(&self) -> usize {
        self.topology.cross_rank
    }

    /// Number of hosts.
    pub fn cross_size(&self) -> usize {
        self.topology.cross_size
    }

    /// Where this rank sits: rank, size, local and cross ranks and sizes.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Start writing a Chrome-trace timeline to `path` (rank 0 writes; other ranks accept
    /// the call and do nothing), replacing any timeline being written. Every rank should call
    /// it, as with Horovod's `start_timeline`.
    pub fn start_timeline(&self, path: &Path) -> Result<(), SchedulerError> {
        if self.inner.rank != 0 {
            return Ok(());
        }
        let t = Timeline::create(path, self.inner.config.effective_channels()).map_err(|e| {
            SchedulerError::InvalidArgument(format!(
                "cannot create the timeline {}: {e}",
                path.display()
            ))
        })?;
        if let Some(old) = self.inner.replace_timeline(Some(Arc::new(t))) {
            old.finish(crate::timeline::STOP_WAIT);
        }
        Ok(())
    }

    /// Stop writing the timeline: the events already handed to its writer thread are written,
    /// the JSON array is closed and the writer joined (waiting at most 10 s) before this
    /// returns. A no-op when none is written.
    pub fn stop_timeline(&self) {
        self.inner.finish_timeline();
    }

    /// The GPU this rank's device channels drive and how they move bytes (NCCL, or host
    /// staging when a host runs more ranks than it has GPUs); `None` when the GPU path is not
    /// open (see [`Config::cuda`](crate::Config#structfield.cuda)).
    pub fn gpu(&self) -> Option<(u32, fh_transport::cuda::DeviceMode)> {
        match (&self.inner.gpu.device, self.inner.gpu.mode) {
            (Ok(d), Some(m)) => Some((*d, m)),
            _ => None,
        }
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// A snapshot of this rank's counters.
    pub fn stats(&self) -> EngineStats {
        self.inner.counters.snapshot()
    }

    /// Why the engine has stopped (shutdown, lost rank, stall), or `None` while it runs.
    pub fn stopped(&self) -> Option<SchedulerError> {
        self.inner.failure()
    }

    /// The stall inspector's reports so far.
    pub fn stall_reports(&self) -> Vec<StallReport> {
        lock(&self.inner.stalls).clone()
    }

    #[allow(clippy::too_many_arguments)]
    /// The fused groups dispatched so far, in dispatch order (empty unless
    /// `Config::record_groups` is on). Identical on every rank.
    pub fn group_log(&self) -> Vec<GroupRecord> {
        lock(&self.inner.groups).clone()
    }

    #[allow(clippy::too_many_arguments)]
    fn entry(
        &self,
        name: &str,
        tensor: Tensor,
        kind: CollectiveKind,
        op: ReduceOp,
        root: usize,
        opts: &AllreduceOptions,
        splits: Option<Vec<usize>>,
    ) -> Result<Handle, SchedulerError> {
        let (entry, handle) = self.prepare(name, tensor, kind, op, root, opts, splits, None)?;
        self.inner.submit(vec![entry])?;
        Ok(handle)
    }

    /// Check a submission and build its entry and handle (nothing is submitted yet).
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        name: &str,
        #[allow(unused_mut)] mut tensor: Tensor,
        kind: CollectiveKind,
        op: ReduceOp,
        root: usize,
        opts: &AllreduceOptions,
        splits: Option<Vec<usize>>,
        group: Option<GroupTag>,
    ) -> Result<(Entry, Handle), SchedulerError> {
        if name.is_empty() {
            return Err(SchedulerError::InvalidArgument(
                "a collective needs a non-empty name".into(),
            ));
        }
        if name.len() > fh_core::wire::MAX_NAME {
            return Err(SchedulerError::InvalidArgument(format!(
                "name of {} bytes is longer than {}",
                name.len(),
                fh_core::wire::MAX_NAME
            )));
        }
        if tensor.shape().len() > fh_core::wire::MAX_DIMS {
            return Err(SchedulerError::InvalidArgument(format!(
                "tensors have at most {} dimensions",
                fh_core::wire::MAX_DIMS
            )));
        }
        if matches!(
            kind,
            CollectiveKind::Allreduce | CollectiveKind::ReduceScatter
        ) && !kernels::supports(tensor.dtype(), op)
        {
            return Err(SchedulerError::InvalidArgument(format!(
                "reduce op {op} is not supported for {} tensors",
                tensor.dtype()
            )));
        }
        if tensor.dtype() == DType::Bool && (opts.prescale != 1.0 || opts.postscale != 1.0) {
            return Err(SchedulerError::InvalidArgument(
                "bool tensors cannot be scaled".into(),
            ));
        }
        let device = crate::gpu::check_submission(
            &self.inner.gpu,
            tensor.device(),
            opts.device,
            kind,
            tensor.dtype(),
            op,
            (opts.prescale, opts.postscale),
        )?;
        #[cfg(feature = "cuda")]
        if let (Some(m), Some(ctx)) = (tensor.device_memory(), &self.inner.gpu.ctx) {
            // Readiness: the work the producer's stream holds now.
            // SAFETY: `Tensor::from_device`'s contract: `m.stream` is a live stream of the
            // tensor's device (checked above to be this engine's) or 0.
            let ev = unsafe {
                fh_transport::cuda::record_on_stream(
                    ctx,
                    m.stream as usize as fh_transport::cuda::CUstream,
                )
            }
            .map_err(|e| SchedulerError::from_transport(&e))?;
            tensor.set_ready(ev);
        }
        let cell = Completion::new();
        let name: Arc<str> = name.into();
        let req = Request {
            name: Arc::clone(&name),
            rank: self.inner.rank as u32,
            sig: Signature {
                kind,
                dtype: tensor.dtype(),
                shape: tensor.shape().iter().map(|&d| d as u64).collect(),
                device,
                op,
                root: root as u32,
                prescale: opts.prescale,
                postscale: opts.postscale,
            },
            priority: opts.priority,
            group,
        };
        let entry = Entry {
            req,
            tensor,
            splits,
            cell: Arc::clone(&cell),
            submitted: Instant::now(),
        };
        Ok((entry, Handle::new(name, cell)))
    }

    /// Allreduce `tensor` across all ranks under `name`; the handle gives back the tensor
    /// holding the result.
    pub fn allreduce(
        &self,
        name: &str,
        tensor: Tensor,
        opts: AllreduceOptions,
    ) -> Result<Handle, SchedulerError> {
        self.entry(
            name,
            tensor,
            CollectiveKind::Allreduce,
            opts.op,
            0,
            &opts,
            None,
        )
    }

    /// Allreduce several tensors as one group; member `i` is named `name[i]`. The members are
    /// released together once all are ready on every rank, and reduced in one fused collective
    /// when they share a dtype and fit under the fusion threshold. If one member fails
    /// negotiation, every member fails. Submission is atomic: if any member is refused (a bad
    /// argument, a name already in flight), no member is submitted.
    pub fn grouped_allreduce(
        &self,
        name: &str,
        tensors: Vec<Tensor>,
        opts: AllreduceOptions,
    ) -> Result<GroupHandle, SchedulerError> {
        let size = tensors.len() as u32;
        let mut handles = Vec::with_capacity(tensors.len());
        let mut entries = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.into_iter().enumerate() {
            let tag = GroupTag {
                name: name.to_string(),
                index: i as u32,
                size,
            };
            let (entry, handle) = self.prepare(
                &format!("{name}[{i}]"),
                t,
                CollectiveKind::Allreduce,
                opts.op,
                0,
                &opts,
                None,
                Some(tag),
            )?;
            entries.push(entry);
            handles.push(handle);
        }
        self.inner.submit(entries)?;
        Ok(GroupHandle::new(handles))
    }

    /// Concatenate every rank's `tensor` along the first dimension (which may differ per
    /// rank; the others must agree).
    pub fn allgather(&self, name: &str, tensor: Tensor) -> Result<Handle, SchedulerError> {
        self.allgather_with(name, tensor, CollectiveOptions::default())
    }

    /// [`Engine::allgather`] with options (priority, device).
    pub fn allgather_with(
        &self,
        name: &str,
        tensor: Tensor,
        opts: CollectiveOptions,
    ) -> Result<Handle, SchedulerError> {
        let opts = no_reduction("allgather", opts)?;
        self.entry(
            name,
            tensor,
            CollectiveKind::Allgather,
            ReduceOp::Sum,
            0,
            &opts,
            None,
        )
    }

    /// Copy `root`'s tensor into every rank's tensor (same shape everywhere).
    pub fn broadcast(
        &self,
        name: &str,
        tensor: Tensor,
        root: usize,
    ) -> Result<Handle, SchedulerError> {
        self.broadcast_with(name, tensor, root, CollectiveOptions::default())
    }

    /// [`Engine::broadcast`] with options (priority, device).
    pub fn broadcast_with(
        &self,
        name: &str,
        tensor: Tensor,
        root: usize,
        opts: CollectiveOptions,
    ) -> Result<Handle, SchedulerError> {
        let opts = no_reduction("broadcast", opts)?;
        if root >= self.inner.size {
            return Err(SchedulerError::InvalidArgument(format!(
                "broadcast root {root} is out of range 0..{}",
                self.inner.size
            )));
        }
        self.entry(
            name,
            tensor,
            CollectiveKind::Broadcast,
            ReduceOp::Sum,
            root,
            &opts,
            None,
        )
    }

    /// Send `splits[r]` first-dimension rows of `tensor` (in order) to rank r and receive the
    /// rows the other ranks send here, concatenated by source rank. Without splits the first
    /// dimension must divide evenly by the number of ranks.
    pub fn alltoall(
        &self,
        name: &str,
        tensor: Tensor,
        splits: Option<Vec<usize>>,
    ) -> Result<Handle, SchedulerError> {
        self.alltoall_with(name, tensor, splits, CollectiveOptions::default())
    }

    /// [`Engine::alltoall`] with options (priority, device).
    pub fn alltoall_with(
        &self,
        name: &str,
        tensor: Tensor,
        splits: Option<Vec<usize>>,
        opts: CollectiveOptions,
    ) -> Result<Handle, SchedulerError> {
        let opts = no_reduction("alltoall", opts)?;
        let n = self.inner.size;
        let dim0 = tensor.shape().first().copied().unwrap_or(1);
        match &splits {
            Some(s) if s.len() != n || s.iter().sum::<usize>() != dim0 => {
                return Err(SchedulerError::InvalidArgument(format!(
                    "alltoall splits {s:?} must have {n} entries summing to the first dimension {dim0}"
                )))
            }
            None if dim0 % n != 0 => {
                return Err(SchedulerError::InvalidArgument(format!(
                    "alltoall without splits needs a first dimension divisible by {n}, got {dim0}"
                )))
            }
            _ => {}
        }
        self.entry(
            name,
            tensor,
            CollectiveKind::Alltoall,
            ReduceOp::Sum,
            0,
            &opts,
            splits,
        )
    }

    /// Reduce `tensor` across ranks and leave this rank's slice of the first dimension (rank r
    /// gets `d/n` rows, plus one if `r < d % n`).
    pub fn reduce_scatter(
        &self,
        name: &str,
        tensor: Tensor,
        op: ReduceOp,
    ) -> Result<Handle, SchedulerError> {
        self.reduce_scatter_with(name, tensor, CollectiveOptions::with_op(op))
    }

    /// [`Engine::reduce_scatter`] with options (op, scale factors, priority, device).
    pub fn reduce_scatter_with(
        &self,
        name: &str,
        tensor: Tensor,
        opts: CollectiveOptions,
    ) -> Result<Handle, SchedulerError> {
        self.entry(
            name,
            tensor,
            CollectiveKind::ReduceScatter,
            opts.op,
            0,
            &opts,
            None,
        )
    }

    /// A barrier over all ranks (each rank's n-th barrier meets the others' n-th).
    pub fn barrier(&self) -> Result<Handle, SchedulerError> {
        let n = self.inner.barrier_seq.fetch_add(1, Ordering::Relaxed);
        let opts = AllreduceOptions::with_op(ReduceOp::Sum);
        self.entry(
            &format!("__barrier.{n}"),
            Tensor::from_parts(DType::U8, vec![0], Vec::new()),
            CollectiveKind::Barrier,
            ReduceOp::Sum,
            0,
            &opts,
            None,
        )
    }

    /// Declare that this rank has run out of data. Until every rank has joined, the other
    /// ranks' allreduces proceed with this rank contributing zeros (`Average` divides by the
    /// number of ranks that have not joined); other collectives fail while a rank is joined.
    /// The handle completes once every rank has joined, with a one-element `i64` tensor
    /// holding the rank that joined last (the same on every rank; among ranks that joined in
    /// the same negotiation round, the highest). Do not submit on this rank until then.
    pub fn join(&self) -> Result<Handle, SchedulerError> {
        let cell = Completion::new();
        self.inner.send(Msg::Join(Arc::clone(&cell)))?;
        Ok(Handle::new("__join".into(), cell))
    }

    /// Shut the engine down: every rank's engine stops (a shutdown on one rank is agreed with
    /// the others in the next negotiation round), pending operations fail with
    /// [`SchedulerError::ShutDown`], the threads are joined. Returns the communication error
    /// that stopped the engine, if one did.
    pub fn shutdown(self) -> Result<(), SchedulerError> {
        self.stop()
    }

    fn stop(&self) -> Result<(), SchedulerError> {
        let _ = self.inner.send(Msg::Shutdown);
        let handle = lock(&self.control).take();
        if let Some(h) = handle {
            if h.join().is_err() {
                tracing::error!(rank = self.inner.rank, "the control thread panicked");
            }
            drop(lock(&self.transport).take());
        }
        // After the control thread (which joins the channels): their last events are queued.
        self.inner.finish_timeline();
        match self.inner.failure() {
            Some(SchedulerError::ShutDown { .. }) | None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Engine>();
        send_sync::<Config>();
        send_sync::<Tensor>();
        send_sync::<SchedulerError>();
        send::<Handle>();
        send::<GroupHandle>();
    }
}
