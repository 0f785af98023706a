//! The in-process harness of the collective tests (`collectives`, `collectives_failures`):
//! a world of threads with every wait bounded, exact inputs and the sequential reference.
//! Each test file includes it with `mod local_world;`.
#![allow(dead_code)]

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Communicator, Transport};
use half::{bf16, f16};

/// Run `f` on every rank of an `n`-rank in-process world (one thread each) and return the
/// results by rank. Every wait is bounded; a panic on any rank is re-raised here.
pub fn world<R, F>(n: usize, timeout: Duration, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(&mut dyn Communicator) -> R + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = LocalWorld::with_timeout(n, timeout)
        .into_iter()
        .map(|mut t| {
            let (f, tx) = (Arc::clone(&f), tx.clone());
            std::thread::spawn(move || {
                let rank = t.rank();
                let out = catch_unwind(AssertUnwindSafe(|| {
                    let mut comm = t.open("test").expect("open");
                    f(&mut *comm)
                }));
                let _ = tx.send((rank, out));
            })
        })
        .collect();
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let mut panic = None;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(r))) => results[rank] = Some(r),
            Ok((_, Err(p))) => {
                panic.get_or_insert(p);
            }
            Err(e) => panic!("world of {n} ranks did not finish: {e}"),
        }
    }
    for h in handles {
        let _ = h.join();
    }
    if let Some(p) = panic {
        resume_unwind(p);
    }
    results.into_iter().map(|r| r.expect("reported")).collect()
}

pub const TIMEOUT: Duration = Duration::from_secs(20);

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rank `rank`'s input of `len` elements: arbitrary bits for integers, small integers for
/// floats (in -2..=2 for products, -8..=8 otherwise, so every sum and product of up to 8 of
/// them is exact even in bf16), 0/1 for bool.
pub fn input(dtype: DType, op: ReduceOp, len: usize, rank: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * dtype.size());
    for i in 0..len {
        let h = splitmix(seed ^ splitmix(((rank as u64) << 40) ^ i as u64));
        let small = if op == ReduceOp::Product {
            (h % 5) as f32 - 2.0
        } else {
            (h % 17) as f32 - 8.0
        };
        match dtype {
            DType::U8 | DType::I8 => out.push(h as u8),
            DType::Bool => out.push((h & 1) as u8),
            DType::I16 => out.extend_from_slice(&(h as i16).to_ne_bytes()),
            DType::I32 => out.extend_from_slice(&(h as i32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&(h as i64).to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(small).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(small).to_bits().to_ne_bytes()),
            DType::F32 => out.extend_from_slice(&small.to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&(small as f64).to_ne_bytes()),
        }
    }
    out
}

pub fn inputs(dtype: DType, op: ReduceOp, len: usize, n: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..n).map(|r| input(dtype, op, len, r, seed)).collect()
}

#[path = "../reference/mod.rs"]
mod reference;
#[allow(unused_imports)] // not every test file checks against it
pub use reference::reference;

/// A copy of `data` at byte offset `offset` of a fresh allocation (to test unaligned buffers).
pub struct Placed {
    storage: Vec<u8>,
    offset: usize,
}

impl Placed {
    pub fn new(data: &[u8], offset: usize) -> Self {
        let mut storage = vec![0u8; data.len() + offset];
        storage[offset..].copy_from_slice(data);
        Placed { storage, offset }
    }
    pub fn get(&mut self) -> &mut [u8] {
        &mut self.storage[self.offset..]
    }
}

pub fn supported_ops(dtype: DType) -> impl Iterator<Item = ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(move |&op| kernels::supports(dtype, op))
}
