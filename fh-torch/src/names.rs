//! PyTorch's names for dtypes and Horovod's names for reduce ops, mapped onto fh-core's.

use fh_core::{DType, ReduceOp};

/// The dtypes `fasthorovod.torch` accepts, as PyTorch names them.
pub const SUPPORTED_DTYPES: &str =
    "torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, \
     torch.bfloat16, torch.float32, torch.float64, torch.bool";

/// The engine dtype of a PyTorch dtype (`"torch.float32"`, `"float32"`, ...).
pub fn dtype(torch_name: &str) -> Result<DType, String> {
    torch_name.parse::<DType>().map_err(|_| {
        format!(
            "{torch_name} tensors are not supported by FastHorovod; supported dtypes: \
             {SUPPORTED_DTYPES}"
        )
    })
}

/// The engine reduce op of one of `fasthorovod.torch`'s op constants (`"average"`, `"sum"`,
/// `"min"`, `"max"`, `"product"`); Horovod's `Adasum` is refused with a clear message.
pub fn reduce_op(name: &str) -> Result<ReduceOp, String> {
    if name.eq_ignore_ascii_case("adasum") {
        return Err("op=Adasum is not supported by FastHorovod; use Average or Sum".into());
    }
    match name.parse::<ReduceOp>() {
        Ok(op @ (ReduceOp::BitAnd | ReduceOp::BitOr)) => Err(format!(
            "op {op} is not one of Horovod's reduce ops (Average, Sum, Min, Max, Product)"
        )),
        Ok(op) => Ok(op),
        Err(_) => Err(format!(
            "unknown reduce op '{name}'; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or \
             hvd.Product"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_dtypes() {
        assert_eq!(dtype("torch.float32").unwrap(), DType::F32);
        assert_eq!(dtype("torch.bfloat16").unwrap(), DType::BF16);
        assert_eq!(dtype("torch.uint8").unwrap(), DType::U8);
        assert_eq!(dtype("torch.bool").unwrap(), DType::Bool);
        assert_eq!(dtype("torch.int16").unwrap(), DType::I16);
        assert_eq!(dtype("torch.short").unwrap(), DType::I16);
        let e = dtype("torch.uint16").unwrap_err();
        assert!(
            e.contains("torch.uint16") && e.contains("torch.int16"),
            "{e}"
        );
        assert!(dtype("torch.complex64").is_err());
    }

    #[test]
    fn ops() {
        assert_eq!(reduce_op("average").unwrap(), ReduceOp::Average);
        assert_eq!(reduce_op("Sum").unwrap(), ReduceOp::Sum);
        assert_eq!(reduce_op("product").unwrap(), ReduceOp::Product);
        assert!(reduce_op("adasum").unwrap_err().contains("Adasum"));
        assert!(reduce_op("band").is_err());
        assert!(reduce_op("median").unwrap_err().contains("hvd.Average"));
    }
}
