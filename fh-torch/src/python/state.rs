//! The one runtime object of this process ([`State`]): the world it runs in, if any. `init` and
//! `shutdown` (in `runtime`) replace it whole; every query and collective reads it.

use std::sync::{Arc, Mutex, MutexGuard};

use fh_scheduler::{Engine, ProcessSets};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::HorovodInternalError;

/// The runtime of this process: one value, replaced whole by `init` and `shutdown`.
pub(super) enum State {
    Uninitialized,
    Running(World),
    ShutDown(String),
}

/// The world this process runs in, and what belongs to it.
pub(super) struct World {
    /// The engine of the world.
    pub(super) engine: Arc<Engine>,
    /// The transport it runs on (`tcp`, `shm`, `hier`, `mpi`, `local`, ...).
    pub(super) backend: &'static str,
    /// Its process sets.
    pub(super) sets: Arc<ProcessSets>,
    /// `(generation, hosts_stamp)` in an elastic job.
    pub(super) assignment: Option<(u64, u64)>,
}

impl World {
    pub(super) fn new(
        engine: Engine,
        backend: &'static str,
        assignment: Option<(u64, u64)>,
    ) -> Self {
        World {
            engine: Arc::new(engine),
            backend,
            sets: Arc::new(ProcessSets::new()),
            assignment,
        }
    }
}

static STATE: Mutex<State> = Mutex::new(State::Uninitialized);

/// What `f` reads of the running world; the error of a runtime that is not running.
pub(super) fn running<T>(f: impl FnOnce(&World) -> T) -> PyResult<T> {
    match &*state() {
        State::Running(w) => Ok(f(w)),
        State::Uninitialized => Err(not_initialized()),
        State::ShutDown(why) => Err(HorovodInternalError::new_err(format!(
            "the FastHorovod runtime has shut down ({why}); call hvd.init() to start it again"
        ))),
    }
}

/// The process sets of the running world.
pub(super) fn sets() -> PyResult<Arc<ProcessSets>> {
    running(|w| Arc::clone(&w.sets))
}

pub(super) fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn not_initialized() -> PyErr {
    PyValueError::new_err("FastHorovod has not been initialized; call hvd.init() before using it")
}

pub(super) fn engine() -> PyResult<Arc<Engine>> {
    running(|w| Arc::clone(&w.engine))
}
