//! The stall inspector's judgement: which names some ranks have submitted and others (not
//! joined) have not, for at least the stall-check time. Pure: every rank judges the same lists
//! and reaches the same report.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::stats::StallReport;

/// The stall, if any, in every rank's pending `(name, age in ms)` lists (in rank order).
pub(crate) fn find(
    lists: &[Vec<(String, u64)>],
    joined: &[bool],
    threshold: Duration,
) -> Option<StallReport> {
    let size = lists.len();
    let mut have: BTreeMap<&str, (Vec<bool>, u64)> = BTreeMap::new();
    for (r, list) in lists.iter().enumerate() {
        for (name, age) in list {
            let e = have
                .entry(name.as_str())
                .or_insert_with(|| (vec![false; size], 0));
            e.0[r] = true;
            e.1 = e.1.max(*age);
        }
    }
    let mut names = Vec::new();
    let mut missing = vec![false; size];
    let mut waited = 0u64;
    for (name, (ranks, age)) in &have {
        let lacking: Vec<usize> = (0..size)
            .filter(|&r| !ranks[r] && !joined.get(r).copied().unwrap_or(false))
            .collect();
        if lacking.is_empty() || Duration::from_millis(*age) < threshold {
            continue;
        }
        names.push(name.to_string());
        waited = waited.max(*age);
        for r in lacking {
            missing[r] = true;
        }
    }
    (!names.is_empty()).then(|| StallReport {
        names,
        missing_ranks: (0..size).filter(|&r| missing[r]).collect(),
        waited: Duration::from_millis(waited),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, a)| (n.to_string(), *a)).collect()
    }

    #[test]
    fn names_the_missing_ranks_and_the_longest_wait() {
        let lists = [
            l(&[("a", 5000), ("b", 100)]),
            l(&[("a", 10)]),
            l(&[]),
            l(&[]),
        ];
        let r = find(&lists, &[false, false, false, true], Duration::from_secs(1)).unwrap();
        // "b" has not waited long enough; rank 3 has joined and is not waited for.
        assert_eq!(r.names, ["a"]);
        assert_eq!(r.missing_ranks, [2]);
        assert_eq!(r.waited, Duration::from_millis(5000));
        // Everybody has everything: no stall.
        let lists = [l(&[("a", 9000)]), l(&[("a", 9000)])];
        assert_eq!(find(&lists, &[false; 2], Duration::ZERO), None);
    }
}
