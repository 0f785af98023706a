//! Host reduction kernels for every dtype × operator.
//!
//! The entry points work on raw little-endian byte buffers tagged with a [`DType`], because the
//! engine and the transports move untyped bytes. When a buffer is suitably aligned it is viewed
//! as a typed slice and reduced with a tight loop the compiler vectorizes; otherwise an
//! unaligned fallback is used. `f16`/`bf16` are widened to `f32` for every operation, so each
//! pairwise step rounds once.
//!
//! `Average` reduces as `Sum` ([`ReduceOp::combining`]); the division by the number of
//! contributors is a separate step ([`divide`]), done once at the end of a collective.

use half::{bf16, f16};

use crate::{CoreError, DType, ReduceOp};

fn check_pair(dtype: DType, acc: &[u8], src: &[u8]) -> Result<(), CoreError> {
    if acc.len() != src.len() {
        return Err(CoreError::LengthMismatch {
            what: "reduction operands",
            expected: acc.len(),
            actual: src.len(),
        });
    }
    dtype.elements_in(acc.len())?;
    Ok(())
}

/// Whether `op` can be applied to `dtype`.
pub fn supports(dtype: DType, op: ReduceOp) -> bool {
    match (dtype, op) {
        (DType::Bool, ReduceOp::Average) => false,
        (d, ReduceOp::BitAnd | ReduceOp::BitOr) => !d.is_float(),
        _ => true,
    }
}

fn unsupported(dtype: DType, op: ReduceOp) -> CoreError {
    CoreError::UnsupportedOp { op, dtype }
}

macro_rules! int_loop {
    ($t:ty, $op:expr, $a:expr, $s:expr) => {{
        let (a, s): (&mut [$t], &[$t]) = ($a, $s);
        match $op {
            ReduceOp::Sum | ReduceOp::Average => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = x.wrapping_add(*y)),
            ReduceOp::Product => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = x.wrapping_mul(*y)),
            ReduceOp::Min => a.iter_mut().zip(s).for_each(|(x, y)| *x = (*x).min(*y)),
            ReduceOp::Max => a.iter_mut().zip(s).for_each(|(x, y)| *x = (*x).max(*y)),
            ReduceOp::BitAnd => a.iter_mut().zip(s).for_each(|(x, y)| *x &= *y),
            ReduceOp::BitOr => a.iter_mut().zip(s).for_each(|(x, y)| *x |= *y),
        }
    }};
}

macro_rules! float_loop {
    ($t:ty, $op:expr, $a:expr, $s:expr) => {{
        let (a, s): (&mut [$t], &[$t]) = ($a, $s);
        match $op {
            ReduceOp::Sum | ReduceOp::Average => a.iter_mut().zip(s).for_each(|(x, y)| *x += *y),
            ReduceOp::Product => a.iter_mut().zip(s).for_each(|(x, y)| *x *= *y),
            ReduceOp::Min => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = if *y < *x { *y } else { *x }),
            ReduceOp::Max => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = if *y > *x { *y } else { *x }),
            ReduceOp::BitAnd | ReduceOp::BitOr => unreachable!("checked by supports()"),
        }
    }};
}

/// Elements of `f16`/`bf16` widened to `f32` at a time: small enough for two stack blocks to
/// stay in L1, large enough to amortise the conversion routines' dispatch.
const HALF_BLOCK: usize = 512;

/// A 16-bit float type that is reduced through `f32`, a block at a time.
trait HalfFloat: bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl HalfFloat for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        // Uses the F16C instructions when the CPU has them.
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

impl HalfFloat for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = f32::from_bits(u32::from(s.to_bits()) << 16));
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        // Round to nearest, ties to even, NaNs stay NaN (quiet bit set): bit for bit what
        // `bf16::from_f32` does, written without branches so that it vectorizes.
        dst.iter_mut().zip(src).for_each(|(d, s)| {
            let x = s.to_bits();
            let is_nan = (x & 0x7fff_ffff) > 0x7f80_0000;
            let round_up = u32::from((x & 0x8000) != 0 && (x & 0x1_7fff) != 0);
            let bits = if is_nan {
                (x >> 16) | 0x0040
            } else {
                (x >> 16) + round_up
            };
            *d = bf16::from_bits(bits as u16);
        });
    }
}

/// Apply `f` to `buf` widened to `f32`, a block at a time, and narrow the result back.
fn half_map<T: HalfFloat>(buf: &mut [T], mut f: impl FnMut(&mut [f32])) {
    let mut wide = [0f32; HALF_BLOCK];
    for blk in buf.chunks_mut(HALF_BLOCK) {
        let w = &mut wide[..blk.len()];
        T::widen(blk, w);
        f(w);
        T::narrow(w, blk);
    }
}

/// `acc = op(acc, src)` for 16-bit floats: both widened to `f32`, combined, rounded once.
fn half_reduce<T: HalfFloat>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    let mut wide_src = [0f32; HALF_BLOCK];
    let mut blocks = src.chunks(HALF_BLOCK);
    half_map(acc, |a| {
        let s = &mut wide_src[..a.len()];
        if let Some(blk) = blocks.next() {
            T::widen(blk, s);
        }
        float_loop!(f32, op, a, &*s);
    });
}

fn reduce_bool(op: ReduceOp, a: &mut [u8], s: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = ((*x != 0) | (*y != 0)) as u8),
        ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = ((*x != 0) & (*y != 0)) as u8),
        ReduceOp::Average => unreachable!("checked by supports()"),
    }
}

macro_rules! half_reduce_loop {
    ($t:ty, $op:expr, $a:expr, $s:expr) => {
        half_reduce::<$t>($op, $a, $s)
    };
}

/// Reduce typed slices in place: `acc[i] = op(acc[i], src[i])`.
fn reduce_aligned(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> bool {
    use bytemuck::{try_cast_slice, try_cast_slice_mut};
    macro_rules! typed {
        ($t:ty, $mac:ident) => {{
            match (
                try_cast_slice_mut::<u8, $t>(acc),
                try_cast_slice::<u8, $t>(src),
            ) {
                (Ok(a), Ok(s)) => {
                    $mac!($t, op, a, s);
                    true
                }
                _ => false,
            }
        }};
    }
    match dtype {
        DType::U8 => {
            int_loop!(u8, op, acc, src);
            true
        }
        DType::I8 => typed!(i8, int_loop),
        DType::I32 => typed!(i32, int_loop),
        DType::I64 => typed!(i64, int_loop),
        DType::F16 => typed!(f16, half_reduce_loop),
        DType::BF16 => typed!(bf16, half_reduce_loop),
        DType::F32 => typed!(f32, float_loop),
        DType::F64 => typed!(f64, float_loop),
        DType::Bool => {
            reduce_bool(op, acc, src);
            true
        }
    }
}

/// Apply `f` to every element of a 16-bit float buffer, computing in `f32`.
fn half_apply<T: HalfFloat>(buf: &mut [u8], f: impl Fn(f32) -> f32) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(s) => half_map(s, |w| w.iter_mut().for_each(|x| *x = f(*x))),
        Err(_) => {
            for chunk in buf.chunks_exact_mut(2) {
                let mut v: [T; 1] = [bytemuck::pod_read_unaligned(chunk)];
                let mut w = [0f32];
                T::widen(&v, &mut w);
                w[0] = f(w[0]);
                T::narrow(&w, &mut v);
                chunk.copy_from_slice(bytemuck::bytes_of(&v[0]));
            }
        }
    }
}

/// Reduce `src` into `acc` element-wise: `acc[i] = op(acc[i], src[i])`.
///
/// Both buffers hold `dtype` elements in native byte order and must have the same length.
/// `Average` accumulates as `Sum`; call [`divide`] once all contributions are in.
pub fn reduce(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<(), CoreError> {
    check_pair(dtype, acc, src)?;
    if !supports(dtype, op) {
        return Err(unsupported(dtype, op));
    }
    if reduce_aligned(dtype, op, acc, src) {
        return Ok(());
    }
    // Unaligned fallback: reduce through aligned scratch blocks.
    const BLOCK: usize = 4096;
    let mut a_tmp = [0u64; BLOCK / 8];
    let mut s_tmp = [0u64; BLOCK / 8];
    for (a, s) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let ab = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a_tmp)[..a.len()];
        ab.copy_from_slice(a);
        let sb = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut s_tmp)[..s.len()];
        sb.copy_from_slice(s);
        let ok = reduce_aligned(dtype, op, ab, sb);
        debug_assert!(ok, "scratch blocks are 8-byte aligned");
        a.copy_from_slice(ab);
    }
    Ok(())
}

macro_rules! map_elems {
    ($dtype:expr, $buf:expr, |$x:ident : f64| $body:expr) => {{
        fn apply<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
            match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
                Ok(s) => s.iter_mut().for_each(|v| *v = f(*v)),
                Err(_) => {
                    for chunk in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                        let v: T = bytemuck::pod_read_unaligned(chunk);
                        chunk.copy_from_slice(bytemuck::bytes_of(&f(v)));
                    }
                }
            }
        }
        let buf: &mut [u8] = $buf;
        match $dtype {
            DType::U8 => apply::<u8>(buf, |v| {
                let $x = v as f64;
                sat_u8($body)
            }),
            DType::I8 => apply::<i8>(buf, |v| {
                let $x = v as f64;
                sat_i8($body)
            }),
            DType::I32 => apply::<i32>(buf, |v| {
                let $x = v as f64;
                ($body) as i32
            }),
            DType::I64 => apply::<i64>(buf, |v| {
                let $x = v as f64;
                ($body) as i64
            }),
            DType::F64 => apply::<f64>(buf, |v| {
                let $x = v;
                $body
            }),
            // Computed in f32 by the caller; bool cannot be scaled.
            DType::F16 | DType::BF16 | DType::F32 | DType::Bool => {}
        }
    }};
}

fn sat_u8(v: f64) -> u8 {
    v as u8
}

fn sat_i8(v: f64) -> i8 {
    v as i8
}

/// Multiply every element by `factor` (pre/post scaling). Integers are scaled through `f64`
/// and truncated toward zero (saturating at the type's range); `f32`, `f16` and `bf16` are
/// multiplied in `f32` by `factor as f32` (as Horovod does), `f64` in `f64`. A factor of
/// exactly 1 is a no-op; bool tensors cannot be scaled.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) -> Result<(), CoreError> {
    dtype.elements_in(buf.len())?;
    if factor == 1.0 {
        return Ok(());
    }
    if dtype == DType::Bool {
        return Err(CoreError::InvalidArgument(format!(
            "cannot scale a bool tensor by {factor}"
        )));
    }
    let f = factor as f32;
    match dtype {
        DType::F32 => {
            // Hot path: keep it in f32 so it vectorizes; the unaligned path computes the same.
            match bytemuck::try_cast_slice_mut::<u8, f32>(buf) {
                Ok(s) => s.iter_mut().for_each(|v| *v *= f),
                Err(_) => {
                    for chunk in buf.chunks_exact_mut(4) {
                        let v: f32 = bytemuck::pod_read_unaligned(chunk);
                        chunk.copy_from_slice(&(v * f).to_ne_bytes());
                    }
                }
            }
            return Ok(());
        }
        DType::F16 => {
            half_apply::<f16>(buf, |v| v * f);
            return Ok(());
        }
        DType::BF16 => {
            half_apply::<bf16>(buf, |v| v * f);
            return Ok(());
        }
        _ => {}
    }
    map_elems!(dtype, buf, |x: f64| x * factor);
    Ok(())
}

/// Divide every element by `n` (the `Average` finalisation). Integers use integer division,
/// truncating toward zero like Horovod; floats divide exactly in their own precision
/// (`f16`/`bf16` through `f32`).
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) -> Result<(), CoreError> {
    dtype.elements_in(buf.len())?;
    if n == 0 {
        return Err(CoreError::InvalidArgument(
            "cannot average over zero contributors".into(),
        ));
    }
    if n == 1 {
        return Ok(());
    }
    fn int_div<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
        match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
            Ok(s) => s.iter_mut().for_each(|v| *v = f(*v)),
            Err(_) => {
                for chunk in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                    let v: T = bytemuck::pod_read_unaligned(chunk);
                    chunk.copy_from_slice(bytemuck::bytes_of(&f(v)));
                }
            }
        }
    }
    match dtype {
        DType::U8 => int_div::<u8>(buf, |v| (v as usize / n) as u8),
        DType::I8 => int_div::<i8>(buf, |v| (v as i64 / n as i64) as i8),
        DType::I32 => int_div::<i32>(buf, |v| (v as i64 / n as i64) as i32),
        DType::I64 => int_div::<i64>(buf, |v| v / n as i64),
        DType::F16 => half_apply::<f16>(buf, |v| v / n as f32),
        DType::BF16 => half_apply::<bf16>(buf, |v| v / n as f32),
        DType::F32 => int_div::<f32>(buf, |v| v / n as f32),
        DType::F64 => int_div::<f64>(buf, |v| v / n as f64),
        DType::Bool => return Err(unsupported(DType::Bool, ReduceOp::Average)),
    }
    Ok(())
}

/// The `Average` finalisation followed by a postscale: [`divide`] by `n`, then [`scale`] by
/// `factor`, with the same result element for element, in one pass over the buffer for `f32`
/// and `f64` (two passes for the other types).
pub fn divide_and_scale(
    dtype: DType,
    buf: &mut [u8],
    n: usize,
    factor: f64,
) -> Result<(), CoreError> {
    fn one_pass<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
        match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
            Ok(s) => s.iter_mut().for_each(|v| *v = f(*v)),
            Err(_) => {
                for chunk in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                    let v: T = bytemuck::pod_read_unaligned(chunk);
                    chunk.copy_from_slice(bytemuck::bytes_of(&f(v)));
                }
            }
        }
    }
    dtype.elements_in(buf.len())?;
    if n == 0 {
        return Err(CoreError::InvalidArgument(
            "cannot average over zero contributors".into(),
        ));
    }
    match dtype {
        DType::F32 if n > 1 || factor != 1.0 => {
            let (d, f) = (n as f32, factor as f32);
            if factor == 1.0 {
                one_pass::<f32>(buf, |v| v / d);
            } else {
                one_pass::<f32>(buf, |v| v / d * f);
            }
            Ok(())
        }
        DType::F64 if n > 1 || factor != 1.0 => {
            let d = n as f64;
            if factor == 1.0 {
                one_pass::<f64>(buf, |v| v / d);
            } else {
                one_pass::<f64>(buf, |v| v / d * factor);
            }
            Ok(())
        }
        _ => {
            divide(dtype, buf, n)?;
            scale(dtype, buf, factor)
        }
    }
}

/// Copy `src` into `dst` (equal lengths) while applying [`divide_and_scale`]`(n, factor)`:
/// one pass instead of a copy and a pass, for unpacking a fused buffer whose average (or
/// postscale) is still to be applied. `f32`/`f64` are transformed as they are copied; other
/// types are copied and then finalised in place, with the same results as
/// [`divide_and_scale`].
pub fn copy_divide_and_scale(
    dtype: DType,
    src: &[u8],
    dst: &mut [u8],
    n: usize,
    factor: f64,
) -> Result<(), CoreError> {
    fn one_pass<T: bytemuck::Pod>(src: &[u8], dst: &mut [u8], f: impl Fn(T) -> T) -> bool {
        match (
            bytemuck::try_cast_slice::<u8, T>(src),
            bytemuck::try_cast_slice_mut::<u8, T>(dst),
        ) {
            (Ok(s), Ok(d)) => {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s));
                true
            }
            _ => false,
        }
    }
    if src.len() != dst.len() {
        return Err(CoreError::InvalidArgument(format!(
            "copy of {} bytes into {} bytes",
            src.len(),
            dst.len()
        )));
    }
    dtype.elements_in(src.len())?;
    if n == 0 {
        return Err(CoreError::InvalidArgument(
            "cannot average over zero contributors".into(),
        ));
    }
    let done = match dtype {
        DType::F32 if n > 1 || factor != 1.0 => {
            let (d, f) = (n as f32, factor as f32);
            if factor == 1.0 {
                one_pass::<f32>(src, dst, |v| v / d)
            } else {
                one_pass::<f32>(src, dst, |v| v / d * f)
            }
        }
        DType::F64 if n > 1 || factor != 1.0 => {
            let d = n as f64;
            if factor == 1.0 {
                one_pass::<f64>(src, dst, |v| v / d)
            } else {
                one_pass::<f64>(src, dst, |v| v / d * factor)
            }
        }
        _ => false,
    };
    if !done {
        dst.copy_from_slice(src);
        divide_and_scale(dtype, dst, n, factor)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
}
