//! The engine over the TCP backend, one process per rank on 127.0.0.1 (a representative
//! subset of the in-process suite).
//!
//! Each test spawns this test binary once per rank, running only the ignored test
//! `child_rank` with the environment `fhrun` would set (`FH_RANK`, `FH_SIZE`,
//! `FH_RENDEZVOUS_ADDR`, `FH_JOB_TOKEN`, ...) plus `FH_TEST_SCENARIO`. The child builds its
//! world with `fh_transport::from_env()` and its engine with `Config::from_env()`, and prints
//! one `RESULT` line. A guard kills and reaps the children when the test ends, also on failure;
//! every wait is bounded.

mod common;

use std::time::Duration;

use common::procs::{result_line, run_ranks};

use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, Tensor};

const SCENARIO: &str = "FH_TEST_SCENARIO";
const DEADLINE: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(60);

/// Run `size` ranks of `scenario` with `extra` environment; returns each rank's exit success
/// and output.
fn run(size: usize, scenario: &str, extra: &[(&str, &str)]) -> Vec<(bool, String)> {
    let mut env = vec![(SCENARIO, scenario), ("FH_TRANSPORT", "tcp")];
    env.extend_from_slice(extra);
    run_ranks(size, "child_rank", &env, DEADLINE)
}

#[test]
fn random_order_allreduces_over_tcp_both_presets() {
    for (schedule, channels) in [("fasthorovod", "2"), ("horovod", "1")] {
        let out = run(
            3,
            "steps",
            &[
                ("FH_SCHEDULE", schedule),
                ("FH_CHANNELS", channels),
                ("FH_PARTITION_BYTES", "4096"),
            ],
        );
        for (ok, text) in &out {
            assert!(ok, "{schedule}: a rank failed:\n{text}");
            assert_eq!(result_line(text), "ok", "{schedule}:\n{text}");
        }
    }
}

#[test]
fn fused_groups_reduced_in_place_over_tcp() {
    // Over TCP, `fasthorovod` reduces a fused group where its tensors lie (scatter-gather
    // sends and receives, the average and the scales on each rank's block of the ring): large
    // groups take the ring, small ones are packed for recursive doubling; lone tensors and
    // chunks on the ring are finished on the own block too; 3 ranks (uneven blocks) and 4.
    for size in [3, 4] {
        let out = run(
            size,
            "fused",
            &[
                ("FH_SCHEDULE", "fasthorovod"),
                ("FH_CHANNELS", "2"),
                ("FH_PARTITION_BYTES", "1048576"),
            ],
        );
        for (ok, text) in &out {
            assert!(ok, "a rank failed:\n{text}");
            assert_eq!(result_line(text), "ok", "{size} ranks:\n{text}");
        }
    }
}

/// Small cached allreduces ride in the negotiation round over TCP (its allreduce carries the
/// bits and the data in one recursive doubling): right results for every op at 3 and 4 ranks,
/// and the same with riding off.
#[test]
fn small_allreduces_ride_in_the_round_over_tcp() {
    for (size, eager) in [(3, "1024"), (4, "1024"), (4, "0")] {
        let out = run(size, "riding", &[("FH_EAGER_BYTES", eager)]);
        for (ok, text) in &out {
            assert!(ok, "a rank failed:\n{text}");
            assert_eq!(result_line(text), "ok", "{size} ranks, {eager}:\n{text}");
        }
    }
}

#[test]
fn mismatch_over_tcp_fails_the_name_on_every_rank() {
    let out = run(2, "mismatch", &[]);
    for (ok, text) in &out {
        assert!(ok, "{text}");
        assert_eq!(
            result_line(text),
            "tensor 'w': Mismatched allreduce tensor shapes: rank 0 sent [17, 17]; rank 1 sent [18, 18]"
        );
    }
}

#[test]
fn a_killed_rank_is_named_by_the_survivors() {
    let out = run(3, "killed", &[]);
    assert!(!out[2].0, "rank 2 exits abruptly");
    for (ok, text) in &out[..2] {
        assert!(ok, "{text}");
        assert_eq!(result_line(text), "lost 2", "{text}");
    }
}

/// The body of one rank (run only as a child of the tests above).
#[test]
#[ignore = "run by the multi-process tests as a child rank"]
fn child_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let world = fh_transport::from_env().expect("world from the environment");
    let engine = Engine::start(world, Config::from_env().expect("config")).expect("engine");
    let rank = engine.rank();
    let size = engine.size();
    let sum = AllreduceOptions::with_op(ReduceOp::Sum);
    let result = match scenario.as_str() {
        "steps" => {
            let mut ok = true;
            for step in 0..3usize {
                // A rank-dependent order.
                let mut order: Vec<usize> = (0..12).collect();
                order.rotate_left((rank * 5 + step) % 12);
                if rank % 2 == 1 {
                    order.reverse();
                }
                let handles: Vec<_> = order
                    .iter()
                    .map(|&t| {
                        let len = 1 + t * 500;
                        let v = vec![(rank + t + step) as f32; len];
                        (
                            t,
                            engine
                                .allreduce(&format!("g{t}"), Tensor::from_slice(&v), sum)
                                .unwrap(),
                        )
                    })
                    .collect();
                for (t, mut h) in handles {
                    let got = h.wait_timeout(WAIT).unwrap().to_vec::<f32>().unwrap();
                    let want = (0..size).map(|r| (r + t + step) as f32).sum::<f32>();
                    ok &= got.len() == 1 + t * 500 && got.iter().all(|&x| x == want);
                }
            }
            let g = engine
                .allgather("ag", Tensor::from_slice(&vec![rank as i64; rank + 1]))
                .unwrap()
                .wait_timeout(WAIT)
                .unwrap()
                .to_vec::<i64>()
                .unwrap();
            let want: Vec<i64> = (0..size).flat_map(|r| vec![r as i64; r + 1]).collect();
            ok &= g == want;
            let b = engine
                .broadcast("bc", Tensor::from_slice(&[rank as i32; 3]), size - 1)
                .unwrap()
                .wait_timeout(WAIT)
                .unwrap()
                .to_vec::<i32>()
                .unwrap();
            ok &= b == [size as i32 - 1; 3];
            if ok {
                "ok".to_string()
            } else {
                "wrong result".to_string()
            }
        }
        "fused" => {
            let mut ok = true;
            let value = |r: usize, t: usize, i: usize, step: usize| {
                ((r * 3 + t + i % 7 + step) % 11) as f32
            };
            for step in 0..3usize {
                // 24 tensors of 1–60 000 floats submitted at once: fused into groups of
                // several whole tensors, from a few KiB to MiBs.
                let opts = AllreduceOptions::with_op(ReduceOp::Average)
                    .prescale(0.5)
                    .postscale(4.0);
                let lens: Vec<usize> = (0..24)
                    .map(|t| 1 + (t * 7919 + step * 13) % 60_000)
                    .collect();
                let handles: Vec<_> = lens
                    .iter()
                    .enumerate()
                    .map(|(t, &len)| {
                        let v: Vec<f32> = (0..len).map(|i| value(rank, t, i, step)).collect();
                        engine
                            .allreduce(&format!("f{t}"), Tensor::from_slice(&v), opts)
                            .unwrap()
                    })
                    .collect();
                for (t, mut h) in handles.into_iter().enumerate() {
                    let got = h.wait_timeout(WAIT).unwrap().to_vec::<f32>().unwrap();
                    ok &= got.len() == lens[t]
                        && got.iter().enumerate().all(|(i, &x)| {
                            let sum: f32 = (0..size).map(|r| value(r, t, i, step) * 0.5).sum();
                            (x - sum / size as f32 * 4.0).abs() < 1e-4
                        });
                }
            }
            // Lone tensors on the ring: one whole (400 kB) and one split into 1 MiB chunks
            // across the channels (2.8 MB), each finished on the own block.
            for (t, len) in [(100usize, 100_000usize), (101, 700_000)] {
                let opts = AllreduceOptions::with_op(ReduceOp::Average)
                    .prescale(0.5)
                    .postscale(4.0);
                let v: Vec<f32> = (0..len).map(|i| value(rank, t, i, 0)).collect();
                let got = engine
                    .allreduce(&format!("lone{t}"), Tensor::from_slice(&v), opts)
                    .unwrap()
                    .wait_timeout(WAIT)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                ok &= got.len() == len
                    && got.iter().enumerate().all(|(i, &x)| {
                        let sum: f32 = (0..size).map(|r| value(r, t, i, 0) * 0.5).sum();
                        (x - sum / size as f32 * 4.0).abs() < 1e-4
                    });
            }
            let stats = engine.stats();
            if ok && stats.in_place_groups == 0 {
                "no fused group was reduced in place".to_string()
            } else if ok {
                "ok".to_string()
            } else {
                "wrong result".to_string()
            }
        }
        "riding" => {
            let want = match std::env::var("FH_EAGER_BYTES").as_deref() {
                Ok("0") => 0,
                _ => common::riding::RIDERS_PER_STEP * 3,
            };
            match common::riding::steps(&engine, 4) {
                Ok(_) if engine.stats().eager_tensors == want => "ok".to_string(),
                Ok(_) => format!(
                    "{} allreduces rode in their rounds, expected {want}",
                    engine.stats().eager_tensors
                ),
                Err(e) => e,
            }
        }
        "mismatch" => {
            let side = 17 + rank;
            let mut h = engine
                .allreduce(
                    "w",
                    Tensor::zeros(fh_scheduler::DType::F32, vec![side, side]).unwrap(),
                    sum,
                )
                .unwrap();
            let mut ok = engine
                .allreduce("ok", Tensor::from_slice(&[1.0f32]), sum)
                .unwrap();
            ok.wait_timeout(WAIT).unwrap();
            h.wait_timeout(WAIT).unwrap_err().to_string()
        }
        "killed" => {
            engine
                .allreduce("first", Tensor::from_slice(&[1.0f32; 1000]), sum)
                .unwrap()
                .wait_timeout(WAIT)
                .unwrap();
            if rank == 2 {
                // Vanish without shutting down.
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(100));
            let err = engine
                .allreduce("second", Tensor::from_slice(&[1.0f32; 1000]), sum)
                .and_then(|mut h| h.wait_timeout(WAIT))
                .unwrap_err();
            match err.lost_rank() {
                Some(r) => format!("lost {r}"),
                None => format!("unexpected error: {err}"),
            }
        }
        other => format!("unknown scenario {other}"),
    };
    println!("RESULT {result}");
    let _ = engine.shutdown();
}
