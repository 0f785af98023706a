//! # fh-torch
//!
//! **Not implemented yet.** This crate will hold the `fasthorovod` Python package (PyO3 +
//! maturin) whose `fasthorovod.torch` module is a drop-in replacement for `horovod.torch`.
//! It is the only crate allowed to know Python. Today it contains no code, so that nothing
//! pretends to work.
#![deny(missing_docs)]
