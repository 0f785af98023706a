//! The stall inspector's step of a round (when `FH_STALL_CHECK_SECONDS` is due): every rank's
//! pending names with their ages are compared; the ranks that lack names others submitted long
//! enough ago are named (in world ranks) by rank 0's warning and by each such rank itself,
//! whose culprit hook shows where it is; every rank writes its flight record.

use std::time::{Duration, Instant};

use fh_core::wire;

use crate::negotiate::{collect, stall};
use crate::stats::StallReport;
use crate::SchedulerError;

use super::Control;

impl Control {
    /// Compare pending names across ranks and report those some ranks lack.
    pub(super) fn inspect_stall(&mut self, now: Instant) -> Result<(), SchedulerError> {
        let mine: Vec<(String, u64)> = self
            .work
            .pending
            .values()
            .map(|p| {
                (
                    p.entry.req.name.to_string(),
                    now.saturating_duration_since(p.entry.submitted).as_millis() as u64,
                )
            })
            .collect();
        let bytes = wire::encode_names(&mine);
        self.add_bytes(bytes.len() + 16);
        let all = collect::allgather_blobs(self.comm.as_mut(), &bytes, self.incarnation)?;
        let mut lists = Vec::with_capacity(all.len());
        for (r, b) in all.iter().enumerate() {
            lists.push(
                wire::decode_names(b).map_err(|e| SchedulerError::Transport {
                    lost_rank: Some(r),
                    message: format!("rank {r} sent a malformed name list: {e}"),
                    source: None,
                })?,
            );
        }
        self.pacing.last_stall_check = now;
        let threshold = self.inner.config.stall_check.unwrap_or(Duration::ZERO);
        let Some(report) = stall::find(&lists, &self.join.set, threshold) else {
            return Ok(());
        };
        // What users read names world ranks (a process set's engine numbers its members from
        // 0); the report itself stays in this engine's numbering for the records below.
        let shown = report.map_ranks(|r| self.inner.world_rank(r));
        if self.inner.rank == 0 {
            tracing::warn!(
                missing_ranks = ?shown.missing_ranks,
                names = ?shown.names,
                waited = ?shown.waited,
                "{shown}"
            );
        }
        self.name_culprit(&report, &shown);
        // The operations waiting here, with the ranks they wait for, in the flight record,
        // which every rank writes now.
        for p in self.work.pending.values() {
            let waits: Vec<usize> = report
                .lacking
                .iter()
                .filter(|(_, names)| names.iter().any(|n| **n == *p.entry.req.name))
                .map(|(r, _)| *r)
                .collect();
            if !waits.is_empty() {
                self.inner.flight.waiting_on(p.entry.cell.record(), &waits);
            }
        }
        self.inner.record_stall(shown.clone());
        self.inner.dump_flight(&shown.to_string());
        if let Some(limit) = self.inner.config.stall_shutdown {
            if shown.waited >= limit {
                return Err(SchedulerError::Stalled {
                    names: shown.names,
                    missing: shown.missing_ranks,
                    lacking: shown.lacking,
                    after: shown.waited,
                });
            }
        }
        Ok(())
    }

    /// This rank is one the stall names as missing tensors: it says so itself, next to rank
    /// 0's warning, and calls the engine's culprit hook (`fasthorovod` prints the Python stack
    /// of every thread there), once for each new list of names it lacks, so that a stall that
    /// lasts does not repeat the stack at every check.
    /// `report` in this engine's numbering, `shown` in world ranks (what the hook gets).
    fn name_culprit(&mut self, report: &StallReport, shown: &StallReport) {
        let Some(names) = report.lacked_by(self.inner.rank) else {
            self.culprit_of = None;
            return;
        };
        if self.culprit_of.as_deref() == Some(names) {
            return;
        }
        self.culprit_of = Some(names.to_vec());
        let hook = self.inner.culprit_hook();
        tracing::warn!(
            "stall: this rank ({}) has not submitted {}, which other ranks submitted up to \
             {:.1}s ago{}",
            self.inner.world_rank(self.inner.rank),
            crate::stats::name_list(names),
            report.waited.as_secs_f64(),
            if hook.is_some() {
                "; where it is instead follows"
            } else {
                ""
            }
        );
        if let Some(hook) = hook {
            hook(shown);
        }
    }
}
