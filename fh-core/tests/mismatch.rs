//! Who sent what: rank sets and their phrases, tallies of disagreeing ranks, and their wire
//! encoding (round trip, and bad input refused without a panic).

use std::sync::Arc;

use fh_core::message::{
    CollectiveKind, Device, MismatchField, NegotiationError, Response, Signature,
};
use fh_core::mismatch::{Disagreement, RankSet, Sent};
use fh_core::wire::{decode_responses, encode_responses};
use fh_core::{DType, ReduceOp};
use proptest::prelude::*;

fn set(ranks: &[u32]) -> RankSet {
    ranks.iter().copied().collect()
}

#[test]
fn rank_sets_read_as_phrases() {
    let cases: [(&[u32], &str); 10] = [
        (&[], "no ranks"),
        (&[1], "rank 1"),
        (&[0, 2], "ranks 0 and 2"),
        (&[0, 1], "ranks 0 and 1"),
        (&[5, 2, 0], "ranks 0, 2 and 5"),
        (&[0, 1, 2], "ranks 0-2"),
        (&[9, 0, 1, 2, 3, 4, 5, 6, 7], "ranks 0-7 and 9"),
        (&[0, 1, 3, 4, 5, 9], "ranks 0, 1, 3-5 and 9"),
        (&[2, 2, 2], "rank 2"),
        (&[u32::MAX - 1, u32::MAX], "ranks 4294967294 and 4294967295"),
    ];
    for (ranks, want) in cases {
        assert_eq!(set(ranks).to_string(), want, "{ranks:?}");
    }
}

#[test]
fn long_rank_sets_say_how_many_more() {
    let even: RankSet = (0..1000).map(|r| r * 2).collect();
    assert_eq!(
        even.to_string(),
        "ranks 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28 and 985 more"
    );
    // Exactly MAX_ITEMS items are all named.
    let sixteen: RankSet = (0..16).map(|r| r * 2).collect();
    assert!(sixteen.to_string().ends_with("28 and 30"), "{sixteen}");
    // Ranges count with all their ranks.
    let runs: RankSet = (0..20).flat_map(|i| (i * 10)..(i * 10 + 3)).collect();
    assert!(runs.to_string().starts_with("ranks 0-2, 10-12"), "{runs}");
    assert!(runs.to_string().ends_with("140-142 and 15 more"), "{runs}");
}

#[test]
fn rank_sets_answer_questions() {
    let s = set(&[0, 1, 2, 3, 7, 9, 10]);
    assert_eq!(s.runs(), [(0, 3), (7, 7), (9, 10)]);
    assert_eq!(s.len(), 7);
    assert_eq!(s.first(), Some(0));
    assert!(s.contains(3) && s.contains(7) && s.contains(10));
    assert!(!s.contains(4) && !s.contains(8) && !s.contains(11));
    assert_eq!(s.iter().collect::<Vec<_>>(), [0, 1, 2, 3, 7, 9, 10]);
    assert!(s.intersects(&set(&[8, 9])));
    assert!(!s.intersects(&set(&[4, 5, 6, 8, 11])));
    assert!(!s.intersects(&RankSet::new()));
    let world = [4u32, 5, 6, 7, 8, 9, 10, 11, 12, 13, 20];
    assert_eq!(
        s.map(|r| world[r as usize]).to_string(),
        "ranks 4-7, 11, 13 and 20"
    );
    assert!(RankSet::new().is_empty() && RankSet::new().first().is_none());
}

#[test]
fn only_canonical_runs_are_accepted() {
    assert!(RankSet::from_runs(vec![(0, 3), (5, 5)]).is_ok());
    assert!(RankSet::from_runs(vec![]).is_ok());
    let reversed = RankSet::from_runs(vec![(3, 1)]).unwrap_err();
    assert!(reversed.contains("reversed"), "{reversed}");
    for bad in [
        vec![(0, 3), (4, 5)],
        vec![(0, 3), (2, 5)],
        vec![(5, 6), (0, 1)],
    ] {
        assert!(RankSet::from_runs(bad.clone()).is_err(), "{bad:?}");
    }
    assert!(RankSet::from_runs(vec![(0, u32::MAX), (u32::MAX, u32::MAX)]).is_err());
}

#[test]
fn a_tally_puts_the_odd_ones_out_first_and_the_most_common_value_last() {
    let d = Disagreement::tally([(2, "[1000]"), (1, "[1001]"), (0, "[1000]")]);
    assert_eq!(
        d.to_string(),
        "rank 1 sent [1001]; ranks 0 and 2 sent [1000]"
    );
    assert!(d.disagrees());
    assert_eq!(d.value_of(2), Some("[1000]"));
    assert_eq!(d.value_of(3), None);
    // Ties: lowest rank first.
    let d = Disagreement::tally([(1, "b"), (0, "a")]);
    assert_eq!(d.to_string(), "rank 0 sent a; rank 1 sent b");
    let d = Disagreement::tally((0..8).map(|r| (r, if r % 4 == 3 { "x" } else { "y" })));
    assert_eq!(
        d.to_string(),
        "ranks 3 and 7 sent x; ranks 0-2 and 4-6 sent y"
    );
    // One value: no disagreement; a rank given twice counts with its first value.
    let d = Disagreement::tally([(0, "a"), (1, "a"), (1, "b")]);
    assert!(!d.disagrees());
    assert_eq!(d.to_string(), "ranks 0 and 1 sent a");
    assert_eq!(
        Disagreement::tally(Vec::<(u32, String)>::new()).to_string(),
        ""
    );
}

#[test]
fn a_tally_shows_at_most_sixteen_values_and_counts_the_rest() {
    // Ranks 0..20 each send their own value, ranks 20..30 all send "common".
    let values = (0..30u32).map(|r| {
        (
            r,
            if r < 20 {
                format!("v{r}")
            } else {
                "common".into()
            },
        )
    });
    let d = Disagreement::tally(values);
    assert_eq!(d.sent().len(), Disagreement::MAX_SHOWN);
    assert_eq!(d.more_values(), 5);
    assert_eq!(d.more_ranks().to_string(), "ranks 15-19");
    let text = d.to_string();
    assert!(
        text.starts_with("rank 0 sent v0; rank 1 sent v1; "),
        "{text}"
    );
    assert!(
        text.ends_with(
            "rank 14 sent v14; ranks 20-29 sent common; and 5 more values from ranks 15-19"
        ),
        "{text}"
    );
    let d = Disagreement::tally((0..17u32).map(|r| (r, r.to_string())));
    assert!(
        d.to_string().ends_with("; and 1 more value from rank 15"),
        "{d}"
    );
}

#[test]
fn long_values_are_shortened() {
    let long = "x".repeat(1000);
    let d = Disagreement::tally([(0, long.clone()), (1, "é".repeat(300))]);
    for s in d.sent() {
        assert!(
            s.value.len() <= Disagreement::MAX_VALUE,
            "{}",
            s.value.len()
        );
        assert!(s.value.ends_with("..."));
    }
}

#[test]
fn renamed_ranks_keep_the_values() {
    let d = Disagreement::tally([(0, "a"), (1, "b"), (2, "a")]);
    let world = [4u32, 6, 9];
    assert_eq!(
        d.map_ranks(|r| world[r as usize]).to_string(),
        "rank 6 sent b; ranks 4 and 9 sent a"
    );
}

#[test]
fn parts_are_checked() {
    let sent = |v: &str, r: &[u32]| Sent {
        value: v.into(),
        ranks: set(r),
    };
    assert!(
        Disagreement::from_parts(vec![sent("a", &[0]), sent("b", &[1])], 0, RankSet::new()).is_ok()
    );
    let overlap =
        Disagreement::from_parts(vec![sent("a", &[0, 1]), sent("b", &[1])], 0, RankSet::new());
    assert!(overlap.unwrap_err().contains("two values"));
    assert!(Disagreement::from_parts(vec![sent("a", &[])], 0, RankSet::new()).is_err());
    let long = sent(&"x".repeat(Disagreement::MAX_VALUE + 1), &[0]);
    let too_long = Disagreement::from_parts(vec![long], 0, RankSet::new()).unwrap_err();
    assert!(too_long.contains("bytes"), "{too_long}");
    assert!(Disagreement::from_parts(vec![sent("a", &[0])], 1, RankSet::new()).is_err());
    assert!(Disagreement::from_parts(vec![sent("a", &[0])], 0, set(&[1])).is_err());
    let full: Vec<Sent> = (0..16).map(|r| sent(&r.to_string(), &[r])).collect();
    assert!(Disagreement::from_parts(full.clone(), 1, set(&[16])).is_ok());
    assert!(Disagreement::from_parts(full.clone(), 2, set(&[16])).is_err());
    assert!(Disagreement::from_parts(full.clone(), 1, set(&[15])).is_err());
    let mut too_many = full;
    too_many.push(sent("x", &[99]));
    assert!(Disagreement::from_parts(too_many, 0, RankSet::new()).is_err());
    assert!(Disagreement::from_parts(vec![sent("a", &[0])], 1, set(&[1])).is_err());
}

/// Reads a rank set's phrase back (for sets short enough to be named in full).
fn parse_phrase(s: &str) -> Vec<u32> {
    if s == "no ranks" {
        return vec![];
    }
    let list = s
        .strip_prefix("ranks ")
        .or_else(|| s.strip_prefix("rank "))
        .unwrap();
    list.split(", ")
        .flat_map(|p| p.split(" and "))
        .flat_map(|item| match item.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().unwrap()..=b.parse().unwrap()).collect::<Vec<_>>(),
            None => vec![item.parse().unwrap()],
        })
        .collect()
}

fn response(error: Option<NegotiationError>) -> Response {
    Response {
        name: Arc::from("w"),
        sig: Signature {
            kind: CollectiveKind::Allreduce,
            dtype: DType::F32,
            shape: vec![4],
            device: Device::Cpu,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
        },
        priority: 0,
        group: None,
        error,
    }
}

fn mismatch(senders: Disagreement) -> NegotiationError {
    NegotiationError::Mismatch {
        kind: CollectiveKind::Allreduce,
        field: MismatchField::Shape,
        senders,
    }
}

/// The bytes of a response list whose one response is a shape mismatch, up to where its
/// disagreement starts; a test appends its own disagreement bytes.
fn prefix() -> Vec<u8> {
    let plain = encode_responses(&[response(None)]);
    let with = encode_responses(&[response(Some(mismatch(Disagreement::tally([(0, "a")]))))]);
    with[..plain.len() + 2].to_vec()
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn mismatches_cross_the_wire_with_their_ranks() {
    let d = Disagreement::tally((0..40u32).map(|r| (r, format!("[{}]", r % 20))));
    let resp = response(Some(mismatch(d.clone())));
    let back = decode_responses(&encode_responses(&[resp])).unwrap();
    assert_eq!(back[0].error, Some(mismatch(d)));
    // The hand-made prefix plus a hand-made disagreement decodes.
    let mut ok = prefix();
    ok.extend(u32s(&[2, 1]));
    ok.push(b'a');
    ok.extend(u32s(&[1, 0, 0, 1]));
    ok.push(b'b');
    ok.extend(u32s(&[1, 1, 2, 0, 0]));
    let back = decode_responses(&ok).unwrap();
    assert_eq!(
        back[0].error.as_ref().unwrap().to_string(),
        "Mismatched allreduce tensor shapes: rank 0 sent a; ranks 1 and 2 sent b"
    );
}

#[test]
fn bad_disagreements_are_decode_errors() {
    let cases: [(&str, Vec<u8>); 8] = [
        ("count", u32s(&[u32::MAX])),
        ("at most 16", {
            let mut b = u32s(&[17]);
            for r in 0..17 {
                b.extend(u32s(&[0, 1, r, r]));
            }
            b.extend(u32s(&[0, 0]));
            b
        }),
        (
            "reversed",
            [u32s(&[1, 1]), b"a".to_vec(), u32s(&[1, 5, 2, 0, 0])].concat(),
        ),
        (
            "gap",
            [u32s(&[1, 1]), b"a".to_vec(), u32s(&[2, 0, 1, 2, 3, 0, 0])].concat(),
        ),
        (
            "two values",
            [
                u32s(&[2, 1]),
                b"a".to_vec(),
                u32s(&[1, 0, 1, 1]),
                b"b".to_vec(),
                u32s(&[1, 1, 1, 0, 0]),
            ]
            .concat(),
        ),
        (
            "more values",
            [u32s(&[1, 1]), b"a".to_vec(), u32s(&[1, 0, 0, 3, 0])].concat(),
        ),
        (
            "truncated",
            [u32s(&[1, 1]), b"a".to_vec(), u32s(&[1, 0, 0])].concat(),
        ),
        (
            "cannot fit",
            [u32s(&[1, 1]), b"a".to_vec(), u32s(&[1, 0])].concat(),
        ),
    ];
    for (want, tail) in cases {
        let mut bytes = prefix();
        bytes.extend(tail);
        let err = decode_responses(&bytes).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}

fn arb_values() -> impl Strategy<Value = Vec<(u32, String)>> {
    proptest::collection::vec((0u32..64, "[a-e]{1,2}"), 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rank_sets_are_canonical_and_read_back(ranks in proptest::collection::vec(0u32..200, 0..60)) {
        let s: RankSet = ranks.iter().copied().collect();
        let mut want = ranks.clone();
        want.sort_unstable();
        want.dedup();
        prop_assert_eq!(s.iter().collect::<Vec<_>>(), want.clone());
        prop_assert_eq!(s.len(), want.len() as u64);
        prop_assert_eq!(&RankSet::from_runs(s.runs().to_vec()).unwrap(), &s);
        for r in 0..200 {
            prop_assert_eq!(s.contains(r), want.contains(&r));
        }
        let text = s.to_string();
        if text.contains(" more") {
            prop_assert!(s.runs().len() > RankSet::MAX_ITEMS / 2);
        } else {
            prop_assert_eq!(parse_phrase(&text), want);
        }
    }

    #[test]
    fn intersection_agrees_with_the_ranks(
        a in proptest::collection::vec(0u32..40, 0..20),
        b in proptest::collection::vec(0u32..40, 0..20),
    ) {
        let (x, y): (RankSet, RankSet) = (a.iter().copied().collect(), b.iter().copied().collect());
        prop_assert_eq!(x.intersects(&y), a.iter().any(|r| b.contains(r)));
    }

    #[test]
    fn a_tally_places_every_rank_once_in_order(values in arb_values()) {
        let d = Disagreement::tally(values.clone());
        let mut first: std::collections::BTreeMap<u32, String> = Default::default();
        for (r, v) in &values {
            first.entry(*r).or_insert_with(|| v.clone());
        }
        let distinct: std::collections::BTreeSet<&String> = first.values().collect();
        prop_assert_eq!(d.sent().len() + d.more_values() as usize, distinct.len());
        let mut placed: Vec<u32> = d.sent().iter().flat_map(|s| s.ranks.iter()).collect();
        placed.extend(d.more_ranks().iter());
        placed.sort_unstable();
        prop_assert_eq!(placed, first.keys().copied().collect::<Vec<_>>());
        for (r, v) in &first {
            if let Some(got) = d.value_of(*r) {
                prop_assert_eq!(got, v.as_str());
            }
        }
        let sizes: Vec<u64> = d.sent().iter().map(|s| s.ranks.len()).collect();
        prop_assert!(sizes.windows(2).all(|w| w[0] <= w[1]));
        prop_assert!(Disagreement::from_parts(
            d.sent().to_vec(), d.more_values(), d.more_ranks().clone()).is_ok());
        prop_assert_eq!(d.disagrees(), distinct.len() > 1);
    }

    #[test]
    fn tallies_round_trip_and_corruption_never_panics(
        values in arb_values(),
        pos in any::<prop::sample::Index>(),
        val in any::<u8>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let resp = response(Some(mismatch(Disagreement::tally(values))));
        let bytes = encode_responses(std::slice::from_ref(&resp));
        let back = decode_responses(&bytes).unwrap();
        prop_assert_eq!(&back[0].error, &resp.error);
        let mut bad = bytes.clone();
        let i = pos.index(bad.len());
        bad[i] = val;
        let _ = decode_responses(&bad);
        let c = cut.index(bytes.len());
        prop_assert!(decode_responses(&bytes[..c]).is_err());
    }
}
