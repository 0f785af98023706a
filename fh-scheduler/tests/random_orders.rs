//! Multi-rank property tests: random per-rank submission orders and delays, every preset and
//! channel count. Every handle must complete with the reference result, every rank must form
//! the same groups, and nothing may deadlock (every wait is bounded).

mod common;

use std::time::Duration;

use common::cases::{as_f64, first_difference, make, reference, Lcg, Spec, DTYPES, OPS};
use common::{configs, run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, DType, ReduceOp, Tensor};
use proptest::prelude::*;

fn arb_spec() -> impl Strategy<Value = Spec> {
    (0usize..400, 0usize..3, 0usize..4).prop_map(|(len, d, o)| Spec {
        len,
        dtype: DTYPES[d],
        op: OPS[o],
    })
}

fn run_case(
    n: usize,
    cfg_idx: usize,
    specs: Vec<Spec>,
    seed: u64,
    steps: usize,
    max_delay_us: u64,
) -> fh_scheduler::EngineStats {
    let (label, cfg) = configs().swap_remove(cfg_idx);
    let cfg = cfg.record_groups(true);
    let specs2 = specs.clone();
    let out = run_world(n, cfg, move |e, rank| {
        let mut rng = Lcg::for_rank(seed, rank);
        let mut results = Vec::new();
        for step in 0..steps {
            // Every allreduce, plus a broadcast and an allgather, in a random order.
            let nt = specs2.len();
            let order = rng.permutation(nt + 2);
            let mut handles = Vec::new();
            let mut others = Vec::new();
            let n = e.size();
            for &t in &order {
                if max_delay_us > 0 {
                    std::thread::sleep(Duration::from_micros(rng.next() % max_delay_us));
                }
                if t == nt {
                    let root = step % n;
                    let h = e
                        .broadcast("bc", Tensor::from_slice(&[rank as f64; 3]), root)
                        .unwrap();
                    others.push((h, Tensor::from_slice(&[root as f64; 3])));
                    continue;
                }
                if t == nt + 1 {
                    let rows = (rank + step) % 3;
                    let mine =
                        Tensor::from_vec(vec![rows, 2], vec![rank as i32; rows * 2]).unwrap();
                    let want: Vec<i32> = (0..n)
                        .flat_map(|r| vec![r as i32; ((r + step) % 3) * 2])
                        .collect();
                    let total: usize = (0..n).map(|r| (r + step) % 3).sum();
                    let h = e.allgather("ag", mine).unwrap();
                    others.push((h, Tensor::from_vec(vec![total, 2], want).unwrap()));
                    continue;
                }
                let h = e
                    .allreduce(
                        &format!("t{t}"),
                        make(specs2[t], rank, step, t),
                        AllreduceOptions::with_op(specs2[t].op),
                    )
                    .unwrap();
                handles.push((t, h));
            }
            let mut got = vec![Vec::new(); specs2.len()];
            for (t, mut h) in handles {
                got[t] = as_f64(&h.wait_timeout(LIMIT).expect("completes"));
            }
            for (mut h, want) in others {
                let name = h.name().to_string();
                let out = h.wait_timeout(LIMIT).expect("completes");
                assert_eq!(out, want, "{name} on rank {rank}, step {step}");
            }
            results.push(got);
        }
        (results, e.group_log(), e.stats())
    });
    for (rank, (results, _, _)) in out.iter().enumerate() {
        for (step, got) in results.iter().enumerate() {
            for (t, v) in got.iter().enumerate() {
                let want = reference(specs[t], n, step, t);
                if let Some(i) = first_difference(v, &want) {
                    panic!(
                        "{label}: rank {rank} step {step} tensor t{t} {:?}: element {i} is {:?}, expected {:?} (lengths {} / {})",
                        specs[t], v.get(i), want.get(i), v.len(), want.len()
                    );
                }
            }
        }
    }
    let log0 = &out[0].1;
    for (rank, (_, log, _)) in out.iter().enumerate() {
        assert_eq!(
            log, log0,
            "{label}: rank {rank} formed other groups than rank 0"
        );
    }
    // Every tensor of every step went through exactly the bytes it has: in a group, or riding
    // in its negotiation round (as many bytes on every rank).
    let rode = out[0].2.eager_bytes;
    for (rank, (_, _, stats)) in out.iter().enumerate() {
        assert_eq!(stats.eager_bytes, rode, "{label}: rank {rank}");
        if label == "horovod" {
            assert_eq!(
                stats.eager_tensors, 0,
                "{label}: Horovod's schedule never rides"
            );
        }
    }
    let total: u64 = rode
        + log0
            .iter()
            .flat_map(|g| g.parts.iter())
            .filter(|p| p.0.starts_with('t'))
            .map(|p| p.2)
            .sum::<u64>();
    let want: u64 = specs
        .iter()
        .map(|s| (s.len * s.dtype.size()) as u64)
        .sum::<u64>()
        * steps as u64;
    assert_eq!(total, want, "{label}");
    out[0].2.clone()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_orders_and_delays(
        n in 2usize..5,
        cfg_idx in 0usize..7,
        specs in proptest::collection::vec(arb_spec(), 1..10),
        seed in any::<u64>(),
    ) {
        run_case(n, cfg_idx, specs, seed, 2, 300);
    }
}

#[test]
fn every_preset_and_channel_count_with_repeated_steps() {
    let specs: Vec<Spec> = (0..12)
        .map(|i| Spec {
            len: [1, 0, 700, 33, 256, 5000][i % 6],
            dtype: [DType::F32, DType::F64, DType::I32][i % 3],
            op: [ReduceOp::Sum, ReduceOp::Average][i % 2],
        })
        .collect();
    for cfg_idx in 0..7 {
        let stats = run_case(4, cfg_idx, specs.clone(), 42 + cfg_idx as u64, 3, 0);
        // Cached small allreduces (1, 33 and 256 elements) ride from the second step on.
        if cfg_idx > 0 {
            assert!(stats.eager_tensors > 0, "config {cfg_idx}: {stats:?}");
        }
    }
}

#[test]
fn steady_state_uses_the_bit_vector_only() {
    let (_, cfg) = configs().swap_remove(3);
    let out = run_world(3, cfg, |e, r| {
        let step = |s: usize| {
            let hs: Vec<_> = (0..20)
                .map(|t| {
                    e.allreduce(
                        &format!("g{t}"),
                        Tensor::from_slice(&[(r + s) as f32; 8]),
                        AllreduceOptions::with_op(ReduceOp::Sum),
                    )
                    .unwrap()
                })
                .collect();
            for mut h in hs {
                h.wait_timeout(LIMIT).unwrap();
            }
        };
        step(0);
        let after_first = e.stats();
        for s in 1..5 {
            step(s);
        }
        (after_first, e.stats())
    });
    for (first, last) in out {
        assert!(first.coordinator_rounds >= 1);
        assert_eq!(
            last.coordinator_rounds, first.coordinator_rounds,
            "cached names must not go back to the coordinator"
        );
        assert!(last.cache_hits >= 80, "{last:?}");
    }
}

/// Random group membership under the same names: every step submits a group "grp" with a
/// random member count (the same on every rank), with random per-rank delays, and sometimes a
/// plain allreduce of a name that was a member before. Every result must be right on every
/// rank within bounded time (a cached member must never stand for another group).
fn run_groups(n: usize, cfg_idx: usize, members: Vec<usize>, seed: u64) {
    let (label, cfg) = configs().swap_remove(cfg_idx);
    let members2 = members.clone();
    let out = run_world(n, cfg, move |e, rank| {
        let mut shared = Lcg::for_rank(seed, usize::MAX - 1); // the same on every rank
        let mut mine = Lcg::for_rank(seed, rank);
        let mut got = Vec::new();
        for (step, &m) in members2.iter().enumerate() {
            std::thread::sleep(Duration::from_micros(mine.next() % 200));
            let ts = (0..m)
                .map(|i| Tensor::from_slice(&[(rank + i + step) as f32; 3]))
                .collect();
            let mut g = e
                .grouped_allreduce("grp", ts, AllreduceOptions::with_op(ReduceOp::Sum))
                .unwrap();
            // A name past this group's members, possibly a former member.
            let lone = (shared.next() % 2 == 0).then(|| {
                e.allreduce(
                    &format!("grp[{m}]"),
                    Tensor::from_slice(&[(rank + step) as f32; 2]),
                    AllreduceOptions::with_op(ReduceOp::Sum),
                )
                .unwrap()
            });
            let vals: Vec<f32> = g
                .wait_timeout(LIMIT)
                .expect("group completes")
                .iter()
                .map(|t| t.to_vec::<f32>().unwrap()[0])
                .collect();
            let lone = lone.map(|mut h| {
                h.wait_timeout(LIMIT)
                    .expect("lone completes")
                    .to_vec::<f32>()
                    .unwrap()[0]
            });
            got.push((vals, lone));
        }
        got
    });
    let tri = (n * (n - 1) / 2) as f32;
    for (rank, got) in out.iter().enumerate() {
        for (step, (vals, lone)) in got.iter().enumerate() {
            let want: Vec<f32> = (0..members[step])
                .map(|i| (n * (i + step)) as f32 + tri)
                .collect();
            assert_eq!(vals, &want, "{label}: rank {rank} step {step}");
            if let Some(v) = lone {
                assert_eq!(
                    *v,
                    (n * step) as f32 + tri,
                    "{label}: rank {rank} step {step}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_group_membership_under_the_same_names(
        n in 2usize..4,
        cfg_idx in 0usize..7,
        members in proptest::collection::vec(1usize..5, 1..7),
        seed in any::<u64>(),
    ) {
        run_groups(n, cfg_idx, members, seed);
    }
}
