//! An agreed shutdown: every rank learns which ranks asked for it and why, so that a rank
//! that leaves (an exception, an exit, `shutdown()` on one rank only) is named in the others'
//! error.

/// Longest reason a rank sends to the others.
const MAX_REASON: usize = 2048;

/// What a rank sends in the shutdown exchange: nothing when it did not ask to shut down,
/// else one marker byte followed by its reason (possibly empty).
pub(crate) fn encode(requested: bool, reason: Option<&str>) -> Vec<u8> {
    if !requested {
        return Vec::new();
    }
    let mut b = vec![1u8];
    if let Some(text) = reason {
        let mut end = text.len().min(MAX_REASON);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        b.extend_from_slice(&text.as_bytes()[..end]);
    }
    b
}

/// Why the engine of rank `me` shuts down, from every rank's [`encode`]d request (in the
/// order of this engine's ranks); `world` maps an engine rank to the rank named in messages
/// (the world rank, for a process set's engine).
pub(crate) fn describe(all: &[Vec<u8>], me: usize, world: impl Fn(usize) -> usize) -> String {
    let mut others = Vec::new();
    let mut mine = false;
    for (rank, blob) in all.iter().enumerate() {
        if blob.is_empty() {
            continue;
        }
        if rank == me {
            mine = true;
            continue;
        }
        let reason = String::from_utf8_lossy(&blob[1..]);
        let reason = reason.trim();
        others.push(if reason.is_empty() {
            format!("rank {} shut down", world(rank))
        } else {
            format!("rank {} shut down: {reason}", world(rank))
        });
    }
    match (mine, others.is_empty()) {
        (true, true) => "shutdown requested on this rank".into(),
        (true, false) => format!(
            "shutdown requested on this rank and by another: {}",
            others.join("; ")
        ),
        (false, false) => others.join("; "),
        // The flag was raised but nobody says so: cannot happen with a consistent exchange.
        (false, true) => "shutdown requested by another rank (which one was not said)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_that_shut_down_are_named_with_their_reasons() {
        let all = vec![
            Vec::new(),
            encode(true, Some("raised ValueError: bad batch")),
            Vec::new(),
        ];
        assert_eq!(
            describe(&all, 0, |r| r),
            "rank 1 shut down: raised ValueError: bad batch"
        );
        assert_eq!(describe(&all, 1, |r| r), "shutdown requested on this rank");
        // A process set's engine names world ranks.
        assert_eq!(
            describe(&all, 2, |r| [4, 6, 7][r]),
            "rank 6 shut down: raised ValueError: bad batch"
        );
        let both = vec![
            encode(true, None),
            encode(true, Some("hvd.shutdown() was called")),
        ];
        assert_eq!(
            describe(&both, 0, |r| r),
            "shutdown requested on this rank and by another: rank 1 shut down: hvd.shutdown() \
             was called"
        );
        assert_eq!(
            describe(&both, 1, |r| r).as_str(),
            "shutdown requested on this rank and by another: rank 0 shut down"
        );
        assert!(describe(&[Vec::new(), Vec::new()], 0, |r| r).contains("not said"));
        assert!(encode(false, Some("x")).is_empty());
        assert!(encode(true, Some(&"é".repeat(5000))).len() <= 1 + MAX_REASON);
    }
}
