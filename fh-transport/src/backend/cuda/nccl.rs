//! The NCCL device communicator: one NCCL communicator per channel, every call enqueued on the
//! channel's stream. The few raw NCCL calls of the crate live here.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use fh_core::{DType, ReduceOp};
use fh_nccl_sys::sys::{
    ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId, NCCL_UNIQUE_ID_BYTES,
};
use fh_nccl_sys::Nccl;

use super::buffers::{DeviceBytes, DeviceBytesMut};
use super::device::DeviceCommunicator;
use super::driver::cuda_err;
use super::nccl_types::nccl_types;
use super::DeviceMode;
use crate::{Communicator, Result, TransportError};

/// One NCCL communicator bound to one CUDA stream.
pub(crate) struct NcclComm {
    nccl: &'static Nccl,
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    label: String,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclComm` is only used through `&mut self` (or dropped), so one thread at a
// time. The stream handle is `Send` (cudarc).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Collectively create the communicator: rank 0 makes NCCL's unique id and sends it over
    /// `host` (the control plane), then every rank joins with `ncclCommInitRank`, waiting at
    /// most `timeout` for it.
    pub(crate) fn connect(
        host: &mut dyn Communicator,
        stream: Arc<CudaStream>,
        label: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let nccl = fh_nccl_sys::load().map_err(|e| TransportError::BackendUnavailable {
            backend: "nccl",
            reason: e.to_string(),
        })?;
        let (rank, size) = (host.rank(), host.size());
        let id = exchange_unique_id(nccl, host, label)?;
        let n = i32::try_from(size).map_err(|_| too_many(size))?;
        let r_ = i32::try_from(rank).map_err(|_| too_many(rank))?;
        let comm = init_rank(nccl, &stream, id, n, r_, label, timeout)?;
        tracing::debug!(channel = label, rank, size, "NCCL communicator ready");
        Ok(NcclComm {
            nccl,
            comm,
            stream,
            rank,
            size,
            label: label.to_string(),
        })
    }

    fn live(&self) -> Result<ncclComm_t> {
        if self.comm.is_null() {
            Err(TransportError::Closed(format!(
                "NCCL communicator of channel {} was aborted",
                self.label
            )))
        } else {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(cuda_err("cuCtxSetCurrent"))?;
            Ok(self.comm)
        }
    }

    fn cu_stream(&self) -> fh_nccl_sys::sys::cudaStream_t {
        self.stream.cu_stream() as fh_nccl_sys::sys::cudaStream_t
    }

    fn check(&self, r: ncclResult_t, op: &str) -> Result<()> {
        check(self.nccl, r, op, &self.label)
    }
}

/// Rank 0 makes NCCL's unique id and broadcasts it over `host` (the control plane); every rank
/// returns it. Rank 0's failure reaches every rank (the first byte of the message says it).
pub(crate) fn exchange_unique_id(
    nccl: &Nccl,
    host: &mut dyn Communicator,
    label: &str,
) -> Result<ncclUniqueId> {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES as usize],
    };
    let mut msg = vec![0u8; 1 + NCCL_UNIQUE_ID_BYTES as usize];
    if host.rank() == 0 {
        // SAFETY: writes one `ncclUniqueId` through a valid pointer.
        let r = unsafe { nccl.lib().ncclGetUniqueId(&mut id) };
        if r == ncclResult_t::ncclSuccess {
            for (m, b) in msg[1..].iter_mut().zip(id.internal.iter()) {
                *m = *b as u8;
            }
        } else {
            msg[0] = 1;
        }
        host.broadcast(&mut msg, 0)?;
        check(nccl, r, "ncclGetUniqueId", label)?;
    } else {
        host.broadcast(&mut msg, 0)?;
        if msg[0] != 0 {
            return Err(TransportError::Device {
                op: format!("ncclGetUniqueId on rank 0 (channel {label})"),
                detail: "rank 0 could not create NCCL's unique id; see its log".into(),
            });
        }
        for (b, m) in id.internal.iter_mut().zip(msg[1..].iter()) {
            *b = *m as std::os::raw::c_char;
        }
    }
    Ok(id)
}

/// A communicator handle moved to and from the initialising thread.
struct SendComm(ncclComm_t);
// SAFETY: a plain handle, used by one thread at a time (see `NcclComm`).
unsafe impl Send for SendComm {}

/// `ncclCommInitRank`, which has no timeout of its own (it waits for every rank), run on a
/// helper thread so that the caller waits at most `timeout`. On timeout the helper is left
/// blocked in NCCL (nothing can cancel it); if it ever finishes, it destroys the communicator
/// nobody is waiting for.
fn init_rank(
    nccl: &'static Nccl,
    stream: &Arc<CudaStream>,
    id: ncclUniqueId,
    size: i32,
    rank: i32,
    label: &str,
    timeout: Duration,
) -> Result<ncclComm_t> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<(ncclResult_t, SendComm)>(1);
    let ctx = stream.context().clone();
    std::thread::Builder::new()
        .name(format!("fh-nccl-init-{label}"))
        .spawn(move || {
            if ctx.bind_to_thread().is_err() {
                let _ = tx.send((
                    ncclResult_t::ncclUnhandledCudaError,
                    SendComm(std::ptr::null_mut()),
                ));
                return;
            }
            let mut comm: ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer; the id came from rank 0's
            // ncclGetUniqueId; the device context is current on this thread.
            let r = unsafe { nccl.lib().ncclCommInitRank(&mut comm, size, id, rank) };
            if let Err(std::sync::mpsc::SendError((_, SendComm(c)))) = tx.send((r, SendComm(comm)))
            {
                if !c.is_null() {
                    // SAFETY: a communicator nobody else holds, destroyed once.
                    let _ = unsafe { nccl.lib().ncclCommDestroy(c) };
                }
            }
        })
        .map_err(|e| TransportError::io("spawn the NCCL initialisation thread", e))?;
    match rx.recv_timeout(timeout) {
        Ok((r, SendComm(comm))) => {
            check(nccl, r, "ncclCommInitRank", label)?;
            Ok(comm)
        }
        Err(_) => Err(TransportError::Device {
            op: format!("ncclCommInitRank (channel {label})"),
            detail: format!(
                "not complete after {timeout:?}: some rank did not join (dead, stuck, or \
                 unable to reach this one over NCCL's network); see the other ranks' logs"
            ),
        }),
    }
}

fn too_many(n: usize) -> TransportError {
    TransportError::InvalidArgument(format!("{n} does not fit NCCL's int"))
}

fn check(nccl: &Nccl, r: ncclResult_t, op: &str, label: &str) -> Result<()> {
    if r == ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(TransportError::Device {
            op: format!("{op} (channel {label})"),
            detail: nccl.error_string(r),
        })
    }
}

fn elements(dtype: DType, bytes: usize) -> Result<usize> {
    Ok(dtype.elements_in(bytes)?)
}

impl DeviceCommunicator for NcclComm {
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn mode(&self) -> DeviceMode {
        DeviceMode::Nccl
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn allreduce(&mut self, buf: DeviceBytesMut<'_>, dtype: DType, op: ReduceOp) -> Result<()> {
        let (t, o) = nccl_types(dtype, op)?;
        let count = elements(dtype, buf.len())?;
        let comm = self.live()?;
        let p = buf.device_ptr() as *mut std::ffi::c_void;
        // SAFETY: `buf` is valid device memory until the operation completes (DeviceBytesMut
        // contract); in-place allreduce is allowed by NCCL.
        let r = unsafe {
            self.nccl
                .lib()
                .ncclAllReduce(p, p, count, t, o, comm, self.cu_stream())
        };
        self.check(r, "ncclAllReduce")
    }

    fn broadcast(&mut self, buf: DeviceBytesMut<'_>, root: usize) -> Result<()> {
        crate::algorithms::check_root(root, self.size)?;
        let comm = self.live()?;
        let p = buf.device_ptr() as *mut std::ffi::c_void;
        let root = i32::try_from(root).map_err(|_| too_many(root))?;
        // SAFETY: as in allreduce; in place.
        let r = unsafe {
            self.nccl.lib().ncclBroadcast(
                p,
                p,
                buf.len(),
                ncclDataType_t::ncclUint8,
                root,
                comm,
                self.cu_stream(),
            )
        };
        self.check(r, "ncclBroadcast")
    }

    fn allgather(&mut self, send: DeviceBytes<'_>, recv: DeviceBytesMut<'_>) -> Result<()> {
        if send.len().checked_mul(self.size) != Some(recv.len()) {
            return Err(TransportError::InvalidArgument(format!(
                "allgather: recv has {} bytes, expected {} × {} ranks",
                recv.len(),
                send.len(),
                self.size
            )));
        }
        let comm = self.live()?;
        // SAFETY: both ranges valid until completion; sizes checked above.
        let r = unsafe {
            self.nccl.lib().ncclAllGather(
                send.device_ptr() as *const std::ffi::c_void,
                recv.device_ptr() as *mut std::ffi::c_void,
                send.len(),
                ncclDataType_t::ncclUint8,
                comm,
                self.cu_stream(),
            )
        };
        self.check(r, "ncclAllGather")
    }

    fn reduce_scatter(
        &mut self,
        send: DeviceBytes<'_>,
        recv: DeviceBytesMut<'_>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if recv.len().checked_mul(self.size) != Some(send.len()) {
            return Err(TransportError::InvalidArgument(format!(
                "reduce_scatter: send has {} bytes, expected recv's {} × {} ranks",
                send.len(),
                recv.len(),
                self.size
            )));
        }
        let (t, o) = nccl_types(dtype, op)?;
        let count = elements(dtype, recv.len())?;
        let comm = self.live()?;
        // SAFETY: both ranges valid until completion; sizes checked above.
        let r = unsafe {
            self.nccl.lib().ncclReduceScatter(
                send.device_ptr() as *const std::ffi::c_void,
                recv.device_ptr() as *mut std::ffi::c_void,
                count,
                t,
                o,
                comm,
                self.cu_stream(),
            )
        };
        self.check(r, "ncclReduceScatter")
    }

    /// Written once over grouped `ncclSend`/`ncclRecv` (NCCL has no alltoallv).
    fn alltoallv(
        &mut self,
        send: DeviceBytes<'_>,
        send_counts: &[usize],
        recv: DeviceBytesMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        check_counts("send", send.len(), send_counts, self.size)?;
        check_counts("recv", recv.len(), recv_counts, self.size)?;
        let comm = self.live()?;
        let lib = self.nccl.lib();
        // SAFETY: no arguments; opens a group that is closed below on every path.
        self.check(unsafe { lib.ncclGroupStart() }, "ncclGroupStart")?;
        let mut result = Ok(());
        let (mut soff, mut roff) = (0u64, 0u64);
        for peer in 0..self.size {
            let p = peer as i32;
            if send_counts[peer] > 0 {
                // SAFETY: inside `send` (counts checked against its length).
                let r = unsafe {
                    lib.ncclSend(
                        (send.device_ptr() + soff) as *const std::ffi::c_void,
                        send_counts[peer],
                        ncclDataType_t::ncclUint8,
                        p,
                        comm,
                        self.cu_stream(),
                    )
                };
                result = result.and(self.check(r, "ncclSend"));
            }
            if recv_counts[peer] > 0 {
                // SAFETY: inside `recv` (counts checked against its length).
                let r = unsafe {
                    lib.ncclRecv(
                        (recv.device_ptr() + roff) as *mut std::ffi::c_void,
                        recv_counts[peer],
                        ncclDataType_t::ncclUint8,
                        p,
                        comm,
                        self.cu_stream(),
                    )
                };
                result = result.and(self.check(r, "ncclRecv"));
            }
            soff += send_counts[peer] as u64;
            roff += recv_counts[peer] as u64;
        }
        // SAFETY: closes the group opened above.
        let end = self.check(unsafe { lib.ncclGroupEnd() }, "ncclGroupEnd");
        result.and(end)
    }

    fn async_error(&mut self) -> Result<()> {
        if self.comm.is_null() {
            return Ok(());
        }
        let mut e = ncclResult_t::ncclSuccess;
        // SAFETY: valid communicator, valid out-pointer.
        let r = unsafe { self.nccl.lib().ncclCommGetAsyncError(self.comm, &mut e) };
        self.check(r, "ncclCommGetAsyncError")?;
        if e == ncclResult_t::ncclSuccess || e == ncclResult_t::ncclInProgress {
            Ok(())
        } else {
            self.check(e, "asynchronous NCCL error")
        }
    }

    fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: valid communicator, not used again (set to null).
            let r = unsafe { self.nccl.lib().ncclCommAbort(self.comm) };
            if r != ncclResult_t::ncclSuccess {
                tracing::warn!(channel = %self.label, "ncclCommAbort: {}", self.nccl.error_string(r));
            }
            self.comm = std::ptr::null_mut();
        }
    }
}

fn check_counts(what: &str, len: usize, counts: &[usize], size: usize) -> Result<()> {
    let total = counts.iter().try_fold(0usize, |a, c| a.checked_add(*c));
    if counts.len() != size || total != Some(len) {
        return Err(TransportError::InvalidArgument(format!(
            "alltoallv: {} {what} counts summing to {total:?} for {size} ranks and a buffer of \
             {len} bytes",
            counts.len()
        )));
    }
    Ok(())
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        if self.stream.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: valid communicator, never used again.
        let r = unsafe { self.nccl.lib().ncclCommDestroy(self.comm) };
        if r != ncclResult_t::ncclSuccess {
            tracing::warn!(channel = %self.label, "ncclCommDestroy: {}", self.nccl.error_string(r));
        }
        self.comm = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::local::LocalWorld;
    use crate::Transport;

    /// NCCL's unique id travels from rank 0 to every rank over the host control plane (no GPU
    /// needed: `ncclGetUniqueId` does not touch the device).
    #[test]
    fn the_unique_id_travels_over_the_control_plane() {
        // The process-wide search, else the wheel in the repository's target/fh-venv (where
        // `cargo xtask test` installs PyTorch).
        let venv_lib = std::fs::read_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/fh-venv/lib"
        ))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/nvidia/nccl/lib/libnccl.so.2"))
        .find(|p| p.is_file());
        let owned;
        let nccl: &Nccl = match (fh_nccl_sys::load(), venv_lib) {
            (Ok(n), _) => n,
            (Err(_), Some(p)) => {
                owned = fh_nccl_sys::find(Some(p)).expect("load the venv's libnccl.so.2");
                &owned
            }
            (Err(e), None) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let ids: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalWorld::new(3)
                .into_iter()
                .map(|mut t| {
                    s.spawn(move || {
                        let mut c = t.open("ctl").unwrap();
                        let id = exchange_unique_id(nccl, &mut *c, "test").unwrap();
                        id.internal.iter().map(|&b| b as u8).collect::<Vec<u8>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids[0].iter().any(|&b| b != 0), "an all-zero id");
        assert!(ids.iter().all(|i| *i == ids[0]), "ranks got different ids");
    }
}
