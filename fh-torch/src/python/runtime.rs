//! The runtime of this process: the engine, its process sets, lifecycle and queries.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use fh_job::token::JobToken;
use fh_scheduler::elastic::{Elastic, ElasticStart};
use fh_scheduler::{Engine, SchedulerError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config;

use super::state::{engine, not_initialized, running, sets, state, State, World};
use super::{observe, to_py, worlds, HorovodInternalError, WorkerRemovedError};

/// The engine that runs process set `id` on this rank (0: the global engine; from
/// [`worlds::GROUP_ID_BASE`] on: a world formed for a `torch.distributed` group).
pub(super) fn engine_for(id: u32) -> PyResult<Arc<Engine>> {
    if id == 0 {
        return engine();
    }
    if id >= worlds::GROUP_ID_BASE {
        return worlds::group_engine(id);
    }
    sets()?.engine(id).map_err(to_py)
}

pub(super) fn install_logging(lookup: &impl Fn(&str) -> Option<String>) {
    let level = config::aliased(lookup, "FH_LOG_LEVEL").unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(level.trim().to_ascii_lowercase())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Another subscriber may already be installed (embedding); keep it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(fh_scheduler::config::log_colour())
        .try_init();
}

/// Start the runtime on the world the environment describes; a no-op when it runs already.
/// Collective: every rank calls it.
///
/// With `rank` (and `size`, `rendezvous`, `label`) the world is instead the one
/// `fasthorovod.torch.distributed` agreed through a torch store: rank `rank` of `size`, rank 0
/// listening at `rendezvous`, keyed by `FH_JOB_TOKEN` derived for `label` when the environment
/// has it, else by `token` (drawn by rank 0 and passed through the store). See
/// [`worlds::store_launch`].
#[pyfunction]
#[pyo3(signature = (*, rank=None, size=None, rendezvous=None, label=None, token=None))]
pub(super) fn init(
    py: Python<'_>,
    rank: Option<usize>,
    size: Option<usize>,
    rendezvous: Option<String>,
    label: Option<String>,
    token: Option<String>,
) -> PyResult<()> {
    if matches!(&*state(), State::Running(_)) {
        return Ok(());
    }
    let formed = match rank {
        None => None,
        Some(rank) => Some(worlds::store_launch(
            rank,
            size.ok_or_else(|| PyValueError::new_err("init(rank=...) needs size"))?,
            rendezvous.as_deref().unwrap_or(""),
            label.as_deref().unwrap_or(""),
            token,
        )?),
    };
    let lookup = |k: &str| std::env::var(k).ok();
    install_logging(&lookup);
    observe::install_sigusr1();
    let ignored = config::ignored_set(lookup);
    if !ignored.is_empty() {
        tracing::info!(
            ?ignored,
            "these HOROVOD_* variables have no effect on FastHorovod"
        );
    }
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    for u in fh_scheduler::config::unknown_variables(names.iter().map(String::as_str)) {
        tracing::warn!("{u}; it has no effect");
    }
    let cfg = config::config_from(lookup).map_err(to_py)?;
    if let Some(info) = formed {
        let choice = std::env::var("FH_TRANSPORT").ok();
        let token = info.token.clone();
        let started = py.detach(move || -> Result<(Engine, &'static str), SchedulerError> {
            let world =
                fh_transport::world_for(&info, choice.as_deref()).map_err(SchedulerError::from)?;
            let backend = world.backend();
            Ok((Engine::start(world, cfg)?, backend))
        });
        let (engine, backend) = started.map_err(|e| match e {
            SchedulerError::Config { .. } => to_py(e),
            other => HorovodInternalError::new_err(format!(
                "the world agreed through the torch store failed to form: {other}"
            )),
        })?;
        worlds::set_world_token(token);
        *state() = State::Running(World::new(engine, backend, None));
        return Ok(());
    }
    if fh_job::elastic::enabled() {
        let (engine, assignment) = start_elastic(py, cfg)?;
        observe::install_culprit_hook(&engine);
        observe::start_metrics(&engine);
        let backend = engine.backend();
        *state() = State::Running(World::new(engine, backend, Some(assignment)));
        return Ok(());
    }
    let started = py.detach(
        move || -> Result<(Engine, &'static str, Option<JobToken>), SchedulerError> {
            let (world, token) = fh_transport::from_env_keyed().map_err(SchedulerError::from)?;
            let backend = world.backend();
            Ok((Engine::start(world, cfg)?, backend, token))
        },
    );
    let (engine, backend, token) = started.map_err(|e| match e {
        SchedulerError::Config { .. } => to_py(e),
        other => HorovodInternalError::new_err(format!(
            "hvd.init() failed: {other}. Launch the script with `fhrun -np N python ...`, \
             `torchrun`, `mpirun` or `srun`, or run it alone for a single process."
        )),
    })?;
    observe::install_culprit_hook(&engine);
    observe::start_metrics(&engine);
    worlds::set_world_token(token);
    *state() = State::Running(World::new(engine, backend, None));
    Ok(())
}

/// Shut the runtime down (collective); pending operations fail. A no-op when not running.
///
/// `reason` is told to the other ranks, whose engines stop with an error naming this rank
/// and the reason ("rank 1 shut down: raised ValueError: ..."), when they still had work.
/// Stops the engine at once even while another thread is inside a call (its operations fail).
#[pyfunction]
#[pyo3(signature = (reason = None))]
pub(super) fn shutdown(py: Python<'_>, reason: Option<String>) -> PyResult<()> {
    let why = reason
        .clone()
        .unwrap_or_else(|| "hvd.shutdown() was called".into());
    let prev = std::mem::replace(&mut *state(), State::ShutDown(why));
    let groups = worlds::take_groups();
    match prev {
        State::Running(World { engine, sets, .. }) => {
            let r = py.detach(move || {
                // The groups' worlds and the sets first (each shutdown is agreed among its
                // members), then the world.
                let r = worlds::close_groups(groups, reason.as_deref());
                let r = r.and(sets.close_all());
                let stopped = match &reason {
                    Some(why) => engine.close_with_reason(why),
                    None => engine.close(),
                };
                r.and(stopped)
            });
            r.map_err(to_py)
        }
        other => {
            *state() = other;
            py.detach(move || worlds::close_groups(groups, reason.as_deref()))
                .map_err(to_py)
        }
    }
}

/// Tell the launcher (fhrun's notice pipe, `FH_NOTICE_FD`) that rank `rank` fails and why;
/// a no-op without a launcher that listens (see `fh_job::notice::notify_launcher`).
#[pyfunction]
pub(super) fn notify_launcher(rank: usize, reason: &str) {
    fh_job::notice::notify_launcher(rank, reason);
}

/// Whether `init()` has been called (and `shutdown()` has not).
#[pyfunction]
pub(super) fn is_initialized() -> bool {
    matches!(&*state(), State::Running(_))
}

/// `(rank, size, local_rank, local_size, cross_rank, cross_size)`.
#[pyfunction]
pub(super) fn topology() -> PyResult<(usize, usize, usize, usize, usize, usize)> {
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
pub(super) fn backend() -> PyResult<&'static str> {
    match &*state() {
        State::Running(w) => Ok(w.backend),
        _ => Err(not_initialized()),
    }
}

/// The TCP streams to each peer on another host and what they were chosen from, as a dict
/// (`streams`, `setting`, and what `auto` measured at start-up: `one_stream_gbps`,
/// `many_streams_gbps`, `probe_streams`, `None` where nothing was measured); `None` when
/// nothing crosses hosts over TCP.
#[pyfunction]
pub(super) fn tcp_streams(py: Python<'_>) -> PyResult<Option<Py<PyDict>>> {
    let choice = match &*state() {
        State::Running(w) => w.engine.stream_choice(),
        _ => return Err(not_initialized()),
    };
    let Some(c) = choice else {
        return Ok(None);
    };
    let gbps = |bps: f64| bps * 8.0 / 1e9;
    let d = PyDict::new(py);
    d.set_item("streams", c.streams)?;
    d.set_item("setting", c.setting.to_string())?;
    d.set_item(
        "one_stream_gbps",
        c.measured.map(|m| gbps(m.one_stream_bps)),
    )?;
    d.set_item(
        "many_streams_gbps",
        c.measured.map(|m| gbps(m.many_streams_bps)),
    )?;
    d.set_item("probe_streams", c.measured.map(|m| m.probe_streams))?;
    Ok(Some(d.unbind()))
}

/// Whether the MPI transport was compiled in.
#[pyfunction]
pub(super) fn mpi_built() -> bool {
    fh_transport::MPI_BUILT
}

/// Whether CUDA support was compiled in (feature `cuda`).
#[pyfunction]
pub(super) fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

/// Whether NCCL support was compiled in (feature `cuda`: NCCL is loaded at run time).
#[pyfunction]
pub(super) fn nccl_built() -> bool {
    cfg!(feature = "cuda")
}

/// Start writing the timeline (rank 0 writes).
#[pyfunction]
pub(super) fn start_timeline(path: &str) -> PyResult<()> {
    engine()?.start_timeline(Path::new(path)).map_err(to_py)
}

/// Stop writing the timeline.
#[pyfunction]
pub(super) fn stop_timeline() -> PyResult<()> {
    engine()?.stop_timeline();
    Ok(())
}

/// The counters of the engine of process set `process_set_id` (0: the world), as a
/// dict-friendly list of pairs.
#[pyfunction]
#[pyo3(signature = (process_set_id=0))]
pub(super) fn stats(process_set_id: u32) -> PyResult<Vec<(String, u64)>> {
    let s = engine_for(process_set_id)?.stats();
    Ok(vec![
        ("completed".into(), s.completed),
        ("cache_hits".into(), s.cache_hits),
        ("rounds".into(), s.rounds),
        ("fused_groups".into(), s.fused_groups),
        ("data_bytes".into(), s.data_bytes),
        ("eager_tensors".into(), s.eager_tensors),
        ("eager_bytes".into(), s.eager_bytes),
    ])
}

/// Collectively (every rank) add a process set of the world ranks `ranks`; returns its id,
/// the same on every rank. A list that differs between ranks, is empty, repeats a rank, names
/// a rank outside the world or equals an existing set raises `ValueError` on every rank.
#[pyfunction]
pub(super) fn add_process_set(py: Python<'_>, ranks: Vec<i64>) -> PyResult<u32> {
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
pub(super) fn remove_process_set(py: Python<'_>, id: u32) -> PyResult<()> {
    let sets = sets()?;
    let world = engine()?;
    py.detach(move || sets.remove(&world, id)).map_err(to_py)
}

/// The world ranks of process set `id`, ascending.
#[pyfunction]
pub(super) fn process_set_ranks(id: u32) -> PyResult<Vec<usize>> {
    if id == 0 {
        return Ok((0..engine()?.size()).collect());
    }
    sets()?.members(id).map_err(to_py)
}

/// The ids of the process sets added so far and not removed (0, the global set, first).
#[pyfunction]
pub(super) fn process_set_ids() -> PyResult<Vec<u32>> {
    let mut ids = vec![0];
    ids.extend(sets()?.list().into_iter().map(|(id, _)| id));
    Ok(ids)
}

/// The session of this process with the elastic driver (a worker of `fhrun
/// --host-discovery-script`), opened at its first `init` and kept for the process's life.
static ELASTIC: Mutex<Option<Elastic>> = Mutex::new(None);

fn elastic_session() -> MutexGuard<'static, Option<Elastic>> {
    ELASTIC.lock().unwrap_or_else(|p| p.into_inner())
}

/// `init` of an elastic worker: register with the driver for the next generation and start
/// the engine on its world; returns it with its `(generation, hosts_stamp)`. `WorkerRemovedError` when the driver leaves this worker out;
/// `HorovodInternalError` when the job cannot go on or the world fails to form (the elastic
/// loop then tries the next one).
fn start_elastic(py: Python<'_>, cfg: fh_scheduler::Config) -> PyResult<(Engine, (u64, u64))> {
    let mut session = elastic_session();
    if session.is_none() {
        let opened = py.detach(Elastic::from_env).map_err(|e| {
            HorovodInternalError::new_err(format!(
                "hvd.init() cannot reach the elastic driver: {e}"
            ))
        })?;
        *session = Some(opened.ok_or_else(|| {
            HorovodInternalError::new_err(
                "hvd.init(): FH_ELASTIC_ADDR is set but names no elastic session (is \
                 FH_ELASTIC_WORKER set? fhrun --host-discovery-script sets both)",
            )
        })?);
    }
    let Some(elastic) = session.as_mut() else {
        return Err(not_initialized());
    };
    // A world that fails to form (a peer lost during its rendezvous or start-up) fails on
    // every member, and each registers again for the next: the driver forms that one from
    // the workers still alive. Bounded: the driver's own limits (--elastic-timeout,
    // --reset-limit) end a job that cannot form a world long before these attempts run out.
    let started = py.detach(|| {
        let mut attempt = 1;
        loop {
            match elastic.start(cfg.clone()) {
                Err(e) if is_transient(&e) && attempt < FORM_ATTEMPTS => {
                    tracing::warn!(
                        attempt,
                        "an elastic world failed to form ({e}); registering for the next"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    });
    match started {
        Ok(ElasticStart::Started { engine, assignment }) => {
            Ok((engine, (assignment.generation, assignment.hosts_stamp)))
        }
        Ok(ElasticStart::Removed(why)) => Err(WorkerRemovedError::new_err(why)),
        Err(e @ SchedulerError::Config { .. }) => Err(to_py(e)),
        Err(e) => Err(HorovodInternalError::new_err(format!(
            "hvd.init() could not form the next elastic world: {e}"
        ))),
    }
}

/// How many worlds in a row `init` may see fail to form before it gives up.
const FORM_ATTEMPTS: u32 = 10;

/// Whether an error of [`Elastic::start`] is a world that failed to form (try the next),
/// rather than the end of the job or a bad assignment.
fn is_transient(e: &SchedulerError) -> bool {
    !matches!(
        e,
        SchedulerError::ElasticFailed { .. }
            | SchedulerError::InvalidArgument(_)
            | SchedulerError::Internal(_)
            | SchedulerError::Config { .. }
    )
}

/// Whether this process is a worker of an elastic job (`FH_ELASTIC_ADDR` set by `fhrun
/// --host-discovery-script`).
#[pyfunction]
pub(super) fn elastic_enabled() -> bool {
    fh_job::elastic::enabled()
}

/// `(generation, hosts_stamp)` of the running elastic world.
#[pyfunction]
pub(super) fn elastic_assignment() -> PyResult<(u64, u64)> {
    running(|w| w.assignment)?
        .ok_or_else(|| PyValueError::new_err("this process is not a worker of an elastic job"))
}

/// `(stamp, added, removed)`: the driver's changes of the usable host set after stamp
/// `since` (rank 0 asks at a commit and broadcasts the answer).
#[pyfunction]
pub(super) fn elastic_host_updates(py: Python<'_>, since: u64) -> PyResult<(u64, bool, bool)> {
    let mut session = elastic_session();
    let Some(elastic) = session.as_mut() else {
        return Err(PyValueError::new_err(
            "this process is not a worker of an elastic job (no session with a driver)",
        ));
    };
    let u = py
        .detach(|| elastic.host_updates(since))
        .map_err(|e| HorovodInternalError::new_err(format!("asking the elastic driver: {e}")))?;
    Ok((u.stamp, u.added, u.removed))
}
