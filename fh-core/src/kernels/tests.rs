use super::*;

/// `n` sample values (−20, −18.63, …) of `dtype` (f32, f64, f16, i64; i32 otherwise) as
/// bytes.
fn sample(dtype: DType, n: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..n).map(|i| i as f64 * 1.37 - 20.0).collect();
    fn bytes<T: bytemuck::Pod>(v: Vec<T>) -> Vec<u8> {
        bytemuck::cast_slice(&v).to_vec()
    }
    match dtype {
        DType::F32 => bytes(vals.iter().map(|&v| v as f32).collect()),
        DType::F64 => bytes(vals),
        DType::F16 => bytes(vals.iter().map(|&v| f16::from_f64(v)).collect()),
        DType::I64 => bytes(vals.iter().map(|&v| v as i64).collect()),
        _ => bytes(vals.iter().map(|&v| v as i32).collect::<Vec<i32>>()),
    }
}

#[test]
fn copy_divide_and_scale_equals_copy_then_divide_and_scale() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::I32, DType::I64] {
        for (n, factor) in [(1, 1.0), (3, 1.0), (3, 0.7), (1, 2.5), (7, 1.0 / 3.0)] {
            let src = sample(dtype, 41);
            let mut expected = src.clone();
            divide_and_scale(dtype, &mut expected, n, factor).unwrap();
            let mut out = vec![0u8; src.len()];
            copy_divide_and_scale(dtype, &src, &mut out, n, factor).unwrap();
            assert_eq!(out, expected, "{dtype} n={n} factor={factor}");
            // Unaligned source: same values.
            let mut shifted = vec![0u8; src.len() + 1];
            shifted[1..].copy_from_slice(&src);
            let mut out2 = vec![0u8; src.len()];
            copy_divide_and_scale(dtype, &shifted[1..], &mut out2, n, factor).unwrap();
            assert_eq!(out2, expected, "{dtype} unaligned");
        }
    }
    assert!(copy_divide_and_scale(DType::F32, &[0; 8], &mut [0; 4], 1, 1.0).is_err());
    assert!(copy_divide_and_scale(DType::F32, &[0; 4], &mut [0; 4], 0, 1.0).is_err());
}

#[test]
fn divide_and_scale_equals_divide_then_scale() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::I32] {
        for (n, factor) in [(1, 1.0), (3, 1.0), (3, 0.7), (1, 2.5), (7, 1.0 / 3.0)] {
            let mut a = sample(dtype, 37);
            let mut b = a.clone();
            divide_and_scale(dtype, &mut a, n, factor).unwrap();
            divide(dtype, &mut b, n).unwrap();
            scale(dtype, &mut b, factor).unwrap();
            assert_eq!(a, b, "{dtype} n={n} factor={factor}");
        }
    }
}

#[test]
fn f32_sum_and_average() {
    let mut a: Vec<u8> = bytemuck::cast_slice(&[1.0f32, 2.0, 3.0]).to_vec();
    let b: Vec<u8> = bytemuck::cast_slice(&[4.0f32, 5.0, 6.0]).to_vec();
    reduce(DType::F32, ReduceOp::Average, &mut a, &b).unwrap();
    divide(DType::F32, &mut a, 2).unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&a), &[2.5, 3.5, 4.5]);
}

#[test]
fn integer_average_truncates_toward_zero() {
    let mut a: Vec<u8> = bytemuck::cast_slice(&[-7i32, 7]).to_vec();
    divide(DType::I32, &mut a, 2).unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, i32>(&a), &[-3, 3]);
}

#[test]
fn unaligned_buffers_are_reduced() {
    let mut a = [0u8; 13];
    let mut b = [0u8; 13];
    a[1..13].copy_from_slice(bytemuck::cast_slice(&[1.0f32, 2.0, 3.0]));
    b[1..13].copy_from_slice(bytemuck::cast_slice(&[1.0f32, 1.0, 1.0]));
    reduce(DType::F32, ReduceOp::Max, &mut a[1..13], &b[1..13]).unwrap();
    let out: Vec<f32> = a[1..13]
        .chunks_exact(4)
        .map(bytemuck::pod_read_unaligned)
        .collect();
    assert_eq!(out, vec![1.0, 2.0, 3.0]);
}

#[test]
fn bad_arguments_are_errors() {
    let mut a = vec![0u8; 6];
    assert!(matches!(
        reduce(DType::F32, ReduceOp::Sum, &mut a, &[0u8; 6]),
        Err(CoreError::Misaligned { .. })
    ));
    assert!(matches!(
        reduce(DType::F32, ReduceOp::BitAnd, &mut [0u8; 4], &[0u8; 4]),
        Err(CoreError::UnsupportedOp { .. })
    ));
    assert!(reduce(DType::U8, ReduceOp::Sum, &mut a, &[0u8; 5]).is_err());
}
