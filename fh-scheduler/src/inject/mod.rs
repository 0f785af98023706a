//! The fault-injection seam: the named fallible steps between a submission and its completion
//! that are not communicator calls, each of which a test can make fail on one rank.
//!
//! Communicator calls (every negotiation step, the agreements, every collective of a group)
//! are failed by the tests through a wrapping transport that fails the n-th call on a rank,
//! for every n a clean run makes; the steps here are the others. In a build without
//! `cfg(test)`, [`hit`] is a constant `false` that the compiler removes: nothing of the seam
//! is in a release build's hot path.

/// A fallible step that is not a communicator call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Point {
    /// Taking this rank's tensor for a negotiated response (a name it never submitted, a
    /// joined rank's zeros it cannot allocate).
    TakeTensor,
    /// Handing a fused group to its channel's worker thread (the worker is gone).
    ChannelQueue,
    /// A channel's worker thread panics while running a group.
    ChannelPanic,
    /// The control thread panics while running a small group itself.
    InlinePanic,
}

impl Point {
    /// Every point, for the tests that fail each in turn.
    #[cfg(test)]
    pub(crate) const ALL: [Point; 4] = [
        Point::TakeTensor,
        Point::ChannelQueue,
        Point::ChannelPanic,
        Point::InlinePanic,
    ];
}

#[cfg(test)]
static ARMED: std::sync::Mutex<Vec<(usize, Point, String)>> = std::sync::Mutex::new(Vec::new());

/// Make `point` fail on `rank` for the tensor `name` (names are unique per test, so tests
/// running in parallel do not meet).
#[cfg(test)]
pub(crate) fn arm(rank: usize, point: Point, name: &str) {
    ARMED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((rank, point, name.to_string()));
}

/// Whether `point` is to fail on `rank` for the tensor `name`.
#[cfg(test)]
pub(crate) fn hit(rank: usize, point: Point, name: &str) -> bool {
    ARMED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|(r, p, n)| *r == rank && *p == point && n == name)
}

#[cfg(test)]
mod tests;

/// Whether `point` is to fail: never, outside the tests.
#[cfg(not(test))]
#[inline(always)]
pub(crate) fn hit(_rank: usize, _point: Point, _name: &str) -> bool {
    false
}
