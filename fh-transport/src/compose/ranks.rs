//! The one rank-renumbering view of the composed worlds: a group of world ranks numbered
//! `0..n` by their position in an ascending list. Subsets (process sets), the hierarchical
//! backend's lanes and leaders, and a backend's own group communicators all translate through
//! it: group ranks to world ranks for messages, and the ranks an error names back to world
//! ranks, so that every error a caller sees names a world rank.

use crate::{Result, TransportError};

/// A group's members (world ranks) by group rank.
#[derive(Debug, Clone, Copy)]
pub struct RankView<'a>(pub &'a [usize]);

impl RankView<'_> {
    /// The world rank of group rank `peer`; an error naming the group when it is out of range.
    pub fn world(&self, peer: usize) -> Result<usize> {
        self.0.get(peer).copied().ok_or_else(|| {
            TransportError::InvalidArgument(format!(
                "peer {peer} out of range 0..{} (the group of world ranks {:?})",
                self.0.len(),
                self.0
            ))
        })
    }

    /// `e` with the group rank it names (if any) as the world rank.
    pub fn error_to_world(&self, e: TransportError) -> TransportError {
        let world = |i: usize| self.0.get(i).copied().unwrap_or(i);
        match e {
            TransportError::PeerLost { rank, detail } => TransportError::PeerLost {
                rank: world(rank),
                detail,
            },
            TransportError::Timeout { rank, op, after } => TransportError::Timeout {
                rank: world(rank),
                op,
                after,
            },
            TransportError::Protocol { rank, detail } => TransportError::Protocol {
                rank: world(rank),
                detail,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ranks_and_errors_become_world_ranks() {
        let members = [2, 5, 7];
        let v = RankView(&members);
        assert_eq!(v.world(1).unwrap(), 5);
        assert!(matches!(
            v.world(3),
            Err(TransportError::InvalidArgument(_))
        ));
        let e = v.error_to_world(TransportError::PeerLost {
            rank: 2,
            detail: "gone".into(),
        });
        assert_eq!(e.blamed_rank(), Some(7));
        let e = v.error_to_world(TransportError::Closed("x".into()));
        assert!(matches!(e, TransportError::Closed(_)));
    }
}
