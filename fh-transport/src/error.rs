//! The error type of `fh-transport`.

use std::time::Duration;

use fh_core::CoreError;

/// Everything that can go wrong while moving bytes between ranks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A peer disconnected, crashed or was killed.
    #[error("rank {rank} is gone: {detail}")]
    PeerLost {
        /// The rank that was lost.
        rank: usize,
        /// What was observed (connection reset, EOF, ...).
        detail: String,
    },
    /// A peer did not answer within the configured timeout.
    #[error("timed out after {after:?} waiting for rank {rank} during {op}; it may be hung or dead (the timeout is FH_TIMEOUT_SECONDS)")]
    Timeout {
        /// The rank that was waited for.
        rank: usize,
        /// The operation in progress.
        op: &'static str,
        /// How long was waited.
        after: Duration,
    },
    /// A connecting peer failed authentication or spoke another protocol version.
    #[error("handshake with {peer} refused: {reason}")]
    Handshake {
        /// Who the peer was (address or rank).
        peer: String,
        /// Why it was refused.
        reason: String,
    },
    /// A peer sent bytes that violate the protocol (wrong length, bad header, ...).
    #[error("protocol error with rank {rank}: {detail}")]
    Protocol {
        /// The peer's rank.
        rank: usize,
        /// What was wrong.
        detail: String,
    },
    /// An operating-system I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The caller passed invalid arguments (sizes, ranks, counts).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Bad or missing configuration (usually an environment variable).
    #[error("invalid configuration {var}: {reason}")]
    Config {
        /// The variable or setting at fault.
        var: String,
        /// What was wrong and how to fix it.
        reason: String,
    },
    /// A backend that was compiled in cannot be used here (missing library, no device, ...).
    #[error("transport backend '{backend}' is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend's name.
        backend: &'static str,
        /// Why, and what to do about it.
        reason: String,
    },
    /// A CUDA driver or NCCL call failed (GPU path, feature `cuda`).
    #[error("{op} failed: {detail}")]
    Device {
        /// The call (and channel) that failed.
        op: String,
        /// The library's message and code.
        detail: String,
    },
    /// A broken invariant of this library (a bug, never the caller's mistake): the message
    /// says which.
    #[error("internal error (a bug in FastHorovod; please report it with this message): {0}")]
    Internal(String),
    /// The communicator was closed (shut down) before or during the operation.
    #[error("communicator closed: {0}")]
    Closed(String),
    /// A pure-logic error from `fh-core` (dtype/length mismatch, unsupported op, ...).
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl TransportError {
    /// The rank blamed by this error, if any (lost, timed out or misbehaving peer).
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            TransportError::PeerLost { rank, .. }
            | TransportError::Timeout { rank, .. }
            | TransportError::Protocol { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// Whether this error means a peer is gone or unresponsive.
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            TransportError::PeerLost { .. } | TransportError::Timeout { .. }
        )
    }

    /// Shorthand for an [`TransportError::Io`] with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        TransportError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Errors of joining a job read as the same-named transport errors (the I/O error's source is
/// kept).
impl From<fh_job::JobError> for TransportError {
    fn from(e: fh_job::JobError) -> Self {
        use fh_job::JobError as J;
        match e {
            J::Config { var, reason } => TransportError::Config { var, reason },
            J::Handshake { peer, reason } => TransportError::Handshake { peer, reason },
            J::Io { context, source } => TransportError::Io { context, source },
            J::InvalidArgument(s) => TransportError::InvalidArgument(s),
            J::Closed(s) => TransportError::Closed(s),
            // JobError is non-exhaustive for its users; this crate names every variant.
            #[allow(unreachable_patterns)]
            other => TransportError::InvalidArgument(other.to_string()),
        }
    }
}
