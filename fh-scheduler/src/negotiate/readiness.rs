//! Rank 0's record of when each rank had each tensor ready, for the timeline: filled from the
//! readiness reports (every rank's newly pending names with how long ago each was submitted),
//! taken when a tensor is agreed ready everywhere. Kept only while a timeline is written.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::timeline::ReadyAt;

/// Per tensor name not yet agreed, each rank's ready time where reported.
pub(crate) struct ReadyTimes {
    size: usize,
    names: HashMap<String, Vec<Option<ReadyAt>>>,
}

impl ReadyTimes {
    /// An empty record for `size` ranks.
    pub(crate) fn new(size: usize) -> Self {
        ReadyTimes {
            size,
            names: HashMap::new(),
        }
    }

    /// Rank `rank` reported `report` (name, µs since it was submitted), which rank 0 received
    /// at `learned`. The first report of a name by a rank counts; ranks outside the job are
    /// ignored.
    pub(crate) fn record(&mut self, rank: usize, report: Vec<(String, u64)>, learned: Instant) {
        if rank >= self.size {
            return;
        }
        for (name, micros) in report {
            let times = self
                .names
                .entry(name)
                .or_insert_with(|| vec![None; self.size]);
            times[rank].get_or_insert(ReadyAt {
                learned,
                age: Duration::from_micros(micros),
            });
        }
    }

    /// The ready times of `name` (agreed now, or failed), forgotten here.
    pub(crate) fn take(&mut self, name: &str) -> Option<Vec<Option<ReadyAt>>> {
        if self.names.is_empty() {
            return None;
        }
        self.names.remove(name)
    }

    /// Forget everything (the timeline stopped).
    pub(crate) fn clear(&mut self) {
        if !self.names.is_empty() {
            self.names.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_report_of_each_rank_counts_and_take_forgets() {
        let mut t = ReadyTimes::new(2);
        let (t0, t1) = (Instant::now(), Instant::now() + Duration::from_millis(5));
        t.record(0, vec![("a".into(), 7)], t0);
        t.record(1, vec![("a".into(), 3), ("b".into(), 1)], t1);
        t.record(0, vec![("a".into(), 99)], t1); // a repeat: the first stays
        t.record(5, vec![("a".into(), 1)], t1); // no such rank
        let a = t.take("a").unwrap();
        assert_eq!(a.len(), 2);
        let r0 = a[0].unwrap();
        assert_eq!((r0.learned, r0.age), (t0, Duration::from_micros(7)));
        let r1 = a[1].unwrap();
        assert_eq!((r1.learned, r1.age), (t1, Duration::from_micros(3)));
        assert!(t.take("a").is_none());
        let b = t.take("b").unwrap();
        assert!(b[0].is_none() && b[1].is_some());
        t.record(0, vec![("c".into(), 1)], t0);
        t.clear();
        assert!(t.take("c").is_none());
    }
}
