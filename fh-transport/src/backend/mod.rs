//! The backends: each moves bytes between ranks its own way and implements the
//! [`Transport`](crate::Transport) and [`Communicator`](crate::Communicator) traits. Every
//! backend has the same shape: `mod.rs` holds its transport (the world: joining, opening
//! communicators), `comm.rs` its communicator (the data path), and, where it has them, `wire`
//! (its bytes on the wire), `sys` (its system calls) and `segment`/`link` (what its
//! communicators share).
//!
//! - [`local`]: ranks as threads of one process (tests, a single host without sockets).
//! - [`tcp`]: TCP between processes; the rendezvous, the authenticated door, the data path.
//! - [`shm`] (Linux): shared memory among the ranks of one host.
//! - [`mpi`] (feature `mpi`): an MPI library's communicators.
//! - [`cuda`] (feature `cuda`): CUDA device memory through NCCL, beside a host transport.

pub mod cuda;
pub mod local;
pub mod mpi;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod tcp;
