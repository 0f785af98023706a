//! Small allreduces riding in the negotiation round (`Config::eager_bytes`): right results for
//! every op, dtype, prescale and postscale at every world size, the same as with riding off; a
//! joined rank contributes zeros; nothing rides under the `horovod` preset or where the
//! negotiation backend cannot reduce mixed parts in one collective. Over TCP: `tcp.rs`.

mod common;

use common::{riding, run_world, LIMIT};
use std::time::Duration;

use fh_scheduler::{AllreduceOptions, CollectiveOptions, Config, Engine, Preset, ReduceOp, Tensor};
use fh_transport::backend::local::LocalWorld;
use fh_transport::Transport;

#[test]
fn small_allreduces_ride_from_their_second_step_with_the_results_of_a_collective() {
    const STEPS: usize = 4;
    for n in 1..=5 {
        for (label, cfg) in [
            ("default", Config::default()),
            ("off", Config::default().eager_bytes(0)),
            ("horovod", Config::preset(Preset::Horovod)),
            ("one channel", Config::default().channels(1).inline_bytes(0)),
        ] {
            let out = run_world(n, cfg, |e, _| (riding::steps(e, STEPS), e.stats()));
            for (rank, (steps, stats)) in out.iter().enumerate() {
                assert_eq!(steps, &Ok(STEPS), "{label}, {n} ranks, rank {rank}");
                let want = match label {
                    "off" | "horovod" => 0,
                    // A world of one runs no collective at all: nothing to ride in.
                    _ if n == 1 => stats.eager_tensors,
                    _ => riding::RIDERS_PER_STEP * (STEPS as u64 - 1),
                };
                assert_eq!(
                    stats.eager_tensors, want,
                    "{label}, {n} ranks, rank {rank}: {stats:?}"
                );
                assert_eq!(stats.eager_bytes, out[0].1.eager_bytes, "{label}");
            }
        }
    }
}

/// Ranks 0 and 2 join; rank 1 averages a cached small tensor alone: the joined ranks ride with
/// zeros, and the average divides by every rank (Horovod's convention), as without riding.
#[test]
fn a_joined_rank_rides_with_zeros() {
    for eager in [1024, 0] {
        let out = run_world(3, Config::default().eager_bytes(eager), |e, r| {
            let avg = CollectiveOptions::default();
            let first = e
                .allreduce("solo", Tensor::from_slice(&[3.0f32, r as f32]), avg)
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            assert_eq!(first, [3.0, 1.0]);
            let mut alone = None;
            if r == 1 {
                let before = e.stats().eager_tensors;
                let got = e
                    .allreduce("solo", Tensor::from_slice(&[3.0f32, 6.0]), avg)
                    .unwrap()
                    .wait_timeout(LIMIT)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                alone = Some((got, e.stats().eager_tensors - before));
            }
            let last = e.join().unwrap().wait_timeout(LIMIT).unwrap();
            (alone, last.to_vec::<i64>().unwrap())
        });
        for (r, (alone, last)) in out.iter().enumerate() {
            assert_eq!(last, &[1], "eager {eager}: rank 1 joined last");
            if r == 1 {
                let (got, rode) = alone.clone().unwrap();
                assert_eq!(got, [1.0, 2.0], "eager {eager}");
                assert_eq!(rode, u64::from(eager > 0), "eager {eager}");
            }
        }
    }
}

/// The ranks must agree on the setting: a rank with another budget refuses to start, naming
/// the variable, on every rank.
#[test]
fn ranks_that_disagree_on_the_budget_refuse_to_start() {
    let threads: Vec<_> = LocalWorld::with_timeout(3, Duration::from_secs(20))
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let budget = if t.topology().rank == 2 { 64 } else { 1024 };
                Engine::start(Box::new(t), Config::default().eager_bytes(budget)).unwrap_err()
            })
        })
        .collect();
    for t in threads {
        let err = t.join().unwrap().to_string();
        assert!(
            err.contains("FH_EAGER_BYTES") && err.contains("disagree"),
            "{err}"
        );
    }
}

/// Riding does not change what a sum of a cached tensor gives when ranks submit it at very
/// different times (it rides only in the round where every rank has it).
#[test]
fn late_ranks_still_get_the_sum() {
    let out = run_world(4, Config::default(), |e, r| {
        let sum = AllreduceOptions::with_op(ReduceOp::Sum);
        let mut got = Vec::new();
        for step in 0..6u64 {
            std::thread::sleep(std::time::Duration::from_micros(
                (r as u64 * 7919 + step * 104_729) % 3000,
            ));
            got.push(
                e.allreduce("late", Tensor::from_slice(&[r as f64 + step as f64]), sum)
                    .unwrap()
                    .wait_timeout(LIMIT)
                    .unwrap()
                    .to_vec::<f64>()
                    .unwrap()[0],
            );
        }
        (got, e.stats().eager_tensors)
    });
    for (got, rode) in &out {
        let want: Vec<f64> = (0..6).map(|s| 6.0 + 4.0 * s as f64).collect();
        assert_eq!(got, &want);
        assert_eq!(*rode, 5, "every step after the first rides");
    }
}
