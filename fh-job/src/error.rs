//! The error type of joining a job.
//!
//! Its variants mean what the same-named variants of `fh_transport::TransportError` mean (which
//! converts from it variant by variant, keeping sources), so an error reads the same whichever
//! crate reports it.

/// Why joining a job failed: a bad launch variable, a refused session, an I/O error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// A launch variable (or a configuration value) is wrong; the reason says how to fix it.
    #[error("invalid configuration {var}: {reason}")]
    Config {
        /// The variable (or setting) at fault.
        var: String,
        /// What is wrong with it and what is expected.
        reason: String,
    },
    /// A peer (the elastic driver or a worker) refused this process, or this process refused
    /// it: a wrong job token, another protocol version.
    #[error("handshake with {peer} refused: {reason}")]
    Handshake {
        /// Who was at the other end.
        peer: String,
        /// Why.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error of the call.
        #[source]
        source: std::io::Error,
    },
    /// The caller passed a value that cannot be used.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The other end ended the session (or this end is shut down).
    #[error("communicator closed: {0}")]
    Closed(String),
}

impl JobError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        JobError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A configuration error naming the variable.
pub(crate) fn config(var: impl Into<String>, reason: impl Into<String>) -> JobError {
    JobError::Config {
        var: var.into(),
        reason: reason.into(),
    }
}
