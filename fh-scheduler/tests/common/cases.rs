//! Deterministic multi-rank cases shared by the in-process property tests
//! (`tests/random_orders.rs`) and the launcher-agnostic suite (`examples/sched_suite.rs`): per-rank
//! inputs that every rank can recompute for every other rank, the reference results, and a tiny
//! seeded generator for submission orders and delays.
#![allow(dead_code)]

use fh_scheduler::{DType, ReduceOp, Tensor};

/// One allreduced tensor: length, element type and reduction.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Number of elements.
    pub len: usize,
    /// Element type (F32, F64 or I32).
    pub dtype: DType,
    /// Reduction (Sum, Average, Max or Min).
    pub op: ReduceOp,
}

/// The dtypes and ops the cases draw from.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F64, DType::I32];
/// See [`DTYPES`].
pub const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Max,
    ReduceOp::Min,
];

/// Element `i` of tensor `t` on `rank` at `step`. Small integers so that float sums are exact.
pub fn value(rank: usize, step: usize, t: usize, i: usize) -> i64 {
    ((rank * 7 + step * 3 + t * 5 + i) % 23) as i64 - 11
}

/// This rank's input for tensor `t` at `step`.
pub fn make(spec: Spec, rank: usize, step: usize, t: usize) -> Tensor {
    let vals: Vec<i64> = (0..spec.len).map(|i| value(rank, step, t, i)).collect();
    match spec.dtype {
        DType::F32 => Tensor::from_slice(&vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::from_slice(&vals.iter().map(|&v| v as f64).collect::<Vec<_>>()),
        _ => Tensor::from_slice(&vals.iter().map(|&v| v as i32).collect::<Vec<_>>()),
    }
}

/// The result every rank must get for tensor `t` at `step` on `n` ranks (as f64).
pub fn reference(spec: Spec, n: usize, step: usize, t: usize) -> Vec<f64> {
    (0..spec.len)
        .map(|i| {
            let vs: Vec<i64> = (0..n).map(|r| value(r, step, t, i)).collect();
            match spec.op {
                ReduceOp::Sum => vs.iter().sum::<i64>() as f64,
                ReduceOp::Average => {
                    let s = vs.iter().sum::<i64>();
                    match spec.dtype {
                        DType::I32 => (s / n as i64) as f64, // truncates toward zero
                        DType::F32 => f64::from(s as f32 / n as f32),
                        _ => s as f64 / n as f64,
                    }
                }
                ReduceOp::Max => vs.iter().copied().max().unwrap_or(0) as f64,
                _ => vs.iter().copied().min().unwrap_or(0) as f64,
            }
        })
        .collect()
}

/// A tensor of F32, F64 or I32 as f64 values (empty for other dtypes).
pub fn as_f64(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap_or_default()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F64 => t.to_vec::<f64>().unwrap_or_default(),
        DType::I32 => t
            .to_vec::<i32>()
            .unwrap_or_default()
            .into_iter()
            .map(f64::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// The first element where `got` and `want` differ (or where one is shorter), if any.
pub fn first_difference(got: &[f64], want: &[f64]) -> Option<usize> {
    (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i))
}

/// A tiny deterministic generator (no extra dependency).
pub struct Lcg(pub u64);

impl Lcg {
    /// A generator for `rank`, derived from a seed shared by all ranks.
    pub fn for_rank(seed: u64, rank: usize) -> Self {
        Lcg(seed ^ (rank as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15))
    }

    /// The next value (31 bits).
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// A uniformly shuffled order of `0..n`.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, self.next() as usize % (i + 1));
        }
        order
    }
}
