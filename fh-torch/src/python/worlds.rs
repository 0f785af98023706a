//! The worlds `fasthorovod.torch.distributed` forms beside the one of the environment: the
//! default group's world agreed through a torch store (`init_process_group` with a store, a
//! rank and a world size, and no launcher's variables), and one world per subgroup
//! (`new_group`), formed among its members only, since torch asks only the members to create
//! a subgroup's backend.
//!
//! Each is an ordinary world of the engine: the launch variables a launcher would give
//! (`FH_RANK`, `FH_SIZE`, `FH_RENDEZVOUS_ADDR`, `FH_JOB_TOKEN`) read by
//! [`LaunchInfo::from_vars`], the same rendezvous, handshake, host facts and `FH_TRANSPORT`
//! choice ([`fh_transport::world_for`]), and an [`Engine`] with the world engine's
//! configuration. A subgroup's key is derived from the world's token and a label every member
//! knows ([`JobToken::derive`]), so it authenticates as the world does and reaches no other
//! world.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use fh_job::{
    launch::LaunchInfo,
    token::{check_token, JobToken},
};
use fh_scheduler::{Engine, SchedulerError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::state::engine;
use super::{to_py, HorovodInternalError};

/// Ids of the engines of subgroup worlds start here (process sets count up from 1), so that
/// every submission function finds them through its `process_set_id`.
pub(super) const GROUP_ID_BASE: u32 = 1 << 31;

/// The token of the running world (`None` for a single process or MPI).
static WORLD_TOKEN: Mutex<Option<JobToken>> = Mutex::new(None);

/// The engines of subgroup worlds, by id.
static GROUPS: Mutex<BTreeMap<u32, Arc<Engine>>> = Mutex::new(BTreeMap::new());

/// The id of the next subgroup world (never reused in a process).
static NEXT_GROUP: Mutex<u32> = Mutex::new(GROUP_ID_BASE);

fn groups() -> MutexGuard<'static, BTreeMap<u32, Arc<Engine>>> {
    GROUPS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keep the running world's token (subgroup worlds derive theirs from it).
pub(super) fn set_world_token(token: Option<JobToken>) {
    *WORLD_TOKEN.lock().unwrap_or_else(|p| p.into_inner()) = token;
}

/// The launch of a world given by its variables: `rank` of `size`, rank 0 listening at
/// `rendezvous`, keyed by `token` (none for a single rank), written as a bare launch
/// ([`LaunchInfo::bare`]); `FH_TIMEOUT_SECONDS`, `FH_HOST_ID` and `FH_ALLOW_WILDCARD` come
/// from the environment, no other launcher variable does (a launcher's local and cross values
/// describe another world).
fn launch(
    rank: usize,
    size: usize,
    rendezvous: &str,
    token: Option<&JobToken>,
) -> PyResult<LaunchInfo> {
    let written = LaunchInfo {
        rendezvous: (size > 1).then(|| rendezvous.to_string()),
        token: token.cloned(),
        ..LaunchInfo::bare(rank, size)
    }
    .to_vars();
    let vars = |k: &str| match k {
        "FH_TIMEOUT_SECONDS" | "FH_HOST_ID" | "FH_ALLOW_WILDCARD" => std::env::var(k).ok(),
        _ => written
            .iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.clone()),
    };
    LaunchInfo::from_vars(vars).map_err(|e| to_py(SchedulerError::from(e)))
}

/// The launch of the default group's world agreed through a torch store: `FH_JOB_TOKEN`
/// derived for `label` (the store's nonce) when the environment has one, else `token`, which
/// rank 0 drew and passed through the store (then the world is as private as the store).
pub(super) fn store_launch(
    rank: usize,
    size: usize,
    rendezvous: &str,
    label: &str,
    token: Option<String>,
) -> PyResult<LaunchInfo> {
    let token = match std::env::var("FH_JOB_TOKEN").ok() {
        Some(env) => {
            check_token(&env).map_err(|e| to_py(SchedulerError::from(e)))?;
            JobToken::new(env.trim()).derive(&format!("torch.distributed store world;{label}"))
        }
        None => {
            let t = token.ok_or_else(|| {
                PyValueError::new_err("init(rank=...): FH_JOB_TOKEN is not set and no token given")
            })?;
            check_token(&t).map_err(|e| to_py(SchedulerError::from(e)))?;
            JobToken::new(t)
        }
    };
    launch(rank, size, rendezvous, Some(&token))
}

/// `(launcher, rank, size, local_rank, local_size)`.
type EnvironmentWorld = (String, usize, usize, usize, usize);

/// `(launcher, rank, size, local_rank, local_size)` of the world the environment describes
/// (what `init()` without arguments would join; the local values are the launcher's claims),
/// or `None` when it describes none (a lone process). A bad variable raises `ValueError`
/// naming it.
#[pyfunction]
pub(super) fn environment_world() -> PyResult<Option<EnvironmentWorld>> {
    let info = LaunchInfo::from_vars(|k| std::env::var(k).ok())
        .map_err(|e| to_py(SchedulerError::from(e)))?;
    Ok(match info.launcher {
        fh_job::launch::Launcher::Single => None,
        l => Some((
            l.name().to_string(),
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
        )),
    })
}

/// Form the world of a subgroup among its members (collective over them): this process is
/// `rank` of `size`, the group's rank 0 listens at `rendezvous`, the key is the running
/// world's token derived for `label` (which names the group and a nonce its rank 0 drew).
/// Returns the id that the submission functions take as `process_set_id`.
#[pyfunction]
pub(super) fn group_start(
    py: Python<'_>,
    rank: usize,
    size: usize,
    rendezvous: &str,
    label: &str,
) -> PyResult<u32> {
    let world = engine()?;
    let token = WORLD_TOKEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let info = match token {
        _ if size == 1 => launch(0, 1, "", None)?,
        Some(t) => {
            let key = t.derive(&format!("torch.distributed group;{label}"));
            launch(rank, size, rendezvous, Some(&key))?
        }
        None => {
            return Err(PyValueError::new_err(
                "a torch.distributed subgroup needs the world's job token to form its own \
                 world, and this world has none (FH_TRANSPORT=mpi): use FH_TRANSPORT=auto or tcp",
            ))
        }
    };
    let cfg = world.config().clone();
    let choice = std::env::var("FH_TRANSPORT").ok();
    let engine = py
        .detach(move || -> Result<Engine, SchedulerError> {
            let transport =
                fh_transport::world_for(&info, choice.as_deref()).map_err(SchedulerError::from)?;
            Engine::start(transport, cfg)
        })
        .map_err(|e| match e {
            SchedulerError::Config { .. } => to_py(e),
            other => HorovodInternalError::new_err(format!(
                "the world of a torch.distributed subgroup failed to form: {other}"
            )),
        })?;
    let id = {
        let mut next = NEXT_GROUP.lock().unwrap_or_else(|p| p.into_inner());
        let id = *next;
        *next = next.checked_add(1).ok_or_else(|| {
            PyValueError::new_err("too many torch.distributed subgroups in one process")
        })?;
        id
    };
    groups().insert(id, Arc::new(engine));
    Ok(id)
}

/// The engine of subgroup world `id`.
pub(super) fn group_engine(id: u32) -> PyResult<Arc<Engine>> {
    groups().get(&id).cloned().ok_or_else(|| {
        PyValueError::new_err(format!(
            "torch.distributed subgroup {id} has been destroyed (or never formed here)"
        ))
    })
}

/// Close subgroup world `id` (collective over its members; a no-op when it is gone);
/// `reason` is told to its members as `shutdown`'s is.
#[pyfunction]
#[pyo3(signature = (id, reason=None))]
pub(super) fn group_close(py: Python<'_>, id: u32, reason: Option<String>) -> PyResult<()> {
    let Some(engine) = groups().remove(&id) else {
        return Ok(());
    };
    py.detach(move || close_one(&engine, reason.as_deref()))
        .map_err(to_py)
}

fn close_one(engine: &Engine, reason: Option<&str>) -> Result<(), SchedulerError> {
    match reason {
        Some(why) => engine.close_with_reason(why),
        None => engine.close(),
    }
}

/// Take every subgroup world (the runtime shuts down).
pub(super) fn take_groups() -> Vec<Arc<Engine>> {
    std::mem::take(&mut *groups()).into_values().collect()
}

/// Close the worlds `take_groups` took; the first error is returned after all are closed.
pub(super) fn close_groups(
    groups: Vec<Arc<Engine>>,
    reason: Option<&str>,
) -> Result<(), SchedulerError> {
    let mut first = Ok(());
    for g in groups {
        let r = close_one(&g, reason);
        if first.is_ok() {
            first = r;
        }
    }
    first
}
