//! The wire format's unit tests: round trips, and the errors each decoder gives.

use super::{
    abort_header, acceptor_proof, check_data_len, connector_proof, constant_time_eq, data_header,
    decode_book, decode_header, decode_proof, decode_rendezvous_answer, encode_book, encode_proof,
    encode_rendezvous_failure, fresh_nonce, max_book_len, max_rendezvous_answer_len, release_field,
    verify_acceptor_proof, verify_connector_proof, version_mismatch, Answer, ConnKind, DecodeError,
    Header, Hello, Key, RendezvousAnswer, Reply, CHALLENGE_LEN, HELLO_LEN, HELLO_MAGIC,
    MAX_FAILURE_TEXT, MAX_REASON_LEN, NONCE_LEN, PREAMBLE_LEN, PROOF_LEN, PROOF_TAG_LEN,
    PROTOCOL_VERSION, RELEASE_FIELD, RENDEZVOUS_FAILED, REPLY_MAGIC, WORLD_ID_LEN,
};

#[test]
fn hello_round_trip() {
    let h = Hello {
        version: PROTOCOL_VERSION,
        kind: ConnKind::Data,
        size: 4,
        rank: 3,
        seq: 77,
        port: 4242,
        lost: 9,
        world: [5; WORLD_ID_LEN],
        nonce: [7; NONCE_LEN],
    };
    let bytes = h.encode();
    assert_eq!(Hello::decode(&bytes), Ok((h, bytes.len())));
    for cut in 0..bytes.len() {
        assert!(matches!(
            Hello::decode(&bytes[..cut]),
            Err(DecodeError::NeedMore(n)) if n > cut
        ));
    }
}

#[test]
fn garbage_and_versions_refused_early() {
    assert!(matches!(
        Hello::decode(b"GET /"),
        Err(DecodeError::Invalid(_))
    ));
    assert!(matches!(Hello::decode(b"X"), Err(DecodeError::Invalid(_))));
    // Before protocol 5 a hello carries no release: refused on its protocol alone.
    let mut b = HELLO_MAGIC.to_vec();
    b.extend_from_slice(&4u16.to_le_bytes());
    let old = Hello::decode(&b).unwrap_err();
    assert_eq!(old, version_mismatch(4, None));
    assert!(
        old.to_string()
            .contains("runs an older FastHorovod (wire protocol 4)"),
        "{old}"
    );
    // From protocol 5 on the release follows, and is named.
    let mut b = HELLO_MAGIC.to_vec();
    b.extend_from_slice(&9u16.to_le_bytes());
    assert_eq!(Hello::decode(&b), Err(DecodeError::NeedMore(PREAMBLE_LEN)));
    b.extend_from_slice(&release_field("7.0.0"));
    let newer = Hello::decode(&b).unwrap_err();
    assert_eq!(newer, version_mismatch(9, Some("7.0.0")));
    assert!(
        newer
            .to_string()
            .contains("runs FastHorovod 7.0.0 (wire protocol 9)"),
        "{newer}"
    );
}

#[test]
fn a_hello_of_another_release_is_refused_naming_both() {
    let h = Hello {
        version: PROTOCOL_VERSION,
        kind: ConnKind::Rendezvous,
        size: 2,
        rank: 1,
        seq: 0,
        port: 1,
        lost: 0,
        world: [0; WORLD_ID_LEN],
        nonce: [1; NONCE_LEN],
    };
    let mut bytes = h.encode();
    assert_eq!(&bytes[6..PREAMBLE_LEN], &RELEASE_FIELD);
    bytes[6..PREAMBLE_LEN].copy_from_slice(&release_field("0.0.1-old"));
    let err = Hello::decode(&bytes).unwrap_err();
    assert_eq!(err, version_mismatch(PROTOCOL_VERSION, Some("0.0.1-old")));
    let text = err.to_string();
    assert!(text.contains("FastHorovod 0.0.1-old"), "{text}");
    assert!(
        text.contains(&format!("FastHorovod {}", fh_core::RELEASE)),
        "{text}"
    );
    // Bytes from the network are printed tamed.
    bytes[6..PREAMBLE_LEN].copy_from_slice(b"1.0\n\x1b[31m\xff\0\0\0\0\0\0");
    assert_eq!(
        Hello::decode(&bytes),
        Err(version_mismatch(PROTOCOL_VERSION, Some("1.0??[31m?")))
    );
}

#[test]
fn reply_and_book_round_trip() {
    for r in [Reply::Accept, Reply::Refuse("wrong job token".into())] {
        let b = r.encode();
        assert_eq!(Reply::decode(&b), Ok((r, b.len())));
    }
    let book = vec![":1".to_string(), "127.0.0.1:2".into(), "10.0.0.2:3".into()];
    let b = encode_book(&book);
    assert_eq!(decode_book(&b, 3), Ok((book.clone(), b.len())));
    assert!(decode_book(&b, 4).is_err());
    assert_eq!(
        decode_rendezvous_answer(&b, 3),
        Ok((RendezvousAnswer::Book(book), b.len()))
    );
    let f = encode_rendezvous_failure(2, "rank 2 never joined");
    assert_eq!(
        decode_rendezvous_answer(&f, 3),
        Ok((
            RendezvousAnswer::Failed {
                lost: 2,
                reason: "rank 2 never joined".into()
            },
            f.len()
        ))
    );
    assert_eq!(
        decode_rendezvous_answer(&f[..f.len() - 1], 3),
        Err(DecodeError::NeedMore(f.len()))
    );
    assert!(encode_rendezvous_failure(1, &"é".repeat(2000)).len() <= 10 + MAX_FAILURE_TEXT);
}

#[test]
fn headers() {
    assert_eq!(decode_header(data_header(0)), Header::Data(0));
    assert_eq!(decode_header(data_header(12345)), Header::Data(12345));
    assert_eq!(decode_header(abort_header(7)), Header::Abort { lost: 7 });
    assert!(check_data_len(5, 5).is_ok());
    assert!(check_data_len(u64::MAX >> 1, 5).is_err());
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"ab"));
}

#[test]
fn proofs_bind_token_hello_nonce_and_side() {
    let hello = b"hello bytes";
    let (na, nb) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
    let key = &Key::new(b"0123456789abcdef-token");
    let a = acceptor_proof(key, hello, &na);
    assert!(verify_acceptor_proof(key, hello, &na, &a));
    assert!(!verify_acceptor_proof(
        &Key::new(b"0123456789abcdef-other"),
        hello,
        &na,
        &a
    ));
    assert!(!verify_acceptor_proof(key, b"hello bytez", &na, &a));
    assert!(!verify_acceptor_proof(key, hello, &nb, &a));
    // A proof of one side is no proof of the other (no reflection).
    assert!(!verify_connector_proof(key, hello, &na, &a));
    let c = connector_proof(key, hello, &na);
    assert!(verify_connector_proof(key, hello, &na, &c));
    assert!(!verify_connector_proof(key, hello, &na, &c[..31]));
    let enc = Answer::encode_challenge(&na, &a);
    assert_eq!(
        Answer::decode(&enc),
        Ok((
            Answer::Challenge {
                nonce: na,
                proof: a
            },
            CHALLENGE_LEN
        ))
    );
    let r = Reply::Refuse("no".into()).encode();
    assert_eq!(
        Answer::decode(&r),
        Ok((Answer::Reply(Reply::Refuse("no".into())), r.len()))
    );
    assert!(Answer::decode(b"HTTP").is_err());
    let p = encode_proof(&c);
    assert_eq!(decode_proof(&p), Ok((c, PROOF_LEN)));
    assert!(matches!(
        decode_proof(&p[..10]),
        Err(DecodeError::NeedMore(PROOF_LEN))
    ));
    assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
}

fn a_hello() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        kind: ConnKind::Abort,
        size: 0x0403_0201,
        rank: 0x0807_0605,
        seq: 0x100f_0e0d_0c0b_0a09,
        port: 0x1211,
        lost: 0x1615_1413,
        world: [0xaa; WORLD_ID_LEN],
        nonce: [0xbb; NONCE_LEN],
    }
}

/// `err`'s text, which must be an [`DecodeError::Invalid`] (a malformed input, not a short one).
fn invalid<T: std::fmt::Debug>(got: Result<T, DecodeError>) -> String {
    match got {
        Err(DecodeError::Invalid(why)) => why,
        other => panic!("expected a malformed input, got {other:?}"),
    }
}

/// Every proper prefix of `bytes` asks for more than it holds, and never for more than `max`.
fn every_cut_needs_more<T: std::fmt::Debug>(
    bytes: &[u8],
    max: usize,
    decode: impl Fn(&[u8]) -> Result<T, DecodeError>,
) {
    for cut in 0..bytes.len() {
        match decode(&bytes[..cut]) {
            Err(DecodeError::NeedMore(n)) => assert!(n > cut && n <= max, "cut {cut}: {n}"),
            other => panic!("cut {cut}: expected a request for more bytes, got {other:?}"),
        }
    }
}

#[test]
fn a_hello_is_laid_out_as_the_table_says() {
    let mut want = b"FHTP".to_vec();
    want.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    want.extend_from_slice(&RELEASE_FIELD);
    want.extend_from_slice(&[2, 0]);
    want.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    want.extend_from_slice(&[9, 10, 11, 12, 13, 14, 15, 16]);
    want.extend_from_slice(&[0x11, 0x12, 0x13, 0x14, 0x15, 0x16]);
    want.extend_from_slice(&[0xaa; WORLD_ID_LEN]);
    want.extend_from_slice(&[0xbb; NONCE_LEN]);
    assert_eq!(want.len(), HELLO_LEN);
    assert_eq!(a_hello().encode(), want);
    // A decoder takes its own bytes and leaves what follows.
    want.extend_from_slice(b"next message");
    assert_eq!(Hello::decode(&want), Ok((a_hello(), HELLO_LEN)));
}

#[test]
fn a_garbled_hello_is_refused_naming_what_is_wrong() {
    let good = a_hello().encode();
    let mut b = good.clone();
    b[PREAMBLE_LEN] = 9;
    assert_eq!(invalid(Hello::decode(&b)), "unknown connection kind 9");
    // Refused only once the whole fixed part is there.
    assert_eq!(
        Hello::decode(&b[..PREAMBLE_LEN + 1]),
        Err(DecodeError::NeedMore(HELLO_LEN))
    );
    let mut b = good.clone();
    b[PREAMBLE_LEN + 1] = 1;
    assert_eq!(
        invalid(Hello::decode(&b)),
        "reserved handshake byte is not 0"
    );
    let mut b = good;
    b[3] = b'X';
    assert!(invalid(Hello::decode(&b)).contains("bad magic"));
}

#[test]
fn challenges_and_proofs_truncated_or_garbled() {
    let (nonce, proof) = ([3u8; NONCE_LEN], [4u8; PROOF_TAG_LEN]);
    let c = Answer::encode_challenge(&nonce, &proof);
    every_cut_needs_more(&c, CHALLENGE_LEN, Answer::decode);
    assert_eq!(
        Answer::decode(&c[..5]),
        Err(DecodeError::NeedMore(CHALLENGE_LEN))
    );
    let http = invalid(Answer::decode(b"HTTP/1.1 400 Bad Request\r\n"));
    assert!(
        http.contains("did not answer with a FastHorovod challenge"),
        "{http}"
    );
    let p = encode_proof(&proof);
    every_cut_needs_more(&p, PROOF_LEN, decode_proof);
    let mut garbled = p.clone();
    garbled[0] = b'X';
    assert_eq!(
        invalid(decode_proof(&garbled)),
        "not a FastHorovod handshake proof (bad magic)"
    );
    let mut longer = p;
    longer.push(0);
    assert_eq!(decode_proof(&longer), Ok((proof, PROOF_LEN)));
}

#[test]
fn replies_truncated_over_long_or_garbled() {
    let refusal = Reply::Refuse("wrong job token".into()).encode();
    every_cut_needs_more(&refusal, refusal.len(), Reply::decode);
    // A reason longer than the maximum is refused from its length, before it arrives.
    let mut long = REPLY_MAGIC.to_vec();
    long.push(1);
    long.extend_from_slice(&(MAX_REASON_LEN as u16 + 1).to_le_bytes());
    assert_eq!(
        invalid(Reply::decode(&long)),
        format!(
            "reply reason of {} bytes exceeds the maximum of {MAX_REASON_LEN}",
            MAX_REASON_LEN + 1
        )
    );
    let mut odd = Reply::Accept.encode();
    odd[4] = 7;
    assert_eq!(invalid(Reply::decode(&odd)), "unknown reply status 7");
    let mut chatty = refusal.clone();
    chatty[4] = 0;
    assert_eq!(
        invalid(Reply::decode(&chatty)),
        "an acceptance carrying a reason"
    );
    let other = invalid(Reply::decode(b"SSH-2.0-OpenSSH"));
    assert!(
        other.contains("is something else listening on that port?"),
        "{other}"
    );
}

#[test]
fn books_and_rendezvous_answers_truncated_over_long_or_garbled() {
    let book = vec![":1".to_string(), "127.0.0.1:2".into()];
    let b = encode_book(&book);
    every_cut_needs_more(&b, max_book_len(2), |x| decode_book(x, 2));
    every_cut_needs_more(&b, max_rendezvous_answer_len(2), |x| {
        decode_rendezvous_answer(x, 2)
    });
    let mut longer = b.clone();
    longer.extend_from_slice(b"more");
    assert_eq!(decode_book(&longer, 2), Ok((book, b.len())));
    assert_eq!(
        invalid(decode_book(&b, 3)),
        "address book lists 2 ranks, expected 3"
    );
    let mut garbled = b;
    garbled[5] = 0xff;
    assert_eq!(
        invalid(decode_book(&garbled, 2)),
        "an address book entry that is not UTF-8"
    );
    let f = encode_rendezvous_failure(1, "rank 1 never joined");
    every_cut_needs_more(&f, max_rendezvous_answer_len(2), |x| {
        decode_rendezvous_answer(x, 2)
    });
    let mut long = RENDEZVOUS_FAILED.to_le_bytes().to_vec();
    long.extend_from_slice(&1u32.to_le_bytes());
    long.extend_from_slice(&2000u16.to_le_bytes());
    assert_eq!(
        invalid(decode_rendezvous_answer(&long, 2)),
        format!("rendezvous failure notice of 2000 bytes (at most {MAX_FAILURE_TEXT})")
    );
}
