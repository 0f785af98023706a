//! Process sets: collectives over subsets of the world's ranks.
//!
//! A process set is a subset of the world's ranks with its **own engine**: its own control
//! communicator, response cache, coordinator (the set's first member) and bit-vector rounds,
//! and its own data channels, all over communicators that only its members use
//! ([`fh_transport::compose::subset`]). Sets therefore negotiate independently — a slow or busy set
//! never holds up another — and an idle set's engine sleeps like the global one (a heartbeat
//! round per [`crate::Config::idle_heartbeat`]).
//!
//! [`ProcessSets`] is the registry of one rank. [`ProcessSets::add`] and
//! [`ProcessSets::remove`] are collective over the **whole world** (every rank, member or
//! not, calls them in the same order, as Horovod's `add_process_set` / `remove_process_set`):
//! the ranks first exchange their arguments through the global engine, so a member list that
//! differs between ranks, an invalid list (empty, duplicate or out-of-range rank) or an unknown
//! set is the same clear error on every rank, and nothing is opened. Ids are assigned by a
//! counter that advances identically on every rank: the global set is id 0, added sets get
//! 1, 2, ... (never reused).
//!
//! A set's engine reports errors with the set's own ranks (0-based within the set), except
//! that a lost peer is named by its world rank (the transport's error).
//!
//! ```
//! use fh_scheduler::{AllreduceOptions, Config, Engine, ProcessSets, ReduceOp, Tensor};
//! use fh_transport::backend::local::LocalWorld;
//!
//! let threads: Vec<_> = LocalWorld::new(3).into_iter().map(|t| std::thread::spawn(move || {
//!     let world = Engine::start(Box::new(t), Config::default().channels(1)).unwrap();
//!     let sets = ProcessSets::new();
//!     let id = sets.add(&world, &[0, 2], world.config()).unwrap();
//!     let out = match sets.engine(id) {
//!         Ok(e) => {
//!             let x = Tensor::from_slice(&[world.rank() as f32]);
//!             let h = e.allreduce("x", x, AllreduceOptions::with_op(ReduceOp::Sum)).unwrap();
//!             Some(h.wait().unwrap().to_vec::<f32>().unwrap()[0])
//!         }
//!         Err(_) => None, // rank 1 is not a member
//!     };
//!     sets.remove(&world, id).unwrap();
//!     out
//! })).collect();
//! let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
//! assert_eq!(got, [Some(2.0), None, Some(2.0)]);
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fh_transport::compose::subset::{canonical_members, SubsetTransport};

use crate::{Config, Engine, SchedulerError, Tensor};

/// How long [`ProcessSets::add`] and [`ProcessSets::remove`] wait for the other ranks by
/// default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

struct SetEntry {
    members: Vec<usize>,
    /// The set's engine, on members.
    engine: Option<Arc<Engine>>,
    /// A non-member's idle ends of the set's world communicators.
    _outside: Option<SubsetTransport>,
}

#[derive(Default)]
struct State {
    next_id: u32,
    sets: BTreeMap<u32, SetEntry>,
}

/// The process sets of one rank (see the [module docs](self)).
pub struct ProcessSets {
    timeout: Duration,
    /// Serialises the collective operations (add, remove) of this rank.
    ops: Mutex<u64>,
    state: Mutex<State>,
}

impl std::fmt::Debug for ProcessSets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessSets")
            .field("sets", &self.list())
            .finish()
    }
}

impl Default for ProcessSets {
    fn default() -> Self {
        Self::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ProcessSets {
    /// An empty registry (only the global set, id 0, which is not held here).
    pub fn new() -> Self {
        Self::with_timeout(DEFAULT_TIMEOUT)
    }

    /// An empty registry whose collective operations wait at most `timeout` for the other
    /// ranks.
    pub fn with_timeout(timeout: Duration) -> Self {
        ProcessSets {
            timeout,
            ops: Mutex::new(0),
            state: Mutex::new(State {
                next_id: 1,
                sets: BTreeMap::new(),
            }),
        }
    }

    /// Gather every rank's `values` (any length) through the global engine under a name
    /// derived from the operation counter.
    fn exchange(
        &self,
        world: &Engine,
        what: &str,
        seq: u64,
        values: &[i64],
    ) -> Result<Vec<Vec<i64>>, SchedulerError> {
        let lens = self.gather(
            world,
            &format!("__process_set.{seq}.{what}.len"),
            &[values.len() as i64],
        )?;
        let flat = self.gather(world, &format!("__process_set.{seq}.{what}"), values)?;
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0usize;
        for &n in &lens {
            let n = usize::try_from(n).unwrap_or(0);
            let end = (at + n).min(flat.len());
            out.push(flat[at..end].to_vec());
            at = end;
        }
        Ok(out)
    }

    fn gather(
        &self,
        world: &Engine,
        name: &str,
        values: &[i64],
    ) -> Result<Vec<i64>, SchedulerError> {
        let t = Tensor::from_slice(values);
        world
            .allgather(name, t)?
            .wait_timeout(self.timeout)?
            .to_vec::<i64>()
    }

    /// Collectively (every rank of `world`, in the same order as its other `add`/`remove`
    /// calls) create a process set of the world ranks `ranks` and return its id (the same on
    /// every rank). Members start the set's engine with `config` (which must agree among the
    /// members, as for [`Engine::start`]). Errors, the same on every rank: the ranks passed
    /// different lists; the list is empty, has a duplicate or a rank outside the world; a set
    /// with these ranks exists already.
    pub fn add(
        &self,
        world: &Engine,
        ranks: &[usize],
        config: &Config,
    ) -> Result<u32, SchedulerError> {
        let mut ops = lock(&self.ops);
        let seq = *ops;
        *ops += 1;
        // Compared sorted: the order of a member list does not matter.
        let mut mine: Vec<i64> = ranks.iter().map(|&r| r as i64).collect();
        mine.sort_unstable();
        let all = self.exchange(world, "add", seq, &mine)?;
        if let Some(other) = all.iter().position(|l| *l != all[0]) {
            return Err(SchedulerError::InvalidArgument(format!(
                "add_process_set: the ranks passed different member lists (rank 0: {:?}, rank \
                 {other}: {:?}); every rank must pass the same list",
                all[0], all[other]
            )));
        }
        let members: Vec<usize> = ranks.to_vec();
        let members = canonical_members(&members, world.size())
            .map_err(|e| SchedulerError::InvalidArgument(format!("add_process_set: {e}")))?;
        let id = {
            let state = lock(&self.state);
            if let Some((id, _)) = state.sets.iter().find(|(_, s)| s.members == members) {
                return Err(SchedulerError::InvalidArgument(format!(
                    "add_process_set: a process set with ranks {members:?} exists already (id \
                     {id})"
                )));
            }
            if members.len() == world.size() {
                return Err(SchedulerError::InvalidArgument(format!(
                    "add_process_set: ranks {members:?} are the whole world, which is the \
                     global process set (id 0)"
                )));
            }
            state.next_id
        };
        let k = config.effective_channels();
        let mut labels = vec![format!("fh-ps{id}-control")];
        labels.extend((0..k).map(|c| format!("fh-ps{id}-channel-{c}")));
        let sub = world.open_subset(&members, &labels)?;
        let (engine, outside, started) = if sub.is_member() {
            // The set's engine numbers the members 0..n; its errors name their world ranks.
            match Engine::start_with_world_ranks(Box::new(sub), config.clone(), &members) {
                Ok(e) => (Some(Arc::new(e)), None, Ok(())),
                Err(e) => (None, None, Err(e)),
            }
        } else {
            (None, Some(sub), Ok(()))
        };
        // Every rank learns whether every member started, so that the registries stay equal.
        let ok = i64::from(started.is_ok());
        let flags = self.gather(world, &format!("__process_set.{seq}.started"), &[ok])?;
        started?;
        if let Some(r) = flags.iter().position(|&f| f == 0) {
            if let Some(e) = &engine {
                let _ = e.close();
            }
            return Err(SchedulerError::InvalidArgument(format!(
                "add_process_set: the engine of the set {members:?} failed to start on rank {r} \
                 (see that rank's error)"
            )));
        }
        let mut state = lock(&self.state);
        state.next_id += 1;
        state.sets.insert(
            id,
            SetEntry {
                members,
                engine,
                _outside: outside,
            },
        );
        tracing::debug!(rank = world.rank(), id, "process set added");
        Ok(id)
    }

    /// Collectively (every rank of `world`) remove the set `id`: its engine shuts down on its
    /// members (pending operations fail with [`SchedulerError::ShutDown`]) and its
    /// communicators close. Errors, the same on every rank: the ranks passed different ids;
    /// `id` is 0 (the global set) or unknown.
    pub fn remove(&self, world: &Engine, id: u32) -> Result<(), SchedulerError> {
        let mut ops = lock(&self.ops);
        let seq = *ops;
        *ops += 1;
        let all = self.exchange(world, "remove", seq, &[i64::from(id)])?;
        if let Some(other) = all.iter().position(|l| *l != all[0]) {
            return Err(SchedulerError::InvalidArgument(format!(
                "remove_process_set: the ranks passed different sets (rank 0: {:?}, rank \
                 {other}: {:?}); every rank must pass the same set",
                all[0], all[other]
            )));
        }
        if id == 0 {
            return Err(SchedulerError::InvalidArgument(
                "remove_process_set: the global process set (id 0) cannot be removed".into(),
            ));
        }
        let entry = lock(&self.state)
            .sets
            .remove(&id)
            .ok_or_else(|| unknown(id))?;
        if let Some(e) = entry.engine {
            e.close()?;
        }
        Ok(())
    }

    /// The engine of set `id` on this rank. Errors: `id` is unknown (never added, or
    /// removed), or this rank is not a member.
    pub fn engine(&self, id: u32) -> Result<Arc<Engine>, SchedulerError> {
        let state = lock(&self.state);
        let set = state.sets.get(&id).ok_or_else(|| unknown(id))?;
        set.engine.clone().ok_or_else(|| {
            SchedulerError::InvalidArgument(format!(
                "this rank is not a member of process set {id} (ranks {:?})",
                set.members
            ))
        })
    }

    /// The world ranks of set `id`, ascending (index = rank within the set).
    pub fn members(&self, id: u32) -> Result<Vec<usize>, SchedulerError> {
        let state = lock(&self.state);
        Ok(state
            .sets
            .get(&id)
            .ok_or_else(|| unknown(id))?
            .members
            .clone())
    }

    /// The id of the set with exactly these world ranks (any order), if one exists.
    pub fn find(&self, ranks: &[usize]) -> Option<u32> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        let state = lock(&self.state);
        state
            .sets
            .iter()
            .find(|(_, s)| s.members == sorted)
            .map(|(&id, _)| id)
    }

    /// Every set: (id, world ranks), by id.
    pub fn list(&self) -> Vec<(u32, Vec<usize>)> {
        lock(&self.state)
            .sets
            .iter()
            .map(|(&id, s)| (id, s.members.clone()))
            .collect()
    }

    /// Shut every set's engine down and forget the sets (not collective: for the end of the
    /// job, when the global engine shuts down too). Returns the first error.
    pub fn close_all(&self) -> Result<(), SchedulerError> {
        let sets = std::mem::take(&mut lock(&self.state).sets);
        let mut first = Ok(());
        for (_, s) in sets {
            if let Some(e) = s.engine {
                let r = e.close();
                if first.is_ok() {
                    first = r;
                }
            }
        }
        first
    }
}

fn unknown(id: u32) -> SchedulerError {
    SchedulerError::InvalidArgument(format!(
        "process set {id} is unknown (it was never added on this job, or it was removed)"
    ))
}
