//! The device communicator trait, the world of devices (`CudaWorld`) and the per-channel state
//! (`DeviceChannel`); NCCL's type mapping.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaSlice, CudaStream};
use fh_core::{DType, ReduceOp};

use super::buffers::{DeviceBytes, DeviceBytesMut};
use super::driver::{cuda_err, driver_present};
use super::{nccl::NcclComm, scale::Scaler, staged::StagedComm, DeviceMode};
use crate::{CollectivesExt, Communicator, Result, Topology, TransportError};

/// Collectives on device memory among a fixed group of ranks, each on one GPU: the device twin
/// of [`Communicator`]. Small and object-safe; the channel logic shared by every backend
/// (readiness, completion, fusion, scaling) lives in [`DeviceChannel`], written once.
///
/// Every method *enqueues* work on [`DeviceCommunicator::stream`] and returns (the host-staged
/// backend, which needs the bytes on the host, synchronizes that stream internally). All ranks
/// call the collectives in the same order with compatible arguments, as for [`Communicator`].
/// `Average` divides by [`DeviceCommunicator::size`].
pub trait DeviceCommunicator: Send {
    /// The backend's name (`"nccl"`, `"host-staged"`).
    fn backend(&self) -> &'static str;
    /// How bytes move.
    fn mode(&self) -> DeviceMode;
    /// This rank within the communicator.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The channel's CUDA stream, on which every operation is ordered.
    fn stream(&self) -> &Arc<CudaStream>;

    /// Reduce `buf` element-wise across all ranks, in place.
    fn allreduce(&mut self, buf: DeviceBytesMut<'_>, dtype: DType, op: ReduceOp) -> Result<()>;
    /// Copy `root`'s `buf` into every rank's `buf`.
    fn broadcast(&mut self, buf: DeviceBytesMut<'_>, root: usize) -> Result<()>;
    /// Gather every rank's `send` (same length everywhere) into `recv`, rank by rank;
    /// `recv.len()` must be `send.len() * size`.
    fn allgather(&mut self, send: DeviceBytes<'_>, recv: DeviceBytesMut<'_>) -> Result<()>;
    /// Reduce `send` (same length everywhere, `size` equal blocks) and leave block r on rank r
    /// in `recv` (`recv.len() * size == send.len()`).
    fn reduce_scatter(
        &mut self,
        send: DeviceBytes<'_>,
        recv: DeviceBytesMut<'_>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;
    /// Personalised all-to-all: `send_counts[r]` bytes (at offset `sum(send_counts[..r])`) go to
    /// rank r; `recv_counts[r]` bytes arrive from rank r.
    fn alltoallv(
        &mut self,
        send: DeviceBytes<'_>,
        send_counts: &[usize],
        recv: DeviceBytesMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// An error the backend met asynchronously (NCCL's `ncclCommGetAsyncError`), if any.
    fn async_error(&mut self) -> Result<()>;
    /// Give up: abort outstanding operations so that waits end (used after a timeout).
    fn abort(&mut self);
}

/// Whether to stage through the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Staging {
    /// Stage only when this host runs more ranks than it has GPUs.
    #[default]
    Auto,
    /// Always stage (for tests of the staged path on machines with enough GPUs).
    Always,
}

/// NCCL, unless staging is forced or this host runs more ranks than it has GPUs (NCCL refuses
/// two ranks on one GPU).
pub(crate) fn choose_mode(local_size: usize, devices: usize, staging: Staging) -> DeviceMode {
    if staging == Staging::Always || local_size > devices {
        DeviceMode::HostStaged
    } else {
        DeviceMode::Nccl
    }
}

/// A rank's GPU world: its device context and the mode its channels will use.
#[derive(Debug)]
pub struct CudaWorld {
    ctx: Arc<CudaContext>,
    topology: Topology,
    mode: DeviceMode,
    devices: usize,
    timeout: Duration,
}

/// How long opening a device channel waits for NCCL's initialisation, unless
/// [`CudaWorld::set_timeout`] says otherwise.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);

impl CudaWorld {
    /// Probe the driver and NCCL, pick device `local_rank % devices` and the mode (NCCL, or
    /// host staging when `local_size > devices` or `staging` is `Always`). Errors, never
    /// panics, when the driver, a device or (NCCL mode) NCCL is missing.
    pub fn new(topology: Topology, staging: Staging) -> Result<Self> {
        let unavailable = |reason: String| TransportError::BackendUnavailable {
            backend: "nccl",
            reason,
        };
        if !driver_present() {
            return Err(unavailable(super::NO_DRIVER.into()));
        }
        cu::init().map_err(|e| {
            unavailable(format!(
                "the CUDA driver failed to initialise ({e:?}); check `nvidia-smi`"
            ))
        })?;
        let devices = cu::device::get_count()
            .map_err(cuda_err("cuDeviceGetCount"))
            .map(|n| usize::try_from(n).unwrap_or(0))?;
        if devices == 0 {
            return Err(unavailable(super::NO_DEVICE.into()));
        }
        let mode = choose_mode(topology.local_size, devices, staging);
        if mode == DeviceMode::Nccl {
            fh_nccl_sys::load().map_err(|e| unavailable(e.to_string()))?;
        }
        let ordinal = topology.local_rank % devices;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        if mode == DeviceMode::HostStaged && staging == Staging::Auto {
            tracing::warn!(
                local_ranks = topology.local_size,
                gpus = devices,
                "this host runs {} ranks but sees {} GPU(s), and NCCL refuses two ranks on one \
                 GPU: device collectives are staged through host memory over the host \
                 transport (slower); give each rank its own GPU to use NCCL",
                topology.local_size,
                devices
            );
        }
        Ok(CudaWorld {
            ctx,
            topology,
            mode,
            devices,
            timeout: DEFAULT_INIT_TIMEOUT,
        })
    }

    /// How long [`CudaWorld::open`] waits for NCCL's initialisation (the engine passes its
    /// `FH_TIMEOUT_SECONDS`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The mode chosen locally (channels agree on one: staging wins if any rank needs it).
    pub fn mode(&self) -> DeviceMode {
        self.mode
    }

    /// This rank's device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Number of GPUs this process sees.
    pub fn devices(&self) -> usize {
        self.devices
    }

    /// Collectively open a device channel. `host` is a communicator over the same ranks,
    /// opened from the host transport (every rank opens it in the same order); it carries the
    /// mode agreement and NCCL's unique id, and in host-staged mode the data itself.
    pub fn open(&mut self, mut host: Box<dyn Communicator>, label: &str) -> Result<DeviceChannel> {
        if host.size() != self.topology.size || host.rank() != self.topology.rank {
            return Err(TransportError::InvalidArgument(format!(
                "device channel {label}: the host communicator is rank {} of {}, but this world \
                 is rank {} of {}",
                host.rank(),
                host.size(),
                self.topology.rank,
                self.topology.size
            )));
        }
        // Agree on the mode: if any rank must stage, all do (NCCL needs every rank).
        let mut staged = [u8::from(self.mode == DeviceMode::HostStaged)];
        host.allreduce_typed(&mut staged, ReduceOp::Max)?;
        let mode = if staged[0] == 1 {
            DeviceMode::HostStaged
        } else {
            DeviceMode::Nccl
        };
        if mode != self.mode {
            tracing::warn!(
                channel = label,
                "another rank must stage device collectives through the host; this channel \
                 does too"
            );
        }
        let stream = self.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let comm: Box<dyn DeviceCommunicator> = match mode {
            DeviceMode::Nccl => Box::new(NcclComm::connect(
                &mut *host,
                stream.clone(),
                label,
                self.timeout,
            )?),
            DeviceMode::HostStaged => Box::new(StagedComm::new(host, stream.clone())),
        };
        DeviceChannel::new(comm, self.ctx.clone(), stream)
    }
}

/// One channel's device state: its communicator, its stream, its fusion buffer and the
/// scaling kernels. Everything here is enqueued on the channel stream.
pub struct DeviceChannel {
    comm: Box<dyn DeviceCommunicator>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    fusion: Option<CudaSlice<u8>>,
    scaler: Option<Scaler>,
}

impl std::fmt::Debug for DeviceChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceChannel")
            .field("backend", &self.comm.backend())
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("fusion_bytes", &self.fusion_capacity())
            .finish()
    }
}

impl DeviceChannel {
    /// A channel over `comm`, whose stream must be `stream`.
    pub fn new(
        comm: Box<dyn DeviceCommunicator>,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
    ) -> Result<Self> {
        if !Arc::ptr_eq(comm.stream(), &stream) {
            return Err(TransportError::InvalidArgument(
                "a device channel's communicator must use the channel's stream".into(),
            ));
        }
        Ok(DeviceChannel {
            comm,
            ctx,
            stream,
            fusion: None,
            scaler: None,
        })
    }

    /// The communicator.
    pub fn comm(&mut self) -> &mut dyn DeviceCommunicator {
        &mut *self.comm
    }

    /// How this channel moves bytes (NCCL or host staging).
    pub fn mode(&self) -> DeviceMode {
        self.comm.mode()
    }

    /// The channel's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Bytes the fusion buffer holds now (it grows on demand).
    pub fn fusion_capacity(&self) -> usize {
        self.fusion.as_ref().map_or(0, |f| f.len())
    }

    /// Readiness: make the channel stream wait (on the device, not the host) for the work the
    /// producer recorded in `producer` (e.g. the framework's stream after the backward kernel).
    pub fn wait_ready(&self, producer: &CudaEvent) -> Result<()> {
        self.stream
            .wait(producer)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }

    /// Completion: an event recorded on the channel stream after everything enqueued so far;
    /// the framework's stream can wait on it (`cuStreamWaitEvent`), or the host can with
    /// [`DeviceChannel::wait_completion`].
    pub fn record_completion(&self) -> Result<CudaEvent> {
        self.stream
            .record_event(None)
            .map_err(cuda_err("cuEventRecord"))
    }

    /// Wait on the host, at most `timeout`, for `event`; checks the communicator's
    /// asynchronous errors while waiting, and aborts it on timeout (so that the device work
    /// ends) before returning [`TransportError::Timeout`].
    pub fn wait_completion(&mut self, event: &CudaEvent, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if event.try_is_complete().map_err(cuda_err("cuEventQuery"))? {
                return Ok(());
            }
            self.comm.async_error()?;
            if start.elapsed() >= timeout {
                self.comm.abort();
                return Err(TransportError::Timeout {
                    rank: self.comm.rank(),
                    op: "device collective",
                    after: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    /// A device-to-device copy on the channel stream (`dst.len()` must equal `src.len()`).
    pub fn copy(&self, dst: DeviceBytesMut<'_>, src: DeviceBytes<'_>) -> Result<()> {
        if dst.len() != src.len() {
            return Err(TransportError::InvalidArgument(format!(
                "device copy of {} bytes into {} bytes",
                src.len(),
                dst.len()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: both ranges are valid device memory for the operation (the `DeviceBytes`
        // contract) and the copy is ordered on the channel stream.
        unsafe { cu::memcpy_dtod_async(dst.ptr, src.ptr, src.len, self.stream.cu_stream()) }
            .map_err(cuda_err("cuMemcpyDtoDAsync"))
    }

    /// Multiply every element of `buf` by `factor` on the device (a no-op for 1).
    pub fn scale(&mut self, buf: DeviceBytesMut<'_>, dtype: DType, factor: f64) -> Result<()> {
        if factor == 1.0 || buf.is_empty() {
            return Ok(());
        }
        if self.scaler.is_none() {
            self.scaler = Some(Scaler::load(&self.ctx)?);
        }
        match &self.scaler {
            Some(s) => s.scale(&self.stream, buf, dtype, factor),
            None => unreachable!("loaded above"),
        }
    }

    /// A view of the first `bytes` of the fusion buffer, growing it when needed (a growth
    /// waits for the stream, so that the old buffer is no longer in use when freed).
    fn fusion_buffer(&mut self, bytes: usize) -> Result<DeviceBytesMut<'_>> {
        if self.fusion_capacity() < bytes {
            if let Some(old) = self.fusion.take() {
                self.stream
                    .synchronize()
                    .map_err(cuda_err("cuStreamSynchronize"))?;
                drop(old);
            }
            // Round up to 1 MiB steps so that slowly growing groups do not reallocate often.
            let cap = bytes.div_ceil(1 << 20).max(1) << 20;
            let buf = self
                .stream
                .alloc_zeros::<u8>(cap)
                .map_err(cuda_err("cuMemAlloc (fusion buffer)"))?;
            self.fusion = Some(buf);
        }
        let stream = self.stream.clone();
        match self.fusion.as_mut() {
            // SAFETY: the buffer is owned by this channel and freed only after a stream sync.
            Some(f) => unsafe { DeviceBytesMut::from_slice(f, &stream) }.slice_mut_owned(bytes),
            None => unreachable!("allocated above"),
        }
    }

    /// Pack `tensors` back to back into the fusion buffer (device-to-device copies on the
    /// channel stream); returns the packed length.
    pub fn pack(&mut self, tensors: &[DeviceBytes<'_>]) -> Result<usize> {
        let total = tensors
            .iter()
            .try_fold(0usize, |a, t| a.checked_add(t.len()));
        let total = total.ok_or_else(|| {
            TransportError::InvalidArgument("fused group larger than the address space".into())
        })?;
        let fusion = self.fusion_buffer(total)?;
        let (ptr, _) = (fusion.ptr, fusion.len);
        let mut off = 0u64;
        for t in tensors {
            // SAFETY: inside the fusion buffer (total bytes were reserved above).
            let dst = unsafe { DeviceBytesMut::from_raw(ptr + off, t.len()) };
            self.copy(dst, *t)?;
            off += t.len() as u64;
        }
        Ok(total)
    }

    /// Unpack the fusion buffer into `tensors` (the same lengths, in the same order, as
    /// packed).
    pub fn unpack(&mut self, tensors: &mut [DeviceBytesMut<'_>]) -> Result<()> {
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        if total > self.fusion_capacity() {
            return Err(TransportError::InvalidArgument(format!(
                "unpacking {total} bytes from a fusion buffer of {}",
                self.fusion_capacity()
            )));
        }
        let base = self.fusion_buffer(total)?.ptr;
        let mut off = 0u64;
        for t in tensors.iter_mut() {
            // SAFETY: inside the fusion buffer.
            let src = unsafe { DeviceBytes::from_raw(base + off, t.len()) };
            self.copy(t.reborrow(), src)?;
            off += t.len() as u64;
        }
        Ok(())
    }

    /// Allreduce a group of tensors of one dtype as one fused collective: pack into the fusion
    /// buffer, multiply by `prescale`, reduce, multiply by `postscale`, unpack. A single tensor
    /// is reduced in place without the fusion buffer. All enqueued on the channel stream.
    pub fn allreduce_fused(
        &mut self,
        tensors: &mut [DeviceBytesMut<'_>],
        dtype: DType,
        op: ReduceOp,
        prescale: f64,
        postscale: f64,
    ) -> Result<()> {
        for t in tensors.iter() {
            dtype.elements_in(t.len())?;
        }
        if let [one] = tensors {
            self.scale(one.reborrow(), dtype, prescale)?;
            self.comm.allreduce(one.reborrow(), dtype, op)?;
            return self.scale(one.reborrow(), dtype, postscale);
        }
        let views: Vec<DeviceBytes<'_>> = tensors.iter().map(|t| t.as_bytes()).collect();
        let total = self.pack(&views)?;
        let fused = self.fusion_buffer(total)?;
        // SAFETY: the fusion buffer lives in `self` until after the stream has used it.
        let fused_ptr = fused.ptr;
        let fused = || unsafe { DeviceBytesMut::from_raw(fused_ptr, total) };
        self.scale(fused(), dtype, prescale)?;
        self.comm.allreduce(fused(), dtype, op)?;
        self.scale(fused(), dtype, postscale)?;
        self.unpack(tensors)
    }
}

/// NCCL's data type and operator for `dtype`/`op`, or why NCCL cannot do it. `bool` travels
/// as `u8` with `Sum`/`BitOr`/`Max` as `Max` (logical OR) and `Product`/`BitAnd`/`Min` as
/// `Min` (logical AND), like `fh_core::kernels`.
pub(crate) fn nccl_types(
    dtype: DType,
    op: ReduceOp,
) -> Result<(
    fh_nccl_sys::sys::ncclDataType_t,
    fh_nccl_sys::sys::ncclRedOp_t,
)> {
    use fh_nccl_sys::sys::ncclRedOp_t as O;
    let t = nccl_dtype(dtype);
    let o = match (dtype, op) {
        (DType::Bool, ReduceOp::Sum | ReduceOp::BitOr | ReduceOp::Max) => O::ncclMax,
        (DType::Bool, ReduceOp::Product | ReduceOp::BitAnd | ReduceOp::Min) => O::ncclMin,
        (DType::Bool, ReduceOp::Average) | (_, ReduceOp::BitAnd | ReduceOp::BitOr) => {
            return Err(TransportError::InvalidArgument(format!(
                "NCCL cannot reduce {dtype:?} with {op:?} (no bitwise or boolean-average \
                 reductions on the device); reduce this tensor on the host"
            )))
        }
        (_, ReduceOp::Sum) => O::ncclSum,
        (_, ReduceOp::Average) => O::ncclAvg,
        (_, ReduceOp::Min) => O::ncclMin,
        (_, ReduceOp::Max) => O::ncclMax,
        (_, ReduceOp::Product) => O::ncclProd,
    };
    Ok((t, o))
}

/// NCCL's data type for `dtype` (`bool` as `u8`): the one `DType → ncclDataType_t` mapping.
pub(crate) fn nccl_dtype(dtype: DType) -> fh_nccl_sys::sys::ncclDataType_t {
    use fh_nccl_sys::sys::ncclDataType_t as T;
    match dtype {
        DType::U8 | DType::Bool => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_types_are_send_and_object_safe() {
        fn is_send<T: Send>() {}
        is_send::<Box<dyn DeviceCommunicator>>();
        is_send::<DeviceChannel>();
        is_send::<CudaWorld>();
        fn takes(_: &mut dyn DeviceCommunicator) {}
        let _ = takes;
    }

    #[test]
    fn nccl_mapping_refuses_what_nccl_cannot_do() {
        use fh_nccl_sys::sys::ncclRedOp_t as O;
        assert_eq!(
            nccl_types(DType::F32, ReduceOp::Average).unwrap().1,
            O::ncclAvg
        );
        assert_eq!(
            nccl_types(DType::Bool, ReduceOp::Sum).unwrap().1,
            O::ncclMax
        );
        assert_eq!(
            nccl_types(DType::Bool, ReduceOp::BitAnd).unwrap().1,
            O::ncclMin
        );
        let e = nccl_types(DType::I32, ReduceOp::BitOr)
            .unwrap_err()
            .to_string();
        assert!(e.contains("reduce this tensor on the host"), "{e}");
        assert!(nccl_types(DType::Bool, ReduceOp::Average).is_err());
    }

    #[test]
    fn every_dtype_and_op_maps_or_is_refused_clearly() {
        use std::collections::HashSet;
        let mut seen = HashSet::new();
        for dtype in DType::ALL {
            let t = nccl_dtype(dtype);
            // One NCCL type per dtype; only bool shares u8's.
            assert!(seen.insert(t.0) || dtype == DType::Bool, "{dtype:?}");
            for op in ReduceOp::ALL {
                let bitwise = matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr);
                let refused = (bitwise && dtype != DType::Bool)
                    || (dtype == DType::Bool && op == ReduceOp::Average);
                match nccl_types(dtype, op) {
                    Ok((tt, _)) => assert!(!refused && tt == t, "{dtype:?} {op:?}"),
                    Err(e) => assert!(
                        refused && e.to_string().contains("on the host"),
                        "{dtype:?} {op:?}: {e}"
                    ),
                }
            }
        }
    }

    #[test]
    fn staging_when_ranks_outnumber_gpus() {
        assert_eq!(choose_mode(1, 1, Staging::Auto), DeviceMode::Nccl);
        assert_eq!(choose_mode(8, 8, Staging::Auto), DeviceMode::Nccl);
        assert_eq!(choose_mode(2, 1, Staging::Auto), DeviceMode::HostStaged);
        assert_eq!(choose_mode(9, 8, Staging::Auto), DeviceMode::HostStaged);
        assert_eq!(choose_mode(1, 8, Staging::Always), DeviceMode::HostStaged);
    }

    #[test]
    fn device_ranges_are_checked() {
        // SAFETY: never dereferenced; only the range arithmetic is exercised.
        let b = unsafe { DeviceBytes::from_raw(0x1000, 64) };
        assert_eq!(b.slice(16, 48).unwrap().device_ptr(), 0x1010);
        assert!(b.slice(16, 49).is_err());
        assert!(b.slice(usize::MAX, 2).is_err());
    }

    /// With no driver (CI), choosing the GPU path is a clear error, not a panic.
    #[test]
    fn without_a_driver_the_world_is_unavailable() {
        if driver_present() {
            eprintln!("skipped: a CUDA driver is present (the GPU tests cover this machine)");
            return;
        }
        let err = CudaWorld::new(Topology::single_host(0, 1), Staging::Auto).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                TransportError::BackendUnavailable {
                    backend: "nccl",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("libcuda.so.1") && msg.contains("nvidia-smi"),
            "{msg}"
        );
    }
}
