//! The cloud check of `cargo xtask multihost`: a 2 × 2 job on an emulated cloud whose TCP
//! connections are each capped well below the link ([`crate::cluster::Shaping`]) must move its
//! gradients across hosts faster than its transport's own connections could at the cap: the
//! engine's defaults (no variable set) must spread the bytes over more flows than the
//! hierarchical transport has lanes.
//!
//! The job is the engine's replay (`fh-scheduler/examples/replay.rs`, `replay-env ... env`:
//! the configuration the environment gives, here none) of [`TENSORS`] gradients of
//! [`TENSOR_ELEMENTS`] float32 each, all released at once, one warm-up and [`STEPS`] timed
//! steps. Over `hier` with two hosts, every byte of the gradients crosses each host's link once
//! per direction, so the cross-host goodput of a step is the gradients' bytes over the step
//! time. The hierarchical allreduce runs one TCP lane per local rank ([`LANES`]), each a
//! connection capped at [`FLOW`]: at most `LANES × FLOW` without more flows. The check asserts
//! the goodput exceeds 1.5 times that (a bound no set of `LANES` capped connections can reach,
//! whatever the load), and reports the goodput beside the link's measured 1- and 8-stream
//! rates and how many connections carried the bytes (the `htb` leaves' counters on h0).

use std::process::Command;
use std::time::Duration;

use super::{all_passed, tail, Bins};
use crate::cluster::{link_bound_rate, show_rates, Cluster, Shaping};

/// The link rate of the cloud (each host's aggregate).
pub(super) const LINK: &str = "400mbit";

/// The cap on each TCP connection.
pub(super) const FLOW: &str = "50mbit";

/// The gradients of the job: how many, and their elements (float32) each.
const TENSORS: usize = 6;
const TENSOR_ELEMENTS: usize = 2 * 1024 * 1024;

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
    let workload = c.dir().join("cloud-workload.json");
    let tensors: Vec<String> = (0..TENSORS)
        .map(|i| {
            format!(
                "{{\"name\": \"cloud.{i}\", \"elements\": {TENSOR_ELEMENTS}, \
                 \"compute_share\": 1.0}}"
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
            "the job did not run over hier (auto's choice for 2 x 2); rank 0 said:\n{}",
            tail(out)
        ));
    }
    let step_ms = step_ms(out).ok_or_else(|| {
        format!(
            "rank 0 did not report its step time; its output:\n{}",
            tail(out)
        )
    })?;
    let after = c.flow_bytes(0)?;
    // Connections (htb leaves of h0's egress) that carried at least a tenth of a lane's share.
    let bytes = (TENSORS * TENSOR_ELEMENTS * 4) as f64;
    let share = bytes * (STEPS + 1) as f64 / LANES / 10.0;
    let flows = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .filter(|(a, b)| a.saturating_sub(**b) as f64 >= share)
        .count();
    let goodput = bytes * 8.0 / (step_ms / 1e3);
    let bound = 1.5 * LANES * flow;
    let link = link_bound_rate(&rates);
    let saw = format!(
        "{:.1} MB of gradients per step in {step_ms:.0} ms: {:.0} Mbit/s across each host's \
         link, {:.0}% of the link's measured {:.0} Mbit/s (TCP h0 -> h1: {}), {:.1}x the \
         {:.0} Mbit/s per-flow cap; {flows} connections out of h0 carried the bytes",
        bytes / 1e6,
        goodput / 1e6,
        100.0 * goodput / link,
        link / 1e6,
        show_rates(&rates),
        goodput / flow,
        flow / 1e6
    );
    if goodput > bound {
        Ok(saw)
    } else {
        Err(format!(
            "{saw}; needs more than {:.0} Mbit/s (1.5 x {LANES} lanes x the cap): the \
             gradients do not spread over more flows than the transport has lanes",
            bound / 1e6
        ))
    }
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
