//! Submissions: framework tensors wrapped as engine tensors and handed to an engine.

use fh_scheduler::{CollectiveOptions, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::names;

use super::handle::PyHandle;
use super::runtime::engine_for;
use super::state::engine;
use super::to_py;

/// Why this build refuses CUDA tensors.
#[cfg(not(feature = "cuda"))]
pub(super) const LACKS_CUDA: &str =
    "this build of FastHorovod lacks CUDA (it was built without the \
     `cuda` feature): rebuild it with `maturin build --features cuda` (no CUDA toolkit \
     needed), or move the tensor to the CPU with .cpu()";

/// The engine's tensor over a framework tensor's memory: host memory when `device < 0`, else
/// CUDA memory of `device`, produced on `stream` (a raw `CUstream`, 0 for the default one).
/// `owner` (the framework tensor) keeps the memory alive while the engine holds it.
///
/// # Safety
/// `address..address + nbytes` is the memory of the contiguous tensor `owner` (host memory,
/// or memory of CUDA device `device`), which the caller does not touch until the handle has
/// completed (for CUDA: until its stream waited on the completion events); `stream` is a
/// live stream of that device.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn wrap(
    owner: Py<PyAny>,
    address: usize,
    nbytes: usize,
    dtype: fh_core::DType,
    shape: Vec<usize>,
    device: i64,
    stream: u64,
) -> PyResult<Tensor> {
    if device < 0 {
        // SAFETY: the caller's promise (host memory).
        return unsafe {
            Tensor::from_external(dtype, shape, address as *mut u8, nbytes, Box::new(owner))
        }
        .map_err(to_py);
    }
    #[cfg(feature = "cuda")]
    {
        let device = u32::try_from(device)
            .map_err(|_| PyValueError::new_err(format!("CUDA device {device} is out of range")))?;
        let mem = fh_scheduler::DeviceMemory {
            device,
            ptr: address as u64,
            len: nbytes,
            stream,
        };
        // SAFETY: the caller's promise (device memory and stream).
        unsafe { Tensor::from_device(dtype, shape, mem, Box::new(owner)) }.map_err(to_py)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (owner, address, nbytes, dtype, shape, stream);
        Err(pyo3::exceptions::PyNotImplementedError::new_err(format!(
            "a tensor on cuda:{device}: {LACKS_CUDA}"
        )))
    }
}

/// A framework tensor as the engine will see it, read from the tensor object itself (never
/// from numbers the caller computed): its address, byte length, dtype, shape and device.
pub(super) struct TensorView {
    owner: Py<PyAny>,
    address: usize,
    nbytes: usize,
    dtype: fh_core::DType,
    shape: Vec<usize>,
    /// The CUDA device, or -1 for host memory.
    device: i64,
}

impl TensorView {
    /// Reads a contiguous `torch.Tensor` (CPU or CUDA); a clear `ValueError` for anything else.
    pub(super) fn of(what: &str, tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        let not_a_tensor = |_| {
            PyValueError::new_err(format!(
                "{what} takes a torch.Tensor, got {}",
                tensor
                    .get_type()
                    .name()
                    .map_or_else(|_| "an object".to_string(), |n| n.to_string())
            ))
        };
        let contiguous: bool = tensor
            .call_method0("is_contiguous")
            .and_then(|c| c.extract())
            .map_err(not_a_tensor)?;
        if !contiguous {
            return Err(PyValueError::new_err(format!(
                "{what}: the tensor must be contiguous (call .contiguous() first)"
            )));
        }
        let address: usize = tensor.call_method0("data_ptr")?.extract()?;
        // `nbytes` is numel × element size (of a contiguous tensor: its memory).
        let nbytes: usize = tensor.getattr("nbytes")?.extract()?;
        let dtype_name = tensor.getattr("dtype")?.str()?.to_string();
        let dtype = names::dtype(&dtype_name).map_err(PyValueError::new_err)?;
        let shape: Vec<usize> = tensor.getattr("shape")?.extract()?;
        // The flags first: building the tensor's `device` costs more than the rest together.
        let device = if tensor.getattr("is_cpu")?.extract::<bool>()? {
            -1
        } else {
            let device = tensor.getattr("device")?;
            let kind = device.getattr("type")?.str()?.to_string();
            if kind != "cuda" {
                return Err(pyo3::exceptions::PyNotImplementedError::new_err(format!(
                    "{what}: {kind} tensors are not supported by FastHorovod (CPU and CUDA \
                     tensors only): move the tensor to the CPU with .cpu()"
                )));
            }
            device
                .getattr("index")?
                .extract::<Option<i64>>()?
                .unwrap_or(0)
        };
        Ok(TensorView {
            owner: tensor.clone().unbind(),
            address,
            nbytes,
            dtype,
            shape,
            device,
        })
    }

    /// The engine's tensor over this memory; `stream` is the raw current stream of a CUDA
    /// tensor's device (ignored for host memory).
    fn into_tensor(self, stream: u64) -> PyResult<Tensor> {
        // SAFETY: `address..address + nbytes` was read from the contiguous tensor `owner`
        // itself (CPU, or CUDA on `device`), and the guard keeps it (and so its storage) alive
        // until the engine lets go of the `Tensor`. The Python side does not touch the
        // tensor's memory until the handle has completed (Horovod's contract for in-flight
        // tensors; for CUDA, `synchronize` makes the current stream wait for the completion
        // events first), and passes the current stream of the tensor's device.
        unsafe {
            wrap(
                self.owner,
                self.address,
                self.nbytes,
                self.dtype,
                self.shape,
                self.device,
                stream,
            )
        }
    }
}

/// The checked scale factors and reduce op of a reducing collective.
fn reduction(
    op: &str,
    prescale: f64,
    postscale: f64,
    priority: i64,
) -> PyResult<CollectiveOptions> {
    let op = names::reduce_op(op).map_err(PyValueError::new_err)?;
    if !(prescale.is_finite() && postscale.is_finite()) {
        return Err(PyValueError::new_err(format!(
            "scale factors must be finite, got prescale={prescale}, postscale={postscale}"
        )));
    }
    Ok(CollectiveOptions {
        op,
        prescale,
        postscale,
        priority,
        ..CollectiveOptions::default()
    })
}

/// Options of a collective that does not reduce.
fn moving() -> CollectiveOptions {
    CollectiveOptions::default().op(fh_core::ReduceOp::Sum)
}

/// Start an allreduce of `tensor` in its own memory; returns its handle.
#[allow(clippy::too_many_arguments)] // keyword-only: every argument is named at the call
#[pyfunction]
#[pyo3(signature = (tensor, *, name, op, prescale=1.0, postscale=1.0, priority=0, stream=0, process_set_id=0))]
pub(super) fn allreduce(
    tensor: &Bound<'_, PyAny>,
    name: &str,
    op: &str,
    prescale: f64,
    postscale: f64,
    priority: i64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let opts = reduction(op, prescale, postscale, priority)?;
    let view = TensorView::of("allreduce", tensor)?;
    let device = view.device;
    let h = engine
        .allreduce(name, view.into_tensor(stream)?, opts)
        .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device))
}

/// Start a grouped allreduce (members released together, fused where they can be), each in
/// its own memory; returns one handle per member.
#[allow(clippy::too_many_arguments)] // keyword-only: every argument is named at the call
#[pyfunction]
#[pyo3(signature = (tensors, *, name, op, prescale=1.0, postscale=1.0, priority=0, stream=0, process_set_id=0))]
pub(super) fn grouped_allreduce(
    tensors: Vec<Bound<'_, PyAny>>,
    name: &str,
    op: &str,
    prescale: f64,
    postscale: f64,
    priority: i64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<Vec<PyHandle>> {
    let engine = engine_for(process_set_id)?;
    let opts = reduction(op, prescale, postscale, priority)?;
    let views = tensors
        .iter()
        .map(|t| TensorView::of("grouped_allreduce", t))
        .collect::<PyResult<Vec<_>>>()?;
    let Some(device) = views.first().map(|v| v.device) else {
        return Err(PyValueError::new_err(
            "grouped_allreduce needs at least one tensor",
        ));
    };
    if views.iter().any(|v| v.device != device) {
        return Err(PyValueError::new_err(
            "grouped_allreduce: the tensors of a group must be on one device",
        ));
    }
    let tensors = views
        .into_iter()
        .map(|v| v.into_tensor(stream))
        .collect::<PyResult<Vec<_>>>()?;
    let group = engine
        .grouped_allreduce(name, tensors, opts)
        .map_err(to_py)?;
    Ok(group
        .into_handles()
        .into_iter()
        .map(|h| PyHandle::on_device(h, device))
        .collect())
}

/// Start an allgather of `tensor` (first dimensions may differ per rank); the handle's result
/// is a new tensor.
#[pyfunction]
#[pyo3(signature = (tensor, *, name, stream=0, process_set_id=0))]
pub(super) fn allgather(
    tensor: &Bound<'_, PyAny>,
    name: &str,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let view = TensorView::of("allgather", tensor)?;
    let device = view.device;
    let h = engine
        .allgather_with(name, view.into_tensor(stream)?, moving())
        .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device))
}

/// Start a broadcast of rank `root`'s (a rank of the process set) `tensor` into every rank's
/// `tensor`; returns its handle.
#[pyfunction]
#[pyo3(signature = (tensor, *, name, root, stream=0, process_set_id=0))]
pub(super) fn broadcast(
    tensor: &Bound<'_, PyAny>,
    name: &str,
    root: i64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let size = engine.size();
    let root = usize::try_from(root)
        .ok()
        .filter(|&r| r < size)
        .ok_or_else(|| {
            PyValueError::new_err(format!("root_rank {root} is out of range 0..{size}"))
        })?;
    let view = TensorView::of("broadcast", tensor)?;
    let device = view.device;
    let h = engine
        .broadcast_with(name, view.into_tensor(stream)?, root, moving())
        .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device))
}

/// Start an alltoall: `splits[r]` first-dimension rows go to rank r (equal parts without
/// `splits`); the handle's result is a new tensor.
#[pyfunction]
#[pyo3(signature = (tensor, *, name, splits=None, stream=0, process_set_id=0))]
pub(super) fn alltoall(
    tensor: &Bound<'_, PyAny>,
    name: &str,
    splits: Option<Vec<i64>>,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let splits = splits
        .map(|s| {
            s.into_iter()
                .map(|x| {
                    usize::try_from(x).map_err(|_| {
                        PyValueError::new_err(format!(
                            "alltoall splits must be non-negative, got {x}"
                        ))
                    })
                })
                .collect::<PyResult<Vec<usize>>>()
        })
        .transpose()?;
    let view = TensorView::of("alltoall", tensor)?;
    let device = view.device;
    let h = engine
        .alltoall_with(name, view.into_tensor(stream)?, splits, moving())
        .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device))
}

/// Start a reduce-scatter of `tensor`; the handle's result is this rank's slice of the first
/// dimension (a new tensor).
#[allow(clippy::too_many_arguments)] // keyword-only: every argument is named at the call
#[pyfunction]
#[pyo3(signature = (tensor, *, name, op, prescale=1.0, postscale=1.0, stream=0, process_set_id=0))]
pub(super) fn reducescatter(
    tensor: &Bound<'_, PyAny>,
    name: &str,
    op: &str,
    prescale: f64,
    postscale: f64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let opts = reduction(op, prescale, postscale, 0)?;
    let view = TensorView::of("reducescatter", tensor)?;
    let device = view.device;
    let h = engine
        .reduce_scatter_with(name, view.into_tensor(stream)?, opts)
        .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device))
}

/// Start a barrier over the ranks of process set `process_set_id` (0: every rank); returns
/// its handle.
#[pyfunction]
#[pyo3(signature = (process_set_id=0))]
pub(super) fn barrier(process_set_id: u32) -> PyResult<PyHandle> {
    Ok(PyHandle::new(
        engine_for(process_set_id)?.barrier().map_err(to_py)?,
    ))
}

/// Start a join; the handle's result is an int64 tensor holding the last rank to join.
#[pyfunction]
pub(super) fn join() -> PyResult<PyHandle> {
    Ok(PyHandle::new(engine()?.join().map_err(to_py)?))
}
