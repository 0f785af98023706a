//! The MPI collective suite as a program: run it under `mpirun`, e.g.
//!
//! ```text
//! cargo build -p fh-transport --features mpi --example mpi_suite
//! mpirun -np 4 --oversubscribe target/debug/examples/mpi_suite
//! FH_MPI_THREAD_LEVEL=serialized mpirun -np 3 --oversubscribe target/debug/examples/mpi_suite
//! ```
//!
//! Knobs: `FH_MPI_SUITE_VERBOSE=1` (rank 0 prints each stage), `FH_MPI_SUITE_SEED=N` (replay
//! the random cases of a failed run; the seed is printed), `FH_MPI_SUITE_TRACE=1` (print every
//! random case), `FH_MPI_SUITE_CASES=3,17` (run only those random cases), and
//! `FH_MPI_THREAD_LEVEL=serialized` (the fallback mode). With Open MPI pass them to the ranks
//! with `-x NAME`.
//!
//! Every rank exits 0 when every check passed on every rank, 1 otherwise (with the failures on
//! stderr). On an unexpected transport error a rank exits at once without finalizing MPI, so
//! that `mpirun` ends the job instead of leaving the others blocked in a collective.

use std::process::ExitCode;

use fh_transport::backend::mpi::MpiTransport;

#[path = "../tests/mpi/suite.rs"]
mod suite;

fn main() -> ExitCode {
    let mut world = match MpiTransport::new() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("mpi_suite: cannot start the MPI transport: {e}");
            return ExitCode::FAILURE;
        }
    };
    match suite::run(&mut world) {
        Ok(rep) => {
            let ok = rep.failures.is_empty();
            let line = suite::summary(&world, &rep);
            if ok {
                println!("{line}");
            } else {
                eprintln!("{line}");
            }
            drop(world);
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!(
                "mpi_suite rank {}: FATAL {e}",
                fh_transport::Transport::rank(&world)
            );
            // Do not finalize: the other ranks may be blocked; mpirun ends the job.
            std::process::exit(1);
        }
    }
}
