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

    /// Blacklist `host` at `now`: for good, or for `draw(MIN, MAX)` seconds with a cooldown
    /// range. Returns the change of the usable set, and the cooldown given.
    pub fn blacklist(
        &mut self,
        host: &str,
        now: Instant,
        draw: impl FnOnce(u64, u64) -> u64,
    ) -> (Option<Change>, Option<Duration>) {
        let before = self.names();
        let cooldown = self.cooldown.map(|(lo, hi)| {
            let (lo, hi) = (lo.min(hi), lo.max(hi));
            Duration::from_secs(draw(lo, hi).clamp(lo, hi))
        });
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
        let (c, cooldown) = s.blacklist("b", now, |_, _| unreachable!());
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
    fn a_cooldown_brings_the_host_back() {
        let mut s = HostState::new(Some((10, 20)));
        let now = Instant::now();
        s.discovered(vec![h("a", 1), h("b", 1)]);
        let (_, cooldown) = s.blacklist("a", now, |lo, hi| {
            assert_eq!((lo, hi), (10, 20));
            15
        });
        assert_eq!(cooldown, Some(Duration::from_secs(15)));
        assert_eq!(
            s.expire(now + Duration::from_secs(14)).0,
            Vec::<String>::new()
        );
        let (back, c) = s.expire(now + Duration::from_secs(15));
        assert_eq!(back, ["a"]);
        let c = c.unwrap();
        assert!(c.added && !c.removed);
        // Discovery order, not blacklist order.
        assert_eq!(names(&s), ["a", "b"]);
        // A draw outside the range is clamped into it.
        let (_, cooldown) = s.blacklist("b", now, |_, _| 99);
        assert_eq!(cooldown, Some(Duration::from_secs(20)));
    }
}
