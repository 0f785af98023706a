//! The error type of `fh-core`.

use crate::bytes::DecodeError;
use crate::{DType, ReduceOp};

/// Errors raised by pure core logic: invalid arguments, malformed wire data and so on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A buffer's length in bytes is not a multiple of its element size.
    #[error("buffer of {len} bytes is not a whole number of {dtype} elements ({elem} bytes each)")]
    Misaligned {
        /// Length of the buffer in bytes.
        len: usize,
        /// Element type expected in the buffer.
        dtype: DType,
        /// Size in bytes of one element.
        elem: usize,
    },
    /// Two buffers that must have the same length do not.
    #[error("length mismatch: {what}: expected {expected} bytes, got {actual}")]
    LengthMismatch {
        /// What was being compared.
        what: &'static str,
        /// Expected length in bytes.
        expected: usize,
        /// Actual length in bytes.
        actual: usize,
    },
    /// A reduce operator cannot be applied to a data type (e.g. bitwise AND on `f32`).
    #[error("reduce op {op} is not supported for dtype {dtype}")]
    UnsupportedOp {
        /// The operator.
        op: ReduceOp,
        /// The data type.
        dtype: DType,
    },
    /// A string could not be parsed as a known name (dtype, op, ...).
    #[error("unknown {what} '{value}'; expected one of: {expected}")]
    UnknownName {
        /// The kind of name ("dtype", "reduce op", ...).
        what: &'static str,
        /// The offending value.
        value: String,
        /// The accepted values, comma separated.
        expected: &'static str,
    },
    /// Malformed bytes were given to a decoder.
    #[error("malformed {what}: {detail}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// What was wrong: the one decode error of the wire formats (a whole message that
        /// ends early is [`DecodeError::Invalid`] here, saying so: nothing more will come).
        detail: DecodeError,
    },
    /// Any other invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}
