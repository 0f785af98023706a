//! This rank's world when running as a worker process: the transport the environment selects.

use fh_transport::Transport;

/// Whether multi-process runs over TCP are possible in this build.
pub fn tcp_available() -> Result<(), String> {
    Ok(())
}

/// The transport described by the environment (`FH_*`, OpenMPI, Slurm variables; see
/// `fh_job::launch`).
pub fn transport_from_env() -> Result<Box<dyn Transport>, String> {
    fh_transport::from_env().map_err(|e| format!("joining the job: {e}"))
}
