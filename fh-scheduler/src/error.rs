//! The error type of `fh-scheduler`.

use std::sync::Arc;
use std::time::Duration;

use fh_core::message::{CollectiveKind, MismatchField, NegotiationError};
use fh_core::mismatch::Disagreement;
use fh_core::CoreError;
use fh_transport::TransportError;

/// Everything a submission, a handle or the engine can report.
///
/// Errors are `Clone` because one failure (a lost peer, a shutdown) is delivered to every
/// pending handle.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// Ranks submitted the same name with different values of one field; the name failed on
    /// every rank with this same error, which names the ranks that sent each value, e.g.
    /// `tensor 'w': Mismatched allreduce tensor shapes: rank 1 sent [1001]; ranks 0 and 2
    /// sent [1000]` (world ranks, also in a process set's engine).
    #[error("tensor '{name}': Mismatched {kind} {}: {senders}", field.describe())]
    Mismatch {
        /// The tensor name.
        name: String,
        /// The collective (as the lowest rank submitted it).
        kind: CollectiveKind,
        /// What differed: the first field, in the order of [`MismatchField::ALL`], on which
        /// not every rank agreed.
        field: MismatchField,
        /// Which ranks sent which value of that field.
        senders: Disagreement,
    },
    /// Negotiation refused the name for another reason (same text on every rank).
    #[error("tensor '{name}': {reason}")]
    Negotiation {
        /// The tensor name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The name is already in flight on this rank.
    #[error("a collective named '{name}' is already in flight on this rank; wait for its handle before submitting the name again, or use another name")]
    DuplicateName {
        /// The tensor name.
        name: String,
    },
    /// The engine has shut down (or is shutting down); the operation was not (or will not be)
    /// performed.
    #[error("the FastHorovod engine has shut down ({reason}); operations can no longer be submitted or completed")]
    ShutDown {
        /// Why the engine shut down.
        reason: String,
    },
    /// Communication failed; every pending operation of the engine fails with this error.
    #[error("communication failed{}: {message}", lost_rank.map(|r| format!(" (rank {r} lost)")).unwrap_or_default())]
    Transport {
        /// The rank that was lost or timed out, if known.
        lost_rank: Option<usize>,
        /// The transport's message.
        message: String,
        /// The transport's own error, when the failure came from the transport.
        #[source]
        source: Option<ErrorSource>,
    },
    /// The stall inspector shut the engine down: some ranks never submitted these names.
    #[error(
        "stalled for {after:?}: {} (FH_STALL_SHUTDOWN_SECONDS)",
        never_submitted(lacking)
    )]
    Stalled {
        /// The stalled names.
        names: Vec<String>,
        /// The ranks that did not submit them.
        missing: Vec<usize>,
        /// Each of those ranks with the names it lacks.
        lacking: Vec<(usize, Vec<String>)>,
        /// How long the oldest waited.
        after: Duration,
    },
    /// `Handle::wait_timeout` gave up; the operation itself goes on in the background.
    #[error("timed out after {after:?} waiting for '{name}'; the operation is still in flight")]
    WaitTimeout {
        /// The tensor name.
        name: String,
        /// How long was waited.
        after: Duration,
    },
    /// A bad argument at submission (buffer length, root out of range, unsupported op, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A broken invariant of the engine (a bug, never the caller's mistake): Python raises it
    /// as `HorovodInternalError`, and the elastic retry policy never retries it.
    #[error("internal error (a bug in FastHorovod; please report it with this message): {0}")]
    Internal(String),
    /// Bad configuration (usually an environment variable).
    #[error("invalid configuration {var}: {reason}")]
    Config {
        /// The variable or setting.
        var: String,
        /// What was wrong and what is accepted.
        reason: String,
    },
    /// The elastic job cannot go on (the driver answered `Failed`, e.g. fewer than `--min-np`
    /// ranks remain); `reason` is the driver's, naming the lost hosts and why they were lost
    /// ([`crate::elastic`]).
    #[error("the elastic job cannot go on: {reason}")]
    ElasticFailed {
        /// The driver's reason.
        reason: String,
    },
    /// A pure-logic error from `fh-core`.
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl SchedulerError {
    /// The error a name gets when negotiation refused it.
    pub fn from_negotiation(name: &str, e: &NegotiationError) -> Self {
        match e {
            NegotiationError::Mismatch {
                kind,
                field,
                senders,
            } => SchedulerError::Mismatch {
                name: name.to_string(),
                kind: *kind,
                field: *field,
                senders: senders.clone(),
            },
            NegotiationError::Other(reason) => SchedulerError::Negotiation {
                name: name.to_string(),
                reason: reason.clone(),
            },
        }
    }

    /// The error every pending operation gets when the transport fails.
    /// A broken invariant of the engine, with what broke.
    pub fn internal(what: impl Into<String>) -> Self {
        SchedulerError::Internal(what.into())
    }

    /// The error every pending operation gets when the transport fails, keeping the
    /// transport's error as the [`std::error::Error::source`].
    pub fn from_transport_owned(e: TransportError) -> Self {
        if let TransportError::Internal(what) = e {
            return SchedulerError::Internal(what);
        }
        SchedulerError::Transport {
            lost_rank: e.blamed_rank(),
            message: e.to_string(),
            source: Some(ErrorSource(Arc::new(e))),
        }
    }

    /// Whether ranks disagreed on this name.
    pub fn is_mismatch(&self) -> bool {
        matches!(self, SchedulerError::Mismatch { .. })
    }

    /// Whether the engine had shut down.
    pub fn is_shutdown(&self) -> bool {
        matches!(self, SchedulerError::ShutDown { .. })
    }

    /// The rank blamed for a communication failure, if any.
    pub fn lost_rank(&self) -> Option<usize> {
        match self {
            SchedulerError::Transport { lost_rank, .. } => *lost_rank,
            _ => None,
        }
    }

    pub(crate) fn config(var: &str, reason: impl Into<String>) -> Self {
        SchedulerError::Config {
            var: var.to_string(),
            reason: reason.into(),
        }
    }
}

/// An error of joining the job (the launch environment, the elastic session) reads as the
/// transport error it maps to.
impl From<fh_job::JobError> for SchedulerError {
    fn from(e: fh_job::JobError) -> Self {
        SchedulerError::from(TransportError::from(e))
    }
}

impl From<TransportError> for SchedulerError {
    fn from(e: TransportError) -> Self {
        SchedulerError::from_transport_owned(e)
    }
}

/// The lower layer's error kept inside a [`SchedulerError`] (shared, because one failure is
/// delivered to every pending handle). Two sources are equal when they print the same.
#[derive(Debug, Clone)]
pub struct ErrorSource(pub Arc<TransportError>);

impl std::fmt::Display for ErrorSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ErrorSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_ref())
    }
}

impl PartialEq for ErrorSource {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

/// `rank 2 never submitted ["a"]; rank 0 never submitted ["b"]`.
fn never_submitted(lacking: &[(usize, Vec<String>)]) -> String {
    let parts: Vec<String> = lacking
        .iter()
        .map(|(r, names)| {
            format!(
                "rank {r} never submitted {}",
                crate::stats::name_list(names)
            )
        })
        .collect();
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_message_names_the_tensor_the_field_and_the_ranks() {
        let e = SchedulerError::from_negotiation(
            "w",
            &NegotiationError::Mismatch {
                kind: CollectiveKind::Allreduce,
                field: MismatchField::Shape,
                senders: Disagreement::tally([(0, "[1000]"), (1, "[1001]"), (2, "[1000]")]),
            },
        );
        assert!(e.is_mismatch());
        assert_eq!(
            e.to_string(),
            "tensor 'w': Mismatched allreduce tensor shapes: rank 1 sent [1001]; ranks 0 and 2 \
             sent [1000]"
        );
    }

    #[test]
    fn transport_errors_name_the_rank() {
        let e = SchedulerError::from(TransportError::PeerLost {
            rank: 3,
            detail: "EOF".into(),
        });
        assert_eq!(e.lost_rank(), Some(3));
        assert!(e.to_string().contains("rank 3 lost"), "{e}");
        let src = std::error::Error::source(&e).expect("the transport error is kept");
        assert!(src.to_string().contains("rank 3 is gone"), "{src}");
    }

    #[test]
    fn a_broken_invariant_is_internal_never_a_bad_argument() {
        let e = SchedulerError::from(TransportError::Internal(
            "a fused tensor went missing".into(),
        ));
        assert!(matches!(e, SchedulerError::Internal(_)), "{e:?}");
        assert!(e.to_string().contains("a bug in FastHorovod"), "{e}");
        assert!(e.to_string().contains("a fused tensor went missing"), "{e}");
        assert!(!matches!(e, SchedulerError::InvalidArgument(_)));
    }
}
