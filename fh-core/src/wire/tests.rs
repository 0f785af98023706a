use super::{
    decode_names, decode_requests, decode_responses, encode_names, encode_requests,
    encode_responses, CollectiveKind, CoreError, DType, DecodeError, Device, Disagreement,
    GroupTag, MismatchField, NegotiationError, ReduceOp, Request, Response, Signature, VERSION,
};
use proptest::prelude::*;

fn arb_sig() -> impl Strategy<Value = Signature> {
    (
        0u8..7,
        0u8..9,
        proptest::collection::vec(any::<u64>(), 0..5),
        prop_oneof![Just(Device::Cpu), any::<u32>().prop_map(Device::Gpu)],
        0u8..7,
        any::<u32>(),
        any::<f64>(),
        any::<f64>(),
    )
        .prop_map(
            |(k, d, shape, device, op, root, prescale, postscale)| Signature {
                kind: CollectiveKind::from_code(k).unwrap(),
                dtype: DType::from_code(d).unwrap(),
                shape,
                device,
                op: ReduceOp::from_code(op).unwrap(),
                root,
                prescale,
                postscale,
            },
        )
}

fn arb_group() -> impl Strategy<Value = Option<GroupTag>> {
    prop_oneof![
        Just(None),
        (".{0,6}", 1u32..5).prop_flat_map(|(name, size)| (0..size).prop_map(move |index| {
            Some(GroupTag {
                name: name.clone(),
                index,
                size,
            })
        })),
    ]
}

fn arb_request() -> impl Strategy<Value = Request> {
    (
        "[a-z./0-9]{0,12}",
        any::<u32>(),
        arb_sig(),
        any::<i64>(),
        arb_group(),
    )
        .prop_map(|(name, rank, sig, priority, group)| Request {
            name: name.into(),
            rank,
            sig,
            priority,
            group,
        })
}

fn arb_error() -> impl Strategy<Value = Option<NegotiationError>> {
    prop_oneof![
        Just(None),
        (
            0u8..7,
            0u8..9,
            proptest::collection::vec((any::<u32>(), ".{0,8}"), 0..40)
        )
            .prop_map(|(k, f, values)| Some(NegotiationError::Mismatch {
                kind: CollectiveKind::from_code(k).unwrap(),
                field: MismatchField::from_code(f).unwrap(),
                senders: Disagreement::tally(values),
            })),
        ".{0,16}".prop_map(|s| Some(NegotiationError::Other(s))),
    ]
}

fn arb_response() -> impl Strategy<Value = Response> {
    (
        "[a-z./0-9]{0,12}",
        arb_sig(),
        any::<i64>(),
        arb_error(),
        arb_group(),
    )
        .prop_map(|(name, sig, priority, error, group)| Response {
            name: name.into(),
            sig,
            priority,
            group,
            error,
        })
}

fn same_req(a: &Request, b: &Request) -> bool {
    a.name == b.name
        && a.rank == b.rank
        && a.priority == b.priority
        && a.group == b.group
        && a.sig.same_as(&b.sig)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn requests_round_trip(reqs in proptest::collection::vec(arb_request(), 0..8)) {
        let back = decode_requests(&encode_requests(&reqs)).unwrap();
        prop_assert_eq!(back.len(), reqs.len());
        for (a, b) in reqs.iter().zip(&back) {
            prop_assert!(same_req(a, b), "{:?} != {:?}", a, b);
        }
    }

    #[test]
    fn responses_round_trip(resps in proptest::collection::vec(arb_response(), 0..8)) {
        let back = decode_responses(&encode_responses(&resps)).unwrap();
        prop_assert_eq!(back.len(), resps.len());
        for (a, b) in resps.iter().zip(&back) {
            prop_assert_eq!(&a.name, &b.name);
            prop_assert!(a.sig.same_as(&b.sig));
            prop_assert_eq!(a.priority, b.priority);
            prop_assert_eq!(&a.group, &b.group);
            prop_assert_eq!(&a.error, &b.error);
        }
    }

    #[test]
    fn names_round_trip(items in proptest::collection::vec((".{0,10}", any::<u64>()), 0..8)) {
        prop_assert_eq!(decode_names(&encode_names(&items)).unwrap(), items);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_requests(&bytes);
        let _ = decode_responses(&bytes);
        let _ = decode_names(&bytes);
    }

    #[test]
    fn corrupted_messages_never_panic(
        reqs in proptest::collection::vec(arb_request(), 1..4),
        pos in any::<prop::sample::Index>(),
        val in any::<u8>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode_requests(&reqs);
        let i = pos.index(bytes.len());
        bytes[i] = val;
        let _ = decode_requests(&bytes);
        let c = cut.index(bytes.len());
        prop_assert!(decode_requests(&encode_requests(&reqs)[..c]).is_err());
    }
}

#[test]
fn huge_counts_are_refused_without_allocating() {
    let mut bytes = b"FHq".to_vec();
    bytes.push(VERSION);
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    let err = decode_requests(&bytes).unwrap_err().to_string();
    assert!(err.contains("count"), "{err}");
}

#[test]
fn a_short_or_garbled_message_is_a_decode_error_that_says_what_is_wrong() {
    // Cut inside the first name's number: the reader's shortfall, as text, in the one
    // decode error (a message arrives whole, so nothing more is waited for).
    let bytes = encode_names(&[("abc".into(), 7)]);
    assert_eq!(bytes.len(), 8 + 4 + 3 + 8);
    assert_eq!(
        decode_names(&bytes[..21]),
        Err(CoreError::Decode {
            what: "name list",
            detail: DecodeError::Invalid("truncated: needed 8 more bytes, 6 left".into()),
        })
    );
    assert_eq!(
        decode_names(b"FHx\x02"),
        Err(CoreError::Decode {
            what: "name list",
            detail: DecodeError::Invalid("bad magic [70, 72, 120]".into()),
        })
    );
    let mut bytes = encode_names(&[("abc".into(), 7)]);
    bytes.push(0);
    assert_eq!(
        decode_names(&bytes).unwrap_err().to_string(),
        "malformed name list: 1 trailing bytes"
    );
}

#[test]
fn wrong_version_is_named() {
    let mut bytes = encode_requests(&[]);
    bytes[3] = 9;
    let err = decode_requests(&bytes).unwrap_err().to_string();
    assert!(err.contains("version 9"), "{err}");
}
