//! Submissions: framework tensors wrapped as engine tensors and handed to an engine.

use super::*;

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

/// The arguments of one submission, as the Python side passes them.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (kind, name, owner, address, nbytes, dtype, shape, op="average", prescale=1.0, postscale=1.0, root=0, splits=None, priority=0, device=-1, stream=0, process_set_id=0))]
pub(super) fn submit(
    kind: &str,
    name: &str,
    owner: Py<PyAny>,
    address: usize,
    nbytes: usize,
    dtype: &str,
    shape: Vec<usize>,
    op: &str,
    prescale: f64,
    postscale: f64,
    root: i64,
    splits: Option<Vec<i64>>,
    priority: i64,
    device: i64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<PyHandle> {
    let engine = engine_for(process_set_id)?;
    let dtype = names::dtype(dtype).map_err(PyValueError::new_err)?;
    let op = names::reduce_op(op).map_err(PyValueError::new_err)?;
    if !(prescale.is_finite() && postscale.is_finite()) {
        return Err(PyValueError::new_err(format!(
            "scale factors must be finite, got prescale={prescale}, postscale={postscale}"
        )));
    }
    // SAFETY: the Python side passes the address and byte length of a contiguous tensor (CPU,
    // or CUDA on `device` with its device's current stream), and `owner` is that tensor: the
    // guard keeps it (and so its storage) alive until the engine lets go of the `Tensor`. The
    // Python side does not touch the tensor's memory until the handle has completed
    // (Horovod's contract for in-flight tensors; for CUDA, `synchronize` makes the current
    // stream wait for the completion events first).
    let tensor = unsafe { wrap(owner, address, nbytes, dtype, shape, device, stream) }?;
    let opts = CollectiveOptions {
        op,
        prescale,
        postscale,
        priority,
        ..CollectiveOptions::default()
    };
    let size = engine.size();
    let root = usize::try_from(root)
        .ok()
        .filter(|&r| r < size)
        .ok_or_else(|| {
            PyValueError::new_err(format!("root_rank {root} is out of range 0..{size}"))
        });
    let h = match kind {
        "allreduce" => engine.allreduce(name, tensor, opts),
        "allgather" => engine.allgather_with(name, tensor, opts.op(fh_core::ReduceOp::Sum)),
        "broadcast" => engine.broadcast_with(name, tensor, root?, opts.op(fh_core::ReduceOp::Sum)),
        "alltoall" => {
            let splits = match splits {
                None => None,
                Some(s) => Some(
                    s.into_iter()
                        .map(|x| {
                            usize::try_from(x).map_err(|_| {
                                PyValueError::new_err(format!(
                                    "alltoall splits must be non-negative, got {x}"
                                ))
                            })
                        })
                        .collect::<PyResult<Vec<usize>>>()?,
                ),
            };
            engine.alltoall_with(name, tensor, splits, opts.op(fh_core::ReduceOp::Sum))
        }
        "reducescatter" => engine.reduce_scatter_with(name, tensor, opts),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown collective '{other}'"
            )))
        }
    }
    .map_err(to_py)?;
    Ok(PyHandle::on_device(h, device.max(-1)))
}

/// One member of a grouped allreduce: `(tensor, address, nbytes, dtype, shape)`.
pub(super) type Member = (Py<PyAny>, usize, usize, String, Vec<usize>);

/// Submit a grouped allreduce (members released together, fused where they can be); returns
/// one handle per member.
#[pyfunction]
#[pyo3(signature = (name, members, op="average", prescale=1.0, postscale=1.0, priority=0, device=-1, stream=0, process_set_id=0))]
#[allow(clippy::too_many_arguments)]
pub(super) fn submit_group(
    name: &str,
    members: Vec<Member>,
    op: &str,
    prescale: f64,
    postscale: f64,
    priority: i64,
    device: i64,
    stream: u64,
    process_set_id: u32,
) -> PyResult<Vec<PyHandle>> {
    let engine = engine_for(process_set_id)?;
    let op = names::reduce_op(op).map_err(PyValueError::new_err)?;
    let mut tensors = Vec::with_capacity(members.len());
    for (owner, address, nbytes, dtype, shape) in members {
        let dtype = names::dtype(&dtype).map_err(PyValueError::new_err)?;
        // SAFETY: as in `submit`: the address and length of a contiguous tensor (every member
        // on `device`) that `owner` (the tensor) keeps alive while the engine holds it.
        let t = unsafe { wrap(owner, address, nbytes, dtype, shape, device, stream) }?;
        tensors.push(t);
    }
    let opts = CollectiveOptions {
        op,
        prescale,
        postscale,
        priority,
        ..CollectiveOptions::default()
    };
    let group = engine
        .grouped_allreduce(name, tensors, opts)
        .map_err(to_py)?;
    Ok(group
        .into_handles()
        .into_iter()
        .map(|h| PyHandle::on_device(h, device.max(-1)))
        .collect())
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
