//! # fh-core
//!
//! The pure heart of FastHorovod: element types ([`DType`]), reduction operators
//! ([`ReduceOp`]), host reduction kernels ([`kernels`]), the error type ([`CoreError`]), the
//! negotiation messages ([`message`]) and their wire encoding ([`wire`]), who sent what when
//! ranks disagree ([`mismatch`]), the bit vectors of
//! the readiness negotiation ([`bitvec`]), the response cache ([`cache`]) and the fusion
//! planner ([`fusion`]).
//!
//! **Invariant:** this crate performs no I/O, spawns no threads and knows nothing about
//! sockets, MPI, CUDA or Python. Everything here is deterministic and unit-testable.
#![deny(missing_docs)]

pub mod bitvec;
pub mod bytes;
pub mod cache;
pub mod dtype;
pub mod error;
pub mod fusion;
pub mod hash;
pub mod kernels;
pub mod message;
pub mod mismatch;
pub mod op;
pub mod units;
pub mod wire;

pub use dtype::{DType, Element};

/// The FastHorovod release this build is (the workspace's version, which every crate of the
/// workspace, the `fasthorovod` Python package and `fhrun` share). Ranks and launchers of one
/// job must be of the same release: the TCP handshake, `fhrun`'s remote parts and the
/// variable `fhrun` gives its ranks (`FH_FHRUN_VERSION`) carry it, and a difference is an error
/// naming both releases.
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");
pub use error::CoreError;
pub use op::ReduceOp;
