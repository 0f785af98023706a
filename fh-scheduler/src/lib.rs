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
//!   communicator and fusion buffer. Over a transport with scatter-gather I/O (TCP) a fused
//!   group on the ring needs no fusion buffer: it is reduced where its tensors lie, and the
//!   average and the scales run on each rank's block only ([`Config::fused_in_place`]). The
//!   `horovod` preset instead runs Horovod 0.28's schedule (one thread, 1 ms cycle, one
//!   channel, packing into its fusion buffer) for comparison.
//!
//! - [`elastic`]: an engine re-started on a new world each time an elastic job's membership
//!   changes ([`elastic::Elastic`]: start, train, on an error close and start again, check
//!   host updates at a commit).
//! - [`ProcessSets`] runs collectives over subsets of the ranks: each process set is an engine
//!   of its own over communicators of its members ([`process_set`]).
//!
//! ## Configuration
//!
//! [`Config::from_env`] reads these variables (a bad value is an error naming the variable and
//! the accepted values); the builder methods of [`Config`] set the same knobs in code.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FH_SCHEDULE` | preset: `fasthorovod` or `horovod` | `fasthorovod` |
//! | `FH_CHANNELS` | data channels, 1–64 (`horovod`: always 1) | 4 |
//! | `FH_FUSION_THRESHOLD` | bytes per fused group (`64MiB`, `1048576`, ...) | 64 MiB (`horovod`: 128 MiB) |
//! | `FH_PARTITION_BYTES` | allreduce tensors above this are split across channels | 16 MiB (`horovod`: never) |
//! | `FH_CYCLE_TIME_MS` | 0 = wake on submission; > 0 = fixed polling cycle | 0 (`horovod`: 1) |
//! | `FH_BATCHING_WINDOW_MS` | after waking on a submission, wait this long for more | 0 |
//! | `FH_CACHE_CAPACITY` | response-cache slots (0 = coordinator every round) | 1024 |
//! | `FH_PRIORITY` | `ready` or `forward` (lower caller priority first) | `ready` |
//! | `FH_TIMELINE` | path of rank 0's Chrome-trace timeline (written by a thread of its own; each tensor's negotiation span names every rank's ready time and the last ready rank); a path holding `{rank}` names a file per rank, which every rank writes ([`timeline_merge`] makes one trace of them); in an elastic job `{generation}` is replaced by each world's generation ([`elastic::for_generation`]) | off |
//! | `FH_FLIGHT_RECORDS` | operations the flight recorder keeps ([`flight`]; 0 = off) | 4096 |
//! | `FH_FLIGHT_DIR` | where each rank writes its flight record (`{generation}`: as for `FH_TIMELINE`) | [`flight::dump::default_dir`] |
//! | `FH_METRICS_ADDR` | where the application serves [`metrics`] (validated here) | off |
//! | `FH_SUMMARY` | the application prints [`EngineStats::summary_line`] at the end (validated here) | 0 |
//! | `FH_STALL_CHECK_SECONDS` | warn about names some ranks lack for this long (0 = off) | 60 |
//! | `FH_STALL_SHUTDOWN_SECONDS` | shut down when a stall lasts this long (0 = never) | 0 |
//! | `FH_BACKPRESSURE` | defer the next round while every channel is busy (`auto`/`0`/`1`; auto: over TCP or between hosts, and from 64 ranks) | `auto` (`horovod`: 0) |
//! | `FH_BACKPRESSURE_BYTES` | defer only while the channels hold at least this many bytes | 0 |
//! | `FH_BACKPRESSURE_MAX_MS` | never defer a round longer than this, 0–1000 | 50 |
//! | `FH_CUDA` | open the GPU path at start-up (`0`/`1`; every rank must agree) | 0 |
//! | `FH_LOG_LEVEL` | validated here; the application installs the `tracing` subscriber | — |
//! | `FH_LOG_COLOR` | colour in log lines: `auto` (only when stderr is a terminal), `always`, `never`; `NO_COLOR` wins ([`config::log_colour`]) | `auto` |
//!
//! Every rank must use the same schedule, channel count, cache capacity, fusion threshold,
//! partition size, priority order, stall-shutdown time and back-pressure settings;
//! [`Engine::start`] checks this and refuses to start otherwise.
//!
//! ## Idle behaviour
//!
//! With `FH_CYCLE_TIME_MS=0` the control thread sleeps on its submission queue. While anything
//! is pending it sits in the next negotiation round (a blocking collective), so a peer's
//! submission completes the round at once. When nothing is pending anywhere it wakes only for
//! a heartbeat round ([`Config::idle_heartbeat`], 1 s) so that a waiting peer never hits the
//! transport timeout and the stall inspector can run: an idle engine uses practically no CPU.
//!
//! ## GPU tensors (feature `cuda`)
//!
//! Built with the `cuda` feature and started with [`Config::cuda`] (`FH_CUDA=1`) on every
//! rank, the engine opens, next to each data channel, a device channel (one NCCL communicator
//! and one CUDA stream; host staging when a host runs more ranks than it has GPUs). If any
//! rank cannot (no driver, no GPU, no NCCL, no feature), start-up fails on every rank naming
//! those ranks. A device tensor ([`Tensor::from_device`]: device pointer, device index, the
//! producer's stream, an owner guard) is negotiated on the host like any other (its signature
//! carries the device — as "this rank's GPU", the same on every rank, since ranks of a host
//! drive different ordinals; the planner never fuses host and device tensors); at submission the engine
//! records a readiness event on the producer's stream, the channel's stream waits on it (no
//! host synchronization), runs the fused allreduce (with prescale, postscale and the average's
//! division on the device) or the broadcast, and records a completion event, which the tensor
//! given back by the handle carries (`Tensor::wait_on_stream`, `Tensor::wait_on_host`). Device
//! allgather, alltoall and reduce-scatter, bitwise reductions, and averages or scaling of
//! integer device tensors are refused at submission. Without the feature, or without
//! `FH_CUDA=1`, submitting a device tensor is an error at submission naming what is missing.
//!
//! ## Limits
//!
//! - A grouped allreduce shares one collective when its members have one dtype and fit under
//!   the fusion threshold (FastHorovod preset); otherwise they are released together but
//!   reduced in several collectives.
//! - While a rank has joined, only allreduce proceeds (other collectives fail with a clear
//!   error when negotiated through the coordinator); joined ranks contribute zeros, which is
//!   exact for `Sum`/`Average` only.
//!
//! **Invariant:** it reaches the network only through `fh-transport`'s traits and knows nothing
//! of Python.
#![deny(missing_docs)]

pub mod config;
mod control;
pub mod elastic;
mod engine;
pub mod error;
mod exec;
pub mod flight;
mod gpu;
pub mod handle;
mod inject;
mod job;
pub mod metrics;
mod negotiate;
mod options;
pub mod process_set;
mod shared;
pub mod stats;
pub mod tensor;
mod timeline;

pub use config::{Config, Preset, Priority, Wire};
pub use engine::{AllreduceOptions, CollectiveOptions, Engine};
pub use error::SchedulerError;
pub use fh_core::message::Device;
pub use fh_core::{DType, ReduceOp};
pub use handle::{GroupHandle, Handle, OpResult};
pub use process_set::ProcessSets;
pub use shared::CulpritHook;
pub use stats::{ChannelStats, EngineStats, GroupRecord, StallReport};
pub use tensor::{DeviceMemory, OwnerGuard, Tensor};
pub use timeline::merge::merge as timeline_merge;
