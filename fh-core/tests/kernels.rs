//! The host kernels against a scalar reference written independently, element by element:
//! every dtype × op, aligned and unaligned buffers, random bit patterns (NaN, infinities and
//! subnormals included for the floats), f16/bf16 combined in f32 and rounded once, integer
//! averages truncating toward zero, scaling.

use fh_core::{kernels, CoreError, DType, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;

/// A bool element (one byte, 0 or 1).
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
struct Bool(u8);

/// The scalar definition of each kernel for one element type.
trait Scalar: bytemuck::Pod + std::fmt::Debug {
    const DTYPE: DType;
    fn from_random(bits: u64) -> Self;
    fn reduce(op: ReduceOp, a: Self, b: Self) -> Self;
    fn divide(a: Self, n: usize) -> Self;
    fn scale(a: Self, factor: f64) -> Self;
    /// Equal, counting any two NaNs as equal.
    fn same(a: Self, b: Self) -> bool;
}

macro_rules! int_scalar {
    ($t:ty, $d:ident) => {
        impl Scalar for $t {
            const DTYPE: DType = DType::$d;
            fn from_random(bits: u64) -> Self {
                bits as $t
            }
            fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Average => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => std::cmp::min(a, b),
                    ReduceOp::Max => std::cmp::max(a, b),
                    ReduceOp::BitAnd => a & b,
                    ReduceOp::BitOr => a | b,
                }
            }
            fn divide(a: Self, n: usize) -> Self {
                // Truncation toward zero, computed in a type wide enough for every case.
                (a as i128 / n as i128) as $t
            }
            fn scale(a: Self, factor: f64) -> Self {
                (a as f64 * factor) as $t
            }
            fn same(a: Self, b: Self) -> bool {
                a == b
            }
        }
    };
}

int_scalar!(u8, U8);
int_scalar!(i8, I8);
int_scalar!(i16, I16);
int_scalar!(i32, I32);
int_scalar!(i64, I64);

fn min_of<T: PartialOrd>(a: T, b: T) -> T {
    if b < a {
        b
    } else {
        a
    }
}

fn max_of<T: PartialOrd>(a: T, b: T) -> T {
    if b > a {
        b
    } else {
        a
    }
}

macro_rules! float_scalar {
    ($t:ty, $d:ident, $bits:ty) => {
        impl Scalar for $t {
            const DTYPE: DType = DType::$d;
            fn from_random(bits: u64) -> Self {
                <$t>::from_bits(bits as $bits)
            }
            fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Average => a + b,
                    ReduceOp::Product => a * b,
                    ReduceOp::Min => min_of(a, b),
                    ReduceOp::Max => max_of(a, b),
                    _ => unreachable!("not supported for floats"),
                }
            }
            fn divide(a: Self, n: usize) -> Self {
                a / n as $t
            }
            fn scale(a: Self, factor: f64) -> Self {
                scale_float(a, factor)
            }
            fn same(a: Self, b: Self) -> bool {
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }
        }
    };
}

float_scalar!(f32, F32, u32);
float_scalar!(f64, F64, u64);

trait ScaleFloat {
    fn scale_float(self, factor: f64) -> Self;
}
impl ScaleFloat for f32 {
    fn scale_float(self, factor: f64) -> Self {
        self * factor as f32
    }
}
impl ScaleFloat for f64 {
    fn scale_float(self, factor: f64) -> Self {
        self * factor
    }
}
fn scale_float<T: ScaleFloat>(a: T, factor: f64) -> T {
    a.scale_float(factor)
}

macro_rules! half_scalar {
    ($t:ty, $d:ident) => {
        impl Scalar for $t {
            const DTYPE: DType = DType::$d;
            fn from_random(bits: u64) -> Self {
                <$t>::from_bits(bits as u16)
            }
            fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
                // Combined in f32, rounded once.
                <$t>::from_f32(f32::reduce(op, a.to_f32(), b.to_f32()))
            }
            fn divide(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
            fn scale(a: Self, factor: f64) -> Self {
                <$t>::from_f32(a.to_f32() * factor as f32)
            }
            fn same(a: Self, b: Self) -> bool {
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }
        }
    };
}

half_scalar!(f16, F16);
half_scalar!(bf16, BF16);

impl Scalar for Bool {
    const DTYPE: DType = DType::Bool;
    fn from_random(bits: u64) -> Self {
        Bool((bits & 1) as u8)
    }
    fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
        let (x, y) = (a.0 != 0, b.0 != 0);
        Bool(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => x || y,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => x && y,
            ReduceOp::Average => unreachable!("not supported for bool"),
        } as u8)
    }
    fn divide(_: Self, _: usize) -> Self {
        unreachable!("not supported for bool")
    }
    fn scale(_: Self, _: f64) -> Self {
        unreachable!("not supported for bool")
    }
    fn same(a: Self, b: Self) -> bool {
        a == b
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn values<T: Scalar>(len: usize, seed: u64) -> Vec<T> {
    (0..len)
        .map(|i| T::from_random(splitmix(seed ^ splitmix(i as u64))))
        .collect()
}

/// `values` serialised at byte offset `offset` of a fresh buffer.
fn placed<T: Scalar>(values: &[T], offset: usize) -> Vec<u8> {
    let mut buf = vec![0u8; offset];
    buf.extend_from_slice(bytemuck::cast_slice(values));
    buf
}

fn read<T: Scalar>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

fn assert_same<T: Scalar>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            T::same(*g, *w),
            "{what}: element {i}: got {g:?}, want {w:?}"
        );
    }
}

fn check_reduce<T: Scalar>(op: ReduceOp, len: usize, oa: usize, ob: usize, seed: u64) {
    let a: Vec<T> = values(len, seed);
    let b: Vec<T> = values(len, !seed);
    let want: Vec<T> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| T::reduce(op, *x, *y))
        .collect();
    let mut abuf = placed(&a, oa);
    let bbuf = placed(&b, ob);
    kernels::reduce(T::DTYPE, op, &mut abuf[oa..], &bbuf[ob..]).unwrap();
    assert_same(
        &read::<T>(&abuf[oa..]),
        &want,
        &format!("reduce {} {op} len={len} offsets={oa},{ob}", T::DTYPE),
    );
}

fn check_divide_and_scale<T: Scalar>(len: usize, offset: usize, n: usize, factor: f64, seed: u64) {
    let a: Vec<T> = values(len, seed);
    let what = format!("{} len={len} offset={offset}", T::DTYPE);

    let want: Vec<T> = a.iter().map(|x| T::divide(*x, n)).collect();
    let mut buf = placed(&a, offset);
    kernels::divide(T::DTYPE, &mut buf[offset..], n).unwrap();
    assert_same(
        &read::<T>(&buf[offset..]),
        &want,
        &format!("divide by {n}: {what}"),
    );

    let want: Vec<T> = a.iter().map(|x| T::scale(*x, factor)).collect();
    let mut buf = placed(&a, offset);
    kernels::scale(T::DTYPE, &mut buf[offset..], factor).unwrap();
    assert_same(
        &read::<T>(&buf[offset..]),
        &want,
        &format!("scale by {factor}: {what}"),
    );
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::U8 => $f::<u8>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::I16 => $f::<i16>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::Bool => $f::<Bool>($($arg),*),
        }
    };
}

#[test]
fn every_dtype_and_op_at_every_offset() {
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            if !kernels::supports(dtype, op) {
                continue;
            }
            // Lengths around the unaligned path's 4 KiB blocks and the half types' blocks.
            for len in [0, 1, 7, 511, 512, 513, 1500] {
                for (oa, ob) in [(0, 0), (1, 0), (0, 3), (2, 2), (5, 7)] {
                    let seed = (len * 64 + oa * 8 + ob) as u64;
                    by_dtype!(dtype, check_reduce, op, len, oa, ob, seed);
                }
            }
        }
    }
}

fn dtype_op() -> impl Strategy<Value = (DType, ReduceOp)> {
    (0..DType::ALL.len(), 0..ReduceOp::ALL.len())
        .prop_map(|(d, o)| (DType::ALL[d], ReduceOp::ALL[o]))
        .prop_filter("op must apply to dtype", |(d, o)| kernels::supports(*d, *o))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn reduce_matches_scalar_reference(
        (dtype, op) in dtype_op(),
        len in prop_oneof![0usize..40, 0usize..5000],
        oa in 0usize..8,
        ob in 0usize..8,
        seed in any::<u64>(),
    ) {
        by_dtype!(dtype, check_reduce, op, len, oa, ob, seed);
    }

    #[test]
    fn divide_and_scale_match_scalar_reference(
        dtype in (0..DType::ALL.len()).prop_map(|d| DType::ALL[d]),
        len in prop_oneof![0usize..40, 0usize..3000],
        offset in 0usize..8,
        n in 1usize..10,
        factor in prop_oneof![Just(0.5), Just(2.0), Just(-3.0), -100.0f64..100.0],
        seed in any::<u64>(),
    ) {
        if dtype != DType::Bool {
            by_dtype!(dtype, check_divide_and_scale, len, offset, n, factor, seed);
        }
    }
}

#[test]
fn integer_average_truncates_toward_zero() {
    let mut a = placed(&[-7i32, 7, -1, 1, -9, i32::MIN], 0);
    kernels::divide(DType::I32, &mut a, 2).unwrap();
    assert_eq!(read::<i32>(&a), vec![-3, 3, 0, 0, -4, i32::MIN / 2]);
    let mut b = placed(&[-128i8, 127, -5], 1);
    kernels::divide(DType::I8, &mut b[1..], 3).unwrap();
    assert_eq!(read::<i8>(&b[1..]), vec![-42, 42, -1]);
    let mut c = placed(&[255u8, 4], 0);
    kernels::divide(DType::U8, &mut c, 4).unwrap();
    assert_eq!(read::<u8>(&c), vec![63, 1]);
}

#[test]
fn half_types_accumulate_in_f32() {
    // 2048 + 1 is not representable in f16: the sum rounds (to even) once.
    let mut a = placed(&[f16::from_f32(2048.0), f16::from_f32(0.1)], 0);
    let b = placed(&[f16::from_f32(1.0), f16::from_f32(0.2)], 0);
    kernels::reduce(DType::F16, ReduceOp::Sum, &mut a, &b).unwrap();
    let got = read::<f16>(&a);
    assert_eq!(got[0].to_f32(), 2048.0);
    assert_eq!(
        got[1],
        f16::from_f32(f16::from_f32(0.1).to_f32() + f16::from_f32(0.2).to_f32())
    );
    // bf16: 256 + 1 rounds to 256, 256 + 3 rounds to 260 (ties to even).
    let mut a = placed(&[bf16::from_f32(256.0), bf16::from_f32(256.0)], 0);
    let b = placed(&[bf16::from_f32(1.0), bf16::from_f32(3.0)], 0);
    kernels::reduce(DType::BF16, ReduceOp::Sum, &mut a, &b).unwrap();
    let got: Vec<f32> = read::<bf16>(&a).iter().map(|x| x.to_f32()).collect();
    assert_eq!(got, vec![256.0, 260.0]);
}

#[test]
fn bad_arguments_are_errors() {
    let mut a = vec![0u8; 8];
    assert!(matches!(
        kernels::reduce(DType::F32, ReduceOp::Sum, &mut a, &[0u8; 4]),
        Err(CoreError::LengthMismatch { .. })
    ));
    assert!(matches!(
        kernels::reduce(DType::I64, ReduceOp::Sum, &mut a[..6], &[0u8; 6]),
        Err(CoreError::Misaligned { .. })
    ));
    for op in [ReduceOp::BitAnd, ReduceOp::BitOr] {
        for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            assert!(matches!(
                kernels::reduce(d, op, &mut a, &[0u8; 8]),
                Err(CoreError::UnsupportedOp { .. })
            ));
        }
    }
    assert!(kernels::divide(DType::Bool, &mut a, 2).is_err());
    assert!(kernels::divide(DType::F32, &mut a, 0).is_err());
    assert!(kernels::scale(DType::Bool, &mut a, 2.0).is_err());
    assert!(kernels::scale(DType::F32, &mut a[..3], 2.0).is_err());
}

/// int16 by hand: three ranks' [1, -1000, 300, 7], [2, -2000, 300, 5], [3, -3000, 300, 3],
/// reduced left to right as the collectives do.
#[test]
fn int16_reductions_worked_out_by_hand() {
    let bytes = |v: &[i16]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let back = |b: &[u8]| {
        b.chunks_exact(2)
            .map(|c| i16::from_ne_bytes([c[0], c[1]]))
            .collect::<Vec<i16>>()
    };
    let ranks: [[i16; 4]; 3] = [[1, -1000, 300, 7], [2, -2000, 300, 5], [3, -3000, 300, 3]];
    let run = |op: ReduceOp| {
        let mut acc = bytes(&ranks[0]);
        for r in &ranks[1..] {
            kernels::reduce(DType::I16, op, &mut acc, &bytes(r)).unwrap();
        }
        acc
    };
    assert_eq!(back(&run(ReduceOp::Sum)), [6, -6000, 900, 15]);
    assert_eq!(back(&run(ReduceOp::Min)), [1, -3000, 300, 3]);
    assert_eq!(back(&run(ReduceOp::Max)), [3, -1000, 300, 7]);
    // 1*2*3 = 6; (-1000)(-2000) = 2e6 wraps in 16 bits, as integer products do: only the
    // first and last columns are checked: 7*5*3 = 105.
    let p = back(&run(ReduceOp::Product));
    assert_eq!((p[0], p[3]), (6, 105));
    // Average: the sum, then division truncating toward zero: [2, -2000, 300, 5]; and of
    // [-7, 7] over 2 ranks: -3 and 3 (toward zero, not down).
    let mut avg = run(ReduceOp::Average);
    kernels::divide(DType::I16, &mut avg, 3).unwrap();
    assert_eq!(back(&avg), [2, -2000, 300, 5]);
    let mut odd = bytes(&[-7, 7]);
    kernels::divide(DType::I16, &mut odd, 2).unwrap();
    assert_eq!(back(&odd), [-3, 3]);
    // Scaling truncates toward zero and saturates at the type's range.
    let mut s = bytes(&[3, -3, 20000, -20000]);
    kernels::scale(DType::I16, &mut s, 2.5).unwrap();
    assert_eq!(back(&s), [7, -7, i16::MAX, i16::MIN]);
    // The name PyTorch gives it, and its size.
    assert_eq!("torch.int16".parse::<DType>().unwrap(), DType::I16);
    assert_eq!(DType::I16.size(), 2);
}
