//! The extension module `fasthorovod._core` (feature `python`).
//!
//! A thin layer: it owns one [`Engine`] per process, turns tensors handed over by the Python
//! side (a contiguous CPU tensor's address, length, dtype and shape, plus the tensor object
//! itself as the owner guard) into engine [`Tensor`]s over that memory, and turns engine
//! errors into Python exceptions. Waits release the GIL; engine threads never take it (a
//! Python reference dropped there is released later by PyO3, when a thread next holds the
//! GIL).

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fh_scheduler::{CollectiveOptions, Engine, Handle, ProcessSets, SchedulerError, Tensor};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::{config, names};

create_exception!(
    _core,
    HorovodInternalError,
    PyRuntimeError,
    "A collective failed on every rank (ranks disagreed, a rank was lost, the runtime shut down)."
);

/// How often a blocked wait comes back for the GIL to let Ctrl-C through.
const SIGNAL_CHECK: Duration = Duration::from_millis(200);

enum State {
    Uninitialized,
    Running(Arc<Engine>, &'static str),
    ShutDown(String),
}

static STATE: Mutex<State> = Mutex::new(State::Uninitialized);

/// The process sets of the running engine (set by `init`, emptied by `shutdown`).
static SETS: Mutex<Option<Arc<ProcessSets>>> = Mutex::new(None);

fn sets() -> PyResult<Arc<ProcessSets>> {
    engine()?;
    SETS.lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or_else(not_initialized)
}

/// The engine that runs process set `id` on this rank (0: the global engine).
fn engine_for(id: u32) -> PyResult<Arc<Engine>> {
    if id == 0 {
        return engine();
    }
    sets()?.engine(id).map_err(to_py)
}

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn not_initialized() -> PyErr {
    PyValueError::new_err("FastHorovod has not been initialized; call hvd.init() before using it")
}

fn engine() -> PyResult<Arc<Engine>> {
    match &*state() {
        State::Running(e, _) => Ok(Arc::clone(e)),
        State::Uninitialized => Err(not_initialized()),
        State::ShutDown(why) => Err(HorovodInternalError::new_err(format!(
            "the FastHorovod runtime has shut down ({why}); call hvd.init() to start it again"
        ))),
    }
}

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

fn install_logging(lookup: &impl Fn(&str) -> Option<String>) {
    let level = config::aliased(lookup, "FH_LOG_LEVEL").unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(level.trim().to_ascii_lowercase())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Another subscriber may already be installed (embedding); keep it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Start the runtime on the world the environment describes; a no-op when it runs already.
/// Collective: every rank calls it.
#[pyfunction]
fn init(py: Python<'_>) -> PyResult<()> {
    if matches!(&*state(), State::Running(..)) {
        return Ok(());
    }
    let lookup = |k: &str| std::env::var(k).ok();
    install_logging(&lookup);
    let ignored = config::ignored_set(lookup);
    if !ignored.is_empty() {
        tracing::info!(
            ?ignored,
            "these HOROVOD_* variables have no effect on FastHorovod"
        );
    }
    let cfg = config::config_from(lookup).map_err(to_py)?;
    let started = py.detach(move || -> Result<(Engine, &'static str), SchedulerError> {
        let world = fh_transport::from_env().map_err(SchedulerError::from)?;
        let backend = world.backend();
        Ok((Engine::start(world, cfg)?, backend))
    });
    let (engine, backend) = started.map_err(|e| match e {
        SchedulerError::Config { .. } => to_py(e),
        other => HorovodInternalError::new_err(format!(
            "hvd.init() failed: {other}. Launch the script with `fhrun -np N python ...`, \
             `torchrun`, `mpirun` or `srun`, or run it alone for a single process."
        )),
    })?;
    *state() = State::Running(Arc::new(engine), backend);
    *SETS.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(ProcessSets::new()));
    Ok(())
}

/// Shut the runtime down (collective); pending operations fail. A no-op when not running.
#[pyfunction]
fn shutdown(py: Python<'_>) -> PyResult<()> {
    let prev = std::mem::replace(
        &mut *state(),
        State::ShutDown("hvd.shutdown() was called".into()),
    );
    let sets = SETS.lock().unwrap_or_else(|p| p.into_inner()).take();
    match prev {
        State::Running(engine, _) => {
            let r = py.detach(move || {
                // The sets first (each shutdown is agreed among its members), then the world.
                let r = sets.map_or(Ok(()), |s| s.close_all());
                r.and(match Arc::try_unwrap(engine) {
                    Ok(e) => e.shutdown(),
                    // Another thread is inside a call; the engine stops when it lets go.
                    Err(_) => Ok(()),
                })
            });
            r.map_err(to_py)
        }
        other => {
            *state() = other;
            Ok(())
        }
    }
}

/// Whether `init()` has been called (and `shutdown()` has not).
#[pyfunction]
fn is_initialized() -> bool {
    matches!(&*state(), State::Running(..))
}

/// `(rank, size, local_rank, local_size, cross_rank, cross_size)`.
#[pyfunction]
fn topology() -> PyResult<(usize, usize, usize, usize, usize, usize)> {
    let e = engine()?;
    let t = e.topology();
    Ok((
        t.rank,
        t.size,
        t.local_rank,
        t.local_size,
        t.cross_rank,
        t.cross_size,
    ))
}

/// The transport the runtime uses (`tcp`, `shm`, `hier`, `mpi`, `local`, ...).
#[pyfunction]
fn backend() -> PyResult<&'static str> {
    match &*state() {
        State::Running(_, b) => Ok(b),
        _ => Err(not_initialized()),
    }
}

/// Whether the MPI transport was compiled in.
#[pyfunction]
fn mpi_built() -> bool {
    fh_transport::MPI_BUILT
}

/// Whether CUDA support was compiled in (feature `cuda`).
#[pyfunction]
fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

/// Whether NCCL support was compiled in (feature `cuda`: NCCL is loaded at run time).
#[pyfunction]
fn nccl_built() -> bool {
    cfg!(feature = "cuda")
}

/// Start writing the timeline (rank 0 writes).
#[pyfunction]
fn start_timeline(path: &str) -> PyResult<()> {
    engine()?.start_timeline(Path::new(path)).map_err(to_py)
}

/// Stop writing the timeline.
#[pyfunction]
fn stop_timeline() -> PyResult<()> {
    engine()?.stop_timeline();
    Ok(())
}

/// The engine's counters, as a dict-friendly list of pairs.
#[pyfunction]
fn stats() -> PyResult<Vec<(String, u64)>> {
    let s = engine()?.stats();
    Ok(vec![
        ("completed".into(), s.completed),
        ("cache_hits".into(), s.cache_hits),
        ("rounds".into(), s.rounds),
        ("fused_groups".into(), s.fused_groups),
        ("data_bytes".into(), s.data_bytes),
    ])
}

/// A pending operation.
#[pyclass(module = "fasthorovod._core", name = "Handle")]
struct PyHandle {
    handle: Mutex<Option<Handle>>,
    name: String,
    /// The CUDA device of the submitted tensor, or -1 for a CPU tensor.
    device: i64,
}

impl PyHandle {
    fn new(h: Handle) -> Self {
        Self::on_device(h, -1)
    }

    fn on_device(h: Handle, device: i64) -> Self {
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
        let tensor = h.try_take().unwrap_or_else(|| {
            Err(SchedulerError::InvalidArgument(
                "internal error: a completed handle had no result".into(),
            ))
        });
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
fn host_wait_limit() -> Duration {
    std::env::var("FH_TIMEOUT_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|t| t.is_finite() && *t > 0.0 && *t < 1e9)
        .map_or(Duration::from_secs(300), Duration::from_secs_f64)
}

/// Why this build refuses CUDA tensors.
#[cfg(not(feature = "cuda"))]
const LACKS_CUDA: &str = "this build of FastHorovod lacks CUDA (it was built without the \
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
unsafe fn wrap(
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
fn submit(
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
type Member = (Py<PyAny>, usize, usize, String, Vec<usize>);

/// Submit a grouped allreduce (members released together, fused where they can be); returns
/// one handle per member.
#[pyfunction]
#[pyo3(signature = (name, members, op="average", prescale=1.0, postscale=1.0, priority=0, device=-1, stream=0, process_set_id=0))]
#[allow(clippy::too_many_arguments)]
fn submit_group(
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
fn barrier(process_set_id: u32) -> PyResult<PyHandle> {
    Ok(PyHandle::new(
        engine_for(process_set_id)?.barrier().map_err(to_py)?,
    ))
}

/// Collectively (every rank) add a process set of the world ranks `ranks`; returns its id,
/// the same on every rank. A list that differs between ranks, is empty, repeats a rank, names
/// a rank outside the world or equals an existing set raises `ValueError` on every rank.
#[pyfunction]
fn add_process_set(py: Python<'_>, ranks: Vec<i64>) -> PyResult<u32> {
    let sets = sets()?;
    let world = engine()?;
    let ranks = ranks
        .into_iter()
        .map(|r| {
            usize::try_from(r)
                .map_err(|_| PyValueError::new_err(format!("rank {r} is out of range")))
        })
        .collect::<PyResult<Vec<usize>>>()?;
    let cfg = world.config().clone();
    py.detach(move || sets.add(&world, &ranks, &cfg))
        .map_err(to_py)
}

/// Collectively (every rank) remove process set `id`; unknown ids (and 0, the global set)
/// raise `ValueError` on every rank.
#[pyfunction]
fn remove_process_set(py: Python<'_>, id: u32) -> PyResult<()> {
    let sets = sets()?;
    let world = engine()?;
    py.detach(move || sets.remove(&world, id)).map_err(to_py)
}

/// The world ranks of process set `id`, ascending.
#[pyfunction]
fn process_set_ranks(id: u32) -> PyResult<Vec<usize>> {
    if id == 0 {
        return Ok((0..engine()?.size()).collect());
    }
    sets()?.members(id).map_err(to_py)
}

/// The ids of the process sets added so far and not removed (0, the global set, first).
#[pyfunction]
fn process_set_ids() -> PyResult<Vec<u32>> {
    let mut ids = vec![0];
    ids.extend(sets()?.list().into_iter().map(|(id, _)| id));
    Ok(ids)
}

/// Start a join; the handle's result is an int64 tensor holding the last rank to join.
#[pyfunction]
fn join() -> PyResult<PyHandle> {
    Ok(PyHandle::new(engine()?.join().map_err(to_py)?))
}

/// The module.
#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "HorovodInternalError",
        m.py().get_type::<HorovodInternalError>(),
    )?;
    m.add_class::<PyHandle>()?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    m.add_function(wrap_pyfunction!(backend, m)?)?;
    m.add_function(wrap_pyfunction!(mpi_built, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_built, m)?)?;
    m.add_function(wrap_pyfunction!(start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stop_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(submit, m)?)?;
    m.add_function(wrap_pyfunction!(submit_group, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ids, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
