//! The MPI communicator: one duplicated MPI communicator, its point-to-point messages in
//! chunks MPI's `int` counts can take, and (in `collectives`) its `Communicator`
//! implementation.

use std::ffi::{c_int, CString};
use std::fmt;
use std::sync::atomic::Ordering;

use fh_core::DType;
use mpi::ffi;

use super::call::{chunk_ranges, empty_status, recv_ptr, send_ptr, to_int, wait_request};
use super::runtime::{
    bytes_type, success, CommHandle, MpiError, Runtime, ThreadMode, HALF_OP_FAILED, MAX_COUNT,
};
use crate::{Result, TransportError};

mod collectives;

/// Tag of the last (often only) MPI message of a point-to-point message.
pub(super) const TAG_LAST: c_int = 0;
/// Tag of a chunk of a point-to-point message that more chunks follow.
pub(super) const TAG_MORE: c_int = 1;

/// A communicator of the MPI backend: one duplicated MPI communicator.
pub struct MpiComm {
    pub(super) handle: CommHandle,
    pub(super) label: String,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) max_count: usize,
}

// SAFETY: see `MpiTransport`.
unsafe impl Send for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("label", &self.label)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// What a collective call does in each thread mode.
pub(super) type Start<'a> = &'a mut dyn FnMut(&mut ffi::MPI_Request) -> c_int;

impl MpiComm {
    pub(super) fn new(handle: CommHandle, label: &str, rank: usize, size: usize) -> Self {
        MpiComm {
            handle,
            label: label.to_string(),
            rank,
            size,
            max_count: MAX_COUNT,
        }
    }

    /// Limit every MPI call to `count` elements (bytes for byte transfers); larger operations
    /// are split or routed through the generic algorithms. The default is `i32::MAX`, MPI's
    /// limit; smaller values exist to test the splitting. Must be set identically on all ranks.
    pub fn set_max_count(&mut self, count: usize) {
        self.max_count = count.clamp(1, MAX_COUNT);
    }

    /// The label given when the communicator was opened.
    pub fn label(&self) -> &str {
        &self.label
    }

    pub(super) fn set_error_handler_and_name(&self) -> Result<()> {
        let _guard = self.handle.rt.lock();
        // SAFETY: `raw` is a valid communicator.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(self.handle.raw, ffi::RSMPI_ERRORS_RETURN) };
        if !success(rc) {
            return Err(self.error_unlocked("MPI_Comm_set_errhandler", rc));
        }
        let mut name: String = self.label.chars().filter(|&c| c != '\0').collect();
        let max = ffi::MPI_MAX_OBJECT_NAME as usize - 1;
        while name.len() > max {
            name.pop();
        }
        if let Ok(c) = CString::new(name) {
            // SAFETY: `raw` is valid and `c` is NUL-terminated and shorter than the limit.
            let rc = unsafe { ffi::MPI_Comm_set_name(self.handle.raw, c.as_ptr()) };
            if !success(rc) {
                tracing::debug!("MPI_Comm_set_name failed with code {rc}");
            }
        }
        Ok(())
    }

    pub(super) fn rt(&self) -> &Runtime {
        &self.handle.rt
    }

    pub(super) fn context(&self, call: &str) -> String {
        format!(
            "{call} on MPI communicator '{}' (rank {} of {})",
            self.label, self.rank, self.size
        )
    }

    pub(super) fn error_from(
        &self,
        call: &str,
        e: MpiError,
        peer: Option<usize>,
    ) -> TransportError {
        let truncate = ffi::MPI_ERR_TRUNCATE as c_int;
        match peer {
            Some(rank) if e.class == truncate => TransportError::Protocol {
                rank,
                detail: format!("{}: {e}", self.context(call)),
            },
            _ => TransportError::io(self.context(call), std::io::Error::other(e)),
        }
    }

    pub(super) fn error(&self, call: &str, rc: c_int, peer: Option<usize>) -> TransportError {
        self.error_from(call, self.rt().describe(rc), peer)
    }

    pub(super) fn error_unlocked(&self, call: &str, rc: c_int) -> TransportError {
        self.error_from(call, self.rt().describe_unlocked(rc), None)
    }

    pub(super) fn check(&self, rc: c_int, call: &str, peer: Option<usize>) -> Result<()> {
        if success(rc) {
            Ok(())
        } else {
            Err(self.error(call, rc, peer))
        }
    }

    pub(super) fn wait(
        &self,
        req: &mut ffi::MPI_Request,
        call: &str,
        peer: Option<usize>,
    ) -> Result<ffi::MPI_Status> {
        wait_request(self.rt(), req).map_err(|rc| self.error(call, rc, peer))
    }

    /// Run a collective: the blocking call in multiple mode; in serialized mode the nonblocking
    /// one, started under the lock and polled without it.
    pub(super) fn run(
        &self,
        call: &str,
        blocking: &mut dyn FnMut() -> c_int,
        start: Start<'_>,
    ) -> Result<()> {
        match self.rt().mode {
            ThreadMode::Multiple => self.check(blocking(), call, None),
            ThreadMode::Serialized => {
                // SAFETY: placeholder request, overwritten by `start`.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                let rc = {
                    let _guard = self.rt().lock();
                    start(&mut req)
                };
                self.check(rc, call, None)?;
                self.wait(&mut req, call, None).map(drop)
            }
        }
    }

    pub(super) fn check_half_op(&self, dtype: DType, call: &str) -> Result<()> {
        if matches!(dtype, DType::F16 | DType::BF16) && HALF_OP_FAILED.swap(false, Ordering::SeqCst)
        {
            return Err(TransportError::io(
                self.context(call),
                std::io::Error::other(format!(
                    "the {} reduction inside MPI failed (see the error logged above)",
                    dtype.name()
                )),
            ));
        }
        Ok(())
    }

    pub(super) fn check_peer(&self, peer: usize) -> Result<c_int> {
        if peer >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "peer {peer} out of range 0..{} on MPI communicator '{}'",
                self.size, self.label
            )));
        }
        to_int(peer).ok_or_else(|| TransportError::InvalidArgument(format!("peer {peer}")))
    }

    /// Start nonblocking sends of `data` to `peer`, in chunks.
    pub(super) fn isend_all(&self, peer: c_int, data: &[u8]) -> Result<Vec<ffi::MPI_Request>> {
        let mut reqs = Vec::new();
        for (range, last) in chunk_ranges(data.len(), self.max_count) {
            let part = &data[range];
            let tag = if last { TAG_LAST } else { TAG_MORE };
            // SAFETY: placeholder request, overwritten by MPI_Isend.
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            let rc = {
                let _guard = self.rt().lock();
                // SAFETY: `part` stays borrowed until the request is waited by the caller.
                unsafe {
                    ffi::MPI_Isend(
                        send_ptr(part),
                        part.len() as c_int,
                        bytes_type(),
                        peer,
                        tag,
                        self.handle.raw,
                        &mut req,
                    )
                }
            };
            if !success(rc) {
                let err = self.error("MPI_Isend", rc, Some(peer as usize));
                // Complete what was started before reporting: its buffer is borrowed.
                self.wait_all(&mut reqs, "MPI_Isend")?;
                return Err(err);
            }
            reqs.push(req);
        }
        Ok(reqs)
    }

    /// Wait for every request; report the first failure after waiting for all.
    pub(super) fn wait_all(&self, reqs: &mut [ffi::MPI_Request], call: &str) -> Result<()> {
        let mut first = Ok(());
        for req in reqs {
            if let Err(e) = self.wait(req, call, None) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Match the next message from `peer` (any of our tags).
    pub(super) fn probe(&self, peer: c_int) -> Result<(ffi::MPI_Message, ffi::MPI_Status)> {
        // SAFETY: placeholder handle, overwritten by the probe.
        let mut msg = unsafe { ffi::RSMPI_MESSAGE_NULL };
        let mut status = empty_status();
        match self.rt().mode {
            ThreadMode::Multiple => {
                // SAFETY: `raw` is a valid communicator; msg/status are out parameters.
                let rc = unsafe {
                    ffi::MPI_Mprobe(
                        peer,
                        ffi::RSMPI_ANY_TAG,
                        self.handle.raw,
                        &mut msg,
                        &mut status,
                    )
                };
                self.check(rc, "MPI_Mprobe", Some(peer as usize))?;
            }
            ThreadMode::Serialized => loop {
                let mut flag: c_int = 0;
                let rc = {
                    let _guard = self.rt().lock();
                    // SAFETY: as above.
                    unsafe {
                        ffi::MPI_Improbe(
                            peer,
                            ffi::RSMPI_ANY_TAG,
                            self.handle.raw,
                            &mut flag,
                            &mut msg,
                            &mut status,
                        )
                    }
                };
                self.check(rc, "MPI_Improbe", Some(peer as usize))?;
                if flag != 0 {
                    break;
                }
                std::thread::yield_now();
            },
        }
        Ok((msg, status))
    }

    /// Receive the matched message `msg` into `buf` (whose length is the message's).
    pub(super) fn mrecv(
        &self,
        msg: &mut ffi::MPI_Message,
        buf: &mut [u8],
        peer: c_int,
    ) -> Result<()> {
        let count = buf.len() as c_int;
        match self.rt().mode {
            ThreadMode::Multiple => {
                let mut status = empty_status();
                // SAFETY: `msg` was matched by MPI_Mprobe and holds exactly `count` bytes.
                let rc =
                    unsafe { ffi::MPI_Mrecv(recv_ptr(buf), count, bytes_type(), msg, &mut status) };
                self.check(rc, "MPI_Mrecv", Some(peer as usize))
            }
            ThreadMode::Serialized => {
                // SAFETY: placeholder request, overwritten by MPI_Imrecv.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                let rc = {
                    let _guard = self.rt().lock();
                    // SAFETY: as above; `buf` stays borrowed until the request is waited.
                    unsafe { ffi::MPI_Imrecv(recv_ptr(buf), count, bytes_type(), msg, &mut req) }
                };
                self.check(rc, "MPI_Imrecv", Some(peer as usize))?;
                self.wait(&mut req, "MPI_Imrecv", Some(peer as usize))
                    .map(drop)
            }
        }
    }

    pub(super) fn message_len(&self, status: &ffi::MPI_Status, peer: c_int) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: `status` was filled by a probe of a byte message.
        let rc = unsafe { ffi::MPI_Get_count(status, bytes_type(), &mut count) };
        self.check(rc, "MPI_Get_count", Some(peer as usize))?;
        usize::try_from(count).map_err(|_| TransportError::Protocol {
            rank: peer as usize,
            detail: format!(
                "{}: message of undefined length",
                self.context("MPI_Get_count")
            ),
        })
    }

    /// Receive exactly `buf.len()` bytes from `peer`, in as many chunks as the sender used.
    pub(super) fn recv_exact(&self, peer: c_int, buf: &mut [u8]) -> Result<()> {
        let mut off = 0usize;
        loop {
            let (mut msg, status) = self.probe(peer)?;
            let n = self.message_len(&status, peer)?;
            let more = status.MPI_TAG == TAG_MORE;
            let end = off.saturating_add(n);
            let fits = if more {
                end < buf.len()
            } else {
                end == buf.len()
            };
            if !fits {
                // Consume the rest of the message so that the communicator stays usable.
                let mut scratch = vec![0u8; n];
                self.mrecv(&mut msg, &mut scratch, peer)?;
                let mut total = end;
                let mut more = more;
                while more {
                    let (mut msg, status) = self.probe(peer)?;
                    let n = self.message_len(&status, peer)?;
                    let mut scratch = vec![0u8; n];
                    self.mrecv(&mut msg, &mut scratch, peer)?;
                    total = total.saturating_add(n);
                    more = status.MPI_TAG == TAG_MORE;
                }
                return Err(TransportError::Protocol {
                    rank: peer as usize,
                    detail: format!(
                        "expected a message of {} bytes on MPI communicator '{}', received {total}",
                        buf.len(),
                        self.label
                    ),
                });
            }
            self.mrecv(&mut msg, &mut buf[off..end], peer)?;
            off = end;
            if !more {
                return Ok(());
            }
        }
    }
}
