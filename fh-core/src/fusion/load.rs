//! The load each channel has been given, carried from round to round.

/// The bytes each channel has been given so far, carried from round to round so that
/// channel assignment balances over a whole step rather than restarting at channel 0 in every
/// round. It changes only through [`plan_round`](super::plan_round), i.e. only as a function of the agreed rounds,
/// so every rank holds the same value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelLoad {
    pub(super) bytes: Vec<u64>,
}

impl ChannelLoad {
    /// No load on `channels` channels (at least one).
    pub fn new(channels: usize) -> Self {
        ChannelLoad {
            bytes: vec![0; channels.max(1)],
        }
    }

    /// Bytes assigned to each channel, relative to the least loaded one.
    pub fn bytes(&self) -> &[u64] {
        &self.bytes
    }

    /// The least-loaded channel of `among` (bit `c` = channel `c`; lowest index on ties).
    pub(super) fn pick(&self, among: u64) -> usize {
        self.bytes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i >= 64 || among & (1 << i) != 0)
            .min_by_key(|(i, l)| (**l, *i))
            .map_or(0, |(i, _)| i)
    }

    pub(super) fn add(&mut self, channel: usize, bytes: u64) {
        if let Some(l) = self.bytes.get_mut(channel) {
            *l = l.saturating_add(bytes);
        }
        // Keep only the differences, so the counters never grow without bound.
        let min = self.bytes.iter().copied().min().unwrap_or(0);
        self.bytes.iter_mut().for_each(|l| *l -= min);
    }
}
