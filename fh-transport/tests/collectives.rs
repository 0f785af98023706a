//! Every collective on the in-process backend against a sequential reference: all dtypes and
//! supported ops, world sizes 1–8, lengths 0, 1, primes and large, uneven splits with zeros,
//! both allreduce algorithms, pre/post scaling, bad arguments and lost peers.
//!
//! Inputs are small integers (floats) or arbitrary bit patterns (integers, which wrap), so
//! every result is exact whatever order the algorithm reduces in, and results are compared
//! bitwise.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::algorithms::{
    allreduce_segments, allreduce_with, AllreduceAlgorithm, ALLREDUCE_RING_THRESHOLD_BYTES,
    BROADCAST_SCATTER_THRESHOLD_BYTES, RING_CHUNK_BYTES,
};
use fh_transport::local::LocalWorld;
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};
use half::{bf16, f16};
use proptest::prelude::*;

const ALGOS: [AllreduceAlgorithm; 3] = [
    AllreduceAlgorithm::Auto,
    AllreduceAlgorithm::RecursiveDoubling,
    AllreduceAlgorithm::Ring,
];

/// Run `f` on every rank of an `n`-rank in-process world (one thread each) and return the
/// results by rank. Every wait is bounded; a panic on any rank is re-raised here.
fn world<R, F>(n: usize, timeout: Duration, f: F) -> Vec<R>
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

const TIMEOUT: Duration = Duration::from_secs(20);

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rank `rank`'s input of `len` elements: arbitrary bits for integers, small integers for
/// floats (in -2..=2 for products, -8..=8 otherwise, so every sum and product of up to 8 of
/// them is exact even in bf16), 0/1 for bool.
fn input(dtype: DType, op: ReduceOp, len: usize, rank: usize, seed: u64) -> Vec<u8> {
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

fn inputs(dtype: DType, op: ReduceOp, len: usize, n: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..n).map(|r| input(dtype, op, len, r, seed)).collect()
}

/// Sequential reference: fold the inputs in rank order, then divide once for `Average`.
fn reference(inputs: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        kernels::reduce(dtype, op.combining(), &mut acc, x).unwrap();
    }
    if op == ReduceOp::Average {
        kernels::divide(dtype, &mut acc, inputs.len()).unwrap();
    }
    acc
}

/// A copy of `data` at byte offset `offset` of a fresh allocation (to test unaligned buffers).
struct Placed {
    storage: Vec<u8>,
    offset: usize,
}

impl Placed {
    fn new(data: &[u8], offset: usize) -> Self {
        let mut storage = vec![0u8; data.len() + offset];
        storage[offset..].copy_from_slice(data);
        Placed { storage, offset }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.storage[self.offset..]
    }
}

fn supported_ops(dtype: DType) -> impl Iterator<Item = ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(move |&op| kernels::supports(dtype, op))
}

#[test]
fn allreduce_every_dtype_op_size_and_algorithm() {
    const LENS: [usize; 9] = [0, 1, 2, 3, 5, 7, 13, 31, 61];
    for n in 1..=8 {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let mut seed = 1;
            for dtype in DType::ALL {
                for op in supported_ops(dtype) {
                    for algo in ALGOS {
                        for len in LENS {
                            seed += 1;
                            let ins = inputs(dtype, op, len, n, seed);
                            let want = reference(&ins, dtype, op);
                            let mut buf = Placed::new(&ins[rank], (seed % 2) as usize);
                            allreduce_with(comm, buf.get(), dtype, op, algo).unwrap();
                            assert_eq!(
                                buf.get(),
                                &want[..],
                                "n={n} rank={rank} {dtype} {op} {algo} len={len}"
                            );
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn allreduce_scaled_applies_pre_and_post_factors() {
    for n in [1, 3, 4, 7] {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            for dtype in DType::ALL.into_iter().filter(|d| *d != DType::Bool) {
                for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max] {
                    for (pre, post) in [(2.0, 0.5), (1.0, 0.25), (0.5, 3.0)] {
                        let len = 29;
                        let mut ins = inputs(dtype, op, len, n, 77 + n as u64);
                        for x in &mut ins {
                            kernels::scale(dtype, x, pre).unwrap();
                        }
                        let mut want = reference(&ins, dtype, op);
                        kernels::scale(dtype, &mut want, post).unwrap();
                        let mut buf = input(dtype, op, len, rank, 77 + n as u64);
                        comm.allreduce_scaled(&mut buf, dtype, op, pre, post)
                            .unwrap();
                        assert_eq!(buf, want, "n={n} {dtype} {op} pre={pre} post={post}");
                    }
                }
            }
        });
    }
}

#[test]
fn average_divides_exactly_once() {
    // 8 ranks each contribute 8: a second division would give 1, none would give 64.
    let out = world(8, TIMEOUT, |comm| {
        let mut small = [8i32; 5];
        comm.allreduce_typed(&mut small, ReduceOp::Average).unwrap();
        let mut large = vec![8.0f32; ALLREDUCE_RING_THRESHOLD_BYTES / 4 + 3];
        comm.allreduce_typed(&mut large, ReduceOp::Average).unwrap();
        (small.to_vec(), large.iter().all(|&x| x == 8.0))
    });
    for (small, large_ok) in out {
        assert_eq!(small, vec![8; 5]);
        assert!(large_ok);
    }
}

#[test]
fn large_allreduce_is_exact() {
    // Ring blocks above RING_CHUNK_BYTES go in several pieces; check that path too.
    let piecewise = 2 * 2 * RING_CHUNK_BYTES / 4 + 11;
    let cases: Vec<(usize, DType, ReduceOp, usize, AllreduceAlgorithm)> = vec![
        (
            2,
            DType::F32,
            ReduceOp::Sum,
            100_003,
            AllreduceAlgorithm::Auto,
        ),
        (
            3,
            DType::F32,
            ReduceOp::Average,
            100_003,
            AllreduceAlgorithm::Ring,
        ),
        (
            5,
            DType::F32,
            ReduceOp::Max,
            100_003,
            AllreduceAlgorithm::RecursiveDoubling,
        ),
        (
            8,
            DType::F32,
            ReduceOp::Sum,
            100_003,
            AllreduceAlgorithm::Auto,
        ),
        (
            6,
            DType::F16,
            ReduceOp::Sum,
            100_019,
            AllreduceAlgorithm::Ring,
        ),
        (
            4,
            DType::I64,
            ReduceOp::Product,
            50_021,
            AllreduceAlgorithm::Auto,
        ),
        (
            2,
            DType::F32,
            ReduceOp::Sum,
            piecewise,
            AllreduceAlgorithm::Ring,
        ),
        (
            3,
            DType::BF16,
            ReduceOp::Min,
            piecewise,
            AllreduceAlgorithm::Ring,
        ),
    ];
    for (n, dtype, op, len, algo) in cases {
        world(n, TIMEOUT, move |comm| {
            let ins = inputs(dtype, op, len, n, len as u64);
            let want = reference(&ins, dtype, op);
            let mut buf = ins[comm.rank()].clone();
            allreduce_with(comm, &mut buf, dtype, op, algo).unwrap();
            assert!(buf == want, "n={n} {dtype} {op} {algo} len={len} differs");
        });
    }
}

fn count_strategy(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 3 => 0..max]
}

fn dtype_op() -> impl Strategy<Value = (DType, ReduceOp)> {
    (0..DType::ALL.len(), 0..ReduceOp::ALL.len())
        .prop_map(|(d, o)| (DType::ALL[d], ReduceOp::ALL[o]))
        .prop_filter("op must apply to dtype", |(d, o)| kernels::supports(*d, *o))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn allreduce_random(
        n in 1usize..=8,
        (dtype, op) in dtype_op(),
        len in prop_oneof![0usize..64, 0usize..3000],
        algo in 0usize..3,
        seed in any::<u64>(),
        offset in 0usize..3,
    ) {
        let algo = ALGOS[algo];
        world(n, TIMEOUT, move |comm| {
            let ins = inputs(dtype, op, len, n, seed);
            let want = reference(&ins, dtype, op);
            let mut buf = Placed::new(&ins[comm.rank()], offset);
            allreduce_with(comm, buf.get(), dtype, op, algo).unwrap();
            assert_eq!(buf.get(), &want[..], "n={n} {dtype} {op} {algo} len={len}");
        });
    }

    #[test]
    fn allreduce_segments_random(
        n in 1usize..=8,
        (dtype, op) in dtype_op(),
        len in prop_oneof![0usize..64, 0usize..3000, 60_000usize..140_000],
        cuts in prop::collection::vec(0usize..1000, 0..6),
        seed in any::<u64>(),
    ) {
        // The in-place allreduce over slices (the default, copying `send_recv_vectored`)
        // gives what the contiguous one gives, for any cut of the buffer, on either path (the
        // ring above the threshold, recursive doubling below it).
        world(n, TIMEOUT, move |comm| {
            let ins = inputs(dtype, op, len, n, seed);
            let want = reference(&ins, dtype, op);
            let esz = dtype.size();
            let mut at: Vec<usize> = cuts.iter().map(|c| c * len / 1000 * esz).collect();
            at.sort_unstable();
            let mut buf = ins[comm.rank()].clone();
            let mut segs: Vec<&mut [u8]> = Vec::new();
            let mut rest = &mut buf[..];
            let mut prev = 0;
            for c in at {
                let (a, b) = rest.split_at_mut(c - prev);
                segs.push(a);
                rest = b;
                prev = c;
            }
            segs.push(rest);
            allreduce_segments(comm, &mut segs, dtype, op, &mut |b| {
                if op == ReduceOp::Average {
                    kernels::divide(dtype, b, n)?;
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(&buf[..], &want[..], "n={n} {dtype} {op} len={len}");
        });
    }

    #[test]
    fn reduce_scatter_random(
        n in 1usize..=8,
        (dtype, op) in dtype_op(),
        counts in prop::collection::vec(count_strategy(40), 8),
        seed in any::<u64>(),
        offset in 0usize..2,
    ) {
        let counts = counts[..n].to_vec();
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let total: usize = counts.iter().sum();
            let ins = inputs(dtype, op, total, n, seed);
            let want = reference(&ins, dtype, op);
            let esz = dtype.size();
            let start = counts[..rank].iter().sum::<usize>() * esz;
            let mut recv = Placed::new(&vec![0xAB; counts[rank] * esz], offset);
            comm.reduce_scatter(&ins[rank], recv.get(), &counts, dtype, op).unwrap();
            assert_eq!(
                recv.get(),
                &want[start..start + counts[rank] * esz],
                "n={n} {dtype} {op} counts={counts:?}"
            );
        });
    }

    #[test]
    fn allgatherv_random(
        n in 1usize..=8,
        counts in prop::collection::vec(count_strategy(100), 8),
        seed in any::<u64>(),
    ) {
        let counts = counts[..n].to_vec();
        world(n, TIMEOUT, move |comm| {
            let all: Vec<Vec<u8>> = (0..n)
                .map(|r| input(DType::U8, ReduceOp::Sum, counts[r], r, seed))
                .collect();
            let want = all.concat();
            let mut recv = vec![0u8; want.len()];
            comm.allgatherv(&all[comm.rank()], &mut recv, &counts).unwrap();
            assert_eq!(recv, want, "n={n} counts={counts:?}");
        });
    }

    #[test]
    fn alltoallv_random(
        n in 1usize..=8,
        matrix in prop::collection::vec(count_strategy(30), 64),
        seed in any::<u64>(),
    ) {
        // matrix[from * 8 + to] bytes go from rank `from` to rank `to`.
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let block = |from: usize, to: usize| {
                input(DType::U8, ReduceOp::Sum, matrix[from * 8 + to], from * 8 + to, seed)
            };
            let send: Vec<u8> = (0..n).flat_map(|to| block(rank, to)).collect();
            let send_counts: Vec<usize> = (0..n).map(|to| matrix[rank * 8 + to]).collect();
            let recv_counts: Vec<usize> = (0..n).map(|from| matrix[from * 8 + rank]).collect();
            let want: Vec<u8> = (0..n).flat_map(|from| block(from, rank)).collect();
            let mut recv = vec![0u8; want.len()];
            comm.alltoallv(&send, &send_counts, &mut recv, &recv_counts).unwrap();
            assert_eq!(recv, want, "n={n} rank={rank}");
        });
    }
}

#[test]
fn reduce_scatter_every_dtype_and_op_with_zero_blocks() {
    for n in [1, 2, 3, 5, 8] {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            for dtype in DType::ALL {
                for op in supported_ops(dtype) {
                    // Uneven counts with zeros, including a world where all but one are zero.
                    for counts in [
                        (0..n).map(|r| (r * 7 + 3) % 5).collect::<Vec<_>>(),
                        (0..n).map(|r| usize::from(r == n - 1) * 13).collect(),
                        vec![1; n],
                    ] {
                        let total: usize = counts.iter().sum();
                        let ins = inputs(dtype, op, total, n, total as u64 + 5);
                        let want = reference(&ins, dtype, op);
                        let esz = dtype.size();
                        let start = counts[..rank].iter().sum::<usize>() * esz;
                        let mut recv = vec![0u8; counts[rank] * esz];
                        comm.reduce_scatter(&ins[rank], &mut recv, &counts, dtype, op)
                            .unwrap();
                        assert_eq!(
                            recv,
                            &want[start..start + counts[rank] * esz],
                            "n={n} {dtype} {op} counts={counts:?}"
                        );
                    }
                }
            }
        });
    }
}

#[test]
fn large_reduce_scatter_and_allgatherv() {
    // The biggest block exceeds RING_CHUNK_BYTES, so it travels in pieces.
    let big = RING_CHUNK_BYTES / 4 + 50_001;
    for (n, counts) in [
        (3, vec![big, 0, 70_001]),
        (4, vec![25_000, 25_001, 1, 49_999]),
    ] {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let total: usize = counts.iter().sum();
            let ins = inputs(DType::F32, ReduceOp::Sum, total, n, 9);
            let want = reference(&ins, DType::F32, ReduceOp::Sum);
            let start = counts[..rank].iter().sum::<usize>() * 4;
            let mut recv = vec![0u8; counts[rank] * 4];
            comm.reduce_scatter(&ins[rank], &mut recv, &counts, DType::F32, ReduceOp::Sum)
                .unwrap();
            assert!(recv == want[start..start + counts[rank] * 4]);

            // Allgather the blocks back: everyone must end with the full reduction.
            let bytes: Vec<usize> = counts.iter().map(|c| c * 4).collect();
            let mut all = vec![0u8; total * 4];
            comm.allgatherv(&recv, &mut all, &bytes).unwrap();
            assert!(all == want);
        });
    }
}

#[test]
fn broadcast_from_every_root() {
    let lens = [0, 1, 13, 1000, BROADCAST_SCATTER_THRESHOLD_BYTES + 7];
    for n in 1..=8 {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            for root in 0..n {
                for len in lens {
                    let want = input(DType::U8, ReduceOp::Sum, len, root, len as u64);
                    let mut buf = input(DType::U8, ReduceOp::Sum, len, rank, len as u64 + 1);
                    if rank == root {
                        buf.copy_from_slice(&want);
                    }
                    comm.broadcast(&mut buf, root).unwrap();
                    assert!(buf == want, "n={n} root={root} len={len} rank={rank}");
                }
            }
        });
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    for n in 1..=8 {
        let arrived: Arc<Vec<AtomicUsize>> =
            Arc::new((0..20).map(|_| AtomicUsize::new(0)).collect());
        let a = Arc::clone(&arrived);
        world(n, TIMEOUT, move |comm| {
            for (round, counter) in a.iter().enumerate() {
                // Stagger the ranks so a barrier that does not wait would be caught.
                if (round + comm.rank()) % 3 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                counter.fetch_add(1, Ordering::SeqCst);
                comm.barrier().unwrap();
                assert_eq!(counter.load(Ordering::SeqCst), n, "round {round}");
            }
        });
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let out = world(3, Duration::from_secs(5), |comm| {
        let mut errors = Vec::new();
        let mut check = |what: &str, r: Result<(), TransportError>| match r {
            Err(TransportError::InvalidArgument(msg)) => errors.push(msg),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        };
        let mut six = [0u8; 6];
        check(
            "misaligned",
            comm.allreduce(&mut six, DType::F32, ReduceOp::Sum),
        );
        check(
            "unsupported op",
            comm.allreduce(&mut [0u8; 8], DType::F32, ReduceOp::BitAnd),
        );
        check(
            "bool average",
            comm.allreduce(&mut [0u8; 8], DType::Bool, ReduceOp::Average),
        );
        check(
            "forced ring, bad length",
            allreduce_with(
                comm,
                &mut six,
                DType::F64,
                ReduceOp::Sum,
                AllreduceAlgorithm::Ring,
            ),
        );
        check("broadcast root", comm.broadcast(&mut [0u8; 4], 3));
        check(
            "allgatherv counts len",
            comm.allgatherv(&[1], &mut [0u8; 3], &[1, 1]),
        );
        check(
            "allgatherv recv len",
            comm.allgatherv(&[1], &mut [0u8; 4], &[1, 1, 1]),
        );
        check(
            "allgatherv send len",
            comm.allgatherv(&[1, 2], &mut [0u8; 3], &[1, 1, 1]),
        );
        check(
            "allgatherv overflow",
            comm.allgatherv(&[], &mut [], &[usize::MAX, 1, 0]),
        );
        check(
            "alltoallv counts len",
            comm.alltoallv(&[0; 2], &[1, 1], &mut [0; 2], &[1, 1]),
        );
        check(
            "alltoallv send len",
            comm.alltoallv(&[0; 2], &[1, 1, 1], &mut [0; 3], &[1, 1, 1]),
        );
        let mut recv_counts = [1usize; 3];
        recv_counts[comm.rank()] = 2;
        check(
            "alltoallv self",
            comm.alltoallv(&[0; 3], &[1, 1, 1], &mut [0; 4], &recv_counts),
        );
        check(
            "reduce_scatter counts len",
            comm.reduce_scatter(&[0; 8], &mut [0; 4], &[1, 1], DType::F32, ReduceOp::Sum),
        );
        check(
            "reduce_scatter total",
            comm.reduce_scatter(&[0; 8], &mut [0; 4], &[1, 1, 1], DType::F32, ReduceOp::Sum),
        );
        check(
            "reduce_scatter recv",
            comm.reduce_scatter(&[0; 12], &mut [0; 8], &[1, 1, 1], DType::F32, ReduceOp::Sum),
        );
        check(
            "reduce_scatter misaligned",
            comm.reduce_scatter(&[0; 13], &mut [0; 4], &[1, 1, 1], DType::F32, ReduceOp::Sum),
        );
        check(
            "reduce_scatter op",
            comm.reduce_scatter(
                &[0; 12],
                &mut [0; 4],
                &[1, 1, 1],
                DType::F32,
                ReduceOp::BitOr,
            ),
        );
        check(
            "reduce_scatter huge count",
            comm.reduce_scatter(
                &[0; 12],
                &mut [0; 4],
                &[usize::MAX / 2, 1, 1],
                DType::F32,
                ReduceOp::Sum,
            ),
        );
        check(
            "allreduce_into",
            comm.allreduce_into(&[0; 4], &mut [0; 8], DType::F32, ReduceOp::Sum),
        );
        check("alltoall", comm.alltoall(&[0; 4], &mut [0; 4]));
        // Nothing was sent by the failed calls: a valid collective still works.
        let mut v = [comm.rank() as i32 + 1];
        comm.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [6]);
        errors
    });
    for msg in &out[0] {
        assert!(!msg.is_empty());
    }
    assert!(out[0].iter().any(|m| m.contains("root 3")), "{:?}", out[0]);
}

/// Rank `dead` drops its communicator before the others start `op`; they must fail promptly,
/// and the ranks that talk to the dead one directly must name it.
fn lost_peer(
    n: usize,
    dead: usize,
    op: fn(&mut dyn Communicator) -> Result<(), TransportError>,
) -> Vec<Option<TransportError>> {
    let gone = Arc::new(std::sync::Barrier::new(n));
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = LocalWorld::with_timeout(n, Duration::from_secs(1))
        .into_iter()
        .map(|mut t| {
            let (gone, tx) = (Arc::clone(&gone), tx.clone());
            std::thread::spawn(move || {
                let rank = t.rank();
                let mut comm = t.open("test").expect("open");
                if rank == dead {
                    drop(comm);
                    gone.wait();
                    let _ = tx.send((rank, None));
                    return;
                }
                gone.wait();
                let err = op(&mut *comm).err();
                let _ = tx.send((rank, err));
                // Keep this communicator open until the others are done, so they blame the
                // dead rank rather than a rank that merely gave up.
                std::thread::sleep(Duration::from_millis(1500));
            })
        })
        .collect();
    drop(tx);
    let mut out: Vec<Option<TransportError>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (rank, err) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("every rank reports within 30 s");
        out[rank] = err;
    }
    for h in handles {
        h.join().expect("rank thread");
    }
    out
}

#[test]
fn a_dropped_peer_is_named() {
    fn small(c: &mut dyn Communicator) -> Result<(), TransportError> {
        c.allreduce_typed(&mut [1.0f32; 16], ReduceOp::Sum)
    }
    fn large(c: &mut dyn Communicator) -> Result<(), TransportError> {
        c.allreduce_typed(
            &mut vec![1.0f32; ALLREDUCE_RING_THRESHOLD_BYTES],
            ReduceOp::Sum,
        )
    }
    fn barrier(c: &mut dyn Communicator) -> Result<(), TransportError> {
        c.barrier()
    }
    fn bcast(c: &mut dyn Communicator) -> Result<(), TransportError> {
        c.broadcast(&mut [0u8; 64], 3)
    }
    let started = Instant::now();
    let errs = lost_peer(2, 1, small);
    assert!(
        matches!(errs[0], Some(TransportError::PeerLost { rank: 1, .. })),
        "{errs:?}"
    );

    // Ring on 4 ranks: rank 0 receives from 3 and rank 2 sends to 3.
    let errs = lost_peer(4, 3, large);
    for r in [0, 2] {
        assert!(
            matches!(errs[r], Some(TransportError::PeerLost { rank: 3, .. })),
            "rank {r}: {errs:?}"
        );
    }
    assert!(
        errs[1].as_ref().is_some_and(|e| e.is_peer_failure()),
        "{errs:?}"
    );

    // Dissemination on 4 ranks: rank 0 hears from 3 in the first round, rank 2 signals it.
    let errs = lost_peer(4, 3, barrier);
    assert!(
        matches!(errs[0], Some(TransportError::PeerLost { rank: 3, .. })),
        "{errs:?}"
    );
    assert!(
        errs.iter()
            .take(3)
            .all(|e| e.as_ref().is_some_and(|e| e.is_peer_failure())),
        "{errs:?}"
    );

    // Broadcast from a dead root: its children (relative ranks 1 and 2) name it.
    let errs = lost_peer(4, 3, bcast);
    for r in [0, 1] {
        assert!(
            matches!(errs[r], Some(TransportError::PeerLost { rank: 3, .. })),
            "rank {r}: {errs:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(40));
}
