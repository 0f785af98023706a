//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::CoreError;

/// A reduction operator applied element-wise by allreduce and reduce-scatter.
///
/// `Average` is computed as a `Sum` followed by a division by the number of contributing
/// ranks (integer types truncate toward zero, as Horovod does). `BitAnd`/`BitOr` operate on
/// raw bytes and exist mainly for the readiness negotiation's bit vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum = 0,
    /// Element-wise sum divided by the number of contributors.
    Average = 1,
    /// Element-wise minimum.
    Min = 2,
    /// Element-wise maximum.
    Max = 3,
    /// Element-wise product.
    Product = 4,
    /// Bitwise AND of the raw bytes (integer and bool types).
    BitAnd = 5,
    /// Bitwise OR of the raw bytes (integer and bool types).
    BitOr = 6,
}

impl ReduceOp {
    /// Every operator, in wire order.
    pub const ALL: [ReduceOp; 7] = [
        ReduceOp::Sum,
        ReduceOp::Average,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
    ];

    /// Lower-case name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Average => "average",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
        }
    }

    /// The wire code of this operator.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The operator with the given wire code.
    pub fn from_code(code: u8) -> Result<Self, CoreError> {
        Self::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| CoreError::Decode {
                what: "reduce op",
                detail: crate::bytes::DecodeError::Invalid(format!("unknown code {code}")),
            })
    }

    /// The operator applied between partial results: `Average` reduces as `Sum`.
    pub const fn combining(self) -> ReduceOp {
        match self {
            ReduceOp::Average => ReduceOp::Sum,
            other => other,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        Self::ALL
            .iter()
            .copied()
            .find(|op| op.name() == lower || (lower == "avg" && *op == ReduceOp::Average))
            .ok_or(CoreError::UnknownName {
                what: "reduce op",
                value: s.to_string(),
                expected: "sum, average, min, max, product, band, bor",
            })
    }
}
