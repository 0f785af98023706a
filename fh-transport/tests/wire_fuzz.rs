//! Every decoder reachable from the network never panics on arbitrary bytes, and never asks
//! for (or returns) more than its configured maximum.

use fh_core::bytes::DecodeError;
use fh_transport::backend::tcp::wire::{
    self, Answer, ConnKind, Header, Hello, RendezvousAnswer, Reply,
};
use proptest::prelude::*;

fn hello_strategy() -> impl Strategy<Value = Hello> {
    (
        0u8..4,
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u16>(),
        any::<u32>(),
        any::<[u8; wire::WORLD_ID_LEN]>(),
        any::<[u8; wire::NONCE_LEN]>(),
    )
        .prop_map(|(kind, size, rank, seq, port, lost, world, nonce)| Hello {
            version: wire::PROTOCOL_VERSION,
            kind: [
                ConnKind::Rendezvous,
                ConnKind::Data,
                ConnKind::Abort,
                ConnKind::Probe,
            ][usize::from(kind)],
            size,
            rank,
            seq,
            port,
            lost,
            world,
            nonce,
        })
}

/// Any well-formed hello of this build.
fn a_valid_hello() -> Hello {
    Hello {
        version: wire::PROTOCOL_VERSION,
        kind: ConnKind::Data,
        size: 2,
        rank: 1,
        seq: 3,
        port: 4,
        lost: 0,
        world: [1; wire::WORLD_ID_LEN],
        nonce: [2; wire::NONCE_LEN],
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn hello_decoder_is_total_and_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        match Hello::decode(&bytes) {
            Ok((h, used)) => {
                prop_assert!(used <= bytes.len() && used <= wire::MAX_HELLO_LEN);
                prop_assert_eq!(h.encode().len(), used);
            }
            // The reader never asks for more than the largest handshake.
            Err(DecodeError::NeedMore(n)) => {
                prop_assert!(n > bytes.len() && n <= wire::MAX_HELLO_LEN)
            }
            Err(_) => {}
        }
    }

    #[test]
    fn hello_with_valid_prefix_is_total(
        tail in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        // Garbage behind a valid preamble (magic, version, release) exercises the deeper
        // checks.
        let valid = a_valid_hello().encode();
        let mut bytes = valid[..wire::PREAMBLE_LEN].to_vec();
        bytes.extend_from_slice(&tail);
        match Hello::decode(&bytes) {
            Ok((_, used)) => prop_assert!(used <= bytes.len()),
            Err(DecodeError::NeedMore(n)) => prop_assert!(n > bytes.len() && n <= wire::MAX_HELLO_LEN),
            Err(_) => {}
        }
    }

    #[test]
    fn hello_round_trips(h in hello_strategy()) {
        let bytes = h.encode();
        prop_assert_eq!(Hello::decode(&bytes), Ok((h, bytes.len())));
    }

    #[test]
    fn reply_decoder_is_total_and_bounded(
        prefix in any::<bool>(),
        tail in proptest::collection::vec(any::<u8>(), 0..1100),
    ) {
        let mut bytes = if prefix { wire::REPLY_MAGIC.to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        match Reply::decode(&bytes) {
            Ok((r, used)) => {
                prop_assert!(used <= bytes.len());
                if let Reply::Refuse(why) = r {
                    prop_assert!(why.len() <= 3 * wire::MAX_REASON_LEN); // lossy UTF-8 may grow
                }
            }
            Err(DecodeError::NeedMore(n)) => prop_assert!(
                n > bytes.len() && n <= wire::REPLY_FIXED_LEN + wire::MAX_REASON_LEN
            ),
            Err(_) => {}
        }
    }

    #[test]
    fn reply_round_trips(refuse in any::<bool>(), why in ".{0,300}") {
        let r = if refuse { Reply::Refuse(why) } else { Reply::Accept };
        let bytes = r.encode();
        prop_assert_eq!(Reply::decode(&bytes), Ok((r, bytes.len())));
    }

    #[test]
    fn book_decoder_is_total_and_bounded(
        size in 1usize..16,
        tail in proptest::collection::vec(any::<u8>(), 0..800),
        claim in any::<bool>(),
    ) {
        let mut bytes = if claim { (size as u32).to_le_bytes().to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        match wire::decode_book(&bytes, size) {
            Ok((entries, used)) => {
                prop_assert_eq!(entries.len(), size);
                prop_assert!(used <= bytes.len());
            }
            Err(DecodeError::NeedMore(n)) => {
                prop_assert!(n > bytes.len() && n <= wire::max_book_len(size))
            }
            Err(_) => {}
        }
    }

    #[test]
    fn frame_headers_are_checked_before_any_payload(bytes in any::<[u8; 8]>(), expected in 0usize..1 << 20) {
        match wire::decode_header(bytes) {
            Header::Data(len) => {
                // Only the exact expected length is accepted: a larger claim is an error,
                // so the receiver never reads (let alone allocates) more than its buffer.
                let ok = wire::check_data_len(len, expected).is_ok();
                prop_assert_eq!(ok, len == expected as u64);
            }
            Header::Abort { .. } | Header::Unknown(_) => {
                prop_assert!(u64::from_le_bytes(bytes) & wire::CONTROL_BIT != 0)
            }
        }
    }

    #[test]
    fn answer_decoder_is_total_and_bounded(
        prefix in 0u8..3,
        tail in proptest::collection::vec(any::<u8>(), 0..1100),
    ) {
        let mut bytes = match prefix {
            0 => wire::CHALLENGE_MAGIC.to_vec(),
            1 => wire::REPLY_MAGIC.to_vec(),
            _ => Vec::new(),
        };
        bytes.extend_from_slice(&tail);
        match Answer::decode(&bytes) {
            Ok((_, used)) => prop_assert!(used <= bytes.len()),
            // The connector reads at most a challenge or a refusal.
            Err(DecodeError::NeedMore(n)) => prop_assert!(
                n > bytes.len() && n <= wire::CHALLENGE_LEN + wire::MAX_REASON_LEN
            ),
            Err(_) => {}
        }
    }

    #[test]
    fn challenges_and_proofs_round_trip(
        nonce in any::<[u8; wire::NONCE_LEN]>(),
        proof in any::<[u8; wire::PROOF_TAG_LEN]>(),
    ) {
        let c = Answer::encode_challenge(&nonce, &proof);
        prop_assert_eq!(
            Answer::decode(&c),
            Ok((Answer::Challenge { nonce, proof }, wire::CHALLENGE_LEN))
        );
        let p = wire::encode_proof(&proof);
        prop_assert_eq!(wire::decode_proof(&p), Ok((proof, wire::PROOF_LEN)));
    }

    #[test]
    fn proof_decoder_is_total_and_bounded(
        prefix in any::<bool>(),
        tail in proptest::collection::vec(any::<u8>(), 0..80),
    ) {
        let mut bytes = if prefix { wire::PROOF_MAGIC.to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        match wire::decode_proof(&bytes) {
            Ok((_, used)) => prop_assert_eq!(used, wire::PROOF_LEN),
            Err(DecodeError::NeedMore(n)) => prop_assert!(n > bytes.len() && n <= wire::PROOF_LEN),
            Err(_) => {}
        }
    }

    #[test]
    fn books_round_trip(book in proptest::collection::vec("[0-9a-f:.\\[\\]]{0,60}", 1..16)) {
        let bytes = wire::encode_book(&book);
        prop_assert!(bytes.len() <= wire::max_book_len(book.len()));
        prop_assert_eq!(wire::decode_book(&bytes, book.len()), Ok((book.clone(), bytes.len())));
        prop_assert_eq!(
            wire::decode_rendezvous_answer(&bytes, book.len()),
            Ok((RendezvousAnswer::Book(book), bytes.len()))
        );
    }

    #[test]
    fn rendezvous_failures_round_trip(lost in any::<u32>(), reason in ".{0,200}", size in 1usize..16) {
        let bytes = wire::encode_rendezvous_failure(lost, &reason);
        prop_assert!(bytes.len() <= wire::max_rendezvous_answer_len(size));
        prop_assert_eq!(
            wire::decode_rendezvous_answer(&bytes, size),
            Ok((RendezvousAnswer::Failed { lost, reason }, bytes.len()))
        );
    }

    #[test]
    fn rendezvous_answer_decoder_is_total_and_bounded(
        size in 1usize..16,
        failed in any::<bool>(),
        tail in proptest::collection::vec(any::<u8>(), 0..1100),
    ) {
        let mut bytes = if failed { u32::MAX.to_le_bytes().to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        match wire::decode_rendezvous_answer(&bytes, size) {
            Ok((_, used)) => prop_assert!(used <= bytes.len()),
            Err(DecodeError::NeedMore(n)) => {
                prop_assert!(n > bytes.len() && n <= wire::max_rendezvous_answer_len(size))
            }
            Err(_) => {}
        }
    }
}
