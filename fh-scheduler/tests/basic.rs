//! Basic multi-rank behaviour of every collective, for every preset.

mod common;

use common::{configs, run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, ReduceOp, Tensor};

#[test]
fn allreduce_sum_and_average() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let mut a = e
                .allreduce(
                    "a",
                    Tensor::from_slice(&[r as f32 + 1.0; 5]),
                    AllreduceOptions::with_op(ReduceOp::Sum),
                )
                .unwrap();
            let mut b = e
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
            let mut g = e
                .allgather(
                    "g",
                    Tensor::from_vec(vec![r + 1, 2], vec![r as i32; 2 * (r + 1)]).unwrap(),
                )
                .unwrap();
            let mut b = e
                .broadcast("b", Tensor::from_slice(&[r as i64; 4]), 2)
                .unwrap();
            let mut rs = e
                .reduce_scatter(
                    "rs",
                    Tensor::from_vec(vec![4, 1], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap(),
                    ReduceOp::Sum,
                )
                .unwrap();
            let send: Vec<i32> = (0..3).map(|d| (10 * r + d) as i32).collect();
            let mut a = e.alltoall("a", Tensor::from_slice(&send), None).unwrap();
            let mut bar = e.barrier().unwrap();
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
        for mut h in hs {
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

#[test]
fn grouped_members_are_reduced_in_one_collective_and_fail_together() {
    let cfg = fh_scheduler::Config::default()
        .channels(4)
        .record_groups(true);
    let out = run_world(3, cfg, |e, r| {
        // Submit an unrelated tensor between rounds so members are likely ready in different
        // rounds on different ranks.
        let mut lone = e
            .allreduce(
                "lone",
                Tensor::from_slice(&[1.0f32; 50_000]),
                AllreduceOptions::with_op(ReduceOp::Sum),
            )
            .unwrap();
        let g = e
            .grouped_allreduce(
                "g",
                vec![
                    Tensor::from_slice(&[r as f32; 30_000]),
                    Tensor::from_slice(&[1.0f32; 20_000]),
                    Tensor::from_slice(&[2.0f32; 10]),
                ],
                AllreduceOptions::with_op(ReduceOp::Sum),
            )
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        lone.wait_timeout(LIMIT).unwrap();
        // A group whose second member disagrees in shape fails as a whole, on every rank.
        let len = if r == 1 { 4 } else { 3 };
        let bad = e
            .grouped_allreduce(
                "bad",
                vec![
                    Tensor::from_slice(&[1.0f32; 2]),
                    Tensor::from_slice(&vec![1.0f32; len]),
                    Tensor::from_slice(&[1.0f32]),
                ],
                AllreduceOptions::with_op(ReduceOp::Sum),
            )
            .unwrap()
            .into_handles()
            .into_iter()
            .map(|mut h| h.wait_timeout(LIMIT).unwrap_err().to_string())
            .collect::<Vec<_>>();
        (
            g.iter()
                .map(|t| t.to_vec::<f32>().unwrap()[0])
                .collect::<Vec<_>>(),
            e.group_log(),
            bad,
        )
    });
    for (vals, log, bad) in &out {
        assert_eq!(vals, &[3.0, 3.0, 6.0]);
        let with_members: Vec<_> = log
            .iter()
            .filter(|g| g.parts.iter().any(|p| p.0.starts_with("g[")))
            .collect();
        assert_eq!(with_members.len(), 1, "{log:?}");
        let names: Vec<&str> = with_members[0].parts.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(names, ["g[0]", "g[1]", "g[2]"]);
        assert_eq!(log, &out[0].1);
        assert!(
            bad[1].contains("Mismatched allreduce tensor shapes"),
            "{bad:?}"
        );
        assert!(
            bad[0].contains("another member of group 'bad' failed"),
            "{bad:?}"
        );
        assert!(
            bad[2].contains("another member of group 'bad' failed"),
            "{bad:?}"
        );
    }
}

#[test]
fn forward_priority_orders_the_groups_of_a_round() {
    use fh_scheduler::Priority;
    let cfg = fh_scheduler::Config::default()
        .channels(1)
        .fusion_threshold(8)
        .priority(Priority::Forward)
        .batching_window(std::time::Duration::from_millis(50))
        .record_groups(true);
    let out = run_world(2, cfg, |e, _| {
        // Submitted in backward order (last layer first), as a backward pass would.
        let hs: Vec<_> = (0..5)
            .rev()
            .map(|layer| {
                e.allreduce(
                    &format!("layer{layer}"),
                    Tensor::from_slice(&[1.0f32, 2.0]),
                    AllreduceOptions::default().priority(layer),
                )
                .unwrap()
            })
            .collect();
        for mut h in hs {
            h.wait_timeout(LIMIT).unwrap();
        }
        e.group_log()
    });
    for log in &out {
        let names: Vec<&str> = log.iter().map(|g| g.parts[0].0.as_str()).collect();
        assert_eq!(
            names,
            ["layer0", "layer1", "layer2", "layer3", "layer4"],
            "{log:?}"
        );
    }
}

#[test]
fn an_idle_engine_does_not_poll_but_the_horovod_preset_does() {
    use fh_scheduler::{Config, Preset};
    for (preset, busy) in [(Preset::FastHorovod, false), (Preset::Horovod, true)] {
        let out = run_world(2, Config::preset(preset), |e, _| {
            e.allreduce(
                "warm",
                Tensor::from_slice(&[1.0f32]),
                AllreduceOptions::default(),
            )
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
            let before = e.stats().rounds;
            std::thread::sleep(std::time::Duration::from_millis(300));
            e.stats().rounds - before
        });
        for rounds in out {
            if busy {
                assert!(rounds >= 10, "{preset:?}: {rounds} rounds while idle");
            } else {
                assert!(rounds <= 1, "{preset:?}: {rounds} rounds while idle");
            }
        }
    }
}

/// Under `FH_CHANNELS=auto` (the default) the engine opens the channels its cores allow for the
/// ranks of its host, runs on exactly those, and reports the count in effect (which a process
/// set then opens too); the work is correct whatever the count.
#[test]
fn the_default_channel_count_is_fitted_to_the_cores_and_reported() {
    use fh_scheduler::{Config, ProcessSets};
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = run_world(4, Config::default(), |e, r| {
        let cfg = e.config().clone();
        let mut h = e
            .allreduce(
                "fit",
                Tensor::from_slice(&[r as f32; 6]),
                AllreduceOptions::with_op(ReduceOp::Sum),
            )
            .unwrap();
        let sum = h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
        let sets = ProcessSets::default();
        let id = sets.add(e, &[0, 1], &cfg).unwrap();
        let in_set = sets.engine(id).ok().map(|s| s.stats().channels.len());
        sets.remove(e, id).unwrap();
        (
            cfg.channels,
            cfg.channels_auto,
            e.stats().channels.len(),
            e.local_size(),
            sum,
            in_set,
        )
    });
    for (r, (k, auto, open, local, sum, in_set)) in out.into_iter().enumerate() {
        let want = Config::default().channels_for(cores, local);
        assert_eq!((k, auto, open), (want, false, want), "rank {r}");
        assert_eq!(sum, vec![6.0; 6], "rank {r}");
        assert_eq!(in_set, (r < 2).then_some(want), "rank {r}");
    }
}
