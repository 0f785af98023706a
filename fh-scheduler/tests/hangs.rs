//! Regressions for ways the engine used to hang or diverge without a word (issue 11): each
//! test ends with the right result, or the same error on every rank, within a bounded time.

mod common;

use std::time::Duration;

use common::{configs, run_world, LIMIT};
use fh_scheduler::{
    AllreduceOptions, Config, DType, Engine, Priority, ReduceOp, SchedulerError, Tensor,
};
use fh_transport::backend::local::LocalWorld;
use fh_transport::Transport;

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

/// Start one engine per rank with `cfg(rank)` and return each rank's start-up error text.
fn start_errors(n: usize, cfg: impl Fn(usize) -> Config + Send + Sync + 'static) -> Vec<String> {
    let cfg = std::sync::Arc::new(cfg);
    let threads: Vec<_> = LocalWorld::with_timeout(n, Duration::from_secs(20))
        .into_iter()
        .map(|t| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let c = cfg(t.rank());
                match Engine::start(Box::new(t), c) {
                    Ok(e) => {
                        let _ = e.shutdown();
                        "started".to_string()
                    }
                    Err(e) => e.to_string(),
                }
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn ranks_with_different_planning_settings_refuse_to_start() {
    // FH_PRIORITY reorders the planner's input: one rank on `forward`, one on `ready` used to
    // build different groups and fail with a protocol error blaming a healthy rank.
    let errs = start_errors(2, |r| {
        Config::default().priority(if r == 0 {
            Priority::Forward
        } else {
            Priority::Ready
        })
    });
    for e in &errs {
        assert!(e.contains("FH_PRIORITY") && e.contains("disagree"), "{e}");
    }
    assert_eq!(errs[0], errs[1]);
    let errs = start_errors(2, |r| {
        Config::default().stall_shutdown((r == 1).then(|| Duration::from_secs(5)))
    });
    for e in &errs {
        assert!(e.contains("FH_STALL_SHUTDOWN_SECONDS"), "{e}");
    }
    let errs = start_errors(3, |r| {
        Config::default().backpressure_bounds(1 << 20, Duration::from_millis(1 + r as u64))
    });
    for e in &errs {
        assert!(e.contains("FH_BACKPRESSURE_MAX_MS"), "{e}");
    }
    // Auto is off at 2 ranks: one rank forcing it on disagrees with it.
    let errs = start_errors(2, |r| {
        Config::default().backpressure((r == 0).then_some(true))
    });
    for e in &errs {
        assert!(e.contains("FH_BACKPRESSURE"), "{e}");
    }
    let errs = start_errors(2, |r| Config::default().inline_bytes(r as u64 * 512));
    for e in &errs {
        assert!(
            e.contains("FH_INLINE_BYTES") && e.contains("disagree"),
            "{e}"
        );
    }
    // The same settings everywhere start.
    let ok = start_errors(2, |_| Config::default().priority(Priority::Forward));
    assert_eq!(ok, ["started", "started"]);
}

#[test]
fn group_membership_changes_under_the_same_names_work_on_every_rank() {
    for (label, cfg) in configs() {
        let out = run_world(2, cfg, |e, r| {
            let mut got = Vec::new();
            let v = |x: f32| Tensor::from_slice(&[x; 5]);
            // Three members, then (cached) the same names with two members: the cache must
            // not reuse the three-member group, or the second call waits forever.
            for members in [3usize, 2, 3, 1] {
                let ts = (0..members).map(|i| v((r + i) as f32)).collect();
                let res = e
                    .grouped_allreduce("g", ts, sum())
                    .unwrap()
                    .wait_timeout(LIMIT)
                    .unwrap();
                got.push(
                    res.iter()
                        .map(|t| t.to_vec::<f32>().unwrap()[0])
                        .collect::<Vec<_>>(),
                );
            }
            // A former member on its own.
            let t = e
                .allreduce("g[0]", v(1.0), sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap();
            got.push(t.to_vec::<f32>().unwrap()[..1].to_vec());
            // And in a group again.
            let res = e
                .grouped_allreduce("g", vec![v(2.0), v(3.0)], sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap();
            got.push(res.iter().map(|t| t.to_vec::<f32>().unwrap()[0]).collect());
            got
        });
        let expect: Vec<Vec<f32>> = vec![
            vec![1.0, 3.0, 5.0],
            vec![1.0, 3.0],
            vec![1.0, 3.0, 5.0],
            vec![1.0],
            vec![2.0],
            vec![4.0, 6.0],
        ];
        for got in &out {
            assert_eq!(got, &expect, "{label}");
        }
    }
}

#[test]
fn ranks_that_group_a_name_differently_fail_it_on_every_rank() {
    for (label, cfg) in configs() {
        let out = run_world(2, cfg, |e, r| {
            // Rank 0 submits "p" in a one-member group "p"; rank 1 submits "p[0]" on its own.
            let mut h = if r == 0 {
                e.grouped_allreduce("p", vec![Tensor::from_slice(&[1.0f32])], sum())
                    .unwrap()
                    .into_handles()
                    .pop()
                    .unwrap()
            } else {
                e.allreduce("p[0]", Tensor::from_slice(&[1.0f32]), sum())
                    .unwrap()
            };
            let err = h.wait_timeout(LIMIT).unwrap_err().to_string();
            // The engine goes on.
            let ok = e
                .allreduce("after", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            (err, ok)
        });
        for (err, ok) in &out {
            assert_eq!(err, &out[0].0, "{label}: same error on every rank");
            assert!(err.contains("group memberships"), "{label}: {err}");
            assert_eq!(ok, &[2.0], "{label}");
        }
    }
}

#[test]
fn a_refused_group_member_leaves_no_member_in_flight() {
    for (label, cfg) in configs() {
        let out = run_world(2, cfg, |e, _| {
            // "g[1]" is in flight on its own, so the group "g" (which would use the name
            // "g[1]") is refused as a whole: "g[0]" must not be left in flight.
            let mut lone = e
                .allreduce("g[1]", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            let refused = e
                .grouped_allreduce(
                    "g",
                    vec![Tensor::from_slice(&[1.0f32]), Tensor::from_slice(&[1.0f32])],
                    sum(),
                )
                .unwrap_err();
            // A member with an unsupported op for its dtype refuses the group too.
            let bad_dtype = e
                .grouped_allreduce(
                    "h",
                    vec![
                        Tensor::from_slice(&[1.0f32]),
                        Tensor::zeros(DType::Bool, vec![1]).unwrap(),
                    ],
                    AllreduceOptions::with_op(ReduceOp::Average),
                )
                .unwrap_err();
            let lone = lone.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
            // Neither "g[0]" nor "h[0]" is in flight: both can be submitted now.
            let g0 = e
                .allreduce("g[0]", Tensor::from_slice(&[2.0f32]), sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let h0 = e
                .allreduce("h[0]", Tensor::from_slice(&[3.0f32]), sum())
                .unwrap()
                .wait_timeout(LIMIT)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            (refused, bad_dtype, lone, g0, h0)
        });
        for (refused, bad_dtype, lone, g0, h0) in &out {
            assert!(
                matches!(refused, SchedulerError::DuplicateName { name } if name == "g[1]"),
                "{label}: {refused}"
            );
            assert!(
                matches!(bad_dtype, SchedulerError::InvalidArgument(_)),
                "{label}: {bad_dtype}"
            );
            assert_eq!(lone, &[2.0], "{label}");
            assert_eq!(g0, &[4.0], "{label}");
            assert_eq!(h0, &[6.0], "{label}");
        }
    }
}
