//! Figures of a running engine, for people: a one-line summary of a rank, and the Prometheus
//! text format (`FH_METRICS_ADDR`; `fasthorovod` serves it). Pure functions of an
//! [`EngineStats`] snapshot.

use std::fmt::Write;

use crate::stats::EngineStats;
pub use crate::stats::GROUP_SIZE_BOUNDS;

/// `1.5 GB`, `12.0 MB`, `640 B`.
fn bytes_text(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

impl EngineStats {
    /// One line for rank `rank`: operations, fused groups and their mean size, bytes and the
    /// rate each channel moved them at while busy (and each channel's share), negotiation
    /// rounds per second, exposed communication per step (when steps were recorded), stalls.
    pub fn summary_line(&self, rank: usize) -> String {
        let secs = self.uptime.as_secs_f64().max(1e-9);
        let mut s = format!(
            "fasthorovod rank {rank}: {} ops in {} fused groups",
            self.completed, self.fused_groups
        );
        if let Some(mean) = self.data_bytes.checked_div(self.fused_groups) {
            let _ = write!(s, " (mean {})", bytes_text(mean));
        }
        let _ = write!(s, ", {}", bytes_text(self.data_bytes));
        let busy: f64 = self.channels.iter().map(|c| c.busy.as_secs_f64()).sum();
        if busy > 0.0 {
            let _ = write!(
                s,
                " at {:.2} GB/s per busy channel",
                self.data_bytes as f64 / busy / 1e9
            );
        }
        if self.channels.len() > 1 {
            let shares: Vec<String> = self
                .channel_shares()
                .iter()
                .map(|x| format!("{:.0}", x * 100.0))
                .collect();
            let _ = write!(
                s,
                " over {} channels ({} %)",
                self.channels.len(),
                shares.join("/")
            );
        }
        let _ = write!(
            s,
            ", {} negotiation rounds ({:.0}/s, {} via the coordinator)",
            self.rounds,
            self.rounds as f64 / secs,
            self.coordinator_rounds
        );
        if self.steps > 0 {
            let _ = write!(
                s,
                ", exposed communication {:.1} ms/step over {} steps",
                self.exposed.as_secs_f64() * 1e3 / self.steps as f64,
                self.steps
            );
        }
        let _ = write!(s, ", {} stall warnings", self.stall_warnings);
        s
    }

    /// The counters in Prometheus' text format (version 0.0.4), each labelled with `rank`.
    pub fn to_prometheus(&self, rank: usize) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(out, "# HELP fasthorovod_{name} {help}");
            let _ = writeln!(out, "# TYPE fasthorovod_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "fasthorovod_{name}{{rank=\"{rank}\"{labels}}} {value}");
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        metric(
            "operations_total",
            "counter",
            "Operations completed (well or not).",
            &one(self.completed.to_string()),
        );
        metric(
            "negotiation_rounds_total",
            "counter",
            "Negotiation rounds run.",
            &one(self.rounds.to_string()),
        );
        metric(
            "coordinator_rounds_total",
            "counter",
            "Negotiation rounds that needed the coordinator.",
            &one(self.coordinator_rounds.to_string()),
        );
        metric(
            "negotiation_seconds_total",
            "counter",
            "Time spent in negotiation rounds.",
            &one(format!("{:.6}", self.negotiation_time.as_secs_f64())),
        );
        metric(
            "negotiation_bytes_total",
            "counter",
            "Bytes this rank sent in negotiation.",
            &one(self.negotiation_bytes_sent.to_string()),
        );
        let per_channel = |f: &dyn Fn(&crate::stats::ChannelStats) -> String| {
            self.channels
                .iter()
                .enumerate()
                .map(|(c, s)| (format!(",channel=\"{c}\""), f(s)))
                .collect::<Vec<_>>()
        };
        metric(
            "channel_bytes_total",
            "counter",
            "Payload bytes through each data channel.",
            &per_channel(&|c| c.bytes.to_string()),
        );
        metric(
            "channel_busy_seconds_total",
            "counter",
            "Time each data channel spent running groups (its rate: bytes / busy seconds).",
            &per_channel(&|c| format!("{:.6}", c.busy.as_secs_f64())),
        );
        metric(
            "channel_groups_total",
            "counter",
            "Fused groups each data channel ran.",
            &per_channel(&|c| c.groups.to_string()),
        );
        // The fused-group size histogram: cumulative buckets.
        let _ = writeln!(
            out,
            "# HELP fasthorovod_fused_group_bytes Sizes of the fused groups run."
        );
        let _ = writeln!(out, "# TYPE fasthorovod_fused_group_bytes histogram");
        let mut total = 0;
        for (i, n) in self.group_sizes.iter().enumerate() {
            total += n;
            let le = GROUP_SIZE_BOUNDS
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(
                out,
                "fasthorovod_fused_group_bytes_bucket{{rank=\"{rank}\",le=\"{le}\"}} {total}"
            );
        }
        let _ = writeln!(
            out,
            "fasthorovod_fused_group_bytes_sum{{rank=\"{rank}\"}} {}",
            self.data_bytes
        );
        let _ = writeln!(
            out,
            "fasthorovod_fused_group_bytes_count{{rank=\"{rank}\"}} {total}"
        );
        let mut metric = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP fasthorovod_{name} {help}");
            let _ = writeln!(out, "# TYPE fasthorovod_{name} {kind}");
            let _ = writeln!(out, "fasthorovod_{name}{{rank=\"{rank}\"}} {v}");
        };
        metric(
            "steps_total",
            "counter",
            "Training steps the framework reported (fasthorovod.torch's optimizer).",
            self.steps.to_string(),
        );
        metric(
            "exposed_communication_seconds_total",
            "counter",
            "Time the steps waited for their gradients' reduction.",
            format!("{:.6}", self.exposed.as_secs_f64()),
        );
        metric(
            "stall_warnings_total",
            "counter",
            "Stall warnings raised.",
            self.stall_warnings.to_string(),
        );
        metric(
            "uptime_seconds",
            "gauge",
            "Time since the engine started.",
            format!("{:.3}", self.uptime.as_secs_f64()),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::stats::{group_bucket, ChannelStats};

    fn stats() -> EngineStats {
        let mut group_sizes = vec![0; GROUP_SIZE_BOUNDS.len() + 1];
        group_sizes[group_bucket(1000)] += 3;
        group_sizes[group_bucket(5 << 20)] += 1;
        group_sizes[group_bucket(1 << 30)] += 1;
        EngineStats {
            rounds: 200,
            coordinator_rounds: 4,
            completed: 50,
            fused_groups: 5,
            data_bytes: 4_000_000,
            steps: 10,
            exposed: Duration::from_millis(25),
            uptime: Duration::from_secs(2),
            group_sizes,
            channels: vec![
                ChannelStats {
                    bytes: 3_000_000,
                    groups: 3,
                    busy: Duration::from_millis(2),
                },
                ChannelStats {
                    bytes: 1_000_000,
                    groups: 2,
                    busy: Duration::from_millis(2),
                },
            ],
            ..EngineStats::default()
        }
    }

    #[test]
    fn the_summary_says_what_a_rank_did_in_one_line() {
        assert_eq!(
            stats().summary_line(3),
            "fasthorovod rank 3: 50 ops in 5 fused groups (mean 800.0 kB), 4.0 MB at 1.00 GB/s \
             per busy channel over 2 channels (75/25 %), 200 negotiation rounds (100/s, 4 via \
             the coordinator), exposed communication 2.5 ms/step over 10 steps, 0 stall warnings"
        );
        assert!(!EngineStats::default().summary_line(0).contains('\n'));
    }

    #[test]
    fn prometheus_text_has_every_family_once_and_cumulative_buckets() {
        let text = stats().to_prometheus(1);
        assert!(text.contains("fasthorovod_channel_bytes_total{rank=\"1\",channel=\"0\"} 3000000"));
        assert!(text.contains("fasthorovod_fused_group_bytes_bucket{rank=\"1\",le=\"4096\"} 3"));
        assert!(
            text.contains("fasthorovod_fused_group_bytes_bucket{rank=\"1\",le=\"268435456\"} 4")
        );
        assert!(text.contains("fasthorovod_fused_group_bytes_bucket{rank=\"1\",le=\"+Inf\"} 5"));
        assert!(text.contains("fasthorovod_exposed_communication_seconds_total{rank=\"1\"} 0.025"));
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).unwrap();
            let n = text
                .lines()
                .filter(|l| l.starts_with("# TYPE") && l.contains(&format!(" {name} ")))
                .count();
            assert_eq!(n, 1, "{name}");
        }
        // Every sample line: name{labels} value.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (head, value) = line.rsplit_once(' ').unwrap();
            assert!(
                head.starts_with("fasthorovod_") && head.ends_with('}'),
                "{line}"
            );
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
        assert_eq!(group_bucket(0), 0);
        assert_eq!(group_bucket(4096), 0);
        assert_eq!(group_bucket(4097), 1);
    }
}
