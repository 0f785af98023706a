//! Mismatch errors name the ranks on each side, the same text on every rank: each field that
//! can disagree, the first field in check order when several do, a name cached before, and a
//! process set's engine, which names world ranks.

mod common;

use common::{configs, run_world, LIMIT};
use fh_core::message::MismatchField;
use fh_scheduler::{
    AllreduceOptions, Config, DType, Engine, Handle, ProcessSets, ReduceOp, SchedulerError, Tensor,
};
use fh_transport::backend::local::LocalWorld;

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

fn failure(mut h: Handle) -> SchedulerError {
    h.wait_timeout(LIMIT).map(|_| ()).unwrap_err()
}

/// The messages every rank of an np 3 world gets when rank 1 alone submits something else.
const ODD_RANK_ONE: [&str; 6] = [
    "tensor 'shape': Mismatched allreduce tensor shapes: rank 1 sent [1001]; ranks 0 and 2 sent \
     [1000]",
    "tensor 'dtype': Mismatched allreduce data types: rank 1 sent f64; ranks 0 and 2 sent f32",
    "tensor 'op': Mismatched allreduce reduce ops: rank 1 sent max; ranks 0 and 2 sent sum",
    "tensor 'kind': Mismatched allreduce operations: rank 1 sent allgather; ranks 0 and 2 sent \
     allreduce",
    "tensor 'root': Mismatched broadcast root ranks: rank 1 sent 2; ranks 0 and 2 sent 0",
    "tensor 'scale': Mismatched allreduce prescale factors: rank 1 sent 0.5; ranks 0 and 2 sent \
     1.0",
];

#[test]
fn rank_one_alone_is_named_against_ranks_zero_and_two_np3() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let odd = r == 1;
            let shape = e
                .allreduce(
                    "shape",
                    Tensor::zeros(DType::F32, vec![if odd { 1001 } else { 1000 }]).unwrap(),
                    sum(),
                )
                .unwrap();
            let dtype = if odd {
                e.allreduce("dtype", Tensor::from_slice(&[1.0f64; 2]), sum())
            } else {
                e.allreduce("dtype", Tensor::from_slice(&[1.0f32; 2]), sum())
            }
            .unwrap();
            let op = e
                .allreduce(
                    "op",
                    Tensor::from_slice(&[1.0f32; 2]),
                    AllreduceOptions::with_op(if odd { ReduceOp::Max } else { ReduceOp::Sum }),
                )
                .unwrap();
            let kind = if odd {
                e.allgather("kind", Tensor::from_slice(&[1.0f32; 2]))
            } else {
                e.allreduce("kind", Tensor::from_slice(&[1.0f32; 2]), sum())
            }
            .unwrap();
            let root = e
                .broadcast("root", Tensor::from_slice(&[1u8]), if odd { 2 } else { 0 })
                .unwrap();
            let scale = e
                .allreduce(
                    "scale",
                    Tensor::from_slice(&[1.0f32; 2]),
                    sum().prescale(if odd { 0.5 } else { 1.0 }),
                )
                .unwrap();
            [shape, dtype, op, kind, root, scale].map(|h| failure(h).to_string())
        });
        for (rank, errs) in out.iter().enumerate() {
            assert_eq!(errs, &ODD_RANK_ONE, "{label}: rank {rank}");
        }
    }
}

#[test]
fn the_first_field_in_check_order_is_named_and_a_cached_name_too() {
    let out = run_world(3, Config::default().channels(2), |e, r| {
        // Rank 1 changes the op, rank 2 the dtype: the dtype is checked first.
        let two = if r == 1 {
            e.allreduce(
                "two",
                Tensor::from_slice(&[1.0f32]),
                AllreduceOptions::with_op(ReduceOp::Min),
            )
        } else if r == 2 {
            e.allreduce("two", Tensor::from_slice(&[1.0f64]), sum())
        } else {
            e.allreduce("two", Tensor::from_slice(&[1.0f32]), sum())
        }
        .unwrap();
        let two = failure(two);
        // Cache "c" with an agreed shape, then change it on rank 2 only (invalidation path).
        let mut c = e
            .allreduce("c", Tensor::from_slice(&[1i32; 4]), sum())
            .unwrap();
        c.wait_timeout(LIMIT).unwrap();
        let len = if r == 2 { 5 } else { 4 };
        let cached = failure(
            e.allreduce("c", Tensor::from_slice(&vec![1i32; len]), sum())
                .unwrap(),
        );
        // Allgather: the first dimension may differ, the rest may not.
        let cols = if r == 0 { 3 } else { 2 };
        let gather = failure(
            e.allgather("g", Tensor::zeros(DType::F32, vec![r + 1, cols]).unwrap())
                .unwrap(),
        );
        (two, cached, gather)
    });
    for (rank, (two, cached, gather)) in out.iter().enumerate() {
        assert_eq!(two, &out[0].0, "rank {rank}: the same error everywhere");
        assert!(
            matches!(
                two,
                SchedulerError::Mismatch {
                    field: MismatchField::DType,
                    ..
                }
            ),
            "{two}"
        );
        assert_eq!(
            two.to_string(),
            "tensor 'two': Mismatched allreduce data types: rank 2 sent f64; ranks 0 and 1 sent \
             f32"
        );
        assert_eq!(
            cached.to_string(),
            "tensor 'c': Mismatched allreduce tensor shapes: rank 2 sent [5]; ranks 0 and 1 \
             sent [4]"
        );
        assert_eq!(
            gather.to_string(),
            "tensor 'g': Mismatched allgather tensor shapes: rank 0 sent [*, 3]; ranks 1 and 2 \
             sent [*, 2]"
        );
    }
}

#[test]
fn a_process_sets_mismatch_names_world_ranks() {
    let out = run_world(4, Config::default().channels(1), |world, rank| {
        let reg = ProcessSets::with_timeout(LIMIT);
        let id = reg.add(world, &[1, 2, 3], world.config()).unwrap();
        let err = reg.engine(id).ok().map(|e| {
            // World rank 2 is the set's rank 1.
            let len = if rank == 2 { 5 } else { 4 };
            failure(
                e.allreduce("w", Tensor::from_slice(&vec![1.0f32; len]), sum())
                    .unwrap(),
            )
        });
        reg.remove(world, id).unwrap();
        err
    });
    assert!(out[0].is_none(), "rank 0 is not a member");
    for (rank, err) in out.iter().enumerate().skip(1) {
        let err = err.as_ref().unwrap();
        assert_eq!(
            err.to_string(),
            "tensor 'w': Mismatched allreduce tensor shapes: rank 2 sent [5]; ranks 1 and 3 sent \
             [4]",
            "world rank {rank}"
        );
    }
}

#[test]
fn world_ranks_must_name_every_rank_of_the_engine() {
    // Refused before any collective, so one rank alone gets the error without waiting.
    let t = LocalWorld::new(2).into_iter().next().unwrap();
    let err = Engine::start_with_world_ranks(Box::new(t), Config::default(), &[3]).unwrap_err();
    assert!(
        matches!(err, SchedulerError::InvalidArgument(ref m) if m.contains("1 world ranks")),
        "{err}"
    );
}
