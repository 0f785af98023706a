//! # fh-job
//!
//! How a process joins a FastHorovod job, before any data moves: where it sits
//! ([`launch::LaunchInfo`], read from whichever launcher started it — `fhrun`, `mpirun`, `srun`,
//! `torchrun` — and written by the launchers that start ranks, [`launch::LaunchInfo::to_vars`]), the job
//! token and every key made from it ([`token`]), which ranks share a host ([`hosts`]: the facts
//! a rank sends at the rendezvous and the layout every rank settles from them), the identity of
//! a world ([`world`]), the heartbeats' settings ([`heartbeat`]), the elastic session with the
//! driver ([`elastic`]), and the notice pipe to `fhrun` ([`notice`]).
//!
//! It opens no data connection: the communicators and their backends are `fh-transport`'s,
//! which builds a world from a [`launch::LaunchInfo`]. `fhrun` depends on this crate to start
//! ranks and run elastic sessions, and on `fh-transport` only where it runs collectives itself.
//!
//! **Invariant:** besides `fh-transport`, this is the only crate of the runtime that opens
//! sockets (the elastic session's), and it knows nothing of communicators, tensors or Python.
#![deny(missing_docs)]

pub mod elastic;
mod error;
pub mod heartbeat;
pub mod hosts;
pub mod launch;
pub mod notice;
pub mod token;
pub mod world;

pub use error::JobError;
pub use launch::{LaunchInfo, Launcher};
pub use token::{JobToken, Key};
pub use world::Topology;

/// The result type of this crate.
pub type Result<T, E = JobError> = std::result::Result<T, E>;
