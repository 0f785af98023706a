//! The pacing policy: when a rank enters its next negotiation round.

/// The pacing policy (back-pressure), shared by the engine and the scale model: it decides
/// only *when* a rank enters its next negotiation round, never what a round decides.
///
/// A rank defers its next round while **every** channel still holds unfinished work (queued or
/// running) and together at least [`Pacing::min_bytes`], for at most [`Pacing::max_defer`].
/// While every channel is busy, a new round's groups could only queue behind that work, so
/// deferring costs nothing and lets more gradients fuse into the round: fewer, larger
/// collectives, which is what matters where each collective pays a large latency (many
/// ranks). As soon as one channel drains, the round starts, so an idle channel never waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// Whether back-pressure is on.
    pub enabled: bool,
    /// Defer only while the channels together hold at least this many unfinished bytes
    /// (0: any amount, as long as every channel is busy).
    pub min_bytes: u64,
    /// Never defer a round longer than this.
    pub max_defer: std::time::Duration,
}

impl Pacing {
    /// No back-pressure.
    pub const OFF: Pacing = Pacing {
        enabled: false,
        min_bytes: 0,
        max_defer: std::time::Duration::ZERO,
    };

    /// Whether a rank keeps deferring its next round: `busy` of its `channels` channels hold
    /// unfinished work, `unfinished` bytes in all, and it has deferred for `deferred` so far.
    pub fn defer(
        &self,
        busy: usize,
        channels: usize,
        unfinished: u64,
        deferred: std::time::Duration,
    ) -> bool {
        self.enabled
            && channels > 0
            && busy >= channels
            && unfinished >= self.min_bytes
            && deferred < self.max_defer
    }
}
