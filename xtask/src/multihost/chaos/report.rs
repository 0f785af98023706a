//! The chaos runs' table: per fault, transport and launcher, the runs, hangs, misnamed ranks
//! and failures, and the times from the fault to the job's end.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use super::{Fault, Outcome};
use crate::multihost::median_and_worst;

/// The table: per fault, transport and launcher.
pub(super) fn report(outcomes: &[Outcome], took: Duration, seed: u64) -> String {
    let mut by: BTreeMap<(Fault, &str, bool), Vec<&Outcome>> = BTreeMap::new();
    for o in outcomes {
        by.entry((o.plan.fault, o.plan.transport, o.plan.fhrun))
            .or_default()
            .push(o);
    }
    let mut s = format!(
        "{} runs in {:.0} s (seed {seed}), failed {}:\n",
        outcomes.len(),
        took.as_secs_f64(),
        outcomes.iter().filter(|o| o.failure.is_some()).count()
    );
    let _ = writeln!(
        s,
        "  fault        transport launcher runs hangs misnamed failed  fault->last error or fhrun's end (median / worst)  [fault->fhrun names a rank]"
    );
    for ((fault, transport, fhrun), os) in by {
        let count = |k: &str| {
            os.iter()
                .filter(|o| o.failure.as_ref().is_some_and(|f| f.0 == k))
                .count()
        };
        let times: Vec<f64> = os.iter().filter_map(|o| o.took).collect();
        let (m, w) = median_and_worst(&times);
        let mut timing = if times.is_empty() {
            "-".to_string()
        } else {
            format!("{m:.2} s / {w:.2} s")
        };
        let named: Vec<f64> = os.iter().filter_map(|o| o.named).collect();
        if !named.is_empty() {
            let (m, w) = median_and_worst(&named);
            let _ = write!(timing, "  [{m:.2} s / {w:.2} s]");
        }
        let _ = writeln!(
            s,
            "  {:<12} {:<9} {:<8} {:>4} {:>5} {:>8} {:>6}  {timing}",
            fault.name(),
            transport,
            if fhrun { "fhrun" } else { "direct" },
            os.len(),
            count("hang"),
            count("misnamed"),
            os.iter().filter(|o| o.failure.is_some()).count()
        );
    }
    s
}
