//! 16-bit floats (`f16`, `bf16`) computed in `f32`, a block at a time.

use half::{bf16, f16};

/// Elements of `f16`/`bf16` widened to `f32` at a time: small enough for two stack blocks to
/// stay in L1, large enough to amortise the conversion routines' dispatch.
pub(super) const HALF_BLOCK: usize = 512;

/// A 16-bit float type that is reduced through `f32`, a block at a time.
pub(super) trait HalfFloat: bytemuck::Pod {
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
pub(super) fn half_map<T: HalfFloat>(buf: &mut [T], mut f: impl FnMut(&mut [f32])) {
    let mut wide = [0f32; HALF_BLOCK];
    for blk in buf.chunks_mut(HALF_BLOCK) {
        let w = &mut wide[..blk.len()];
        T::widen(blk, w);
        f(w);
        T::narrow(w, blk);
    }
}

/// Apply `f` to every element of a 16-bit float buffer, computing in `f32`.
pub(super) fn half_apply<T: HalfFloat>(buf: &mut [u8], f: impl Fn(f32) -> f32) {
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
