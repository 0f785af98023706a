//! # fh-scheduler
//!
//! The FastHorovod engine: named, asynchronous collectives (allreduce, allgather, broadcast,
//! alltoall, reduce-scatter, barrier, join) negotiated across ranks and executed as fused
//! groups over parallel channels.
//!
//! - [`Engine::start`] takes a world ([`fh_transport::Transport`]) and a [`Config`]; every rank
//!   starts one.
//! - Submissions move a [`Tensor`] into the engine and return a [`Handle`]; the handle gives the
//!   tensor back, holding the result (see [`tensor`] for the ownership contract).
//! - A control thread negotiates readiness on its own communicator: a bitwise-AND allreduce over
//!   the response cache's slots in steady state, the coordinator (rank 0) for names not cached.
//! - Ready names are fused by [`fh_core::fusion`] and run on K channel threads, each with its own
//!   communicator and fusion buffer. The `horovod` preset instead runs Horovod 0.28's schedule
//!   (one thread, 1 ms cycle, one channel) for comparison.
//!
//! **Invariant:** it reaches the network only through `fh-transport`'s traits and knows nothing
//! of Python.
#![deny(missing_docs)]

pub mod config;
mod control;
mod engine;
pub mod error;
mod exec;
pub mod handle;
pub mod stats;
pub mod tensor;
mod timeline;

pub use config::{Config, Preset, Priority};
pub use engine::{AllreduceOptions, Engine};
pub use error::SchedulerError;
pub use fh_core::message::Device;
pub use fh_core::{DType, ReduceOp};
pub use handle::{GroupHandle, Handle, OpResult};
pub use stats::{EngineStats, GroupRecord, StallReport};
pub use tensor::Tensor;
