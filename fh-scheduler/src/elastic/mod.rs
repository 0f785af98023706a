//! Elastic training for Rust users: an engine re-started on a new world each time the job's
//! membership changes, as Horovod's elastic mode does (issue 28).
//!
//! Under `fhrun --host-discovery-script SCRIPT --min-np N ...` every worker process holds a
//! session to the elastic *driver* (fhrun). The worker asks the driver for the next world —
//! a *generation*: its size, this worker's rank, rank 0's rendezvous address and a token of
//! its own — and starts an engine on it; when a rank is lost, the survivors' engines fail,
//! each survivor closes its engine and asks again, and the driver answers all of them at once
//! with the next, smaller, world. When hosts are added, the workers learn it at a commit
//! ([`Elastic::host_updates`]), close their engines and ask again, and the new world includes
//! the new workers. Rank 0 of a new generation is the lowest surviving rank, so the state is
//! synchronised from it (a broadcast from rank 0).
//!
//! An engine shuts down completely when closed, also after a failure — every thread it and its
//! transport started is joined, no socket stays open and no shared-memory segment is left —
//! so a process can re-form its world any number of times.
//!
//! - [`Elastic::from_env`] connects to the driver (`FH_ELASTIC_ADDR`); `None` outside an
//!   elastic job. [`Elastic::with_source`] takes any [`WorldSource`] instead (tests, other
//!   schedulers).
//! - [`Elastic::start`] registers for the next world and starts its engine:
//!   [`ElasticStart::Started`] with the engine and the generation's [`Assignment`], or
//!   [`ElasticStart::Removed`] when this worker is not in the new world (leave quietly: the
//!   driver stops it). [`SchedulerError::ElasticFailed`] means the job cannot go on (fewer
//!   than `--min-np` ranks remain, or the session to the driver is lost; the error carries the
//!   driver's reason). Any other error means that this generation's world could not be formed
//!   (a peer was lost during its rendezvous or start-up): call [`Elastic::start`] again.
//! - [`Elastic::host_updates`] asks the driver whether hosts were added or removed since a
//!   stamp (the [`Assignment::hosts_stamp`] of the running world, then the last stamp seen).
//!
//! # An elastic training loop
//!
//! Commit (keep a copy of) the state every few steps; on an engine error restore the last
//! commit, close the engine and start again; at a commit, rank 0 asks for host updates and
//! broadcasts the answer, and every rank re-forms the world when the stamp moved (as Horovod's
//! `State.check_host_updates` does).
//!
//! ```no_run
//! use fh_scheduler::elastic::{Elastic, ElasticStart};
//! use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, SchedulerError, Tensor};
//!
//! /// The training state: the step and the weights (a real job also keeps the optimizer's).
//! #[derive(Clone)]
//! struct State {
//!     step: usize,
//!     weights: Vec<f32>,
//! }
//!
//! /// Why a generation ended.
//! enum End {
//!     Done,
//!     HostsChanged,
//! }
//!
//! /// Train until done, a host update, or an error; `committed` is the restore point.
//! fn train(
//!     engine: &Engine,
//!     elastic: &mut Elastic,
//!     committed: &mut State,
//!     seen: &mut u64,
//! ) -> Result<End, SchedulerError> {
//!     let mut state = committed.clone();
//!     while state.step < 1000 {
//!         let grads = vec![1.0f32; state.weights.len()];
//!         let avg = engine
//!             .allreduce("grads", Tensor::from_slice(&grads), AllreduceOptions::with_op(ReduceOp::Average))?
//!             .wait()?
//!             .to_vec::<f32>()?;
//!         for (w, g) in state.weights.iter_mut().zip(avg) {
//!             *w -= 0.01 * g;
//!         }
//!         state.step += 1;
//!         if state.step % 10 == 0 {
//!             *committed = state.clone();
//!             // check_host_updates: rank 0 asks the driver, every rank gets its answer.
//!             let mine = if engine.rank() == 0 {
//!                 let u = elastic.host_updates(*seen)?;
//!                 [u.stamp as i64, i64::from(u.added), i64::from(u.removed)]
//!             } else {
//!                 [0; 3]
//!             };
//!             let u = engine.broadcast("hosts", Tensor::from_slice(&mine), 0)?.wait()?.to_vec::<i64>()?;
//!             if u[0] as u64 > *seen {
//!                 *seen = u[0] as u64;
//!                 return Ok(End::HostsChanged);
//!             }
//!         }
//!     }
//!     *committed = state;
//!     Ok(End::Done)
//! }
//!
//! fn main() -> Result<(), SchedulerError> {
//!     let Some(mut elastic) = Elastic::from_env()? else {
//!         panic!("not an elastic job: launch with fhrun --host-discovery-script");
//!     };
//!     let mut committed = State { step: 0, weights: vec![0.0; 1000] };
//!     loop {
//!         let (engine, assignment) = match elastic.start(Config::from_env()?) {
//!             Ok(ElasticStart::Started { engine, assignment }) => (engine, assignment),
//!             // Not in the new world (host removed, above --max-np): leave quietly.
//!             Ok(ElasticStart::Removed(_why)) => return Ok(()),
//!             // The job cannot go on: the error names the lost hosts.
//!             Err(e @ SchedulerError::ElasticFailed { .. }) => return Err(e),
//!             // A peer was lost while this world formed: register again.
//!             Err(_) => continue,
//!         };
//!         let mut seen = assignment.hosts_stamp;
//!         // Sync from rank 0, the lowest surviving rank (new ranks start from its state).
//!         let synced = engine
//!             .broadcast("sync-weights", Tensor::from_slice(&committed.weights), 0)
//!             .and_then(|mut h| h.wait())
//!             .and_then(|t| t.to_vec::<f32>())
//!             .and_then(|w| {
//!                 let step = [committed.step as i64];
//!                 let s = engine.broadcast("sync-step", Tensor::from_slice(&step), 0)?.wait()?;
//!                 Ok((w, s.to_vec::<i64>()?[0] as usize))
//!             });
//!         let outcome = synced.and_then(|(weights, step)| {
//!             committed = State { step, weights };
//!             train(&engine, &mut elastic, &mut committed, &mut seen)
//!         });
//!         match outcome {
//!             Ok(End::Done) => return engine.shutdown(),
//!             // Hosts changed at a commit, or a rank was lost (`committed` is the restore
//!             // point): shut this engine down and form the next world.
//!             Ok(End::HostsChanged) | Err(_) => {
//!                 let _ = engine.close();
//!             }
//!         }
//!     }
//! }
//! ```

use fh_job::launch::LaunchInfo;

use fh_job::elastic::ELASTIC_INCARNATION_BASE;
pub use fh_job::elastic::{Assignment, HostUpdate, Membership};

use crate::{Config, Engine, SchedulerError};

/// The placeholder `FH_FLIGHT_DIR` and `FH_TIMELINE` may hold for the generation in an
/// elastic job (`/tmp/job/flight/gen-{generation}`): each world's engine writes its records
/// and timeline where the placeholder is that world's generation, so that ranks renumbered by
/// a later world never overwrite an earlier one's (fhrun's elastic job directory uses it).
pub const GENERATION_PLACEHOLDER: &str = "{generation}";

/// `config` for the world of generation `generation`: [`GENERATION_PLACEHOLDER`] in the
/// flight directory and the timeline path replaced by the number.
pub fn for_generation(mut config: Config, generation: u64) -> Config {
    let put = |p: &mut std::path::PathBuf| {
        let text = p.to_string_lossy();
        if text.contains(GENERATION_PLACEHOLDER) {
            *p = text
                .replace(GENERATION_PLACEHOLDER, &generation.to_string())
                .into();
        }
    };
    config.flight_dir.iter_mut().for_each(put);
    config.timeline.iter_mut().for_each(put);
    config
}

/// Where an elastic engine's worlds come from: the driver's session
/// (`fh_job::elastic::Client`, through a small adapter in this module), or anything else
/// that hands out generations (tests implement it without a driver).
pub trait WorldSource: Send {
    /// Register for the next generation and wait (bounded) for the answer.
    fn next_world(&mut self) -> Result<Membership, SchedulerError>;
    /// The changes of the usable host set after stamp `since`.
    fn host_updates(&mut self, since: u64) -> Result<HostUpdate, SchedulerError>;
}

/// One worker's elastic engine: each [`Elastic::start`] forms the next world and starts an
/// engine on it (see the [module documentation](self)).
pub struct Elastic {
    source: Box<dyn WorldSource>,
    base: LaunchInfo,
    transport_choice: Option<String>,
    /// The generation of the last world started, so that a world's token is never used twice.
    last_generation: Option<u64>,
}

impl std::fmt::Debug for Elastic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elastic")
            .field("base", &self.base)
            .field("transport_choice", &self.transport_choice)
            .field("last_generation", &self.last_generation)
            .finish_non_exhaustive()
    }
}

/// What [`Elastic::start`] gives.
#[derive(Debug)]
pub enum ElasticStart {
    /// This worker is in the new world: its running engine and its place.
    Started {
        /// The engine of the new world.
        engine: Engine,
        /// The generation, this worker's topology, the rendezvous and the host-set stamp.
        assignment: Assignment,
    },
    /// This worker is not in the new world (its host was removed or blacklisted, or it is
    /// above `--max-np`); the driver's reason. The process should end quietly (status 0).
    Removed(String),
}

impl Elastic {
    /// The elastic engine of a worker of an elastic job (`FH_ELASTIC_ADDR` set by
    /// `fhrun --host-discovery-script`): connects to the driver as `FH_ELASTIC_WORKER` with
    /// `FH_JOB_TOKEN`. `None` when the process is not a worker of an elastic job. The backend
    /// is chosen by `FH_TRANSPORT`, as for [`fh_transport::from_env`].
    pub fn from_env() -> Result<Option<Elastic>, SchedulerError> {
        let Some(client) = fh_job::elastic::Client::from_env()? else {
            return Ok(None);
        };
        let base = fh_job::elastic::base_info()?;
        let choice = std::env::var("FH_TRANSPORT").ok();
        Ok(Some(Elastic::with_source(
            Box::new(ClientSource(client)),
            base,
            choice,
        )))
    }

    /// An elastic engine whose worlds come from `source`: each generation's world is built
    /// with [`fh_transport::world_for`] from `base` (timeout, job token, host id: the
    /// launch without rank variables) and the generation's [`Assignment`], on the backend
    /// named by `transport_choice` (as `FH_TRANSPORT`; `None`: `auto`).
    pub fn with_source(
        source: Box<dyn WorldSource>,
        base: LaunchInfo,
        transport_choice: Option<String>,
    ) -> Elastic {
        Elastic {
            source,
            base,
            transport_choice,
            last_generation: None,
        }
    }

    /// Build the next worlds on the backend named `choice` (as `FH_TRANSPORT`; `None`:
    /// `auto`) instead of the one given at construction.
    pub fn set_transport_choice(&mut self, choice: Option<String>) {
        self.transport_choice = choice;
    }

    /// The next world's engine: register with the source, build the world
    /// ([`fh_transport::world_for`] with the generation's [`LaunchInfo`]:
    /// [`Assignment::launch_info`]) and [`Engine::start`] it with `config`. Collective over
    /// the new world's ranks. Close the previous generation's engine first.
    ///
    /// Errors: [`SchedulerError::Config`] for a backend that cannot form elastic worlds
    /// (`mpi`); [`SchedulerError::ElasticFailed`] when the job cannot go on (the source answered
    /// `Failed(reason)`: the error carries the reason; or the source itself failed, e.g. the
    /// session to the driver is lost); [`SchedulerError::InvalidArgument`] for an assignment
    /// that makes no sense (a rank outside the world, a generation not after the last one);
    /// any other error is this world failing to form (a peer lost during the rendezvous or
    /// the engine's start-up): call `start` again to register for the next.
    pub fn start(&mut self, config: Config) -> Result<ElasticStart, SchedulerError> {
        // MPI's world is the one mpirun started: it cannot shrink or grow.
        if let Some(choice) = &self.transport_choice {
            if choice
                .split('+')
                .any(|b| b.trim().eq_ignore_ascii_case("mpi"))
            {
                return Err(SchedulerError::config(
                    "FH_TRANSPORT",
                    format!(
                        "{choice:?} cannot carry an elastic job: an MPI world is fixed by \
                         mpirun; use tcp, shm, hier or auto (the default)"
                    ),
                ));
            }
        }
        let membership = self
            .source
            .next_world()
            .map_err(|e| SchedulerError::ElasticFailed {
                reason: format!("no answer from the elastic driver: {e}"),
            })?;
        let assignment = match membership {
            Membership::Member(a) => a,
            Membership::Removed(why) => return Ok(ElasticStart::Removed(why)),
            Membership::Failed(why) => return Err(SchedulerError::ElasticFailed { reason: why }),
        };
        self.check(&assignment)?;
        self.last_generation = Some(assignment.generation);
        let info = assignment.launch_info(&self.base);
        let world = fh_transport::world_for(&info, self.transport_choice.as_deref())?;
        let engine = Engine::start(world, for_generation(config, assignment.generation))?;
        tracing::debug!(
            generation = assignment.generation,
            rank = assignment.topology.rank,
            size = assignment.topology.size,
            "elastic world started"
        );
        Ok(ElasticStart::Started { engine, assignment })
    }

    /// The changes of the usable host set after stamp `since` (the running world's
    /// [`Assignment::hosts_stamp`], then the last stamp seen). In a training loop only rank 0
    /// asks, at a commit, and broadcasts the answer (see the [module documentation](self)).
    pub fn host_updates(&mut self, since: u64) -> Result<HostUpdate, SchedulerError> {
        self.source.host_updates(since)
    }

    /// Refuse an assignment that cannot be a world of this worker.
    fn check(&self, a: &Assignment) -> Result<(), SchedulerError> {
        let t = a.topology;
        let bad = |what: String| {
            Err(SchedulerError::InvalidArgument(format!(
                "the elastic driver assigned generation {} {what}; this is a bug of the driver \
                 (or of the WorldSource)",
                a.generation
            )))
        };
        if t.size == 0 || t.rank >= t.size {
            return bad(format!("rank {} of a world of {} ranks", t.rank, t.size));
        }
        if t.local_size == 0
            || t.local_rank >= t.local_size
            || t.cross_size == 0
            || t.cross_rank >= t.cross_size
        {
            return bad(format!("the impossible host place {t:?}"));
        }
        if t.size > 1 && a.rendezvous.trim().is_empty() {
            return bad("no rendezvous address".into());
        }
        if a.generation > u64::MAX - ELASTIC_INCARNATION_BASE {
            return bad("a generation number past the last token incarnation".into());
        }
        if let Some(last) = self.last_generation {
            if a.generation <= last {
                return bad(format!(
                    "after generation {last}: each world needs a new generation (and token)"
                ));
            }
        }
        Ok(())
    }
}

/// The driver's session as a [`WorldSource`].
struct ClientSource(fh_job::elastic::Client);

impl WorldSource for ClientSource {
    fn next_world(&mut self) -> Result<Membership, SchedulerError> {
        Ok(self.0.next_world()?)
    }

    fn host_updates(&mut self, since: u64) -> Result<HostUpdate, SchedulerError> {
        Ok(self.0.host_updates(since)?)
    }
}

#[cfg(test)]
mod tests;
