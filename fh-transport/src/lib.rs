//! # fh-transport
//!
//! How bytes move between ranks. A [`Transport`] is a *world*: it knows its rank, the world
//! size and the host topology, and it opens independent [`Communicator`]s (each with its own
//! connections), so that a scheduler can run several collectives at once — one per channel —
//! without interference.
//!
//! A backend implements only point-to-point messaging ([`Communicator::send`],
//! [`Communicator::recv`], [`Communicator::send_recv`]); every collective (allreduce,
//! allgather(v), broadcast, alltoall(v), reduce-scatter, barrier) is written once, in
//! [`algorithms`], against that interface. Backends with faster native collectives override the
//! trait's default methods.
//!
//! **Invariant:** this is the only crate that talks to sockets, MPI or NCCL. It knows nothing of
//! tensor names, fusion, scheduling or Python.
#![deny(missing_docs)]

pub mod algorithms;
pub mod comm;
pub mod error;
pub mod local;
pub mod mpi;

pub use comm::{CollectivesExt, Communicator, Topology, Transport};
pub use error::TransportError;

/// Result type of this crate.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
