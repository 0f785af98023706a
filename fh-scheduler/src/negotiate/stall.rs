//! The stall inspector's judgement: which names some ranks have submitted and others (not
//! joined) have not, for at least the stall-check time, and which rank lacks which of them.
//! Pure: every rank judges the same lists and reaches the same report.

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
    let mut lacking: Vec<Vec<String>> = vec![Vec::new(); size];
    let mut waited = 0u64;
    for (name, (ranks, age)) in &have {
        let missing: Vec<usize> = (0..size)
            .filter(|&r| !ranks[r] && !joined.get(r).copied().unwrap_or(false))
            .collect();
        if missing.is_empty() || Duration::from_millis(*age) < threshold {
            continue;
        }
        names.push(name.to_string());
        waited = waited.max(*age);
        for r in missing {
            lacking[r].push(name.to_string());
        }
    }
    (!names.is_empty()).then(|| StallReport {
        names,
        missing_ranks: (0..size).filter(|&r| !lacking[r].is_empty()).collect(),
        lacking: lacking
            .into_iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .collect(),
        waited: Duration::from_millis(waited),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, a)| (n.to_string(), *a)).collect()
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|n| n.to_string()).collect()
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
        assert_eq!(r.lacking, [(2, s(&["a"]))]);
        assert_eq!(r.waited, Duration::from_millis(5000));
        // Everybody has everything: no stall.
        let lists = [l(&[("a", 9000)]), l(&[("a", 9000)])];
        assert_eq!(find(&lists, &[false; 2], Duration::ZERO), None);
    }

    #[test]
    fn says_which_rank_lacks_which_name() {
        // Horovod's unnamed allgathers at 3 ranks: rank 0 lacks one name, rank 2 the other.
        let (a, b) = ("allgather.noname.0", "allgather.noname.1");
        let lists = [l(&[(a, 6000)]), l(&[(a, 6000), (b, 6000)]), l(&[(b, 5000)])];
        let r = find(&lists, &[false; 3], Duration::from_secs(5)).unwrap();
        assert_eq!(r.names, [a, b]);
        assert_eq!(r.missing_ranks, [0, 2]);
        assert_eq!(r.lacking, [(0, s(&[b])), (2, s(&[a]))]);
        assert_eq!(
            r.to_string(),
            "stall: rank 0 has not submitted [\"allgather.noname.1\"]; rank 2 has not \
             submitted [\"allgather.noname.0\"] (other ranks submitted them up to 6.0s ago)"
        );
        assert_eq!(r.lacked_by(2), Some(&s(&[a])[..]));
        assert_eq!(r.lacked_by(1), None);
    }

    #[test]
    fn ranks_that_lack_the_same_names_are_named_together() {
        let lists = [
            l(&[("x", 2000), ("y", 2000)]),
            l(&[]),
            l(&[]),
            l(&[("x", 1)]),
        ];
        let r = find(&lists, &[false; 4], Duration::from_secs(1)).unwrap();
        assert_eq!(
            r.to_string(),
            "stall: ranks 1 and 2 have not submitted [\"x\", \"y\"]; rank 3 has not submitted \
             [\"y\"] (other ranks submitted them up to 2.0s ago)"
        );
    }
}
