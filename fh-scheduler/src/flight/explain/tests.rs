use super::{explain, Dump, Finding, OpRecord};

fn op(seq: u64, name: &str, shape: &[u64], outcome: &str, round: Option<u64>) -> OpRecord {
    OpRecord {
        seq,
        name: name.into(),
        kind: "allreduce".into(),
        dtype: "f32".into(),
        shape: shape.to_vec(),
        ndim: shape.len(),
        bytes: 4 * shape.iter().product::<u64>(),
        submitted_us: 1_000_000 + seq as i64 * 1000,
        negotiated_us: round.map(|_| 1_000_500 + seq as i64 * 1000),
        round,
        started_us: None,
        done_us: (outcome != "pending").then_some(1_000_900 + seq as i64 * 1000),
        channel: None,
        waiting_on: Vec::new(),
        outcome: outcome.into(),
        error: (outcome == "error").then(|| "Mismatched allreduce tensor shapes".into()),
        lost_rank: None,
    }
}

fn dump(rank: usize, size: usize, ops: Vec<OpRecord>) -> Dump {
    Dump {
        format: super::super::dump::FORMAT.into(),
        rank,
        size,
        reason: "stall".into(),
        written_unix_us: 9_000_000,
        capacity: 16,
        recorded: ops.len() as u64,
        stall: None,
        stopped: None,
        ops,
        members: None,
    }
}

#[test]
fn a_process_sets_records_expect_its_members_not_the_world() {
    let mut d = dump(3, 2, vec![]);
    d.members = Some(vec![1, 3, 4]);
    let text = explain(&[d]).to_string();
    assert!(
        text.starts_with("flight records of rank 3 (of the process set of ranks 1, 3 and 4)"),
        "{text}"
    );
    assert!(text.contains("; none from ranks 1 and 4 ("), "{text}");
    assert!(!text.contains("rank 0"), "{text}");
}

#[test]
fn names_the_rank_that_never_submitted_and_the_last_common_collective() {
    let ok = |s, n, r| op(s, n, &[2], "ok", Some(r));
    let dumps = [
        dump(
            0,
            3,
            vec![
                ok(1, "a", 3),
                ok(2, "b", 4),
                op(3, "c", &[3], "pending", None),
            ],
        ),
        dump(
            1,
            3,
            vec![
                ok(1, "a", 3),
                ok(2, "b", 4),
                op(3, "c", &[3], "pending", None),
            ],
        ),
        dump(2, 3, vec![ok(1, "a", 3), ok(2, "b", 4)]),
    ];
    let e = explain(&dumps);
    assert_eq!(
        e.findings,
        [Finding::NeverSubmitted {
            name: "c".into(),
            what: "allreduce f32 [3]".into(),
            lacking: vec![2],
            have: vec![0, 1],
            at_us: 1_003_000,
        }]
    );
    assert_eq!(
        e.last_completed,
        Some(("b".into(), "allreduce f32 [2]".into(), 4))
    );
    let text = e.to_string();
    assert!(
        text.contains(
            "first divergence: rank 2 has never submitted \"c\" (allreduce f32 [3]), which \
             ranks 0 and 1 submitted and wait on"
        ),
        "{text}"
    );
    assert!(text.contains("rank 2's last operation: \"b\""), "{text}");
    assert!(
        text.contains("last collective every rank completed: \"b\""),
        "{text}"
    );
}

#[test]
fn names_the_rank_that_sent_a_different_shape() {
    let dumps = [
        dump(
            0,
            3,
            vec![
                op(1, "a", &[2], "ok", Some(1)),
                op(2, "x", &[17], "error", None),
            ],
        ),
        dump(
            1,
            3,
            vec![
                op(1, "a", &[2], "ok", Some(1)),
                op(2, "x", &[18], "error", None),
            ],
        ),
        dump(
            2,
            3,
            vec![
                op(1, "a", &[2], "ok", Some(1)),
                op(2, "x", &[17], "error", None),
            ],
        ),
    ];
    let e = explain(&dumps);
    assert_eq!(e.findings.len(), 1, "{e}");
    match &e.findings[0] {
        Finding::Mismatch {
            name, field, sent, ..
        } => {
            assert_eq!((name.as_str(), *field), ("x", "shape"));
            assert_eq!(
                sent,
                &[
                    ("[18]".to_string(), vec![1]),
                    ("[17]".to_string(), vec![0, 2])
                ]
            );
        }
        other => panic!("{other:?}"),
    }
    let text = e.to_string();
    assert!(
        text.contains(
            "first divergence: rank 1 sent \"x\" with shape [18] where ranks 0 and 2 sent [17]"
        ),
        "{text}"
    );
    assert!(
        text.contains("last collective every rank completed: \"a\""),
        "{text}"
    );
}

#[test]
fn an_allgather_first_dimension_is_no_mismatch_and_a_lost_rank_is_named() {
    let mut g0 = op(1, "g", &[3, 4], "error", None);
    let mut g1 = op(1, "g", &[5, 4], "error", None);
    for g in [&mut g0, &mut g1] {
        g.kind = "allgather".into();
        g.error = Some("communication failed (rank 2 lost)".into());
        g.lost_rank = Some(2);
    }
    let e = explain(&[dump(0, 3, vec![g0]), dump(1, 3, vec![g1])]);
    assert_eq!(e.findings.len(), 1, "{e}");
    assert!(
        matches!(&e.findings[0], Finding::Failed { lost: Some(2), ranks, .. } if ranks == &[0, 1])
    );
    let text = e.to_string();
    assert!(text.contains("none from rank 2"), "{text}");
    assert!(text.contains("first divergence: rank 2 was lost"), "{text}");
    assert!(
        text.contains("no collective is completed in every rank's record"),
        "{text}"
    );
}

#[test]
fn agreeing_records_have_no_divergence() {
    let ok = |s, n, r| op(s, n, &[2], "ok", Some(r));
    let e = explain(&[
        dump(0, 2, vec![ok(1, "a", 1)]),
        dump(1, 2, vec![ok(1, "a", 1)]),
    ]);
    assert!(e.findings.is_empty());
    assert!(e.to_string().contains("no divergence"), "{e}");
}
