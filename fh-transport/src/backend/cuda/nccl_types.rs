//! NCCL's data types and reduction operators for ours: the one mapping, and what NCCL
//! cannot reduce on the device.

use fh_core::{DType, ReduceOp};

use crate::{Result, TransportError};

/// NCCL's data type and operator for `dtype`/`op`, or why NCCL cannot do it. `bool` travels
/// as `u8` with `Sum`/`BitOr`/`Max` as `Max` (logical OR) and `Product`/`BitAnd`/`Min` as
/// `Min` (logical AND), like `fh_core::kernels`.
pub(crate) fn nccl_types(
    dtype: DType,
    op: ReduceOp,
) -> Result<(
    fh_nccl_sys::sys::ncclDataType_t,
    fh_nccl_sys::sys::ncclRedOp_t,
)> {
    use fh_nccl_sys::sys::ncclRedOp_t as O;
    let t = nccl_dtype(dtype).ok_or_else(|| {
        TransportError::InvalidArgument(format!(
            "NCCL has no {dtype} type; reduce this tensor on the host"
        ))
    })?;
    let o = match (dtype, op) {
        (DType::Bool, ReduceOp::Sum | ReduceOp::BitOr | ReduceOp::Max) => O::ncclMax,
        (DType::Bool, ReduceOp::Product | ReduceOp::BitAnd | ReduceOp::Min) => O::ncclMin,
        (DType::Bool, ReduceOp::Average) | (_, ReduceOp::BitAnd | ReduceOp::BitOr) => {
            return Err(TransportError::InvalidArgument(format!(
                "NCCL cannot reduce {dtype:?} with {op:?} (no bitwise or boolean-average \
                 reductions on the device); reduce this tensor on the host"
            )))
        }
        (_, ReduceOp::Sum) => O::ncclSum,
        (_, ReduceOp::Average) => O::ncclAvg,
        (_, ReduceOp::Min) => O::ncclMin,
        (_, ReduceOp::Max) => O::ncclMax,
        (_, ReduceOp::Product) => O::ncclProd,
    };
    Ok((t, o))
}

/// NCCL's data type for `dtype` (`bool` as `u8`): the one `DType → ncclDataType_t` mapping;
/// `None` for `i16`, which NCCL lacks.
pub(crate) fn nccl_dtype(dtype: DType) -> Option<fh_nccl_sys::sys::ncclDataType_t> {
    use fh_nccl_sys::sys::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 | DType::Bool => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I16 => return None,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_mapping_refuses_what_nccl_cannot_do() {
        use fh_nccl_sys::sys::ncclRedOp_t as O;
        assert_eq!(
            nccl_types(DType::F32, ReduceOp::Average).unwrap().1,
            O::ncclAvg
        );
        assert_eq!(
            nccl_types(DType::Bool, ReduceOp::Sum).unwrap().1,
            O::ncclMax
        );
        assert_eq!(
            nccl_types(DType::Bool, ReduceOp::BitAnd).unwrap().1,
            O::ncclMin
        );
        let e = nccl_types(DType::I32, ReduceOp::BitOr)
            .unwrap_err()
            .to_string();
        assert!(e.contains("reduce this tensor on the host"), "{e}");
        assert!(nccl_types(DType::Bool, ReduceOp::Average).is_err());
    }

    #[test]
    fn every_dtype_and_op_maps_or_is_refused_clearly() {
        use std::collections::HashSet;
        let mut seen = HashSet::new();
        for dtype in DType::ALL {
            let t = nccl_dtype(dtype);
            // One NCCL type per dtype; only bool shares u8's; NCCL lacks i16.
            match t {
                Some(t) => assert!(seen.insert(t.0) || dtype == DType::Bool, "{dtype:?}"),
                None => assert_eq!(dtype, DType::I16),
            }
            for op in ReduceOp::ALL {
                let bitwise = matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr);
                let refused = (bitwise && dtype != DType::Bool)
                    || (dtype == DType::Bool && op == ReduceOp::Average)
                    || dtype == DType::I16;
                match nccl_types(dtype, op) {
                    Ok((tt, _)) => assert!(!refused && Some(tt) == t, "{dtype:?} {op:?}"),
                    Err(e) => assert!(
                        refused && e.to_string().contains("on the host"),
                        "{dtype:?} {op:?}: {e}"
                    ),
                }
            }
        }
    }
}
