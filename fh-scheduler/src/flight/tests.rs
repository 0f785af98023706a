use std::sync::Arc;
use std::time::{Duration, Instant};

use fh_core::message::{CollectiveKind, Device, Request, Signature};
use fh_core::{DType, ReduceOp};

use super::*;

fn req(name: &str, shape: &[u64]) -> Request {
    Request {
        name: Arc::from(name),
        rank: 0,
        sig: Signature {
            kind: CollectiveKind::Allreduce,
            dtype: DType::F32,
            shape: shape.to_vec(),
            device: Device::Cpu,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
        },
        priority: 0,
        group: None,
    }
}

#[test]
fn keeps_the_last_operations_with_their_steps() {
    let rec = Recorder::new(4);
    let t = Instant::now();
    let mut seqs = Vec::new();
    for i in 0..6u64 {
        seqs.push(rec.submitted(&req(&format!("t{i}"), &[i + 1, 2]), t));
    }
    assert_eq!(seqs, [1, 2, 3, 4, 5, 6]);
    // The two oldest fell out of the ring: updates to them change nothing.
    rec.negotiated(1, 7, t);
    rec.finished(2, t, None);
    rec.negotiated(5, 9, t + Duration::from_millis(1));
    rec.started([5, 6].into_iter(), 3, t + Duration::from_millis(2));
    rec.finished(5, t + Duration::from_millis(3), None);
    let err = SchedulerError::Transport {
        lost_rank: Some(1),
        message: "peer closed".into(),
        source: None,
    };
    rec.finished(6, t + Duration::from_millis(4), Some(&err));
    rec.waiting_on(4, &[2, 3]);
    let (total, ops) = rec.records(|r| r + 10);
    assert_eq!(total, 6);
    let names: Vec<&str> = ops.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["t2", "t3", "t4", "t5"]);
    let by_seq = |s: u64| ops.iter().find(|o| o.seq == s).unwrap();
    let five = by_seq(5);
    assert_eq!(
        (five.outcome.as_str(), five.round, five.channel),
        ("ok", Some(9), Some(3))
    );
    assert_eq!(five.shape, [5, 2]);
    assert_eq!(
        (five.kind.as_str(), five.dtype.as_str(), five.bytes),
        ("allreduce", "f32", 40)
    );
    assert_eq!(five.done_us.unwrap() - five.submitted_us, 3000);
    assert_eq!(by_seq(4).waiting_on, [12, 13]);
    assert_eq!(by_seq(4).outcome, "pending");
    let six = by_seq(6);
    assert_eq!(six.outcome, "error");
    assert_eq!(six.lost_rank, Some(11));
    assert_eq!(six.channel, Some(3));
    assert!(six.error.as_deref().unwrap().contains("peer closed"));
}

#[test]
fn long_shapes_are_cut_and_an_off_recorder_records_nothing() {
    let rec = Recorder::new(2);
    let s = rec.submitted(&req("deep", &[1, 2, 3, 4, 5, 6, 7, 8]), Instant::now());
    let (_, ops) = rec.records(|r| r);
    assert_eq!(ops[0].seq, s);
    assert_eq!(ops[0].shape.len(), MAX_DIMS);
    assert_eq!(ops[0].ndim, 8);
    let off = Recorder::new(0);
    assert!(!off.enabled());
    assert_eq!(off.submitted(&req("x", &[1]), Instant::now()), 0);
    assert!(off.records(|r| r).1.is_empty());
}

#[test]
fn a_process_sets_records_go_to_its_own_directory_and_are_read_with_the_worlds() {
    let base = std::env::temp_dir().join(format!("fh-flight-sets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let record = |rank: usize, members: Option<Vec<usize>>| dump::Dump {
        format: dump::FORMAT.into(),
        rank,
        size: members.as_ref().map_or(4, Vec::len),
        reason: "stall".into(),
        written_unix_us: 1,
        capacity: 4,
        recorded: 0,
        stall: None,
        stopped: None,
        ops: Vec::new(),
        members,
    };
    for r in 0..4 {
        dump::write(&base, false, &record(r, None)).unwrap();
    }
    let set = vec![1, 3];
    let path = dump::write(&base, false, &record(3, Some(set.clone()))).unwrap();
    assert_eq!(path, base.join("set-1.3").join("rank-3.json"));
    dump::write(&base, false, &record(1, Some(set.clone()))).unwrap();
    let all = dump::read_all(&base).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].set, None);
    assert_eq!(all[0].dumps.len(), 4);
    assert_eq!(all[1].set.as_deref(), Some(&set[..]));
    assert_eq!(
        all[1].dumps.iter().map(|d| d.rank).collect::<Vec<_>>(),
        [1, 3]
    );
    let text = explain::explain_all(&all);
    assert!(text.contains("the world's engine ("), "{text}");
    assert!(
        text.contains("the process set of ranks 1 and 3 ("),
        "{text}"
    );
    // Only a set's records: read, and the report has no heading.
    std::fs::remove_dir_all(&base).unwrap();
    dump::write(&base, false, &record(1, Some(set.clone()))).unwrap();
    let all = dump::read_all(&base).unwrap();
    assert_eq!(all.len(), 1);
    assert!(explain::explain_all(&all).starts_with("flight records of rank 1 (of the process set"));
    std::fs::remove_dir_all(&base).unwrap();
    assert!(dump::read_all(&base).is_err());
}

#[test]
fn a_large_sets_directory_name_is_short_and_the_same_for_the_same_members() {
    let a: Vec<usize> = (0..1000).collect();
    let mut b = a.clone();
    b[500] = 1000;
    let na = dump::set_dir_name(&a);
    assert!(na.len() < 64 && na.starts_with("set-n1000-0-999-"), "{na}");
    assert_eq!(na, dump::set_dir_name(&a.clone()));
    assert_ne!(na, dump::set_dir_name(&b));
    assert_eq!(dump::set_dir_name(&[0, 2]), "set-0.2");
}
