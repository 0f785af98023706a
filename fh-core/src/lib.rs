//! # fh-core
//!
//! The pure heart of FastHorovod: element types ([`DType`]), reduction operators
//! ([`ReduceOp`]), host reduction kernels ([`kernels`]) and the error type ([`CoreError`]).
//!
//! **Invariant:** this crate performs no I/O, spawns no threads and knows nothing about
//! sockets, MPI, CUDA or Python. Everything here is deterministic and unit-testable.
#![deny(missing_docs)]

pub mod dtype;
pub mod error;
pub mod kernels;
pub mod op;

pub use dtype::{DType, Element};
pub use error::CoreError;
pub use op::ReduceOp;
