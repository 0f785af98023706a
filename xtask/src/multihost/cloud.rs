//! The cloud check of `cargo xtask multihost`: a 2 × 2 job on an emulated cloud whose TCP
//! connections are each capped well below the link ([`crate::cluster::Shaping`]) must move its
//! gradients across hosts faster than its transport's own connections could at the cap: the
//! engine's defaults (no variable set) must spread the bytes over more flows than the
//! hierarchical transport has lanes.
//!
//! The job is the engine's replay (`fh-scheduler/examples/replay.rs`, `replay-env ... env`:
//! the configuration the environment gives, here none) of the gradients of [`WORKLOADS`], all
//! released at once, one warm-up and [`STEPS`] timed steps. Over `hier` with two hosts, every
//! byte of the gradients crosses each host's link once per direction, so the cross-host
//! goodput of a step is the gradients' bytes over the step time. The hierarchical allreduce runs one TCP lane per local rank ([`LANES`]), each a
//! connection capped at [`FLOW`]: at most `LANES × FLOW` without more flows. The check asserts
//! the goodput exceeds 1.5 times that (a bound no set of `LANES` capped connections can reach,
//! whatever the load), and reports the goodput beside the link's measured 1- and 8-stream
//! rates and how many connections carried the bytes (the `htb` leaves' counters on h0). A
//! single fused group must beat it too: it has more than one flow per lane only through the
//! TCP backend's parallel streams (`FH_TCP_STREAMS`, chosen at start by measuring).

use std::process::Command;
use std::time::Duration;

use super::common::{all_passed, tail};
use super::Bins;
use crate::cluster::{link_bound_rate, show_rates, Cluster, Shaping};

/// The link rate of the cloud (each host's aggregate).
pub(super) const LINK: &str = "400mbit";

/// The cap on each TCP connection.
pub(super) const FLOW: &str = "50mbit";

/// A job's gradients: a name for reports, how many, and their elements (float32) each.
struct Workload {
    name: &'static str,
    tensors: usize,
    elements: usize,
    /// Whether the check asserts the bound on it (else it only reports it).
    asserted: bool,
}

/// The workloads, in turn on one cluster. Several large gradients (six of 8 MiB: several
/// groups in flight, K channels, K flows per lane) and one gradient of 12 MiB (a single fused
/// group, below the partition size: one frame at a time per lane, so only the TCP backend's
/// parallel streams to a peer on another host give it more than one flow) must beat the
/// bound.
const WORKLOADS: [Workload; 2] = [
    Workload {
        name: "six 8 MiB gradients",
        tensors: 6,
        elements: 2 * 1024 * 1024,
        asserted: true,
    },
    Workload {
        name: "one 12 MiB gradient",
        tensors: 1,
        elements: 3 * 1024 * 1024,
        asserted: true,
    },
];

/// Timed steps (after one warm-up).
const STEPS: usize = 2;

/// The hierarchical transport's TCP lanes between the two hosts (one per local rank).
const LANES: f64 = 2.0;

/// The cloud's shaping.
pub(super) fn shaping() -> Result<Shaping, String> {
    Shaping::new(Some(LINK), Some(FLOW))
}

/// Runs the check on `c` (two hosts shaped by [`shaping`]); the figures, or why it failed.
pub(super) fn cloud_goodput(c: &Cluster, bins: &Bins) -> Result<String, String> {
    let flow = shaping()?.flow.ok_or("the cloud has no per-flow cap")? as f64;
    let rates = c.link_rates(0, 1, 1.5, &[1, 8], &|cmd: &mut Command, a: &[&str]| {
        cmd.arg("__link-probe").args(a);
    })?;
    let link = link_bound_rate(&rates);
    let bound = 1.5 * LANES * flow;
    let mut saw = vec![format!(
        "per-flow cap {:.0} Mbit/s, link measured at {:.0} Mbit/s (TCP h0 -> h1: {}), bound \
         {:.0} Mbit/s (1.5 x {LANES} lanes x the cap)",
        flow / 1e6,
        link / 1e6,
        show_rates(&rates),
        bound / 1e6
    )];
    let mut failed = false;
    for w in &WORKLOADS {
        let (step_ms, flows) = replay(c, bins, w)?;
        let bytes = (w.tensors * w.elements * 4) as f64;
        let goodput = bytes * 8.0 / (step_ms / 1e3);
        let verdict = match (w.asserted, goodput > bound) {
            (true, true) => "above the bound",
            (true, false) => {
                failed = true;
                "BELOW the bound: the gradients do not spread over more flows than the \
                 transport has lanes"
            }
            (false, _) => "reported only",
        };
        saw.push(format!(
            "{}: {:.1} MB per step in {step_ms:.0} ms, {:.0} Mbit/s across each host's link \
             ({:.0}% of the link, {:.1}x the cap); over the {} steps {flows} connections out of h0 \
             carried a fiftieth of a lane's share or more; {verdict}",
            w.name,
            bytes / 1e6,
            goodput / 1e6,
            100.0 * goodput / link,
            goodput / flow,
            STEPS + 1
        ));
    }
    let saw = saw.join("; ");
    if failed {
        Err(saw)
    } else {
        Ok(saw)
    }
}

/// The replay of `w` on 2 × 2 under the defaults: rank 0's median step time (ms) and how many
/// connections out of h0 (per-flow `htb` leaves) carried at least a fiftieth of a lane's share
/// over all the steps (the warm-up included; successive steps may use other channels, so this
/// counts the connections used, not how many ran at once).
fn replay(c: &Cluster, bins: &Bins, w: &Workload) -> Result<(f64, usize), String> {
    let workload = c
        .dir()
        .join(format!("cloud-{}x{}.json", w.tensors, w.elements));
    let tensors: Vec<String> = (0..w.tensors)
        .map(|i| {
            format!(
                "{{\"name\": \"cloud.{i}\", \"elements\": {}, \"compute_share\": 1.0}}",
                w.elements
            )
        })
        .collect();
    std::fs::write(
        &workload,
        format!(
            "{{\"model\": \"cloud\", \"dtype\": \"float32\", \"tensors\": [{}]}}",
            tensors.join(", ")
        ),
    )
    .map_err(|e| format!("cannot write {}: {e}", workload.display()))?;
    let before = c.flow_bytes(0)?;
    let path = workload.display().to_string();
    let steps = STEPS.to_string();
    let job = c.launch(
        &[2, 2],
        &bins.replay,
        &["replay-env", &path, "0", &steps, "env"],
        Duration::from_secs(60),
        &[],
    )?;
    let ends = job.wait(Duration::from_secs(180));
    all_passed(&ends)?;
    let out = &ends[0].output;
    if !out.contains(" over hier:") {
        return Err(format!(
            "{}: the job did not run over hier (auto's choice for 2 x 2); rank 0 said:\n{}",
            w.name,
            tail(out)
        ));
    }
    let step_ms = step_ms(out).ok_or_else(|| {
        format!(
            "{}: rank 0 did not report its step time; its output:\n{}",
            w.name,
            tail(out)
        )
    })?;
    let after = c.flow_bytes(0)?;
    let share = (w.tensors * w.elements * 4 * (STEPS + 1)) as f64 / LANES / 50.0;
    let flows = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .filter(|(a, b)| a.saturating_sub(**b) as f64 >= share)
        .count();
    Ok((step_ms, flows))
}

/// The step time rank 0 of `replay-env ... env` prints on its line `env STEP_MS EXPOSED_MS`.
fn step_ms(output: &str) -> Option<f64> {
    output.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let at = w.iter().position(|x| *x == "env")?;
        let ms = w.get(at + 1)?.parse::<f64>().ok()?;
        w.get(at + 2)?.parse::<f64>().ok()?;
        Some(ms)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_time_is_read_from_rank_0s_table() {
        let out = "replay /x/cloud-workload.json over hier: 6 tensors, np=4, backward 0 ms, median of 2 steps\n\
                   \x20             schedule      step ms     exposed ms\n\
                   \x20                  env       1578.8         1578.8\n";
        assert_eq!(step_ms(out), Some(1578.8));
        assert_eq!(step_ms("env: 3 settings\n"), None);
        assert!(shaping().is_ok());
    }
}
