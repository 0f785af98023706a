//! Shared helpers of the shared-memory tests: deterministic data, sequential references and a
//! collective suite every rank runs against its communicator.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::backend::shm::ShmOptions;
use fh_transport::{algorithms, CollectivesExt, Communicator};

/// A fresh job token, unique per call (pid, time, counter).
pub fn token() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "test-{:x}-{t:x}-{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Small slots and rings so that tests cross many round and wrap-around boundaries.
pub fn small_opts() -> ShmOptions {
    ShmOptions {
        timeout: Duration::from_secs(20),
        slot_bytes: 4096,
        ring_bytes: 1024,
        small_allreduce_bytes: 512,
        ..ShmOptions::default()
    }
}

/// Names in /dev/shm that start with `prefix`.
pub fn leftovers(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// splitmix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(parts: &[u64]) -> Rng {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        for &p in parts {
            r.0 ^= p;
            r.next();
        }
        r
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// `len` elements of `dtype` for `rank` in case `case`: full-range integers, and small
/// integers for floats (so that every summation order gives the same bits).
pub fn values(dtype: DType, seed: u64, case: u64, rank: usize, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(&[seed, case, rank as u64, dtype.code() as u64]);
    let mut out = Vec::with_capacity(len * dtype.size());
    for _ in 0..len {
        let r = rng.next();
        let small = (r % 7) as f32 - 3.0;
        match dtype {
            DType::U8 | DType::I8 => out.push(r as u8),
            DType::Bool => out.push((r & 1) as u8),
            DType::I16 => out.extend_from_slice(&(r as i16).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(r as i32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(r as i64).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(small).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(small).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&small.to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(small as f64).to_le_bytes()),
        }
    }
    out
}

#[path = "../reference/mod.rs"]
mod reference;
pub use reference::reference;

/// Every supported (dtype, op) pair.
pub fn pairs() -> Vec<(DType, ReduceOp)> {
    let mut v = Vec::new();
    for d in DType::ALL {
        for o in ReduceOp::ALL {
            if kernels::supports(d, o) {
                v.push((d, o));
            }
        }
    }
    v
}

fn check(what: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{what}: result differs from the sequential reference (lengths {} vs {}, first \
             difference at byte {first:?})",
            got.len(),
            want.len()
        );
    }
}

/// Allreduce of every dtype and operator over several lengths (around slot and share
/// boundaries), checked against the sequential reference.
pub fn suite_allreduce(c: &mut dyn Communicator, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    let lens = [0usize, 1, 7, 100, 1000, 3000, 10_000];
    for (i, (d, o)) in pairs().into_iter().enumerate() {
        for (j, &len) in lens.iter().enumerate() {
            let case = (i * 100 + j) as u64;
            let inputs: Vec<_> = (0..n).map(|r| values(d, seed, case, r, len)).collect();
            let mut buf = inputs[me].clone();
            c.allreduce(&mut buf, d, o).unwrap();
            check(
                &format!("allreduce {d} {o:?} len {len}"),
                &buf,
                &reference(d, o, &inputs),
            );
        }
    }
}

/// The other collectives: allgatherv, broadcast, alltoallv, reduce_scatter, barrier.
pub fn suite_others(c: &mut dyn Communicator, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    for case in 0..6u64 {
        let mut rng = Rng::new(&[seed, 1000 + case]);
        let scale = [0usize, 1, 40, 5000, 13000, 3][case as usize];
        // allgatherv
        let counts: Vec<usize> = (0..n).map(|_| rng.below(scale + 1)).collect();
        let parts: Vec<_> = (0..n)
            .map(|r| values(DType::U8, seed, 2000 + case, r, counts[r]))
            .collect();
        let mut recv = vec![0u8; counts.iter().sum()];
        c.allgatherv(&parts[me], &mut recv, &counts).unwrap();
        check(&format!("allgatherv {counts:?}"), &recv, &parts.concat());
        // broadcast from every root
        for root in 0..n {
            let want = values(DType::U8, seed, 3000 + case, root, scale);
            let mut buf = if me == root {
                want.clone()
            } else {
                vec![0u8; scale]
            };
            c.broadcast(&mut buf, root).unwrap();
            check(&format!("broadcast root {root} len {scale}"), &buf, &want);
        }
        // alltoallv: matrix[i][j] bytes from i to j
        let matrix: Vec<Vec<usize>> = (0..n)
            .map(|_| (0..n).map(|_| rng.below(scale / 2 + 1)).collect())
            .collect();
        let block = |i: usize, j: usize| {
            values(
                DType::U8,
                seed,
                4000 + case * 64 + j as u64,
                i,
                matrix[i][j],
            )
        };
        let send: Vec<u8> = (0..n).flat_map(|j| block(me, j)).collect();
        let send_counts = matrix[me].clone();
        let recv_counts: Vec<usize> = (0..n).map(|i| matrix[i][me]).collect();
        let want: Vec<u8> = (0..n).flat_map(|i| block(i, me)).collect();
        let mut recv = vec![0u8; want.len()];
        c.alltoallv(&send, &send_counts, &mut recv, &recv_counts)
            .unwrap();
        check(&format!("alltoallv {matrix:?}"), &recv, &want);
        // reduce_scatter
        for (d, o) in [
            (DType::F32, ReduceOp::Sum),
            (DType::I64, ReduceOp::Max),
            (DType::BF16, ReduceOp::Average),
            (DType::U8, ReduceOp::BitOr),
        ] {
            let counts: Vec<usize> = (0..n).map(|_| rng.below(scale / 2 + 1)).collect();
            let total: usize = counts.iter().sum();
            let inputs: Vec<_> = (0..n)
                .map(|r| values(d, seed, 5000 + case, r, total))
                .collect();
            let full = reference(d, o, &inputs);
            let e = d.size();
            let off: usize = counts[..me].iter().sum();
            let mut recv = vec![0u8; counts[me] * e];
            c.reduce_scatter(&inputs[me], &mut recv, &counts, d, o)
                .unwrap();
            check(
                &format!("reduce_scatter {d} {o:?} {counts:?}"),
                &recv,
                &full[off * e..(off + counts[me]) * e],
            );
        }
        c.barrier().unwrap();
    }
    // Bitwise negotiation on bytes.
    let mut bits = vec![0u8; 37];
    bits[me % 37] = 1 << (me % 8);
    let mut and = vec![0xffu8; 37];
    and[5] = !(1 << me);
    let mut want_or = vec![0u8; 37];
    for r in 0..n {
        want_or[r % 37] |= 1 << (r % 8);
    }
    c.allreduce(&mut bits, DType::U8, ReduceOp::BitOr).unwrap();
    check("bitor", &bits, &want_or);
    c.allreduce(&mut and, DType::U8, ReduceOp::BitAnd).unwrap();
    let mut want_and = vec![0xffu8; 37];
    for r in 0..n {
        want_and[5] &= !(1 << r);
    }
    check("bitand", &and, &want_and);
    // Convenience forms.
    let mut v = vec![me as f64 + 1.0; 11];
    c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
    let s = (n * (n + 1) / 2) as f64;
    assert_eq!(v, vec![s; 11]);
}

/// Point-to-point: a ring shift with messages larger than the rings, ordered pairs, and the
/// generic algorithms (which only use point-to-point) compared with the native ones.
pub fn suite_p2p(c: &mut dyn Communicator, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    if n == 1 {
        return;
    }
    for len in [0usize, 1, 9, 1023, 1024, 1025, 50_000] {
        let to = (me + 1) % n;
        let from = (me + n - 1) % n;
        let send = values(DType::U8, seed, 6000 + len as u64, me, len);
        let mut recv = vec![0u8; len];
        c.send_recv(to, &send, from, &mut recv).unwrap();
        check(
            &format!("send_recv len {len}"),
            &recv,
            &values(DType::U8, seed, 6000 + len as u64, from, len),
        );
    }
    // Ordered messages between rank 0 and everyone else.
    for round in 0..3u64 {
        if me == 0 {
            for peer in 1..n {
                let msg = values(DType::U8, seed, 7000 + round, peer, 300 * peer);
                c.send(peer, &msg).unwrap();
            }
            for peer in 1..n {
                let mut back = vec![0u8; 300 * peer];
                c.recv(peer, &mut back).unwrap();
                let mut want = values(DType::U8, seed, 7000 + round, peer, 300 * peer);
                want.iter_mut().for_each(|b| *b = b.wrapping_add(1));
                check("echo", &back, &want);
            }
        } else {
            let mut msg = vec![0u8; 300 * me];
            c.recv(0, &mut msg).unwrap();
            msg.iter_mut().for_each(|b| *b = b.wrapping_add(1));
            c.send(0, &msg).unwrap();
        }
    }
    // Generic algorithms over the rings.
    for (i, (d, o)) in [(DType::F32, ReduceOp::Sum), (DType::I32, ReduceOp::Min)]
        .into_iter()
        .enumerate()
    {
        let inputs: Vec<_> = (0..n)
            .map(|r| values(d, seed, 8000 + i as u64, r, 5000))
            .collect();
        let mut buf = inputs[me].clone();
        algorithms::allreduce(c, &mut buf, d, o).unwrap();
        check("generic allreduce", &buf, &reference(d, o, &inputs));
    }
    let parts: Vec<_> = (0..n)
        .map(|r| values(DType::U8, seed, 8100, r, 2000 + r))
        .collect();
    let counts: Vec<usize> = parts.iter().map(Vec::len).collect();
    let mut recv = vec![0u8; counts.iter().sum()];
    algorithms::allgatherv(c, &parts[me], &mut recv, &counts).unwrap();
    check("generic allgatherv", &recv, &parts.concat());
}

/// Everything.
/// One buffer of parts with their own dtype and op equals each part reduced alone: small (one
/// synchronisation) and past the direct threshold (one allreduce per part).
pub fn suite_parts(c: &mut dyn Communicator, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    let all = pairs();
    for (case, lens) in [vec![3usize, 1, 8, 2, 5], vec![1, 20_000]]
        .into_iter()
        .enumerate()
    {
        let mut mine = Vec::new();
        let mut want = Vec::new();
        let mut parts = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let (d, o) = all[(case * 7 + i * 13 + seed as usize) % all.len()];
            let id = (case * 100 + i) as u64 + 50_000;
            let inputs: Vec<_> = (0..n).map(|r| values(d, seed, id, r, len)).collect();
            mine.extend_from_slice(&inputs[me]);
            want.extend_from_slice(&reference(d, o, &inputs));
            parts.push(fh_transport::algorithms::ReducePart {
                len: len * d.size(),
                dtype: d,
                op: o,
            });
        }
        c.allreduce_parts(&mut mine, &parts).unwrap();
        check(&format!("allreduce_parts {parts:?}"), &mine, &want);
    }
    assert!(c.parts_in_band());
}

pub fn suite(c: &mut dyn Communicator, seed: u64) {
    suite_allreduce(c, seed);
    suite_parts(c, seed);
    suite_others(c, seed);
    suite_p2p(c, seed);
    c.barrier().unwrap();
}
