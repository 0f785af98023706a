//! Handles: waiting for an operation (the GIL released) and taking its result.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fh_scheduler::{Handle, SchedulerError};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use super::to_py;

/// How often a blocked wait comes back for the GIL to let Ctrl-C through.
pub(super) const SIGNAL_CHECK: Duration = Duration::from_millis(200);

/// A pending operation.
#[pyclass(module = "fasthorovod._core", name = "Handle")]
pub(super) struct PyHandle {
    handle: Mutex<Option<Handle>>,
    name: String,
    /// The CUDA device of the submitted tensor, or -1 for a CPU tensor.
    device: i64,
}

impl PyHandle {
    pub(super) fn new(h: Handle) -> Self {
        Self::on_device(h, -1)
    }

    pub(super) fn on_device(h: Handle, device: i64) -> Self {
        PyHandle {
            name: h.name().to_string(),
            handle: Mutex::new(Some(h)),
            device,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Handle>> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyHandle {
    /// The operation's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The CUDA device of the submitted tensor, or -1 for a CPU tensor.
    #[getter]
    fn device(&self) -> i64 {
        self.device
    }

    /// Whether the operation has completed (true also once its result was taken).
    fn poll(&self) -> bool {
        self.lock().as_ref().is_none_or(Handle::poll)
    }

    /// Wait for completion (the GIL released) and return the result: `None` when the result
    /// is in the submitted tensor's own memory, else `(bytearray, shape)` for a new tensor.
    /// `timeout` in seconds; on timeout `TimeoutError` is raised and the handle stays
    /// pending. For a CUDA tensor the result is always in the tensor's own memory: `stream`
    /// (a raw `CUstream` of the tensor's device, e.g. `torch.cuda.current_stream().cuda_stream`)
    /// is made to wait on the device for the collective's completion events, or, without
    /// `stream`, the host waits for them (bounded by `timeout`, else `FH_TIMEOUT_SECONDS` or
    /// 300 s).
    #[pyo3(signature = (timeout=None, stream=None))]
    fn wait(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        stream: Option<u64>,
    ) -> PyResult<Option<(Py<PyAny>, Vec<usize>)>> {
        let deadline = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, got {t}"
                )))
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
            None => None,
        };
        let mut slot = self.lock();
        let Some(h) = slot.as_mut() else {
            return Err(PyValueError::new_err(format!(
                "the result of '{}' was already taken (synchronize each handle once)",
                self.name
            )));
        };
        loop {
            let step = match deadline {
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(SIGNAL_CHECK),
                None => SIGNAL_CHECK,
            };
            let done = py.detach(|| h.wait_for(step));
            if done {
                break;
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "timed out waiting for '{}'; the operation is still in flight",
                    self.name
                )));
            }
        }
        let mut h = slot.take().expect("checked above");
        drop(slot);
        let tensor = h
            .try_take()
            .unwrap_or_else(|| Err(SchedulerError::internal("a completed handle had no result")));
        let tensor = tensor.map_err(to_py)?;
        if tensor.is_device() {
            #[cfg(feature = "cuda")]
            {
                let r = match stream {
                    // SAFETY: the caller passes a live stream of the tensor's device.
                    Some(s) => unsafe { tensor.wait_on_stream(s) },
                    None => {
                        let limit = deadline
                            .map(|d| d.saturating_duration_since(Instant::now()))
                            .unwrap_or_else(host_wait_limit);
                        py.detach(|| tensor.wait_on_host(limit))
                    }
                };
                r.map_err(to_py)?;
            }
            #[cfg(not(feature = "cuda"))]
            let _ = stream;
            // The result is in the caller's CUDA tensor; dropping ours releases the guard.
            return Ok(None);
        }
        if tensor.is_external() {
            // The result is in the caller's tensor; dropping ours releases the guard.
            return Ok(None);
        }
        let shape = tensor.shape().to_vec();
        let bytes = PyByteArray::new(py, tensor.data());
        Ok(Some((bytes.into_any().unbind(), shape)))
    }
}

/// How long `Handle.wait` without a stream waits on the host for a CUDA tensor's completion:
/// `FH_TIMEOUT_SECONDS`, else 300 s.
#[cfg(feature = "cuda")]
pub(super) fn host_wait_limit() -> Duration {
    std::env::var("FH_TIMEOUT_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|t| t.is_finite() && *t > 0.0 && *t < 1e9)
        .map_or(Duration::from_secs(300), Duration::from_secs_f64)
}
