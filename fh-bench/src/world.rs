//! This rank's world when running as a worker process: the transport the environment selects.

use fh_transport::Transport;

/// Whether multi-process runs over TCP are possible in this build.
pub fn tcp_available() -> Result<(), String> {
    Err("the TCP backend (fh_transport::from_env) is not in this build yet".into())
}

/// The transport described by the environment (`FH_*`, OpenMPI, Slurm variables).
pub fn transport_from_env() -> Result<Box<dyn Transport>, String> {
    tcp_available().map(|_| unreachable!())
}
