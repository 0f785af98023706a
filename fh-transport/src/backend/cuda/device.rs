//! The device communicator trait: collectives on device memory, the twin of [`Communicator`]
//! that NCCL and host staging implement.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use fh_core::{DType, ReduceOp};

use super::buffers::{DeviceBytes, DeviceBytesMut};
#[cfg(doc)]
use super::DeviceChannel;
use super::DeviceMode;
#[cfg(doc)]
use crate::Communicator;
use crate::Result;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::{CudaWorld, DeviceChannel};

    #[test]
    fn device_types_are_send_and_object_safe() {
        fn is_send<T: Send>() {}
        is_send::<Box<dyn DeviceCommunicator>>();
        is_send::<DeviceChannel>();
        is_send::<CudaWorld>();
        fn takes(_: &mut dyn DeviceCommunicator) {}
        let _ = takes;
    }
}
