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

mod half_float;
mod scale;
#[cfg(test)]
mod tests;

use half_float::{half_map, HalfFloat, HALF_BLOCK};
pub use scale::{copy_divide_and_scale, divide, divide_and_scale, scale};

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

pub(super) fn unsupported(dtype: DType, op: ReduceOp) -> CoreError {
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
        DType::I16 => typed!(i16, int_loop),
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
