//! Every collective on the in-process backend against a sequential reference: all dtypes and
//! supported ops, world sizes 1–8, lengths 0, 1, primes and large, uneven splits with zeros,
//! both allreduce algorithms, pre/post scaling, and the in-place allreduce over slices. Bad
//! arguments and lost peers: `collectives_failures`.
//!
//! Inputs are small integers (floats) or arbitrary bit patterns (integers, which wrap), so
//! every result is exact whatever order the algorithm reduces in, and results are compared
//! bitwise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::algorithms::{
    allreduce_segments, allreduce_with, AllreduceAlgorithm, ALLREDUCE_RING_THRESHOLD_BYTES,
    BROADCAST_SCATTER_THRESHOLD_BYTES, RING_CHUNK_BYTES,
};
use fh_transport::{CollectivesExt, Communicator};
use proptest::prelude::*;

mod local_world;
use local_world::*;

const ALGOS: [AllreduceAlgorithm; 3] = [
    AllreduceAlgorithm::Auto,
    AllreduceAlgorithm::RecursiveDoubling,
    AllreduceAlgorithm::Ring,
];

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
                            let want = reference(dtype, op, &ins);
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

/// The allreduce that also ANDs a flag: with every rank able it equals the plain allreduce
/// (below the ring threshold, where the flag rides in recursive doubling's messages, and
/// above it, where a one-byte agreement comes first); when any one rank cannot (whichever
/// rank, at every world size, odd ones included), every rank gets `false`. The default
/// (two collectives) answers the same as the in-message form.
#[test]
fn allreduce_agreeing_reduces_only_when_every_rank_can() {
    let lens = [0usize, 1, 7, 61, ALLREDUCE_RING_THRESHOLD_BYTES / 4 + 3];
    for n in 1..=6 {
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let mut seed = 500;
            for (dtype, op) in [
                (DType::F32, ReduceOp::Sum),
                (DType::F32, ReduceOp::Average),
                (DType::I32, ReduceOp::Max),
                (DType::U8, ReduceOp::BitAnd),
            ] {
                for len in lens {
                    seed += 1;
                    let ins = inputs(dtype, op, len, n, seed);
                    let want = reference(dtype, op, &ins);
                    let mut buf = ins[rank].clone();
                    let ok = fh_transport::algorithms::allreduce_agreeing(
                        comm, &mut buf, dtype, op, true,
                    )
                    .unwrap();
                    assert!(ok, "n={n} {dtype} {op} len={len}: every rank can");
                    assert_eq!(buf, want, "n={n} rank={rank} {dtype} {op} len={len}");
                    // The trait's default (a flag first, then the reduction) agrees.
                    let mut buf = ins[rank].clone();
                    let ok = Defaulted(&mut *comm)
                        .allreduce_agreeing(&mut buf, dtype, op, true)
                        .unwrap();
                    assert!(ok);
                    assert_eq!(buf, want, "default form, n={n} {dtype} {op} len={len}");
                    for cannot in 0..n {
                        let mut buf = ins[rank].clone();
                        let mine = rank != cannot;
                        let ok = fh_transport::algorithms::allreduce_agreeing(
                            comm, &mut buf, dtype, op, mine,
                        )
                        .unwrap();
                        assert!(!ok, "n={n} len={len}: rank {cannot} cannot");
                        let ok = Defaulted(&mut *comm)
                            .allreduce_agreeing(&mut buf, dtype, op, mine)
                            .unwrap();
                        assert!(!ok, "default form, n={n} len={len}: rank {cannot} cannot");
                    }
                }
            }
        });
    }
}

/// One buffer of parts with their own dtype and op (bit masks, sums, averages, maxima, odd
/// lengths) equals the parts reduced one by one, at every world size, below the ring
/// threshold (one recursive doubling) and above it (one allreduce per part); the trait's
/// default form (one allreduce per part) answers the same; parts that do not tile the buffer
/// are refused before anything is sent.
#[test]
fn allreduce_parts_equals_each_part_reduced_alone() {
    let big = ALLREDUCE_RING_THRESHOLD_BYTES / 4 + 5;
    let shapes: Vec<Vec<(DType, ReduceOp, usize)>> = vec![
        vec![
            (DType::U8, ReduceOp::BitAnd, 19),
            (DType::F32, ReduceOp::Sum, 1),
            (DType::F64, ReduceOp::Average, 3),
            (DType::I32, ReduceOp::Max, 5),
            (DType::F16, ReduceOp::Min, 7),
        ],
        vec![(DType::F32, ReduceOp::Average, 2)],
        vec![
            (DType::U8, ReduceOp::BitOr, 3),
            (DType::F32, ReduceOp::Sum, big),
        ],
    ];
    for n in 1..=6 {
        let shapes = shapes.clone();
        world(n, TIMEOUT, move |comm| {
            let rank = comm.rank();
            let mut seed = 900;
            for shape in &shapes {
                let mut mine = Vec::new();
                let mut want = Vec::new();
                let mut parts = Vec::new();
                for &(dtype, op, len) in shape {
                    seed += 1;
                    let ins = inputs(dtype, op, len, n, seed);
                    mine.extend_from_slice(&ins[rank]);
                    want.extend_from_slice(&reference(dtype, op, &ins));
                    parts.push(fh_transport::algorithms::ReducePart {
                        len: len * dtype.size(),
                        dtype,
                        op,
                    });
                }
                let mut buf = mine.clone();
                fh_transport::algorithms::allreduce_parts(comm, &mut buf, &parts).unwrap();
                assert_eq!(buf, want, "n={n} rank={rank} {shape:?}");
                let mut buf = mine.clone();
                comm.allreduce_parts(&mut buf, &parts).unwrap();
                assert_eq!(buf, want, "trait method, n={n} {shape:?}");
                let mut buf = mine.clone();
                Defaulted(&mut *comm)
                    .allreduce_parts(&mut buf, &parts)
                    .unwrap();
                assert_eq!(buf, want, "default form, n={n} {shape:?}");
            }
            let short = [fh_transport::algorithms::ReducePart {
                len: 4,
                dtype: DType::F32,
                op: ReduceOp::Sum,
            }];
            let err = comm.allreduce_parts(&mut [0u8; 8], &short).unwrap_err();
            assert!(err.to_string().contains("cover 4 bytes"), "{err}");
        });
    }
}

/// A communicator that forwards everything but keeps the trait's default
/// `allreduce_agreeing` (the form backends with their own allreduce use).
struct Defaulted<'a>(&'a mut dyn fh_transport::Communicator);

impl fh_transport::Communicator for Defaulted<'_> {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> fh_transport::Result<()> {
        self.0.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> fh_transport::Result<()> {
        self.0.recv(peer, buf)
    }
    fn send_recv(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
    ) -> fh_transport::Result<()> {
        self.0.send_recv(to, send, from, recv)
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
                        let mut want = reference(dtype, op, &ins);
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
            let want = reference(dtype, op, &ins);
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
            let want = reference(dtype, op, &ins);
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
            let want = reference(dtype, op, &ins);
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
            let want = reference(dtype, op, &ins);
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
                        let want = reference(dtype, op, &ins);
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
            let want = reference(DType::F32, ReduceOp::Sum, &ins);
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
