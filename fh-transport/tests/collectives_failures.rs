//! Every collective on the in-process backend when something is wrong: bad arguments are
//! errors (never panics) before anything is sent, and a peer that goes away is named, within
//! bounded time.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_transport::algorithms::{
    allreduce_with, AllreduceAlgorithm, ALLREDUCE_RING_THRESHOLD_BYTES,
};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};

mod local_world;
use local_world::*;

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
