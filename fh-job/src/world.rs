//! Who is in the world: a rank's place ([`Topology`]) and the world's identity (the nonce rank 0
//! draws for each world, [`WORLD_ID_LEN`] bytes, which keys its heartbeats and names its
//! shared-memory segments).

use fh_core::bytes::{DecodeError, Reader};

/// Length of a world's identity, in bytes.
pub const WORLD_ID_LEN: usize = 16;

/// Where a rank sits: its global rank and size, and its place among the ranks of its host
/// (`local_*`) and among the hosts (`cross_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Global rank, `0..size`.
    pub rank: usize,
    /// Number of ranks in the world.
    pub size: usize,
    /// Rank among the ranks of this host.
    pub local_rank: usize,
    /// Number of ranks on this host.
    pub local_size: usize,
    /// Index of this host among the hosts (rank among the ranks with the same `local_rank`).
    pub cross_rank: usize,
    /// Number of hosts.
    pub cross_size: usize,
}

impl Topology {
    /// The topology of `size` ranks all on one host.
    pub fn single_host(rank: usize, size: usize) -> Self {
        Topology {
            rank,
            size,
            local_rank: rank,
            local_size: size,
            cross_rank: 0,
            cross_size: 1,
        }
    }

    /// Whether every host runs the same number of ranks.
    pub fn is_homogeneous(&self) -> bool {
        self.local_size * self.cross_size == self.size
    }
}

/// A world id as text (hex), for messages.
pub fn world_hex(id: &[u8; WORLD_ID_LEN]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decode the world id rank 0 sends at the end of the rendezvous: [`WORLD_ID_LEN`] bytes, never
/// all zeros (zeros mean "not known yet"). Returns the id and the bytes it used.
pub fn decode_world_id(buf: &[u8]) -> Result<([u8; WORLD_ID_LEN], usize), DecodeError> {
    let mut r = Reader::new(buf);
    let id: [u8; WORLD_ID_LEN] = r.array()?;
    if id == [0; WORLD_ID_LEN] {
        return Err(DecodeError::Invalid("a world id of all zeros".into()));
    }
    Ok((id, r.pos()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_world_id_truncated_all_zeros_or_followed_by_more() {
        let id = [7u8; WORLD_ID_LEN];
        for cut in 0..WORLD_ID_LEN {
            assert_eq!(
                decode_world_id(&id[..cut]),
                Err(DecodeError::NeedMore(WORLD_ID_LEN))
            );
        }
        assert_eq!(
            decode_world_id(&[0; WORLD_ID_LEN]),
            Err(DecodeError::Invalid("a world id of all zeros".into()))
        );
        let mut longer = id.to_vec();
        longer.push(1);
        assert_eq!(decode_world_id(&longer), Ok((id, WORLD_ID_LEN)));
    }

    proptest! {
        #[test]
        fn a_world_id_decoder_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            match decode_world_id(&bytes) {
                Ok((id, used)) => {
                    prop_assert_eq!(used, WORLD_ID_LEN);
                    prop_assert_eq!(&id[..], &bytes[..WORLD_ID_LEN]);
                    prop_assert!(id != [0; WORLD_ID_LEN]);
                }
                Err(DecodeError::NeedMore(n)) => {
                    prop_assert!(bytes.len() < WORLD_ID_LEN && n == WORLD_ID_LEN)
                }
                Err(DecodeError::Invalid(_)) => prop_assert!(bytes[..WORLD_ID_LEN] == [0; WORLD_ID_LEN]),
            }
        }
    }
}
