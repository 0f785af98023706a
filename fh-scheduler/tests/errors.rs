//! Error paths: disagreements between ranks, duplicate names, shutdown, stalls, lost ranks,
//! join, and configuration disagreements.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{configs, run_world, run_world_with, LIMIT};
use fh_core::message::MismatchField;
use fh_scheduler::{
    AllreduceOptions, Config, DType, Engine, ReduceOp, SchedulerError, Tensor, Wire,
};
use fh_transport::backend::local::LocalWorld;
use fh_transport::Transport;

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

#[test]
fn mismatched_shapes_fail_that_name_on_every_rank_and_others_proceed() {
    for (label, cfg) in configs() {
        let out = run_world(2, cfg, |e, r| {
            // Once with an uncached name, once after the name was cached (invalidation path).
            let side = r + 17;
            let mut bad = e
                .allreduce(
                    "w",
                    Tensor::zeros(DType::F32, vec![side, side]).unwrap(),
                    sum(),
                )
                .unwrap();
            let mut ok = e
                .allreduce("ok", Tensor::from_slice(&[1.0f32; 3]), sum())
                .unwrap();
            let first = bad.wait_timeout(LIMIT).unwrap_err();
            assert_eq!(
                ok.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap(),
                [2.0; 3]
            );
            // Cache "c" with an agreed shape, then change it on rank 1 only.
            let mut c = e
                .allreduce("c", Tensor::from_slice(&[1i32; 4]), sum())
                .unwrap();
            c.wait_timeout(LIMIT).unwrap();
            let len = if r == 1 { 5 } else { 4 };
            let mut c = e
                .allreduce("c", Tensor::from_slice(&vec![1i32; len]), sum())
                .unwrap();
            let mut ok = e
                .allreduce("ok", Tensor::from_slice(&[1.0f32; 3]), sum())
                .unwrap();
            let second = c.wait_timeout(LIMIT).unwrap_err();
            ok.wait_timeout(LIMIT).unwrap();
            // And the name works again once the ranks agree.
            let mut c = e
                .allreduce("c", Tensor::from_slice(&[2i32; 4]), sum())
                .unwrap();
            let again = c.wait_timeout(LIMIT).unwrap().to_vec::<i32>().unwrap();
            (first, second, again)
        });
        for (first, second, again) in &out {
            assert_eq!(first, &out[0].0, "{label}: same error on every rank");
            assert!(
                first.to_string().ends_with(
                    "Mismatched allreduce tensor shapes: rank 0 sent [17, 17]; rank 1 sent [18, 18]"
                ),
                "{label}: {first}"
            );
            assert!(
                matches!(
                    second,
                    SchedulerError::Mismatch {
                        field: MismatchField::Shape,
                        ..
                    }
                ),
                "{label}: {second}"
            );
            assert!(
                second
                    .to_string()
                    .ends_with("rank 0 sent [4]; rank 1 sent [5]"),
                "{label}: {second}"
            );
            assert_eq!(again, &[4; 4], "{label}");
        }
    }
}

#[test]
fn mismatched_dtype_op_and_root() {
    let out = run_world(2, Config::default().channels(2), |e, r| {
        let mut d = if r == 0 {
            e.allreduce("d", Tensor::from_slice(&[1.0f32]), sum())
        } else {
            e.allreduce("d", Tensor::from_slice(&[1.0f64]), sum())
        }
        .unwrap();
        let op = if r == 0 { ReduceOp::Sum } else { ReduceOp::Max };
        let mut o = e
            .allreduce(
                "o",
                Tensor::from_slice(&[1.0f32]),
                AllreduceOptions::with_op(op),
            )
            .unwrap();
        let mut b = e.broadcast("b", Tensor::from_slice(&[1u8]), r).unwrap();
        (
            d.wait_timeout(LIMIT).unwrap_err(),
            o.wait_timeout(LIMIT).unwrap_err(),
            b.wait_timeout(LIMIT).unwrap_err(),
        )
    });
    for (d, o, b) in &out {
        assert_eq!(d, &out[0].0);
        assert_eq!(
            d.to_string(),
            "tensor 'd': Mismatched allreduce data types: rank 0 sent f32; rank 1 sent f64"
        );
        assert!(
            o.to_string()
                .contains("reduce ops: rank 0 sent sum; rank 1 sent max"),
            "{o}"
        );
        assert!(
            b.to_string()
                .contains("root ranks: rank 0 sent 0; rank 1 sent 1"),
            "{b}"
        );
    }
}

#[test]
fn duplicate_in_flight_name_is_refused() {
    let gate = Arc::new(Barrier::new(2));
    let out = run_world(2, Config::default(), move |e, r| {
        let mut dup = None;
        let mut h = if r == 0 {
            let h = e
                .allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            dup = Some(
                e.allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
                    .unwrap_err(),
            );
            gate.wait();
            h
        } else {
            gate.wait(); // rank 0 has tried the duplicate: "x" cannot have completed yet
            e.allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap()
        };
        let v = h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
        // Once completed, the name can be used again.
        let mut again = e
            .allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
            .unwrap();
        again.wait_timeout(LIMIT).unwrap();
        (dup, v)
    });
    let dup = out[0].0.clone().unwrap();
    assert_eq!(dup, SchedulerError::DuplicateName { name: "x".into() });
    assert!(dup.to_string().contains("already in flight"));
    assert_eq!(out[1].1, [2.0]);
}

#[test]
fn shutdown_fails_pending_and_later_submissions() {
    let gate = Arc::new(Barrier::new(2));
    let out = run_world(
        2,
        Config::default().idle_heartbeat(Duration::from_millis(20)),
        move |e, r| {
            if r == 0 {
                gate.wait();
                return None; // run_world shuts rank 0 down now
            }
            let mut lonely = e
                .allreduce("lonely", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            gate.wait();
            let pending = lonely.wait_timeout(LIMIT).unwrap_err();
            let start = Instant::now();
            let later = loop {
                match e.allreduce("later", Tensor::from_slice(&[1.0f32]), sum()) {
                    Err(e) => break e,
                    Ok(mut h) => {
                        let _ = h.wait_timeout(LIMIT);
                    }
                }
                assert!(start.elapsed() < LIMIT);
            };
            Some((pending, later))
        },
    );
    let (pending, later) = out[1].clone().unwrap();
    assert!(pending.is_shutdown(), "{pending}");
    assert!(later.is_shutdown(), "{later}");
    assert!(later.to_string().contains("shut down"), "{later}");
}

#[test]
fn a_rank_that_stops_submitting_is_named_by_the_stall_inspector() {
    let gate = Arc::new(Barrier::new(2));
    let cfg = Config::default()
        .stall_check(Some(Duration::from_millis(200)))
        .idle_heartbeat(Duration::from_millis(20));
    let out = run_world(2, cfg, move |e, r| {
        let mut x = e
            .allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
            .unwrap();
        let mut late = if r == 0 {
            let late = e
                .allreduce("late", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            let start = Instant::now();
            while e.stall_reports().is_empty() {
                assert!(start.elapsed() < LIMIT, "no stall report");
                std::thread::sleep(Duration::from_millis(10));
            }
            gate.wait();
            late
        } else {
            gate.wait();
            e.allreduce("late", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap()
        };
        x.wait_timeout(LIMIT).unwrap();
        late.wait_timeout(LIMIT).unwrap();
        (e.stall_reports(), e.stats().stall_warnings)
    });
    let (reports, warnings) = &out[0];
    assert!(*warnings >= 1);
    assert_eq!(reports[0].names, ["late"]);
    assert_eq!(reports[0].missing_ranks, [1]);
    assert!(reports[0].waited >= Duration::from_millis(200));
    // Every rank records the same finding.
    assert_eq!(out[1].0[0], reports[0]);
}

#[test]
fn the_rank_a_stall_names_runs_its_culprit_hook_once_per_lack() {
    // Three ranks: rank 2 holds "b" back (it submits it late), every other name goes through.
    // Only rank 2's hook runs, with a report that says it lacks "b", and only once however
    // many checks see the same stall.
    let gate = Arc::new(Barrier::new(3));
    let cfg = Config::default()
        .stall_check(Some(Duration::from_millis(100)))
        .idle_heartbeat(Duration::from_millis(20));
    let out = run_world(3, cfg, move |e, r| {
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&calls);
        e.set_culprit_hook(Arc::new(move |report: &fh_scheduler::StallReport| {
            seen.lock().unwrap().push(report.clone());
        }));
        let mut b = if r == 2 {
            // Wait for at least two reports (two checks of the same stall), then submit.
            let start = Instant::now();
            while e.stall_reports().len() < 2 {
                assert!(start.elapsed() < LIMIT, "no stall report");
                std::thread::sleep(Duration::from_millis(10));
            }
            gate.wait();
            e.allreduce("b", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap()
        } else {
            let b = e
                .allreduce("b", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            gate.wait();
            b
        };
        assert_eq!(
            b.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap(),
            [3.0]
        );
        let calls = calls.lock().unwrap().clone();
        calls
    });
    assert!(out[0].is_empty() && out[1].is_empty(), "{out:?}");
    assert_eq!(out[2].len(), 1, "{:?}", out[2]);
    assert_eq!(out[2][0].lacked_by(2), Some(&["b".to_string()][..]));
    assert_eq!(
        out[2][0].to_string().split(" (").next(),
        Some("stall: rank 2 has not submitted [\"b\"]")
    );
}

#[test]
fn stall_shutdown_stops_every_rank_naming_the_silent_one() {
    let cfg = Config::default()
        .stall_check(Some(Duration::from_millis(100)))
        .stall_shutdown(Some(Duration::from_millis(300)))
        .idle_heartbeat(Duration::from_millis(20));
    let out = run_world_with(2, cfg, |e, r| {
        if r == 0 {
            let mut h = e
                .allreduce("late", Tensor::from_slice(&[1.0f32]), sum())
                .unwrap();
            Some(h.wait_timeout(LIMIT).unwrap_err())
        } else {
            // Wait (bounded) until the engine is stopped by the stall inspector.
            let start = Instant::now();
            loop {
                if let Some(err) = e.stopped() {
                    assert!(e.barrier().is_err());
                    return Some(err);
                }
                assert!(start.elapsed() < LIMIT);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    for (err, shut) in out {
        let err = err.unwrap();
        assert!(
            matches!(err, SchedulerError::Stalled { ref missing, .. } if missing == &[1]),
            "{err}"
        );
        assert!(matches!(shut, Err(SchedulerError::Stalled { .. })));
    }
}

#[test]
fn a_lost_rank_fails_pending_handles_naming_it() {
    let mut world = LocalWorld::with_timeout(2, Duration::from_secs(20)).into_iter();
    let t0 = world.next().unwrap();
    let mut t1 = world.next().unwrap();
    let cfg = Config::default().channels(2);
    let c2 = cfg.clone();
    // Rank 1 plays the engine's start-up protocol by hand, then vanishes.
    let ghost = std::thread::spawn(move || {
        let mut control = t1.open("fh-control").unwrap();
        // The start-up agreement's fields (fh_scheduler::config::planning_fields, then the
        // heartbeats' silence and interval: none on the in-process transport), then the
        // channels this rank asks for.
        let vals: [i64; 17] = [
            0,
            2,
            c2.cache_capacity as i64,
            c2.fusion_threshold as i64,
            c2.partition_bytes as i64,
            0,
            0,
            i64::from(c2.backpressure_on(2, Wire::Memory)),
            c2.backpressure_bytes as i64,
            c2.backpressure_max.as_millis() as i64,
            i64::from(c2.cuda),
            c2.inline_bytes as i64,
            c2.eager_bytes as i64,
            c2.effective_stage_bytes(1) as i64,
            0,
            0,
            2,
        ];
        let mut b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        control
            .allreduce(&mut b, DType::I64, ReduceOp::Min)
            .unwrap();
        control
            .allreduce(&mut b, DType::I64, ReduceOp::Max)
            .unwrap();
        // The engine's incarnation, broadcast by rank 0 (taken, so that rank 0's send cannot
        // meet a communicator already dropped).
        control.broadcast(&mut [0u8; 8], 0).unwrap();
        let data: Vec<_> = (0..2)
            .map(|c| t1.open(&format!("fh-channel-{c}")).unwrap())
            .collect();
        drop((control, data, t1));
    });
    let engine = Engine::start(Box::new(t0), cfg).unwrap();
    ghost.join().unwrap();
    let mut h = engine
        .allreduce("x", Tensor::from_slice(&[1.0f32]), sum())
        .unwrap();
    let err = h.wait_timeout(LIMIT).unwrap_err();
    assert_eq!(err.lost_rank(), Some(1), "{err}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    let later = engine
        .allreduce("y", Tensor::from_slice(&[1.0f32]), sum())
        .unwrap_err();
    assert_eq!(later.lost_rank(), Some(1));
    assert!(engine.shutdown().is_err());
}

#[test]
fn joined_rank_contributes_zeros_and_average_divides_by_every_rank() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            if r == 2 {
                e.join().unwrap().wait_timeout(LIMIT).unwrap();
                return None;
            }
            // Rank 0 sends 1, rank 1 sends 2, rank 2 (joined) zeros: Horovod's average is
            // (1 + 2 + 0) / 3 = 1, its sum 3.
            let mut a = e
                .allreduce(
                    "a",
                    Tensor::from_slice(&[r as f32 + 1.0; 4]),
                    AllreduceOptions::default(),
                )
                .unwrap();
            let mut s = e
                .allreduce("s", Tensor::from_slice(&[r as f64 + 1.0; 2]), sum())
                .unwrap();
            // Integers truncate: (4 + 8 + 0) / 3 = 4 exactly, (5 + 9 + 0) / 3 = 4.67 -> 4.
            let mut i = e
                .allreduce(
                    "i",
                    Tensor::from_slice(&[4 + 4 * r as i32, 5 + 4 * r as i32]),
                    AllreduceOptions::default(),
                )
                .unwrap();
            let a = a.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
            let s = s.wait_timeout(LIMIT).unwrap().to_vec::<f64>().unwrap();
            let i = i.wait_timeout(LIMIT).unwrap().to_vec::<i32>().unwrap();
            e.join().unwrap().wait_timeout(LIMIT).unwrap();
            Some((a, s, i))
        });
        for (rank, v) in out.into_iter().take(2).enumerate() {
            let (a, s, i) = v.unwrap();
            assert_eq!(a, [1.0; 4], "{label}: rank {rank} average");
            assert_eq!(s, [3.0; 2], "{label}: rank {rank} sum");
            assert_eq!(i, [4, 4], "{label}: rank {rank} integer average");
        }
    }
}

/// What each non-allreduce collective reports on the ranks that submitted it while rank 1 has
/// joined (np 3), once uncached and once after the name was cached by a run with every rank
/// (a cached response must not wait for the joined rank's bit: that was a hang).
#[test]
fn other_collectives_fail_on_every_submitting_rank_while_a_rank_is_joined() {
    for (label, cfg) in configs() {
        let l = label.clone();
        let out = run_world(3, cfg, move |e, r| {
            let label = &l;
            // Cache every name with all three ranks first.
            let warm = [
                e.allgather("ag", Tensor::from_slice(&[r as f32; 2]))
                    .unwrap(),
                e.broadcast("bc", Tensor::from_slice(&[r as f32; 2]), 0)
                    .unwrap(),
                e.alltoall("a2a", Tensor::from_slice(&[r as f32; 3]), None)
                    .unwrap(),
                e.reduce_scatter("rs", Tensor::from_slice(&[1.0f32; 3]), ReduceOp::Sum)
                    .unwrap(),
                e.allreduce(
                    "mx",
                    Tensor::from_slice(&[-1.0f32; 2]),
                    AllreduceOptions::with_op(ReduceOp::Max),
                )
                .unwrap(),
            ];
            for mut h in warm {
                h.wait_timeout(LIMIT).unwrap();
            }
            if r == 1 {
                let last = e.join().unwrap().wait_timeout(LIMIT).unwrap();
                return (Vec::new(), last.to_vec::<i64>().unwrap());
            }
            let mut errs = Vec::new();
            for pass in ["cached", "uncached"] {
                let sfx = if pass == "cached" { "" } else { "-new" };
                let hs = vec![
                    e.allgather(&format!("ag{sfx}"), Tensor::from_slice(&[r as f32; 2]))
                        .unwrap(),
                    e.broadcast(&format!("bc{sfx}"), Tensor::from_slice(&[r as f32; 2]), 0)
                        .unwrap(),
                    e.alltoall(
                        &format!("a2a{sfx}"),
                        Tensor::from_slice(&[r as f32; 3]),
                        None,
                    )
                    .unwrap(),
                    e.reduce_scatter(
                        &format!("rs{sfx}"),
                        Tensor::from_slice(&[1.0f32; 3]),
                        ReduceOp::Sum,
                    )
                    .unwrap(),
                    e.allreduce(
                        &format!("mx{sfx}"),
                        Tensor::from_slice(&[-1.0f32; 2]),
                        AllreduceOptions::with_op(ReduceOp::Max),
                    )
                    .unwrap(),
                    e.barrier().unwrap(),
                ];
                for mut h in hs {
                    let err = h.wait_timeout(LIMIT).map(|_| ()).unwrap_err();
                    errs.push((pass, err.to_string()));
                }
                // An allreduce still runs with the joined rank's zeros: 1 + 1 + 0.
                let mut s = e
                    .allreduce(&format!("s{sfx}"), Tensor::from_slice(&[1.0f32; 2]), sum())
                    .unwrap();
                let s = s.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(
                    s, [2.0; 2],
                    "{label}: rank {r} sum after the refusals ({pass})"
                );
            }
            if r == 2 {
                // Alone (ranks 0 and 1 joined: this waits for rank 0's join), then last.
                let mut h = e
                    .allreduce("solo", Tensor::from_slice(&[5.0f32]), sum())
                    .unwrap();
                let v = h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(v, [5.0], "{label}: rank 2 alone");
            }
            let last = e.join().unwrap().wait_timeout(LIMIT).unwrap();
            (errs, last.to_vec::<i64>().unwrap())
        });
        for (rank, (errs, last)) in out.into_iter().enumerate() {
            assert_eq!(last, [2], "{label}: rank {rank} join's last rank");
            if rank == 1 {
                continue;
            }
            let kinds = [
                "allgather",
                "broadcast",
                "alltoall",
                "reducescatter",
                "max",
                "barrier",
            ];
            assert_eq!(
                errs.len(),
                2 * kinds.len(),
                "{label}: rank {rank}: {errs:?}"
            );
            for ((pass, e), kind) in errs.iter().zip(kinds.iter().cycle()) {
                assert!(
                    e.to_lowercase().contains(kind) && e.contains("joined") && e.contains("[1]"),
                    "{label}: rank {rank} {kind} ({pass}): {e}"
                );
            }
        }
    }
}

#[test]
fn max_allreduce_while_a_rank_is_joined_fails_instead_of_using_zeros() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            if r == 2 {
                e.join().unwrap().wait_timeout(LIMIT).unwrap();
                return None;
            }
            // Negative inputs: a zero from the joined rank would win a Max silently.
            let mut m = e
                .allreduce(
                    "m",
                    Tensor::from_slice(&[-(r as f32) - 1.0; 3]),
                    AllreduceOptions::with_op(ReduceOp::Max),
                )
                .unwrap();
            let mut s = e
                .allreduce("s", Tensor::from_slice(&[r as f64 + 1.0; 2]), sum())
                .unwrap();
            let m = m.wait_timeout(LIMIT).map(|_| ()).unwrap_err().to_string();
            let s = s.wait_timeout(LIMIT).unwrap().to_vec::<f64>().unwrap();
            e.join().unwrap().wait_timeout(LIMIT).unwrap();
            Some((m, s))
        });
        for v in out.into_iter().take(2) {
            let (m, s) = v.unwrap();
            assert!(
                m.contains("max") && m.contains("joined") && m.contains("[2]"),
                "{label}: {m}"
            );
            assert_eq!(s, [3.0; 2], "{label}");
        }
    }
}

#[test]
fn ranks_with_different_channel_counts_refuse_to_start() {
    let threads: Vec<_> = LocalWorld::with_timeout(2, Duration::from_secs(20))
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let k = 1 + t.rank();
                Engine::start(Box::new(t), Config::default().channels(k)).unwrap_err()
            })
        })
        .collect();
    for t in threads {
        let err = t.join().unwrap().to_string();
        assert!(
            err.contains("FH_CHANNELS") && err.contains("disagree"),
            "{err}"
        );
    }
}
