//! One channel's device state (`DeviceChannel`): its communicator and stream, the readiness
//! and completion events, the device fusion buffer and the scaling kernels, written once for
//! every backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaSlice, CudaStream};
use fh_core::{DType, ReduceOp};

use super::buffers::{DeviceBytes, DeviceBytesMut};
use super::device::DeviceCommunicator;
use super::driver::cuda_err;
use super::scale::Scaler;
use super::DeviceMode;
use crate::{Result, TransportError};

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
