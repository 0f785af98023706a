//! The CUDA driver: is it there (asked once per process), driver errors, and stream events
//! that carry readiness in from a framework and completion back to it.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent};

use super::Probe;
use crate::{Result, TransportError};

/// Turn a driver error into a [`TransportError::Device`] naming what was being done.
pub(crate) fn cuda_err(op: &str) -> impl FnOnce(cu::DriverError) -> TransportError + '_ {
    move |e| {
        let detail = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{e:?}"));
        TransportError::Device {
            op: op.to_string(),
            detail: format!("{detail} ({e:?})"),
        }
    }
}

/// Whether the driver library can be loaded (asked first: cudarc's loader panics otherwise).
///
/// Asked once per process, whatever the number of threads asking at once (engines, process
/// sets, tests): the answer cannot change, and when the driver is there cudarc's process-wide
/// handle takes it at once, so the driver is loaded once and never unloaded (cudarc's
/// presence check alone opens and closes it).
pub(super) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to `dlopen` the candidate names (closing what
        // it opened); `culib` then loads the library it found into cudarc's process-wide
        // handle, which cannot panic since the library is loadable.
        unsafe {
            let present = cudarc::driver::sys::is_culib_present();
            if present {
                let _ = cudarc::driver::sys::culib();
            }
            present
        }
    })
}

/// See [`super::probe`].
pub(crate) fn probe() -> Probe {
    let nccl = fh_nccl_sys::load()
        .map_err(|e| e.to_string())
        .and_then(|n| n.version());
    if !driver_present() {
        return Probe {
            driver: false,
            devices: 0,
            nccl,
        };
    }
    let devices = cu::init()
        .and_then(|()| cu::device::get_count())
        .map(|n| usize::try_from(n).unwrap_or(0));
    Probe {
        driver: devices.is_ok(),
        devices: devices.unwrap_or(0),
        nccl,
    }
}

/// Readiness from a framework: record, on the framework's own stream (e.g. PyTorch's current
/// stream, given as its raw handle), an event marking the work enqueued so far; pass it to
/// [`DeviceChannel::wait_ready`](super::DeviceChannel::wait_ready).
///
/// # Safety
/// `stream` is a live CUDA stream of `ctx`'s device (or null, the legacy default stream).
pub unsafe fn record_on_stream(ctx: &Arc<CudaContext>, stream: sys::CUstream) -> Result<CudaEvent> {
    let event = ctx.new_event(None).map_err(cuda_err("cuEventCreate"))?;
    // SAFETY: the event was just created on this context; `stream` is live (caller).
    unsafe { cu::event::record(event.cu_event(), stream) }.map_err(cuda_err("cuEventRecord"))?;
    Ok(event)
}

/// Completion into a framework: make the framework's stream (raw handle) wait, on the device,
/// for `event` (from [`DeviceChannel::record_completion`](super::DeviceChannel::record_completion)), so that its next kernels see the
/// reduced tensors without any host synchronization.
///
/// # Safety
/// `stream` is a live CUDA stream of the event's device (or null, the legacy default stream).
pub unsafe fn stream_wait(stream: sys::CUstream, event: &CudaEvent) -> Result<()> {
    event
        .context()
        .bind_to_thread()
        .map_err(cuda_err("cuCtxSetCurrent"))?;
    // SAFETY: both handles are live (caller; the event is borrowed).
    unsafe {
        cu::stream::wait_event(
            stream,
            event.cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(cuda_err("cuStreamWaitEvent"))
}
