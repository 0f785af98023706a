//! Submission: every collective of the public API, checked here and handed to the control
//! thread as a named request.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use fh_core::message::{CollectiveKind, GroupTag, Request, Signature};
use fh_core::{kernels, DType, ReduceOp};

use super::Engine;
use crate::handle::{Completion, GroupHandle, Handle};
use crate::options::{no_reduction, AllreduceOptions, CollectiveOptions};
use crate::shared::{Entry, Msg, Resolver};
use crate::{SchedulerError, Tensor};

impl Engine {
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
                fh_transport::backend::cuda::record_on_stream(
                    ctx,
                    m.stream as usize as fh_transport::backend::cuda::CUstream,
                )
            }
            .map_err(SchedulerError::from_transport_owned)?;
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
            cell: Resolver::new(&self.inner, Arc::clone(&name), Arc::clone(&cell)),
            submitted: Instant::now(),
        };
        let assist = Some(Arc::clone(&self.inner.assist));
        Ok((entry, Handle::new(name, cell, assist)))
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
    /// ranks' allreduces with `Sum` or `Average` proceed with this rank contributing zeros
    /// (`Average` divides by every rank, joined ones included, as Horovod does); an allreduce
    /// with another op and every other collective (broadcast, allgather, alltoall,
    /// reducescatter, barrier) fail on the ranks that submitted them while a rank is joined.
    /// The handle completes once every rank has joined, with a one-element `i64` tensor
    /// holding the rank that joined last (the same on every rank; among ranks that joined in
    /// the same negotiation round, the highest). Do not submit on this rank until then.
    pub fn join(&self) -> Result<Handle, SchedulerError> {
        let cell = Completion::new();
        let mut resolver = Resolver::untracked(&self.inner, "__join".into(), Arc::clone(&cell));
        resolver.arm();
        self.inner.send(Msg::Join(resolver))?;
        Ok(Handle::new("__join".into(), cell, None))
    }
}
