//! The MPI backend (Cargo feature `mpi`, off by default), for clusters that already run MPI.
//!
//! Build it with `cargo build --features fh-transport/mpi`; that needs an MPI library with its
//! headers (Debian/Ubuntu: `libopenmpi-dev` or `libmpich-dev`) and `libclang-dev` (the `mpi`
//! crate generates its bindings with bindgen). Select it at run time with `FH_TRANSPORT=mpi` and
//! start the ranks with `mpirun -np N program` (or `srun` with PMI support).
//!
//! # What it does
//! - **World.** `MpiTransport::new` initialises MPI with `MPI_Init_thread`, asking for
//!   `MPI_THREAD_MULTIPLE` so that the scheduler's control and data channels can each run on
//!   their own thread. If the library offers less, the transport falls back to a *serialized*
//!   mode: every MPI call goes through one process-wide mutex and blocking operations become
//!   nonblocking ones polled with `MPI_Test` (the lock is never held while waiting, so channels
//!   cannot deadlock each other). The mode is logged through `tracing` and reported by
//!   `MpiTransport::thread_mode`.
//! - **Channels.** Every [`Transport::open`] duplicates the world
//!   communicator (`MPI_Comm_dup`), so each channel and the control plane have their own matching
//!   context and never see each other's messages.
//! - **Collectives.** Allreduce, allgatherv, broadcast, alltoallv, reduce-scatter and barrier map
//!   to the native MPI collectives (the library's tuned algorithms beat the generic ones in
//!   [`crate::algorithms`]). `BitAnd`/`BitOr` map to `MPI_BAND`/`MPI_BOR`; `bool` travels as
//!   `u8` and reduces with `MPI_LOR`/`MPI_LAND` exactly like `fh_core::kernels`. MPI has no
//!   16-bit float types: `f16`/`bf16` travel as 16-bit words and reduce with user-defined
//!   operations that call `fh_core::kernels::reduce`. Counts that do not fit MPI's `int` are
//!   split into chunks, or (for the v-collectives, whose displacements are `int`) routed through
//!   the generic algorithms.
//! - **Point to point.** `send`/`recv` use `MPI_Send` and a matched probe
//!   (`MPI_Mprobe`/`MPI_Mrecv`), so a message of the wrong length is reported as
//!   [`TransportError::Protocol`](crate::TransportError::Protocol) (and consumed, leaving the
//!   communicator usable), never truncated silently. Messages longer than `i32::MAX` bytes are
//!   sent as several MPI messages. `send_recv` posts its sends nonblocking, so it never deadlocks.
//! - **Errors.** The communicators use `MPI_ERRORS_RETURN`; every return code is checked and
//!   turned into a [`TransportError`](crate::TransportError) naming the call, the communicator
//!   and the library's own message (`MpiError` is kept as the source).
//! - **Topology.** `local_*` comes from `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`, `cross_*`
//!   from a split of the world by local rank.
//!
//! # Lifetime: when MPI is finalized
//! MPI can be initialised once per process and never again after `MPI_Finalize`. The transport
//! and every communicator it opened share one reference-counted runtime; `MPI_Finalize` runs
//! when the **last** of them is dropped (and only if this crate initialised MPI: if the host
//! program initialised MPI itself, it also finalizes it). It therefore never runs twice and
//! never while a communicator is alive. Keep the transport alive for the whole program: once it
//! has been finalized, `MpiTransport::new` returns
//! [`TransportError::BackendUnavailable`](crate::TransportError::BackendUnavailable). Drop it
//! on the thread that created it where possible (MPI asks that the initialising thread
//! finalizes). A process that exits while a transport is still alive (leaked, in a `static`)
//! does not finalize, and `mpirun` reports that.
//!
//! # Limits
//! MPI has no receive timeout: `FH_TIMEOUT_SECONDS` does not apply, and a dead peer is handled
//! by the MPI runtime (OpenMPI's `mpirun` aborts the job). A dropped communicator is freed
//! (`MPI_Comm_free`) but its peers are not told, unlike the socket backends.

//!
//! # Testing and measuring
//! - `fh-transport/tests/mpi/run.sh` runs the collective suite (`examples/mpi_suite.rs`, every
//!   collective × dtype × operator, lengths 0, 1, primes and large, uneven v-splits, split
//!   messages, concurrent channels, checked bit for bit against a local sequential reference)
//!   under `mpirun` with 2, 3 and 4 ranks, in serialized mode, through `fhrun --mpi`, and as a
//!   singleton; then the scheduler (`fh-scheduler/examples/train_env.rs`) over MPI with both
//!   presets, and mixed with TCP (`FH_TRANSPORT=mpi+tcp` / `tcp+mpi`, see [`crate::compose::split`]).
//! - `cargo test -p fh-transport --features mpi --test mpi_mpirun` does the same from Rust and
//!   skips (with a message) when `mpirun` is missing.
//! - `examples/mpi_busbw.rs` measures allreduce bus bandwidth of this backend and of the TCP
//!   backend inside one `mpirun` job.

use crate::{Result, Transport};

#[cfg(feature = "mpi")]
mod call;
#[cfg(feature = "mpi")]
mod comm;
#[cfg(feature = "mpi")]
mod runtime;
#[cfg(feature = "mpi")]
mod transport;

#[cfg(feature = "mpi")]
pub use comm::MpiComm;
#[cfg(feature = "mpi")]
pub use runtime::{MpiError, ThreadMode};
#[cfg(feature = "mpi")]
pub use transport::MpiTransport;

/// Whether this build of `fh-transport` contains the MPI backend (Cargo feature `mpi`).
pub const COMPILED: bool = cfg!(feature = "mpi");

/// The name of the environment variable that requests a thread level other than
/// `MPI_THREAD_MULTIPLE` (`multiple`, the default, or `serialized`): a debugging and testing
/// knob that forces the serialized fallback mode.
pub const THREAD_LEVEL_VAR: &str = "FH_MPI_THREAD_LEVEL";

/// Build the MPI world as a boxed [`Transport`]; this is what `FH_TRANSPORT=mpi` selects.
///
/// Without the `mpi` feature this returns
/// [`TransportError::BackendUnavailable`](crate::TransportError::BackendUnavailable) explaining
/// how to compile it in.
pub fn world() -> Result<Box<dyn Transport>> {
    #[cfg(feature = "mpi")]
    {
        Ok(Box::new(MpiTransport::new()?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(crate::TransportError::BackendUnavailable {
            backend: "mpi",
            reason: "this build does not include the MPI backend; rebuild with \
                     `cargo build --features fh-transport/mpi` (needs an MPI library with headers, \
                     e.g. Debian `libopenmpi-dev`, and `libclang-dev`) and start the ranks with \
                     `mpirun`; or use FH_TRANSPORT=tcp (or auto)"
                .into(),
        })
    }
}

#[cfg(all(test, not(feature = "mpi")))]
mod tests {
    use super::*;

    #[test]
    fn without_the_feature_world_names_the_feature() {
        let err = world().err().expect("the mpi backend is not compiled in");
        let msg = err.to_string();
        assert!(msg.contains("fh-transport/mpi"), "{msg}");
        assert!(matches!(
            err,
            crate::TransportError::BackendUnavailable { backend: "mpi", .. }
        ));
    }
}
