//! Host staging: the device communicator for hosts with more ranks than GPUs. Every collective
//! copies device → host, runs the host communicator's collective, and copies host → device,
//! all ordered on the channel stream (the stream is synchronized before the host touches the
//! bytes, so readiness events waited on by the stream are honoured).

use std::sync::Arc;

use cudarc::driver::{result as cu, CudaStream};
use fh_core::{DType, ReduceOp};

use super::buffers::{DeviceBytes, DeviceBytesMut};
use super::device::DeviceCommunicator;
use super::driver::cuda_err;
use super::DeviceMode;
use crate::{Communicator, Result, TransportError};

/// A device communicator that moves bytes through host memory over a host [`Communicator`].
pub(crate) struct StagedComm {
    host: Box<dyn Communicator>,
    stream: Arc<CudaStream>,
    /// Staging buffers, reused between calls.
    send: Vec<u8>,
    recv: Vec<u8>,
}

impl StagedComm {
    pub(crate) fn new(host: Box<dyn Communicator>, stream: Arc<CudaStream>) -> Self {
        StagedComm {
            host,
            stream,
            send: Vec::new(),
            recv: Vec::new(),
        }
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize (host staging)"))
    }

    /// Copy `src` into `dst` (resized), waiting for everything before it on the stream.
    fn to_host(&self, src: DeviceBytes<'_>, dst: &mut Vec<u8>) -> Result<()> {
        dst.clear();
        dst.resize(src.len(), 0);
        if src.is_empty() {
            return self.sync();
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: `src` is valid device memory (DeviceBytes contract); `dst` has its length
        // and outlives the copy, which is waited for right after.
        unsafe {
            cu::memcpy_dtoh_async(
                dst.as_mut_slice(),
                src.device_ptr(),
                self.stream.cu_stream(),
            )
        }
        .map_err(cuda_err("cuMemcpyDtoHAsync (host staging)"))?;
        self.sync()
    }

    /// Copy `src` to `dst` and wait (the host buffer is reused by the next call).
    fn to_device(&self, src: &[u8], dst: DeviceBytesMut<'_>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(TransportError::InvalidArgument(format!(
                "host staging: {} bytes for a device buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is valid device memory; `src` lives until the sync below.
        unsafe { cu::memcpy_htod_async(dst.device_ptr(), src, self.stream.cu_stream()) }
            .map_err(cuda_err("cuMemcpyHtoDAsync (host staging)"))?;
        self.sync()
    }
}

impl DeviceCommunicator for StagedComm {
    fn backend(&self) -> &'static str {
        "host-staged"
    }
    fn mode(&self) -> DeviceMode {
        DeviceMode::HostStaged
    }
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn allreduce(&mut self, buf: DeviceBytesMut<'_>, dtype: DType, op: ReduceOp) -> Result<()> {
        let mut host = std::mem::take(&mut self.send);
        let r = self
            .to_host(buf.as_bytes(), &mut host)
            .and_then(|()| self.host.allreduce(&mut host, dtype, op))
            .and_then(|()| self.to_device(&host, buf));
        self.send = host;
        r
    }

    fn broadcast(&mut self, buf: DeviceBytesMut<'_>, root: usize) -> Result<()> {
        let mut host = std::mem::take(&mut self.send);
        let r = self
            .to_host(buf.as_bytes(), &mut host)
            .and_then(|()| self.host.broadcast(&mut host, root))
            .and_then(|()| self.to_device(&host, buf));
        self.send = host;
        r
    }

    fn allgather(&mut self, send: DeviceBytes<'_>, recv: DeviceBytesMut<'_>) -> Result<()> {
        let (mut s, mut r) = (
            std::mem::take(&mut self.send),
            std::mem::take(&mut self.recv),
        );
        r.clear();
        r.resize(recv.len(), 0);
        let res = self
            .to_host(send, &mut s)
            .and_then(|()| crate::CollectivesExt::allgather(&mut *self.host, &s, &mut r))
            .and_then(|()| self.to_device(&r, recv));
        (self.send, self.recv) = (s, r);
        res
    }

    fn reduce_scatter(
        &mut self,
        send: DeviceBytes<'_>,
        recv: DeviceBytesMut<'_>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let size = self.size();
        if recv.len().checked_mul(size) != Some(send.len()) {
            return Err(TransportError::InvalidArgument(format!(
                "reduce_scatter: send has {} bytes, expected recv's {} × {size} ranks",
                send.len(),
                recv.len()
            )));
        }
        let counts = vec![dtype.elements_in(recv.len())?; size];
        let (mut s, mut r) = (
            std::mem::take(&mut self.send),
            std::mem::take(&mut self.recv),
        );
        r.clear();
        r.resize(recv.len(), 0);
        let res = self
            .to_host(send, &mut s)
            .and_then(|()| self.host.reduce_scatter(&s, &mut r, &counts, dtype, op))
            .and_then(|()| self.to_device(&r, recv));
        (self.send, self.recv) = (s, r);
        res
    }

    fn alltoallv(
        &mut self,
        send: DeviceBytes<'_>,
        send_counts: &[usize],
        recv: DeviceBytesMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (mut s, mut r) = (
            std::mem::take(&mut self.send),
            std::mem::take(&mut self.recv),
        );
        r.clear();
        r.resize(recv.len(), 0);
        let res = self
            .to_host(send, &mut s)
            .and_then(|()| self.host.alltoallv(&s, send_counts, &mut r, recv_counts))
            .and_then(|()| self.to_device(&r, recv));
        (self.send, self.recv) = (s, r);
        res
    }

    fn async_error(&mut self) -> Result<()> {
        Ok(())
    }

    fn abort(&mut self) {
        // Host collectives are synchronous and bounded by the host transport's timeout:
        // nothing is left running on the device to abort.
    }
}
