//! One heartbeat datagram: who sends it to whom, its place in the sender's sequence, what it
//! says (alive, leaving, or which rank it lost), the silence its sender tolerates, the job's
//! world id, and a MAC keyed with the job token's key over all of it. Fixed length; anything
//! else on the socket is dropped before the MAC is computed.

use fh_core::bytes::{DecodeError, Reader};
use fh_job::token::constant_time_eq;

use crate::backend::tcp::wire::WORLD_ID_LEN;
use crate::backend::tcp::Key;

/// First bytes of every heartbeat.
const MAGIC: [u8; 4] = *b"FHLB";
/// The format's version.
const VERSION: u8 = 1;
/// Bytes of a heartbeat on the wire.
pub(crate) const LEN: usize = 48 + MAC_LEN;
/// Bytes of the (truncated) HMAC-SHA-256 tag.
const MAC_LEN: usize = 16;
/// Domain separation of the MAC from every other use of the key.
const DOMAIN: &[u8] = b"fasthorovod heartbeat";

/// What a heartbeat says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The sender's engine is alive.
    Alive,
    /// The sender leaves in order (its world closed): its silence from now on is no fault.
    Bye,
    /// The sender stopped because it lost this rank (itself, when it failed on its own).
    Lost(u32),
}

/// A heartbeat's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Beat {
    pub(crate) from: u32,
    pub(crate) to: u32,
    /// Increases with every round of beats the sender sends (replays are older).
    pub(crate) seq: u64,
    pub(crate) kind: Kind,
    /// The silence the sender tolerates before it declares a peer lost, in milliseconds.
    pub(crate) silence_ms: u32,
    pub(crate) world: [u8; WORLD_ID_LEN],
}

impl Beat {
    /// The datagram, MAC included.
    pub(crate) fn encode(&self, key: &Key) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        let (kind, lost) = match self.kind {
            Kind::Alive => (0, 0),
            Kind::Bye => (1, 0),
            Kind::Lost(r) => (2, r),
        };
        b[5] = kind;
        b[8..12].copy_from_slice(&self.from.to_le_bytes());
        b[12..16].copy_from_slice(&self.to.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&lost.to_le_bytes());
        b[28..32].copy_from_slice(&self.silence_ms.to_le_bytes());
        b[32..48].copy_from_slice(&self.world);
        let tag = key.mac(&[DOMAIN, &b[..48]]);
        b[48..].copy_from_slice(&tag[..MAC_LEN]);
        b
    }

    /// The heartbeat in `b`, if `b` is one of this world's, sent to `me`, with a valid MAC.
    pub(crate) fn decode(b: &[u8], key: &Key, world: &[u8; WORLD_ID_LEN], me: u32) -> Option<Beat> {
        if b.len() != LEN {
            return None;
        }
        let (beat, tag) = read(b).ok()?;
        if beat.world != *world || beat.to != me {
            return None;
        }
        let mac = key.mac(&[DOMAIN, &b[..LEN - MAC_LEN]]);
        // Constant time is not needed against a forger who learns nothing from timing about a
        // fresh tag per datagram, but costs nothing.
        constant_time_eq(&mac[..MAC_LEN], &tag).then_some(beat)
    }
}

/// The fields of a heartbeat of [`LEN`] bytes and its tag, MAC not checked: an error for
/// anything that is not a heartbeat of this format.
fn read(b: &[u8]) -> Result<(Beat, [u8; MAC_LEN]), DecodeError> {
    let mut r = Reader::new(b);
    r.magic(&MAGIC, || "not a heartbeat".into())?;
    let version = r.u8()?;
    if version != VERSION {
        return Err(DecodeError::Invalid(format!(
            "a heartbeat of version {version}"
        )));
    }
    let kind = r.u8()?;
    let _reserved = r.u16()?;
    let (from, to, seq, lost, silence_ms) = (r.u32()?, r.u32()?, r.u64()?, r.u32()?, r.u32()?);
    let kind = match kind {
        0 => Kind::Alive,
        1 => Kind::Bye,
        2 => Kind::Lost(lost),
        k => return Err(DecodeError::Invalid(format!("a heartbeat of kind {k}"))),
    };
    let beat = Beat {
        from,
        to,
        seq,
        kind,
        silence_ms,
        world: r.array()?,
    };
    Ok((beat, r.array()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn beat(kind: Kind) -> Beat {
        Beat {
            from: 3,
            to: 1,
            seq: 77,
            kind,
            silence_ms: 1500,
            world: [9; WORLD_ID_LEN],
        }
    }

    #[test]
    fn a_beat_round_trips_and_anything_else_is_dropped() {
        let key = Key::new(b"0123456789abcdef-token");
        for kind in [Kind::Alive, Kind::Bye, Kind::Lost(2)] {
            let b = beat(kind);
            let bytes = b.encode(&key);
            assert_eq!(Beat::decode(&bytes, &key, &b.world, 1), Some(b));
            // Another receiver, world or key: dropped.
            assert_eq!(Beat::decode(&bytes, &key, &b.world, 2), None);
            assert_eq!(Beat::decode(&bytes, &key, &[8; WORLD_ID_LEN], 1), None);
            assert_eq!(
                Beat::decode(&bytes, &Key::new(b"another-token-entirely"), &b.world, 1),
                None
            );
            assert_eq!(Beat::decode(&bytes[..LEN - 1], &key, &b.world, 1), None);
            // Truncated or over-long: dropped.
            let mut longer = bytes.to_vec();
            longer.push(0);
            assert_eq!(Beat::decode(&longer, &key, &b.world, 1), None);
        }
    }

    proptest! {
        #[test]
        fn any_flipped_bit_is_refused(at in 0..LEN * 8) {
            let key = Key::new(b"0123456789abcdef-token");
            let b = beat(Kind::Lost(5));
            let mut bytes = b.encode(&key);
            bytes[at / 8] ^= 1 << (at % 8);
            prop_assert_eq!(Beat::decode(&bytes, &key, &b.world, 1), None);
        }

        #[test]
        fn arbitrary_datagrams_are_dropped_without_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..2 * LEN),
            magic in any::<bool>(),
        ) {
            let key = Key::new(b"0123456789abcdef-token");
            let mut bytes = bytes;
            if magic && bytes.len() >= 5 {
                bytes[..4].copy_from_slice(&MAGIC);
                bytes[4] = VERSION;
            }
            prop_assert_eq!(Beat::decode(&bytes, &key, &[9; WORLD_ID_LEN], 1), None);
        }
    }
}
