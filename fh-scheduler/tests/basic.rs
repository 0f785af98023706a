//! Basic multi-rank behaviour of every collective, for every preset.

mod common;

use common::{configs, run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, ReduceOp, Tensor};

#[test]
fn allreduce_sum_and_average() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let a = e
                .allreduce(
                    "a",
                    Tensor::from_slice(&[r as f32 + 1.0; 5]),
                    AllreduceOptions::with_op(ReduceOp::Sum),
                )
                .unwrap();
            let b = e
                .allreduce(
                    "b",
                    Tensor::from_slice(&[r as f64 * 3.0; 2]),
                    AllreduceOptions::default(),
                )
                .unwrap();
            (
                a.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap(),
                b.wait_timeout(LIMIT).unwrap().to_vec::<f64>().unwrap(),
            )
        });
        for (a, b) in out {
            assert_eq!(a, [6.0; 5], "{label}");
            assert_eq!(b, [3.0; 2], "{label}");
        }
    }
}

#[test]
fn other_collectives() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let g = e
                .allgather(
                    "g",
                    Tensor::from_vec(vec![r + 1, 2], vec![r as i32; 2 * (r + 1)]).unwrap(),
                )
                .unwrap();
            let b = e
                .broadcast("b", Tensor::from_slice(&[r as i64; 4]), 2)
                .unwrap();
            let rs = e
                .reducescatter(
                    "rs",
                    Tensor::from_vec(vec![4, 1], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap(),
                    ReduceOp::Sum,
                )
                .unwrap();
            let send: Vec<i32> = (0..3).map(|d| (10 * r + d) as i32).collect();
            let a = e.alltoall("a", Tensor::from_slice(&send), None).unwrap();
            let bar = e.barrier().unwrap();
            bar.wait_timeout(LIMIT).unwrap();
            let g = g.wait_timeout(LIMIT).unwrap();
            let rs = rs.wait_timeout(LIMIT).unwrap();
            (
                g.shape().to_vec(),
                g.to_vec::<i32>().unwrap(),
                b.wait_timeout(LIMIT).unwrap().to_vec::<i64>().unwrap(),
                rs.shape().to_vec(),
                rs.to_vec::<f32>().unwrap(),
                a.wait_timeout(LIMIT).unwrap().to_vec::<i32>().unwrap(),
            )
        });
        for (r, (gs, g, b, rss, rs, a)) in out.into_iter().enumerate() {
            assert_eq!(gs, [6, 2], "{label}");
            assert_eq!(g, [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2], "{label}");
            assert_eq!(b, [2; 4], "{label}");
            // 4 rows over 3 ranks: 2, 1, 1.
            let (lo, n) = [(0, 2), (2, 1), (3, 1)][r];
            assert_eq!(rss, [n, 1], "{label}");
            let want: Vec<f32> = (lo..lo + n).map(|i| 3.0 * (i + 1) as f32).collect();
            assert_eq!(rs, want, "{label}");
            let want: Vec<i32> = (0..3).map(|s| (10 * s + r) as i32).collect();
            assert_eq!(a, want, "{label}");
        }
    }
}

#[test]
fn completion_callbacks_and_grouped_allreduce() {
    let out = run_world(2, fh_scheduler::Config::default().channels(2), |e, r| {
        let (tx, rx) = std::sync::mpsc::channel();
        e.allreduce(
            "cb",
            Tensor::from_slice(&[r as i64 + 1]),
            AllreduceOptions::with_op(ReduceOp::Sum),
        )
        .unwrap()
        .on_complete(move |res| {
            let _ = tx.send(res.map(|t| t.to_vec::<i64>().unwrap()));
        });
        let g = e
            .grouped_allreduce(
                "grp",
                vec![
                    Tensor::from_slice(&[1.0f32; 3]),
                    Tensor::from_slice(&[2.0f32; 1000]),
                ],
                AllreduceOptions::with_op(ReduceOp::Sum).postscale(0.5),
            )
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        let cb = rx.recv_timeout(LIMIT).unwrap().unwrap();
        (
            cb,
            g[0].to_vec::<f32>().unwrap(),
            g[1].to_vec::<f32>().unwrap(),
        )
    });
    for (cb, a, b) in out {
        assert_eq!(cb, [3]);
        assert_eq!(a, [1.0; 3]);
        assert_eq!(b, [2.0; 1000]);
    }
}

#[test]
fn timeline_is_valid_json_with_channel_lanes() {
    let path = std::env::temp_dir().join(format!("fh-timeline-test-{}.json", std::process::id()));
    let cfg = fh_scheduler::Config::default()
        .channels(2)
        .fusion_threshold(64)
        .timeline(&path);
    run_world(2, cfg, |e, r| {
        let hs: Vec<_> = (0..6)
            .map(|i| {
                e.allreduce(
                    &format!("t{i}"),
                    Tensor::from_slice(&[r as f32; 64]),
                    AllreduceOptions::default(),
                )
                .unwrap()
            })
            .collect();
        for h in hs {
            h.wait_timeout(LIMIT).unwrap();
        }
    });
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let events = v.as_array().unwrap();
    let lanes: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert!(lanes.contains(&0), "negotiation lane: {lanes:?}");
    assert!(lanes.iter().any(|&l| l >= 1), "channel lanes: {lanes:?}");
    assert!(events.iter().any(|e| e["args"]["name"] == "channel 1"));
    let queued = events.iter().filter(|e| e["name"] == "queued").count();
    assert_eq!(queued, 2 * 6, "a begin and an end per tensor on rank 0");
}
