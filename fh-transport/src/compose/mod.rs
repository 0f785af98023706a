//! Worlds made of other worlds: what every backend gets without writing it itself.
//!
//! - [`subset`]: communicators over a subset of the ranks (process sets), renumbered `0..n`.
//! - [`split`]: control and data on two backends (`FH_TRANSPORT=mpi+tcp`).
//! - [`ranks`]: the one rank-renumbering view all of them use.
//! - [`hier`] (Linux): shared memory within a host and TCP between hosts, as one world.

#[cfg(target_os = "linux")]
pub mod hier;
pub mod ranks;
pub mod split;
pub mod subset;
