//! The collective checks (the scheduler's suite across hosts) and where ranks say they are
//! placed (fh-selftest's lines, for the launcher checks).

use std::process::ExitStatus;
use std::time::Duration;

use super::common::{all_passed, tail};
use super::Bins;
use crate::cluster::Cluster;

/// The scheduler's suite on `layout` under `FH_TRANSPORT=transport`; rank 0 must report the
/// backend `want`.
pub(super) fn collectives(
    c: &Cluster,
    bins: &Bins,
    layout: &[usize],
    transport: &str,
    want: &str,
) -> Result<String, String> {
    let job = c.launch(
        layout,
        &bins.sched_suite,
        &["--schedule", "all", "--channels", "1,2,4"],
        Duration::from_secs(20),
        &[("FH_TRANSPORT", transport)],
    )?;
    let ends = job.wait(Duration::from_secs(240));
    all_passed(&ends)?;
    let over = format!("sched_suite over {want}: passed");
    match ends[0].output.lines().find(|l| l.contains(&over)) {
        Some(line) => Ok(line.trim().to_string()),
        None => Err(format!(
            "rank 0 did not report `{over}`; its output:\n{}",
            tail(&ends[0].output)
        )),
    }
}

/// Where fh-selftest says each rank is: `(rank, local size, cross rank)` from its lines
/// `fh-selftest: rank R of N (local L/LS, cross C/CS), ...`.
fn places(output: &str) -> Vec<(usize, usize, usize)> {
    let mut found = Vec::new();
    for line in output.lines() {
        let Some(at) = line.find("fh-selftest: rank ") else {
            continue;
        };
        let rest = &line[at + "fh-selftest: rank ".len()..];
        let nums: Vec<usize> = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse().ok())
            .collect();
        // R, N, L, LS, C, CS
        if rest.contains(" of ") && rest.contains("cross") && nums.len() >= 6 {
            found.push((nums[0], nums[3], nums[4]));
        }
    }
    found.sort();
    found
}

/// Checks that a 4-rank fh-selftest run passed with ranks placed as `hosts[r]` says (the
/// host index mpirun put rank r on; the settled cross ranks must group the ranks the same way).
pub(super) fn check_placed(
    status: Option<ExitStatus>,
    out: &str,
    hosts: [usize; 4],
) -> Result<String, String> {
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!("ended with {status:?}; output:\n{}", tail(out)));
    }
    let p = places(out);
    if p.len() != 4 || out.matches("PASSED").count() != 4 {
        return Err(format!(
            "expected four ranks to report and pass; output:\n{}",
            tail(out)
        ));
    }
    for a in 0..4 {
        for b in 0..4 {
            let same = hosts[a] == hosts[b];
            if (p[a].2 == p[b].2) != same || p[a].1 != 2 {
                return Err(format!(
                    "ranks {a} and {b} should be on {} host{} (2 ranks each); they report \
                     (rank, local size, cross rank) {:?} and {:?}",
                    if same { "the same" } else { "different" },
                    if same { "" } else { "s" },
                    p[a],
                    p[b]
                ));
            }
        }
    }
    Ok(format!(
        "cross ranks of ranks 0-3: {:?}",
        p.iter().map(|x| x.2).collect::<Vec<_>>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_read_from_selftest_lines() {
        let out = "[1,2]<stdout>:fh-selftest: rank 2 of 4 (local 1/2, cross 0/2), backend hier, connected in 0.1 s\n\
                   fh-selftest: rank 0 of 4 (local 0/2, cross 1/2), backend hier, connected in 0.2 s\n\
                   fh-selftest: rank 0: PASSED\n";
        assert_eq!(places(out), vec![(0, 2, 1), (2, 2, 0)]);
    }
}
