//! A local inconsistency (a negotiated tensor this rank cannot run) becomes one error that
//! every rank stops with.

use crate::SchedulerError;

/// Longest fault description a rank sends to the others.
const MAX_FAULT_TEXT: usize = 4096;

/// What a rank sends in the fault exchange: nothing, or its tensor name and what went wrong.
pub(crate) fn encode(fault: Option<&(String, String)>) -> Vec<u8> {
    match fault {
        Some((name, text)) => {
            let mut b = name.as_bytes().to_vec();
            b.push(0);
            let mut end = text.len().min(MAX_FAULT_TEXT);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            b.extend_from_slice(&text.as_bytes()[..end]);
            b
        }
        None => Vec::new(),
    }
}

/// The error every rank stops with, from every rank's [`encode`]d fault (in rank order): the
/// lowest faulty rank's, naming it (as `world` maps it: a process set's engine names world
/// ranks), its tensor and what went wrong.
pub(crate) fn agreed(all: &[Vec<u8>], world: impl Fn(usize) -> usize) -> SchedulerError {
    let Some((rank, blob)) = all.iter().enumerate().find(|(_, b)| !b.is_empty()) else {
        return SchedulerError::Transport {
            lost_rank: None,
            message: "a rank raised the fault flag but sent no fault".into(),
            source: None,
        };
    };
    let rank = world(rank);
    let text = String::from_utf8_lossy(blob);
    let (name, what) = text.split_once('\0').unwrap_or(("?", &text));
    SchedulerError::Negotiation {
        name: name.to_string(),
        reason: format!(
            "rank {rank} could not run this negotiated tensor ({what}); the engine stopped on \
             every rank"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_faulty_rank_is_named() {
        let f = |n: &str, t: &str| encode(Some(&(n.to_string(), t.to_string())));
        let all = vec![Vec::new(), f("w", "no memory"), f("v", "other")];
        assert_eq!(
            agreed(&all, |r| r).to_string(),
            "tensor 'w': rank 1 could not run this negotiated tensor (no memory); the engine \
             stopped on every rank"
        );
        assert!(encode(None).is_empty());
        assert!(f("x", &"é".repeat(5000)).len() <= 2 + MAX_FAULT_TEXT);
        assert!(agreed(&[Vec::new()], |r| r)
            .to_string()
            .contains("no fault"));
        // A process set's engine names the member's world rank.
        assert!(agreed(&all, |r| [3, 5, 6][r])
            .to_string()
            .contains("rank 5 could not run"));
    }
}
