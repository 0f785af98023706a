//! Scaling and the average's finalisation: `scale`, `divide`, `divide_and_scale`, and the
//! unpacking copy that finalises as it goes.

use half::{bf16, f16};

use super::half_float::half_apply;
use super::unsupported;
use crate::{CoreError, DType, ReduceOp};

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
