//! The driver's host set: the hosts the discovery script names (in its order), the
//! blacklist (for good, or for a cooldown), and the stamp bumped at every change of the
//! usable set. Pure: time comes in as arguments.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::hosts::Host;

/// A change of the usable host set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The new stamp.
    pub stamp: u64,
    /// Hosts became usable.
    pub added: bool,
    /// Hosts stopped being usable.
    pub removed: bool,
}

/// The host set.
#[derive(Debug, Default)]
pub struct HostState {
    discovered: Vec<Host>,
    /// Blacklisted hosts, until when (`None`: for good).
    blacklist: HashMap<String, Option<Instant>>,
    /// `--blacklist-cooldown-range MIN MAX`, seconds.
    cooldown: Option<(u64, u64)>,
    /// How many times each host was blacklisted (its cooldown doubles each time).
    strikes: HashMap<String, u32>,
    stamp: u64,
}

impl HostState {
    /// An empty set; blacklisting is for good unless `cooldown` gives a range of seconds.
    pub fn new(cooldown: Option<(u64, u64)>) -> HostState {
        HostState {
            cooldown,
            ..HostState::default()
        }
    }

    /// The current stamp.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// The usable hosts (discovered, not blacklisted), in discovery order.
    pub fn usable(&self) -> Vec<&Host> {
        self.discovered
            .iter()
            .filter(|h| !self.blacklist.contains_key(&h.name))
            .collect()
    }

    /// Whether `host` is usable.
    pub fn is_usable(&self, host: &str) -> bool {
        self.usable().iter().any(|h| h.name == host)
    }

    /// Whether `host` is blacklisted now.
    pub fn is_blacklisted(&self, host: &str) -> bool {
        self.blacklist.contains_key(host)
    }

    /// `host`'s place in the discovery order (hosts not discovered come last).
    pub fn order(&self, host: &str) -> usize {
        self.discovered
            .iter()
            .position(|h| h.name == host)
            .unwrap_or(usize::MAX)
    }

    fn names(&self) -> Vec<String> {
        self.usable().iter().map(|h| h.name.clone()).collect()
    }

    fn commit(&mut self, before: Vec<String>) -> Option<Change> {
        let after = self.names();
        let added = after.iter().any(|h| !before.contains(h));
        let removed = before.iter().any(|h| !after.contains(h));
        if !added && !removed {
            return None;
        }
        self.stamp += 1;
        Some(Change {
            stamp: self.stamp,
            added,
            removed,
        })
    }

    /// The discovery script's latest answer.
    pub fn discovered(&mut self, hosts: Vec<Host>) -> Option<Change> {
        let before = self.names();
        self.discovered = hosts;
        self.commit(before)
    }

    /// Blacklist `host` at `now`: for good, or, with a cooldown range `MIN..MAX`, for
    /// [`cooldown`]`(MIN, MAX, n, draw())` seconds after its n-th blacklisting (`draw()`: a
    /// uniform number in `[0, 1)`). Returns the change of the usable set, and the cooldown
    /// given.
    pub fn blacklist(
        &mut self,
        host: &str,
        now: Instant,
        draw: impl FnOnce() -> f64,
    ) -> (Option<Change>, Option<Duration>) {
        let before = self.names();
        let strikes = self.strikes.entry(host.to_string()).or_insert(0);
        *strikes += 1;
        let n = *strikes;
        let cooldown = self.cooldown.map(|(lo, hi)| cooldown(lo, hi, n, draw()));
        self.blacklist
            .insert(host.to_string(), cooldown.map(|c| now + c));
        (self.commit(before), cooldown)
    }

    /// Lift the cooldowns that have expired at `now`; returns the hosts and the change.
    pub fn expire(&mut self, now: Instant) -> (Vec<String>, Option<Change>) {
        let before = self.names();
        let done: Vec<String> = self
            .blacklist
            .iter()
            .filter(|(_, until)| until.is_some_and(|u| now >= u))
            .map(|(h, _)| h.clone())
            .collect();
        for h in &done {
            self.blacklist.remove(h);
        }
        (done, self.commit(before))
    }
}

/// A host's cooldown after its `n`-th blacklisting (n >= 1), as Horovod's driver draws it:
/// `lo·2^n + u·lo` seconds (`u` uniform in `[0, 1)`), kept within `lo..=hi`. A host that
/// keeps failing waits longer each time, up to `hi`.
pub fn cooldown(lo: u64, hi: u64, n: u32, u: f64) -> Duration {
    let (lo, hi) = (lo.min(hi) as f64, lo.max(hi) as f64);
    let grown = lo * 2f64.powi(n.min(62) as i32) + u.clamp(0.0, 1.0) * lo;
    Duration::from_secs_f64(grown.clamp(lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, slots: usize) -> Host {
        Host {
            name: name.into(),
            slots,
        }
    }

    fn names(s: &HostState) -> Vec<String> {
        s.usable().iter().map(|h| h.name.clone()).collect()
    }

    #[test]
    fn discovery_changes_bump_the_stamp() {
        let mut s = HostState::new(None);
        let c = s.discovered(vec![h("a", 1), h("b", 2)]).unwrap();
        assert_eq!((c.stamp, c.added, c.removed), (1, true, false));
        assert_eq!(s.discovered(vec![h("a", 1), h("b", 2)]), None);
        let c = s.discovered(vec![h("b", 2), h("c", 1)]).unwrap();
        assert_eq!((c.stamp, c.added, c.removed), (2, true, true));
        assert_eq!(names(&s), ["b", "c"]);
        assert_eq!(s.order("c"), 1);
        assert_eq!(s.order("a"), usize::MAX);
    }

    #[test]
    fn blacklisting_for_good() {
        let mut s = HostState::new(None);
        let now = Instant::now();
        s.discovered(vec![h("a", 1), h("b", 1)]);
        let (c, cooldown) = s.blacklist("b", now, || unreachable!());
        assert_eq!(cooldown, None);
        let c = c.unwrap();
        assert_eq!((c.stamp, c.added, c.removed), (2, false, true));
        assert_eq!(names(&s), ["a"]);
        // Still listed by discovery, still out; and it never expires.
        assert_eq!(s.discovered(vec![h("a", 1), h("b", 1)]), None);
        let (back, c) = s.expire(now + Duration::from_secs(1 << 30));
        assert!(back.is_empty() && c.is_none());
        assert!(s.is_blacklisted("b") && !s.is_usable("b"));
    }

    #[test]
    fn a_cooldown_brings_the_host_back_and_grows_with_each_failure() {
        let mut s = HostState::new(Some((5, 100)));
        let now = Instant::now();
        s.discovered(vec![h("a", 1), h("b", 1)]);
        // First failure: 5·2 + 0.5·5 = 12.5 s.
        let (_, cooldown) = s.blacklist("a", now, || 0.5);
        assert_eq!(cooldown, Some(Duration::from_secs_f64(12.5)));
        assert_eq!(
            s.expire(now + Duration::from_secs(12)).0,
            Vec::<String>::new()
        );
        let (back, c) = s.expire(now + Duration::from_secs(13));
        assert_eq!(back, ["a"]);
        let c = c.unwrap();
        assert!(c.added && !c.removed);
        // Discovery order, not blacklist order.
        assert_eq!(names(&s), ["a", "b"]);
        // Its second failure doubles the wait (5·4 = 20 s), another host starts afresh, and
        // the growth stops at MAX.
        let (_, cooldown) = s.blacklist("a", now, || 0.0);
        assert_eq!(cooldown, Some(Duration::from_secs(20)));
        let (_, cooldown) = s.blacklist("b", now, || 0.0);
        assert_eq!(cooldown, Some(Duration::from_secs(10)));
        s.expire(now + Duration::from_secs(1000));
        for _ in 0..5 {
            s.blacklist("a", now, || 0.99);
        }
        assert_eq!(s.strikes["a"], 7);
        let (_, cooldown) = s.blacklist("a", now, || 0.99);
        assert_eq!(cooldown, Some(Duration::from_secs(100)));
    }

    #[test]
    fn cooldowns_follow_horovods_formula_within_the_range() {
        assert_eq!(cooldown(1, 3600, 1, 0.0), Duration::from_secs(2));
        assert_eq!(cooldown(1, 3600, 3, 0.5), Duration::from_secs_f64(8.5));
        assert_eq!(cooldown(10, 15, 1, 0.0), Duration::from_secs(15));
        // A range given backwards is taken in order; huge strike counts do not overflow.
        assert_eq!(cooldown(20, 10, 1, 0.0), Duration::from_secs(20));
        assert_eq!(cooldown(2, 50, 10_000, 1.0), Duration::from_secs(50));
        // A cooldown never falls below MIN.
        assert_eq!(cooldown(7, 9, 0, 0.0), Duration::from_secs(7));
    }
}
