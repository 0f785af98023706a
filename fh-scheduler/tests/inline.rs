//! Small single-group rounds run on the negotiation thread (`Config::inline_bytes`): the same
//! results and the same groups on the same channels as when every group goes through the
//! channel threads. (Ranks that differ in where a group runs: `control`'s unit tests.)

mod common;

use common::{run_world_each, LIMIT};
use fh_scheduler::{AllreduceOptions, Config, Engine, GroupRecord, Preset, ReduceOp, Tensor};

const RANKS: usize = 3;
const STEPS: usize = 12;
/// The inline limit when on: the 2 KiB tensor below stays on the channel threads.
const LIMIT_BYTES: u64 = 1024;

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

fn f32s(t: Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

/// What a rank saw: every result in order, the group log after the lockstep phase, the full
/// group log, and how many groups the negotiation thread ran.
type Seen = (Vec<Vec<f32>>, Vec<GroupRecord>, Vec<GroupRecord>, u64);

/// A mixed workload. Lockstep phase: every operation waits for the previous one, so every
/// round holds exactly one operation and the group log is the same in every run. Concurrent
/// phase: several submissions at once (rounds with several groups, or one).
fn workload(e: &Engine, r: usize) -> Seen {
    let mut out = Vec::new();
    let rf = r as f32;
    for i in 0..STEPS {
        let fi = i as f32;
        // 64 bytes: inline when on.
        let t = e
            .allreduce("small", Tensor::from_slice(&[rf + fi; 16]), sum())
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        out.push(f32s(t));
        // 2 KiB: above the limit, always through a channel thread.
        let t = e
            .allreduce("big", Tensor::from_slice(&[rf * fi; 512]), sum())
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        out.push(f32s(t));
        // A grouped submission: one fused group of three members.
        let members = vec![
            Tensor::from_slice(&[rf; 4]),
            Tensor::from_slice(&[2.0 * rf; 4]),
            Tensor::from_slice(&[3.0 * rf + fi; 4]),
        ];
        for t in e
            .grouped_allreduce("g", members, sum())
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap()
        {
            out.push(f32s(t));
        }
        let t = e
            .broadcast("b", Tensor::from_slice(&[rf + 10.0 * fi; 4]), i % RANKS)
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        out.push(f32s(t));
        let t = e
            .allgather("ag", Tensor::from_slice(&vec![rf + fi; r + 1]))
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        out.push(f32s(t));
    }
    let lockstep_log = e.group_log();
    for i in 0..STEPS {
        let handles: Vec<_> = (0..6)
            .map(|k| {
                e.allreduce(
                    &format!("c{k}"),
                    Tensor::from_slice(&[rf + (i * k) as f32; 8]),
                    sum(),
                )
                .unwrap()
            })
            .collect();
        for mut h in handles {
            out.push(f32s(h.wait_timeout(LIMIT).unwrap()));
        }
    }
    (out, lockstep_log, e.group_log(), e.stats().inline_groups)
}

/// The results every rank must see.
fn expected() -> Vec<Vec<f32>> {
    let n = RANKS as f32;
    let ranks_sum = (0..RANKS).map(|r| r as f32).sum::<f32>();
    let mut out = Vec::new();
    for i in 0..STEPS {
        let fi = i as f32;
        out.push(vec![ranks_sum + n * fi; 16]);
        out.push(vec![ranks_sum * fi; 512]);
        out.push(vec![ranks_sum; 4]);
        out.push(vec![2.0 * ranks_sum; 4]);
        out.push(vec![3.0 * ranks_sum + n * fi; 4]);
        let root = (i % RANKS) as f32;
        out.push(vec![root + 10.0 * fi; 4]);
        out.push(
            (0..RANKS)
                .flat_map(|r| std::iter::repeat_n(r as f32 + fi, r + 1))
                .collect(),
        );
    }
    for i in 0..STEPS {
        for k in 0..6 {
            out.push(vec![ranks_sum + n * (i * k) as f32; 8]);
        }
    }
    out
}

/// Channel and parts of every group (the round numbers count this rank's empty rounds too,
/// which depend on timing).
/// A group's channel and parts (name, offset, length).
type Placed<'a> = (usize, &'a [(String, u64, u64)]);

fn shape(log: &[GroupRecord]) -> Vec<Placed<'_>> {
    log.iter()
        .map(|g| (g.channel, g.parts.as_slice()))
        .collect()
}

#[test]
fn small_rounds_run_inline_with_the_same_results_and_groups_as_the_channels() {
    let base = Config::preset(Preset::FastHorovod)
        .channels(2)
        .record_groups(true);
    // Small rounds through the channel threads, or on the negotiation thread.
    let variants: [(&str, [bool; RANKS]); 2] =
        [("channels only", [false; RANKS]), ("inline", [true; RANKS])];
    let want = expected();
    let mut reference: Option<Vec<GroupRecord>> = None;
    for (label, on) in variants {
        let cfg = base.clone();
        let out = run_world_each(
            RANKS,
            move |r| {
                cfg.clone()
                    .inline_bytes(if on[r] { LIMIT_BYTES } else { 0 })
            },
            workload,
        );
        for (r, (results, lockstep, full, inline)) in out.iter().enumerate() {
            assert_eq!(results, &want, "{label}: rank {r}'s results");
            assert_eq!(
                full, &out[0].2,
                "{label}: rank {r} formed other groups than rank 0"
            );
            let reference = reference.get_or_insert_with(|| lockstep.clone());
            assert_eq!(
                shape(lockstep),
                shape(reference),
                "{label}: rank {r}'s lockstep groups differ from the channel-only run"
            );
            if on[r] {
                assert!(*inline > 0, "{label}: rank {r} never ran a group inline");
            } else {
                assert_eq!(*inline, 0, "{label}: rank {r} ran groups inline while off");
            }
        }
        // The 2 KiB tensor never ran inline: it is in the log all the same, once per step.
        let big = out[0]
            .1
            .iter()
            .filter(|g| g.parts.iter().any(|p| p.0 == "big"))
            .count();
        assert_eq!(big, STEPS, "{label}");
    }
}

/// A small single-group round whose group holds only empty tensors still takes part in the
/// agreement it carries (over the in-process transport the allreduce carries it): every
/// member completes, empty, on every rank, also the next time round (found by the
/// random-order test once rounds got smaller).
#[test]
fn a_group_of_empty_tensors_agrees_and_completes() {
    let out = common::run_world(3, Config::default(), |e, _| {
        (0..3)
            .map(|step| {
                let empty = || Tensor::from_vec::<f32>(vec![0], Vec::new()).unwrap();
                e.grouped_allreduce(&format!("empty{step}"), vec![empty(), empty()], sum())
                    .unwrap()
                    .wait_timeout(LIMIT)
                    .map(|ts| ts.iter().map(|t| t.shape().to_vec()).collect::<Vec<_>>())
                    .map_err(|e| e.to_string())
            })
            .collect::<Vec<_>>()
    });
    for (rank, steps) in out.iter().enumerate() {
        for (step, got) in steps.iter().enumerate() {
            assert_eq!(got, &Ok(vec![vec![0], vec![0]]), "rank {rank}, step {step}");
        }
    }
}
