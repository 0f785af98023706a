//! # fh-torch
//!
//! FastHorovod's PyTorch adapter: the Rust half of the Python package `fasthorovod`, whose
//! module `fasthorovod.torch` is a drop-in for `horovod.torch` (see this crate's `README.md`).
//!
//! - With the `python` feature (what `pip install ./fh-torch` builds through maturin) this
//!   crate is the extension module `fasthorovod._core`: it starts an [`fh_scheduler::Engine`]
//!   on the world that [`fh_transport::from_env`] finds (`fhrun`, `torchrun`, `mpirun`,
//!   Slurm), submits CPU tensors **in place, without copies** (the engine works on the
//!   tensor's own memory while a guard keeps the Python object alive), releases the GIL in
//!   every wait and never takes it on an engine thread.
//! - Without the feature it is a plain Rust library holding the parts that need no Python and
//!   are tested with `cargo test`: the `HOROVOD_*` configuration aliases ([`config`]) and the
//!   dtype and reduce-op names of PyTorch ([`names`]).
//!
//! Everything else in `fasthorovod.torch` (autograd, `DistributedOptimizer`, broadcasting of
//! parameters and objects, compression) is Python, in `python/fasthorovod/`.
//!
//! **Invariant:** this is the only crate of the workspace that knows Python.
#![deny(missing_docs)]

pub mod config;
pub mod names;

#[cfg(feature = "python")]
mod python;
