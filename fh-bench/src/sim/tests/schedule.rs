//! The schedules: `horovod`'s cycle, the inline rule, back-pressure, and the engine's own
//! planner (the model and the engine plan the same groups).

use super::*;
use fh_core::fusion::Group;

#[test]
fn horovod_waits_for_its_cycle_and_its_own_execution() {
    let mut l = link(1e-5, 1e9, None);
    let coll = 1.56e-3;
    // Loops tick at 0, 1 ms, 2 ms, ... while idle: the tensor ready at 0.5 ms is negotiated
    // at 1 ms (round: log2(4)·α = 20 µs, then the one-byte can-run agreement, 20 µs), then
    // reduced.
    let h = Schedule::horovod();
    let m = simulate_step(&[1_000_000], &[0.0005], 4, &l, &h, &NO_OVERHEAD);
    assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
    // At 1.0 ms exactly it goes at once.
    let m = simulate_step(&[1_000_000], &[0.001], 4, &l, &h, &NO_OVERHEAD);
    assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
    // Two tensors: the second becomes ready while the first executes; it waits for the
    // loop to finish (execution) and for the next cycle tick 1 ms after the first start.
    let m = simulate_step(
        &[1_000_000, 1_000_000],
        &[0.0, 0.0002],
        4,
        &l,
        &h,
        &NO_OVERHEAD,
    );
    let first_end = 4e-5 + coll; // 1.6 ms > 1 ms cycle: the next loop starts at once
    assert!(close(m.step_s, first_end + 4e-5 + coll), "{m:?}");
    assert_eq!(m.rounds, 2);
    // With fasthorovod K=1 without back-pressure, the second round overlaps the first
    // collective; with it (the preset), the round waits for the channel to drain.
    let two = |s: &Schedule| {
        simulate_step(
            &[1_000_000, 1_000_000],
            &[0.0, 0.0002],
            4,
            &l,
            s,
            &NO_OVERHEAD,
        )
    };
    let off = two(&Schedule::fasthorovod(1).without_back_pressure());
    assert!(close(off.step_s, 2e-5 + coll + coll), "{off:?}");
    let on = two(&Schedule::fasthorovod(1).with_back_pressure());
    assert!(close(on.step_s, 2e-5 + coll + 2e-5 + coll), "{on:?}");
    // As shipped (auto), back-pressure is on over a network link, off over one host's memory
    // below 64 ranks: the engine's own rule.
    assert_eq!(two(&Schedule::fasthorovod(1)), on);
    l.wire = fh_scheduler::Wire::Memory;
    let shipped = simulate_step(
        &[1_000_000, 1_000_000],
        &[0.0, 0.0002],
        4,
        &l,
        &Schedule::fasthorovod(1),
        &NO_OVERHEAD,
    );
    assert_eq!(shipped, off);
}

#[test]
fn a_group_run_on_the_negotiation_thread_holds_the_next_round() {
    // Two 1 KB tensors on 2 ranks, the second ready 1 µs after the first: the first round's
    // single small group runs inline (α + 1 KB; that every rank can run it rides in the
    // allreduce itself), and the second round starts only when it is done. Round = α each.
    let mut l = link(1e-5, 1e9, None);
    let s = Schedule::fasthorovod(2);
    let m = simulate_step(&[1000, 1000], &[0.0, 1e-6], 2, &l, &s, &NO_OVERHEAD);
    let one = 1e-5 + (1e-5 + 1e3 / 1e9);
    assert!(close(m.step_s, 2.0 * one), "{m:?}");
    assert_eq!((m.rounds, m.collectives), (2, 2));
    // Over channels that cannot carry the flag in the allreduce (shared memory,
    // hierarchical), the agreement is a one-byte allreduce of its own first (α).
    l.agrees_in_band = false;
    let m = simulate_step(&[1000, 1000], &[0.0, 1e-6], 2, &l, &s, &NO_OVERHEAD);
    assert!(close(m.step_s, 2.0 * (one + 1e-5)), "{m:?}");
}

#[test]
fn back_pressure_fuses_what_becomes_ready_meanwhile() {
    // K=1: the first tensor (5 MB) runs for ~5 ms; the 3 tensors ready meanwhile wait for
    // the busy channel and are negotiated in one round: 2 collectives in all, not 4.
    let l = link(1e-5, 1e9, None);
    let sizes = [5_000_000, 1000, 1000, 1000];
    let ready = [0.0, 1e-4, 2e-4, 3e-4];
    let bp = Schedule::fasthorovod(1).with_back_pressure();
    let m = simulate_step(&sizes, &ready, 2, &l, &bp, &NO_OVERHEAD);
    assert_eq!((m.rounds, m.collectives), (2, 2), "{m:?}");
    // Without back-pressure every small tensor gets its own round and collective.
    let off = Schedule::fasthorovod(1).without_back_pressure();
    let m = simulate_step(&sizes, &ready, 2, &l, &off, &NO_OVERHEAD);
    assert_eq!(m.collectives, 4, "{m:?}");
    // K=2: the second channel is idle, so nothing is deferred.
    let mut two = Schedule::fasthorovod(2).with_back_pressure();
    two.fusion_bytes = 1;
    let m = simulate_step(&sizes, &ready, 2, &l, &two, &NO_OVERHEAD);
    assert_eq!(m.rounds, 4, "{m:?}");
}

#[test]
fn fusion_and_partition_through_the_engines_planner() {
    let bytes = |g: Vec<Group>| g.iter().map(Group::bytes).collect::<Vec<_>>();
    let f = Schedule::fasthorovod(4);
    // 40 MiB splits into 4 chunks of 10 MiB (16 MiB partitions would give 3; a multiple
    // of K), each its own group; the small tensors around it (4 MiB) are sized for a share of
    // the 4 channels each (1 MiB: the chunks do not count), so the two after the chunks do
    // not fuse into one group for one channel.
    let mut p = ModelPlanner::new(&f);
    let g = p.round(&[1 << 20, 40 << 20, 1 << 20, 2 << 20], 0);
    assert_eq!(
        bytes(g.clone()),
        [
            1 << 20,
            10 << 20,
            10 << 20,
            10 << 20,
            10 << 20,
            1 << 20,
            2 << 20
        ]
    );
    // Small tensors alone still fuse up to the share of the channels: 8 × 1 MiB in 4 groups.
    let small = ModelPlanner::new(&f).round(&[1 << 20; 8], 0);
    assert_eq!(bytes(small), [2 << 20; 4]);
    // Every channel carries a chunk of the large tensor.
    let mut chans: Vec<usize> = g[1..5].iter().map(|g| g.channel).collect();
    chans.sort();
    assert_eq!(chans, [0, 1, 2, 3]);
    // 100 MiB: ceil(100/16) = 7 chunks, rounded up to 8.
    let g = ModelPlanner::new(&f).round(&[100 << 20], 0);
    assert_eq!(g.len(), 8);
    assert_eq!(g.iter().map(Group::bytes).sum::<u64>(), 100 << 20);
    let h = Schedule::horovod();
    assert_eq!(
        bytes(ModelPlanner::new(&h).round(&[40 << 20, 1 << 20], 0)),
        [41 << 20]
    );
    assert_eq!(
        bytes(ModelPlanner::new(&h).round(&[40 << 20; 4], 0)),
        [120 << 20, 40 << 20]
    );
}

/// The model and the engine form the same groups on the same channels for the same
/// arrival sequence: the engine's rounds (as it logged them) replayed through the model's
/// planner give the engine's groups, parts and channels, load carried across rounds.
#[test]
fn model_and_engine_plan_the_same_groups_and_channels() {
    use fh_scheduler::{AllreduceOptions, Engine, Tensor};
    use fh_transport::backend::local::LocalWorld;
    use std::collections::HashMap;
    use std::time::Duration;

    let mut sched = Schedule::fasthorovod(4);
    sched.fusion_bytes = 16 << 10;
    sched.partition_bytes = 4 << 10;
    // Batches of f32 gradients (element counts); each batch is submitted at once and
    // waited for before the next.
    let batches: Vec<Vec<usize>> = vec![
        vec![10, 3000, 7, 500, 500],
        vec![1],
        vec![2500, 2500, 9, 4000, 1, 1, 1],
        vec![64; 12],
        vec![5000, 3, 1000],
    ];
    let cfg = sched.config().record_groups(true);
    let threads: Vec<_> = LocalWorld::with_timeout(2, Duration::from_secs(30))
        .into_iter()
        .map(|t| {
            let (cfg, batches) = (cfg.clone(), batches.clone());
            std::thread::spawn(move || {
                let e = Engine::start(Box::new(t), cfg).unwrap();
                for (b, batch) in batches.iter().enumerate() {
                    let hs: Vec<_> = batch
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| {
                            e.allreduce(
                                &format!("b{b}.t{i}"),
                                Tensor::from_slice(&vec![1.0f32; n]),
                                AllreduceOptions::default(),
                            )
                            .unwrap()
                        })
                        .collect();
                    for mut h in hs {
                        h.wait_timeout(Duration::from_secs(30)).unwrap();
                    }
                }
                let log = e.group_log();
                e.shutdown().unwrap();
                log
            })
        })
        .collect();
    let logs: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(logs[0], logs[1]);
    let log = &logs[0];
    let size: HashMap<String, u64> = batches
        .iter()
        .enumerate()
        .flat_map(|(b, batch)| {
            batch
                .iter()
                .enumerate()
                .map(move |(i, &n)| (format!("b{b}.t{i}"), n as u64 * 4))
        })
        .collect();
    // The engine's rounds: tensors in planner-input order (first appearance), by round.
    // The engine's rounds: tensors in planner-input order (first appearance), by round, with
    // the channels that round agreed were idle.
    let mut rounds: Vec<(u64, u64, Vec<String>)> = Vec::new();
    for g in log {
        if rounds.last().map(|r| r.0) != Some(g.round) {
            rounds.push((g.round, g.idle_channels, Vec::new()));
        }
        let names = &mut rounds.last_mut().unwrap().2;
        for (name, _, _) in &g.parts {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    let mut model = ModelPlanner::new(&sched);
    let mut planned = Vec::new();
    for (round, idle, names) in &rounds {
        let sizes: Vec<u64> = names.iter().map(|n| size[n]).collect();
        for g in model.round(&sizes, *idle) {
            planned.push(fh_scheduler::GroupRecord {
                round: *round,
                idle_channels: *idle,
                channel: g.channel,
                parts: g
                    .parts
                    .iter()
                    .map(|p| (names[p.item].clone(), p.offset, p.len))
                    .collect(),
            });
        }
    }
    assert_eq!(&planned, log);
    // The sequence exercised chunking and several channels.
    assert!(log.iter().any(|g| g.parts[0].1 > 0));
    assert!(log.iter().any(|g| g.channel == 3));
}
