//! Whom the heartbeats condemn: when each peer was last heard, and the judgement that a peer
//! silent for longer than the tolerated silence is lost. Pure (the clock is passed in).
//!
//! **The same rank on every rank.** When a host is cut off, all its ranks fall silent at once,
//! but each was last heard at its own moment within one interval. So when the first of them
//! passes the tolerated silence, every peer silent for nearly as long (within two intervals) is
//! a suspect too, and the *lowest* suspect is named: every rank on the other side of the cut
//! names the same rank. A single frozen rank is the only suspect.
//!
//! **This rank's own stalls.** A silence that overlaps this rank's own stall (its process was
//! stopped, or its thread did not run) proves nothing about the peers: after a gap of half the
//! tolerated silence between two looks, every peer's silence counts from the end of the gap.

use std::time::{Duration, Instant};

/// The silence judgement of one rank's heartbeats.
#[derive(Debug)]
pub(crate) struct Tracker {
    me: usize,
    /// This rank's tolerated silence.
    silence: Duration,
    /// The interval between heartbeats.
    interval: Duration,
    /// When each peer was last heard (or the start, or the end of this rank's last stall).
    heard: Vec<Instant>,
    /// The highest sequence number heard from each peer (older heartbeats are replays).
    seq: Vec<u64>,
    /// The silence each peer says it tolerates (the larger of its and ours is used for it).
    tolerance: Vec<Duration>,
    /// Peers that left in order: never blamed for their silence.
    departed: Vec<bool>,
    /// When this rank last looked.
    last_look: Instant,
    /// The longest time between two heartbeats heard from each peer (see [`Tracker::gaps`]).
    longest: Vec<Duration>,
}

/// A peer found silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Silent {
    pub(crate) rank: usize,
    /// How long it has been silent.
    pub(crate) for_: Duration,
}

impl Tracker {
    pub(crate) fn new(
        me: usize,
        size: usize,
        interval: Duration,
        silence: Duration,
        now: Instant,
    ) -> Self {
        Tracker {
            me,
            silence,
            interval,
            heard: vec![now; size],
            seq: vec![0; size],
            tolerance: vec![silence; size],
            departed: vec![false; size],
            last_look: now,
            longest: vec![Duration::ZERO; size],
        }
    }

    /// The longest time between two heartbeats heard from each peer so far (its first
    /// heartbeat and this rank's own stalls excepted): what the tolerated silence must cover.
    pub(crate) fn gaps(&self) -> &[Duration] {
        &self.longest
    }

    /// A valid heartbeat from `from` with sequence number `seq`, announcing the silence it
    /// tolerates: whether it is fresh (not a replay or a duplicate), recorded if so.
    pub(crate) fn heard(
        &mut self,
        from: usize,
        seq: u64,
        tolerates: Duration,
        now: Instant,
    ) -> bool {
        if from >= self.heard.len() || from == self.me || seq <= self.seq[from] {
            return false;
        }
        if self.seq[from] > 0 {
            let gap = now.saturating_duration_since(self.heard[from]);
            self.longest[from] = self.longest[from].max(gap);
        }
        self.seq[from] = seq;
        self.heard[from] = now;
        self.tolerance[from] = tolerates.max(self.silence);
        true
    }

    /// `from` left in order.
    pub(crate) fn departed(&mut self, from: usize) {
        if let Some(d) = self.departed.get_mut(from) {
            *d = true;
        }
    }

    /// Whether `peer` has been silent for at least half the tolerated silence (a suspect;
    /// not worth a slow notice).
    pub(crate) fn is_quiet(&self, peer: usize, now: Instant) -> bool {
        peer < self.heard.len()
            && peer != self.me
            && !self.departed[peer]
            && now.saturating_duration_since(self.heard[peer]) >= self.tolerance[peer] / 2
    }

    /// Look at the peers at `now`: the peer to declare lost, if one has been silent for longer
    /// than it is tolerated (see the module documentation for which one is named).
    pub(crate) fn look(&mut self, now: Instant) -> Option<Silent> {
        let gap = now.saturating_duration_since(self.last_look);
        self.last_look = now;
        if gap >= self.silence / 2 {
            // This rank did not look for a long while: it cannot tell the peers' silence from
            // its own.
            for h in &mut self.heard {
                *h = (*h).max(now);
            }
            return None;
        }
        let silent = |r: usize| now.saturating_duration_since(self.heard[r]);
        let candidates = || (0..self.heard.len()).filter(|&r| r != self.me && !self.departed[r]);
        candidates().find(|&r| silent(r) >= self.tolerance[r])?;
        let near = self.interval * 2;
        candidates()
            .find(|&r| silent(r) + near >= self.tolerance[r])
            .map(|rank| Silent {
                rank,
                for_: silent(rank),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: Duration = Duration::from_millis(200);
    const S: Duration = Duration::from_millis(1500);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Feed beats every `I` from `alive` ranks, from t0 to `until`, looking after each.
    fn run(
        t: &mut Tracker,
        t0: Instant,
        until: Duration,
        alive: impl Fn(usize, Duration) -> bool,
        n: usize,
    ) -> Option<(Duration, Silent)> {
        let mut at = Duration::ZERO;
        let mut seq = 1;
        while at <= until {
            let now = t0 + at;
            for r in 0..n {
                if alive(r, at) {
                    t.heard(r, seq, S, now);
                }
            }
            seq += 1;
            if let Some(s) = t.look(now) {
                return Some((at, s));
            }
            at += I / 2;
        }
        None
    }

    #[test]
    fn a_frozen_peer_is_named_after_the_silence_and_the_living_never() {
        let t0 = Instant::now();
        let mut t = Tracker::new(0, 4, I, S, t0);
        assert_eq!(run(&mut t, t0, ms(20_000), |_, _| true, 4), None);
        let mut t = Tracker::new(0, 4, I, S, t0);
        let (at, s) = run(&mut t, t0, ms(20_000), |r, at| r != 2 || at < ms(5000), 4).unwrap();
        assert_eq!(s.rank, 2);
        assert!(at >= ms(5000) + S - I && at <= ms(5000) + S + I, "{at:?}");
    }

    #[test]
    fn a_cut_host_is_named_by_its_lowest_rank_whoever_fell_silent_first() {
        let t0 = Instant::now();
        // Ranks 2 and 3 fall silent; 3's last beat came an interval later than 2's... and the
        // other way round: rank 2 is named either way.
        for (last2, last3) in [(ms(5000), ms(5200)), (ms(5200), ms(5000))] {
            let mut t = Tracker::new(1, 4, I, S, t0);
            let alive = |r: usize, at: Duration| match r {
                2 => at < last2,
                3 => at < last3,
                _ => true,
            };
            let (_, s) = run(&mut t, t0, ms(20_000), alive, 4).unwrap();
            assert_eq!(s.rank, 2);
        }
    }

    #[test]
    fn replays_do_not_revive_and_departed_peers_are_never_blamed() {
        let t0 = Instant::now();
        let mut t = Tracker::new(0, 3, I, S, t0);
        assert!(t.heard(1, 5, S, t0));
        assert!(!t.heard(1, 5, S, t0 + ms(100)));
        assert!(!t.heard(1, 4, S, t0 + ms(100)));
        assert!(!t.heard(0, 9, S, t0), "not from oneself");
        assert!(!t.heard(7, 9, S, t0), "not from outside the world");
        assert!(t.heard(1, 6, S, t0 + ms(700)));
        assert_eq!(t.gaps()[1], ms(700));
        t.departed(2);
        // Rank 2 is never heard again; rank 1 keeps beating.
        assert_eq!(run(&mut t, t0, ms(10_000), |r, _| r == 1, 3), None);
        assert!(!t.is_quiet(2, t0 + ms(10_000)));
    }

    #[test]
    fn a_peer_tolerating_more_silence_gets_it() {
        let t0 = Instant::now();
        let mut t = Tracker::new(0, 2, I, S, t0);
        assert!(t.heard(1, 1, ms(4000), t0));
        let mut at = ms(100);
        while at < ms(3900) {
            assert_eq!(t.look(t0 + at), None, "at {at:?}");
            at += ms(100);
        }
        at += ms(200);
        assert_eq!(t.look(t0 + at).map(|s| s.rank), Some(1));
    }

    #[test]
    fn this_ranks_own_stall_blames_nobody() {
        let t0 = Instant::now();
        let mut t = Tracker::new(0, 3, I, S, t0);
        t.heard(1, 1, S, t0);
        t.heard(2, 1, S, t0);
        assert_eq!(t.look(t0 + ms(100)), None);
        // This rank was stopped for 10 s: when it runs again, nobody is to blame yet...
        assert_eq!(t.look(t0 + ms(10_100)), None);
        // ... and a peer that stays silent afterwards is named a silence later.
        t.heard(1, 2, S, t0 + ms(10_150));
        assert_eq!(t.look(t0 + ms(10_200)), None);
        let mut at = ms(10_300);
        loop {
            if let Some(s) = t.look(t0 + at) {
                assert_eq!(s.rank, 2);
                assert!(at >= ms(10_100) + S);
                break;
            }
            t.heard(1, at.as_millis() as u64, S, t0 + at);
            at += ms(100);
        }
        assert!(t.is_quiet(2, t0 + at));
        assert!(!t.is_quiet(1, t0 + at));
    }
}
