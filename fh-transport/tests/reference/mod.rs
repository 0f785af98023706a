//! The sequential reduction every collective test checks against, shared by the test harnesses.

use fh_core::{kernels, DType, ReduceOp};

/// Sequential reference: fold the inputs in rank order, then divide once for `Average`.
pub fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        kernels::reduce(dtype, op.combining(), &mut acc, x).unwrap();
    }
    if op == ReduceOp::Average {
        kernels::divide(dtype, &mut acc, inputs.len()).unwrap();
    }
    acc
}
