//! Scaling and the average's finalisation: `scale`, `divide`, `divide_and_scale`, and the
//! unpacking copy that finalises as it goes.

use half::{bf16, f16};

use super::half_float::half_apply;
use super::unsupported;
use crate::{CoreError, DType, ReduceOp};

/// Apply `f` to every `T` of `buf` in place: as a slice of `T` when `buf` is aligned for it
/// (so that the loop vectorizes), else element by element through unaligned reads.
fn map_in_place<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
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

macro_rules! map_elems {
    ($dtype:expr, $buf:expr, |$x:ident : f64| $body:expr) => {{
        let buf: &mut [u8] = $buf;
        match $dtype {
            DType::U8 => map_in_place::<u8>(buf, |v| {
                let $x = v as f64;
                sat_u8($body)
            }),
            DType::I8 => map_in_place::<i8>(buf, |v| {
                let $x = v as f64;
                sat_i8($body)
            }),
            DType::I16 => map_in_place::<i16>(buf, |v| {
                let $x = v as f64;
                ($body) as i16
            }),
            DType::I32 => map_in_place::<i32>(buf, |v| {
                let $x = v as f64;
                ($body) as i32
            }),
            DType::I64 => map_in_place::<i64>(buf, |v| {
                let $x = v as f64;
                ($body) as i64
            }),
            DType::F64 => map_in_place::<f64>(buf, |v| {
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
            // Hot path: keep it in f32 so it vectorizes.
            map_in_place::<f32>(buf, |v| v * f);
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
    match dtype {
        DType::U8 => map_in_place::<u8>(buf, |v| (v as usize / n) as u8),
        DType::I8 => map_in_place::<i8>(buf, |v| (v as i64 / n as i64) as i8),
        DType::I16 => map_in_place::<i16>(buf, |v| (v as i64 / n as i64) as i16),
        DType::I32 => map_in_place::<i32>(buf, |v| (v as i64 / n as i64) as i32),
        DType::I64 => map_in_place::<i64>(buf, |v| v / n as i64),
        DType::F16 => half_apply::<f16>(buf, |v| v / n as f32),
        DType::BF16 => half_apply::<bf16>(buf, |v| v / n as f32),
        DType::F32 => map_in_place::<f32>(buf, |v| v / n as f32),
        DType::F64 => map_in_place::<f64>(buf, |v| v / n as f64),
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
                map_in_place::<f32>(buf, |v| v / d);
            } else {
                map_in_place::<f32>(buf, |v| v / d * f);
            }
            Ok(())
        }
        DType::F64 if n > 1 || factor != 1.0 => {
            let d = n as f64;
            if factor == 1.0 {
                map_in_place::<f64>(buf, |v| v / d);
            } else {
                map_in_place::<f64>(buf, |v| v / d * factor);
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
    fn copy_map<T: bytemuck::Pod>(src: &[u8], dst: &mut [u8], f: impl Fn(T) -> T) -> bool {
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
                copy_map::<f32>(src, dst, |v| v / d)
            } else {
                copy_map::<f32>(src, dst, |v| v / d * f)
            }
        }
        DType::F64 if n > 1 || factor != 1.0 => {
            let d = n as f64;
            if factor == 1.0 {
                copy_map::<f64>(src, dst, |v| v / d)
            } else {
                copy_map::<f64>(src, dst, |v| v / d * factor)
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
