//! Element data types and the mapping from Rust types to them.

use std::fmt;
use std::str::FromStr;

use crate::CoreError;

/// The element type of a tensor.
///
/// `Bool` is stored as one byte per element holding 0 or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// Unsigned 8-bit integer.
    U8 = 0,
    /// Signed 8-bit integer.
    I8 = 1,
    /// Signed 32-bit integer.
    I32 = 2,
    /// Signed 64-bit integer.
    I64 = 3,
    /// IEEE 754 half precision (via the `half` crate).
    F16 = 4,
    /// bfloat16 (via the `half` crate).
    BF16 = 5,
    /// IEEE 754 single precision.
    F32 = 6,
    /// IEEE 754 double precision.
    F64 = 7,
    /// Boolean, one byte per element (0 or 1).
    Bool = 8,
    /// Signed 16-bit integer (PyTorch's `int16`/`ShortTensor`; last, so that the older
    /// codes keep their values).
    I16 = 9,
}

impl DType {
    /// Every dtype, in wire order.
    pub const ALL: [DType; 10] = [
        DType::U8,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Bool,
        DType::I16,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Lower-case name, as accepted by [`FromStr`] (`"float32"` style aliases are accepted too).
    pub const fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::Bool => "bool",
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The wire code of this dtype.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The dtype with the given wire code.
    pub fn from_code(code: u8) -> Result<Self, CoreError> {
        Self::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| CoreError::Decode {
                what: "dtype",
                detail: crate::bytes::DecodeError::Invalid(format!("unknown code {code}")),
            })
    }

    /// Number of elements in a buffer of `len` bytes, or an error if it is not a whole number.
    pub fn elements_in(self, len: usize) -> Result<usize, CoreError> {
        let elem = self.size();
        if len % elem != 0 {
            return Err(CoreError::Misaligned {
                len,
                dtype: self,
                elem,
            });
        }
        Ok(len / elem)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let d = match s.to_ascii_lowercase().trim_start_matches("torch.") {
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" | "short" => DType::I16,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "bool" => DType::Bool,
            _ => {
                return Err(CoreError::UnknownName {
                    what: "dtype",
                    value: s.to_string(),
                    expected: "u8, i8, i16, i32, i64, f16, bf16, f32, f64, bool",
                })
            }
        };
        Ok(d)
    }
}

/// A Rust type that is the in-memory representation of a [`DType`].
///
/// # Safety
/// Implementors must be plain old data whose size is `DTYPE.size()` and whose every bit
/// pattern is valid (guaranteed by the `bytemuck::Pod` bound).
pub unsafe trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype this Rust type represents.
    const DTYPE: DType;
}

macro_rules! impl_element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            // SAFETY: the type is Pod and its size matches the dtype (checked in tests).
            unsafe impl Element for $t {
                const DTYPE: DType = DType::$d;
            }
        )*
    };
}

impl_element!(
    u8 => U8,
    i8 => I8,
    i16 => I16,
    i32 => I32,
    i64 => I64,
    half::f16 => F16,
    half::bf16 => BF16,
    f32 => F32,
    f64 => F64,
);

#[cfg(test)]
mod tests {
    use super::*;

    fn size_of<T: Element>() -> (usize, usize) {
        (std::mem::size_of::<T>(), T::DTYPE.size())
    }

    #[test]
    fn element_sizes_match_dtypes() {
        for (a, b) in [
            size_of::<u8>(),
            size_of::<i8>(),
            size_of::<i16>(),
            size_of::<i32>(),
            size_of::<i64>(),
            size_of::<half::f16>(),
            size_of::<half::bf16>(),
            size_of::<f32>(),
            size_of::<f64>(),
        ] {
            assert_eq!(a, b);
        }
    }

    #[test]
    fn names_and_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_code(d.code()).unwrap(), d);
        }
        assert!(DType::from_code(200).is_err());
        let err = "complex".parse::<DType>().unwrap_err().to_string();
        assert!(err.contains("complex") && err.contains("f32"), "{err}");
    }
}
