//! The extension module `fasthorovod._core` (feature `python`).
//!
//! A thin layer: it owns one [`Engine`] per process, turns tensors handed over by the Python
//! side (the `torch.Tensor` itself: its address, length, dtype, shape and device are read
//! from it, and it is the owner guard) into engine [`Tensor`]s over that memory, one
//! function per collective with keyword-only arguments, and turns engine errors into Python
//! exceptions. Waits release the GIL; engine threads never take it (a
//! Python reference dropped there is released later by PyO3, when a thread next holds the
//! GIL).

use fh_scheduler::SchedulerError;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

mod handle;
mod observe;
mod runtime;
mod state;
mod submit;
mod worlds;

use handle::PyHandle;
use runtime::*;
use submit::*;

// Named, printed and pickled as `fasthorovod.common.exceptions.HorovodInternalError`, where
// that module re-exports it (Horovod's is `horovod.common.exceptions.HorovodInternalError`).
create_exception!(
    fasthorovod.common.exceptions,
    HorovodInternalError,
    PyRuntimeError,
    "A collective failed on every rank (ranks disagreed, a rank was lost, the runtime shut down)."
);

// Raised by `init()` in an elastic worker that the driver left out of the new world (its host
// was removed or blacklisted, or it is above `--max-np`); `hvd.elastic.run` ends the process
// quietly on it.
create_exception!(
    fasthorovod._core,
    WorkerRemovedError,
    PyRuntimeError,
    "This elastic worker is not in the new world; the driver stops it."
);

/// An engine error as the Python exception Horovod users expect.
fn to_py(e: SchedulerError) -> PyErr {
    let msg = e.to_string();
    match e {
        SchedulerError::DuplicateName { .. }
        | SchedulerError::InvalidArgument(_)
        | SchedulerError::Config { .. } => PyValueError::new_err(msg),
        SchedulerError::WaitTimeout { .. } => PyTimeoutError::new_err(msg),
        _ => HorovodInternalError::new_err(msg),
    }
}

/// The module.
#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "HorovodInternalError",
        m.py().get_type::<HorovodInternalError>(),
    )?;
    m.add(
        "WorkerRemovedError",
        m.py().get_type::<WorkerRemovedError>(),
    )?;
    m.add_class::<PyHandle>()?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(notify_launcher, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    m.add_function(wrap_pyfunction!(backend, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_streams, m)?)?;
    m.add_function(wrap_pyfunction!(mpi_built, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_built, m)?)?;
    m.add_function(wrap_pyfunction!(start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stop_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(observe::stack_signal, m)?)?;
    m.add_function(wrap_pyfunction!(observe::enable_stack_dumps, m)?)?;
    m.add_function(wrap_pyfunction!(observe::timeline_on, m)?)?;
    m.add_function(wrap_pyfunction!(observe::timeline_span, m)?)?;
    m.add_function(wrap_pyfunction!(observe::explain, m)?)?;
    m.add_function(wrap_pyfunction!(observe::record_step, m)?)?;
    m.add_function(wrap_pyfunction!(observe::summary, m)?)?;
    m.add_function(wrap_pyfunction!(submit::allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(submit::grouped_allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(submit::allgather, m)?)?;
    m.add_function(wrap_pyfunction!(submit::broadcast, m)?)?;
    m.add_function(wrap_pyfunction!(submit::alltoall, m)?)?;
    m.add_function(wrap_pyfunction!(submit::reducescatter, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ids, m)?)?;
    m.add_function(wrap_pyfunction!(elastic_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(elastic_assignment, m)?)?;
    m.add_function(wrap_pyfunction!(elastic_host_updates, m)?)?;
    m.add_function(wrap_pyfunction!(worlds::environment_world, m)?)?;
    m.add_function(wrap_pyfunction!(worlds::group_start, m)?)?;
    m.add_function(wrap_pyfunction!(worlds::group_close, m)?)?;
    m.add("__version__", fh_core::RELEASE)?;
    m.add(
        "PROTOCOL_VERSION",
        fh_transport::backend::tcp::wire::PROTOCOL_VERSION,
    )?;
    Ok(())
}
