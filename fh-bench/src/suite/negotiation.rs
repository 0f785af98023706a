//! The negotiation-cost measurement: both modes, every tensor count, at each rank count.

use indicatif::ProgressBar;

use super::Options;
use crate::record::{NegRow, RunRecord, Skipped};
use crate::replay::{NegotiationJob, BACK_TO_BACK, CALLER_ROUNDS_OFF, RIDING_OFF};
use crate::runner::{Job, RankOutput, Runner};
use crate::stats::Quantity;

/// The modes measured at every tensor count.
pub(super) const MODES: [&str; 3] = ["coordinator", "bit-vector", RIDING_OFF];

/// The modes of the 8-byte allreduce back to back.
pub(super) const BACK_TO_BACK_MODES: [&str; 3] = ["bit-vector", CALLER_ROUNDS_OFF, RIDING_OFF];

/// Run the measurement over `runner` (transport `tname`) at each of `neg_nps` rank counts.
pub(super) fn run(
    opts: &Options,
    tname: &str,
    runner: &Runner,
    neg_nps: &[usize],
    bar: &ProgressBar,
    record: &mut RunRecord,
) {
    let steps = if opts.quick { 3 } else { 10 };
    for &np in neg_nps {
        let mut runner = runner.clone();
        runner.np = np;
        for mode in MODES {
            for &tensors in &opts.tensor_counts {
                bar.set_message(format!(
                    "negotiation: {mode}, {tensors} tensors, np {np} over {tname}"
                ));
                let job = Job::Negotiation(NegotiationJob {
                    mode: mode.into(),
                    tensors,
                    warmup: 1,
                    steps,
                    back_to_back: 0,
                });
                match runner.run(&format!("negotiation-{mode}-{tensors}-np{np}"), &job) {
                    Ok(outs) => record
                        .negotiation
                        .push(negotiation_row(mode, np, tensors, &outs)),
                    Err(e) => record.skipped.push(Skipped::failed(
                        "negotiation",
                        format!("{mode}, {tensors} tensors, np {np}"),
                        e,
                    )),
                }
                bar.inc(1);
            }
        }
        // The latency of one small named allreduce, back to back (riding in the round, with
        // the caller running the rounds and without, and not riding): what a training loop's
        // metric or loss costs.
        for mode in BACK_TO_BACK_MODES {
            let label = format!("{mode}{BACK_TO_BACK}");
            bar.set_message(format!("negotiation: {label}, np {np} over {tname}"));
            let job = Job::Negotiation(NegotiationJob {
                mode: label.clone(),
                tensors: 1,
                warmup: 1,
                steps,
                back_to_back: 1000,
            });
            match runner.run(&format!("negotiation-b2b-{mode}-np{np}"), &job) {
                Ok(outs) => record
                    .negotiation
                    .push(negotiation_row(&label, np, 1, &outs)),
                Err(e) => record.skipped.push(Skipped::failed(
                    "negotiation",
                    format!("{label}, np {np}"),
                    e,
                )),
            }
            bar.inc(1);
        }
    }
}

/// Per step, the slowest rank's latency; rounds, bytes and time per round from the rank that
/// sent the most negotiation bytes (rank 0 in coordinator rounds).
pub fn negotiation_row(mode: &str, np: usize, tensors: usize, outs: &[RankOutput]) -> NegRow {
    let per_rank: Vec<&Vec<crate::replay::NegotiationStep>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Negotiation(v) => Some(v),
            _ => None,
        })
        .collect();
    let steps = per_rank.first().map_or(0, |v| v.len());
    let mut lat = Vec::new();
    let mut rounds = Vec::new();
    let mut per_round = Vec::new();
    let mut bytes = Vec::new();
    let mut cpu = Vec::new();
    for i in 0..steps {
        let at: Vec<&crate::replay::NegotiationStep> =
            per_rank.iter().filter_map(|v| v.get(i)).collect();
        lat.push(at.iter().map(|s| s.seconds).fold(0.0, f64::max) * 1e6);
        cpu.push(at.iter().map(|s| s.cpu_s).sum::<f64>() * 1e6);
        if let Some(top) = at.iter().max_by_key(|s| s.bytes) {
            let r = top.rounds.max(1) as f64;
            rounds.push(top.rounds as f64);
            per_round.push(top.negotiation_s / r * 1e6);
            bytes.push(top.bytes as f64 / r);
        }
    }
    NegRow {
        mode: mode.to_string(),
        np,
        tensors,
        step_latency: Quantity::from_samples(&lat, "us"),
        rounds_per_step: Quantity::from_samples(&rounds, "rounds"),
        round_latency: Quantity::from_samples(&per_round, "us"),
        bytes_per_round: Quantity::from_samples(&bytes, "B"),
        cpu_per_step: Some(Quantity::from_samples(&cpu, "us")),
    }
}
