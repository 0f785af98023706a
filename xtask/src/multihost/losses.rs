//! The loss checks of `cargo xtask multihost`: a 2 × 2 job that loses a host's link, a rank or
//! a host, and what every survivor must say, and when.

use std::time::{Duration, Instant};

use super::common::tail;
use super::Bins;
use crate::cluster::Cluster;

/// The runtime's timeout in the loss checks (seconds), and the bound on a survivor's exit.
const LOSS_TIMEOUT_S: u64 = 5;
const LOSS_BOUND: Duration = Duration::from_secs(60);
/// What the loss checks do to a running 2 × 2 job.
pub(super) enum Loss {
    /// Cut h1's link.
    LinkDown,
    /// SIGKILL these ranks (all on h1).
    Ranks(&'static [usize]),
}

/// Whether `msg` names one of `ranks` as `rank N` (not a prefix of a longer number).
pub(super) fn names_rank(msg: &str, ranks: &[usize]) -> bool {
    ranks.iter().any(|r| {
        let pat = format!("rank {r}");
        msg.match_indices(&pat).any(|(i, _)| {
            !msg[i + pat.len()..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
    })
}

/// The ranks of a 2 × 2 job (numbered host by host) on the host other than `rank`'s.
pub(super) fn other_host(rank: usize) -> Vec<usize> {
    (0..4).filter(|&r| r / 2 != rank / 2).collect()
}

/// The median and the largest of `times` (seconds; the median of an even count is the mean of
/// the middle two).
pub(crate) fn median_and_worst(times: &[f64]) -> (f64, f64) {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    let n = t.len();
    match n {
        0 => (0.0, 0.0),
        _ if n % 2 == 1 => (t[n / 2], t[n - 1]),
        _ => ((t[n / 2 - 1] + t[n / 2]) / 2.0, t[n - 1]),
    }
}

/// fh-selftest looping on 2 × 2 under `FH_TRANSPORT=transport` (`auto` must pick `hier`);
/// once every rank loops, `loss` happens; every survivor must then fail by itself within
/// [`LOSS_BOUND`], its error naming a rank it lost (with the link cut: a rank of the other
/// host). Reports when each rank failed, counted from the loss.
pub(super) fn losses(
    c: &Cluster,
    bins: &Bins,
    loss: &Loss,
    transport: &str,
) -> Result<String, String> {
    let mut job = c.launch(
        &[2, 2],
        &bins.selftest,
        &["--loop", "--bytes", "262144"],
        Duration::from_secs(LOSS_TIMEOUT_S),
        &[("FH_TRANSPORT", transport)],
    )?;
    let backend = format!(
        "backend {}",
        if transport == "auto" {
            "hier"
        } else {
            transport
        }
    );
    if !job.wait_for_all("looping", Duration::from_secs(60)) {
        let outs: Vec<String> = (0..4)
            .map(|r| format!("rank {r}: {}", tail(&job.output(r))))
            .collect();
        return Err(format!(
            "the job did not start looping:\n{}",
            outs.join("\n")
        ));
    }
    let killed: &[usize] = match loss {
        Loss::LinkDown => {
            c.set_link(1, false)?;
            &[]
        }
        Loss::Ranks(r) => {
            for &rank in *r {
                job.kill(rank);
            }
            r
        }
    };
    let lost_at = Instant::now();
    let ends = job.wait(LOSS_BOUND);
    let took = lost_at.elapsed();
    let mut said = Vec::new();
    let mut times = Vec::new();
    for (rank, e) in ends.iter().enumerate() {
        if killed.contains(&rank) {
            continue;
        }
        if !e.output.contains(&backend) {
            return Err(format!(
                "rank {rank} did not report `{backend}` under FH_TRANSPORT={transport}; its \
                 output:\n{}",
                tail(&e.output)
            ));
        }
        // A survivor of killed ranks must name one of them. With the link cut nobody died:
        // every rank must fail by itself naming a rank across the cut, never a live peer of
        // its own host (which may itself be waiting across the cut).
        let lost: Vec<usize> = match loss {
            Loss::LinkDown => other_host(rank),
            Loss::Ranks(r) => r.to_vec(),
        };
        let failure = e
            .output
            .lines()
            .find_map(|l| l.split_once("FAILED: ").map(|(_, m)| m.to_string()));
        match (e.status, failure) {
            (None, _) => {
                return Err(format!(
                    "rank {rank} was still running {LOSS_BOUND:?} after the loss; its output:\n{}",
                    tail(&e.output)
                ))
            }
            (Some(s), _) if s.success() => {
                return Err(format!("rank {rank} passed after losing ranks {lost:?}"))
            }
            (Some(_), Some(msg)) if names_rank(&msg, &lost) => {
                times.push(e.after.as_secs_f64());
                said.push(format!(
                    "rank {rank} after {:.1} s: {msg}",
                    e.after.as_secs_f64()
                ))
            }
            (Some(s), _) => {
                return Err(format!(
                    "rank {rank} exited with {s} without an error naming one of ranks \
                     {lost:?}; its output:\n{}",
                    tail(&e.output)
                ))
            }
        }
    }
    let (median, worst) = median_and_worst(&times);
    Ok(format!(
        "every survivor failed within {:.1} s of the loss (median {median:.1} s, worst \
         {worst:.1} s): {}",
        took.as_secs_f64(),
        said.join(" | ")
    ))
}
