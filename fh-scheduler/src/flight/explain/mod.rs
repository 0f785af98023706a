//! Reading every rank's flight record together: the first divergence across ranks (a rank that
//! never submitted a tensor the others wait on, ranks that sent a tensor with different
//! shapes, dtypes or kinds, a lost rank), and the last collective every rank completed.
//! Pure: a function of the dumps, tested on its own; `fhrun --explain DIR` and
//! `python -m fasthorovod.explain DIR` print it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use fh_core::mismatch::RankSet;

use super::dump::{self, Dump, OpRecord};

/// One thing the records show going wrong, with when it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Some ranks submitted `name` and wait on it; the `lacking` ranks never submitted it.
    NeverSubmitted {
        /// The tensor.
        name: String,
        /// What the ranks that have it submitted (`allreduce f32 [3]`).
        what: String,
        /// The ranks that never submitted it.
        lacking: Vec<usize>,
        /// The ranks that submitted it and wait.
        have: Vec<usize>,
        /// The earliest submission among `have` (µs since the Unix epoch).
        at_us: i64,
    },
    /// The ranks submitted `name` with different collectives, dtypes or shapes.
    Mismatch {
        /// The tensor.
        name: String,
        /// `kind`, `dtype` or `shape`: the first that differs.
        field: &'static str,
        /// Each value sent, with the ranks that sent it; the fewest ranks first.
        sent: Vec<(String, Vec<usize>)>,
        /// The error the ranks got, as the first of them recorded it.
        error: Option<String>,
        /// The earliest submission (µs since the Unix epoch).
        at_us: i64,
    },
    /// Operations failed on some ranks because `lost` was lost (or failed otherwise, with
    /// `lost` unset): the first such error.
    Failed {
        /// The first operation that failed so.
        name: String,
        /// The ranks on which operations failed so.
        ranks: Vec<usize>,
        /// The rank the errors blame as lost, if any.
        lost: Option<usize>,
        /// The first error.
        error: String,
        /// When it failed first (µs since the Unix epoch).
        at_us: i64,
    },
}

impl Finding {
    fn at_us(&self) -> i64 {
        match self {
            Finding::NeverSubmitted { at_us, .. }
            | Finding::Mismatch { at_us, .. }
            | Finding::Failed { at_us, .. } => *at_us,
        }
    }

    /// The ranks this finding blames (for their last operations).
    fn blamed(&self) -> Vec<usize> {
        match self {
            Finding::NeverSubmitted { lacking, .. } => lacking.clone(),
            Finding::Mismatch { sent, .. } if sent.len() > 1 => sent[0].1.clone(),
            Finding::Mismatch { .. } => Vec::new(),
            Finding::Failed { lost, .. } => lost.iter().copied().collect(),
        }
    }
}

/// What [`explain`] found in a set of flight records; its `Display` is the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    /// The ranks whose records were read.
    pub ranks: Vec<usize>,
    /// Ranks in the world (or in the process set).
    pub size: usize,
    /// For a process set's records, its members (world ranks): the ranks expected.
    pub members: Option<Vec<usize>>,
    /// The reasons the records were written, each with the ranks that gave it.
    pub reasons: Vec<(String, Vec<usize>)>,
    /// What went wrong, earliest first: the first is the first divergence.
    pub findings: Vec<Finding>,
    /// The last collective every rank completed: name, what, round.
    pub last_completed: Option<(String, String, u64)>,
    /// The last operation of each rank a finding blames: rank, a description.
    pub last_ops: Vec<(usize, String)>,
    /// The latest time any record was written (µs since the Unix epoch).
    pub written_us: i64,
}

fn ranks_text(ranks: &[usize]) -> String {
    RankSet::from_ranks(ranks.iter().map(|&r| r as u32)).to_string()
}

/// `[17, 17]`; for allgather and alltoall, whose first dimension may differ, `[*, 17]`.
fn shape_text(op: &OpRecord, free_first: bool) -> String {
    let mut dims: Vec<String> = op
        .shape
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if i == 0 && free_first {
                "*".to_string()
            } else {
                d.to_string()
            }
        })
        .collect();
    if op.ndim > op.shape.len() {
        dims.push(format!("... {} dims", op.ndim));
    }
    format!("[{}]", dims.join(", "))
}

fn free_first(kind: &str) -> bool {
    matches!(kind, "allgather" | "alltoall")
}

/// `allreduce f32 [3]`.
fn what(op: &OpRecord) -> String {
    format!("{} {} {}", op.kind, op.dtype, shape_text(op, false))
}

/// Seconds between two times, for "N s before the records were written".
fn secs(from_us: i64, to_us: i64) -> f64 {
    (to_us.saturating_sub(from_us)) as f64 / 1e6
}

/// The report on every engine's records in a flight directory ([`dump::read_all`]): the
/// world's, then each process set's, each under a line naming where it is when there are
/// several.
pub fn explain_all(all: &[dump::Records]) -> String {
    let mut out = String::new();
    for r in all {
        if all.len() > 1 {
            match &r.set {
                None => out.push_str(&format!("the world's engine ({}):\n", r.dir.display())),
                Some(m) => out.push_str(&format!(
                    "the process set of {} ({}):\n",
                    ranks_text(m),
                    r.dir.display()
                )),
            }
        }
        out.push_str(&explain(&r.dumps).to_string());
    }
    out
}

/// The report on the flight directory `dir` ([`dump::read_all`], [`explain_all`]); for an
/// elastic job's, whose records are per generation ([`dump::generations`]), every
/// generation's that holds any, each under a line naming it. An error when there are none.
pub fn explain_dir(dir: &Path) -> Result<String, String> {
    let gens = dump::generations(dir);
    if gens.is_empty() {
        return dump::read_all(dir).map(|all| explain_all(&all));
    }
    let mut out = String::new();
    for (g, path) in &gens {
        let all = match dump::read_all(path) {
            Ok(all) => all,
            // An empty generation's directory has nothing to say.
            Err(_) if std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_none()) => continue,
            Err(e) => return Err(e),
        };
        out.push_str(&format!("generation {g} ({}):\n", path.display()));
        out.push_str(&explain_all(&all));
    }
    if out.is_empty() {
        return Err(format!(
            "{} holds no flight records in any of its generations' directories (gen-N)",
            dir.display()
        ));
    }
    Ok(out)
}

/// Read the dumps (one per rank, any order) and name what went wrong, earliest first.
pub fn explain(dumps: &[Dump]) -> Explanation {
    let mut dumps: Vec<&Dump> = dumps.iter().collect();
    dumps.sort_by_key(|d| d.rank);
    dumps.dedup_by_key(|d| d.rank);
    let ranks: Vec<usize> = dumps.iter().map(|d| d.rank).collect();
    let size = dumps
        .iter()
        .map(|d| d.size)
        .chain(ranks.iter().map(|r| r + 1))
        .max()
        .unwrap_or(0);
    let mut reasons: Vec<(String, Vec<usize>)> = Vec::new();
    for d in &dumps {
        match reasons.iter_mut().find(|(r, _)| *r == d.reason) {
            Some((_, rs)) => rs.push(d.rank),
            None => reasons.push((d.reason.clone(), vec![d.rank])),
        }
    }
    let written_us = dumps.iter().map(|d| d.written_unix_us).max().unwrap_or(0);
    let mut findings = Vec::new();
    findings.extend(never_submitted(&dumps));
    let (mismatches, mismatched_names) = mismatches(&dumps);
    findings.extend(mismatches);
    findings.extend(failures(&dumps, &mismatched_names));
    findings.sort_by_key(Finding::at_us);
    let last_completed = last_completed(&dumps);
    let mut last_ops = Vec::new();
    if let Some(first) = findings.first() {
        for r in first.blamed() {
            if let Some(d) = dumps.iter().find(|d| d.rank == r) {
                last_ops.push((r, last_op(d, written_us)));
            }
        }
    }
    let members = dumps.iter().find_map(|d| d.members.clone());
    Explanation {
        ranks,
        size,
        members,
        reasons,
        findings,
        last_completed,
        last_ops,
        written_us,
    }
}

/// Names pending (submitted, not negotiated) on some ranks and absent from others' pending.
fn never_submitted(dumps: &[&Dump]) -> Vec<Finding> {
    // name -> (ranks that have it pending, earliest submission, what)
    let mut pending: BTreeMap<&str, (BTreeSet<usize>, i64, String)> = BTreeMap::new();
    for d in dumps {
        for op in &d.ops {
            if op.outcome == "pending" && op.negotiated_us.is_none() {
                let e = pending
                    .entry(op.name.as_str())
                    .or_insert_with(|| (BTreeSet::new(), i64::MAX, what(op)));
                e.0.insert(d.rank);
                e.1 = e.1.min(op.submitted_us);
            }
        }
    }
    pending
        .into_iter()
        .filter_map(|(name, (have, at_us, what))| {
            let lacking: Vec<usize> = dumps
                .iter()
                .map(|d| d.rank)
                .filter(|r| !have.contains(r))
                .collect();
            (!lacking.is_empty()).then(|| Finding::NeverSubmitted {
                name: name.to_string(),
                what,
                lacking,
                have: have.into_iter().collect(),
                at_us,
            })
        })
        .collect()
}

/// A field of a record, as the ranks compare it.
type FieldOf = fn(&OpRecord) -> String;

/// Names whose last record failed on some ranks, submitted with different kinds, dtypes or
/// shapes; and the set of those names.
fn mismatches(dumps: &[&Dump]) -> (Vec<Finding>, BTreeSet<String>) {
    // name -> each rank's last record of it, when that failed
    let mut failed: BTreeMap<&str, Vec<(usize, &OpRecord)>> = BTreeMap::new();
    for d in dumps {
        let mut last: BTreeMap<&str, &OpRecord> = BTreeMap::new();
        for op in &d.ops {
            last.insert(op.name.as_str(), op);
        }
        for (name, op) in last {
            if op.outcome == "error" && op.lost_rank.is_none() {
                failed.entry(name).or_default().push((d.rank, op));
            }
        }
    }
    let mut out = Vec::new();
    let mut names = BTreeSet::new();
    for (name, recs) in failed {
        let fields: [(&'static str, FieldOf); 3] = [
            ("kind", |o| o.kind.clone()),
            ("dtype", |o| o.dtype.clone()),
            ("shape", |o| shape_text(o, free_first(&o.kind))),
        ];
        for (field, value) in fields {
            let mut sent: Vec<(String, Vec<usize>)> = Vec::new();
            for (r, op) in &recs {
                let v = value(op);
                match sent.iter_mut().find(|(s, _)| *s == v) {
                    Some((_, rs)) => rs.push(*r),
                    None => sent.push((v, vec![*r])),
                }
            }
            if sent.len() > 1 {
                sent.sort_by_key(|(_, rs)| (rs.len(), rs[0]));
                names.insert(name.to_string());
                out.push(Finding::Mismatch {
                    name: name.to_string(),
                    field,
                    sent,
                    error: recs.iter().find_map(|(_, o)| o.error.clone()),
                    at_us: recs.iter().map(|(_, o)| o.submitted_us).min().unwrap_or(0),
                });
                break;
            }
        }
    }
    (out, names)
}

/// Failures that are not mismatches: one finding per lost rank (the first operation that
/// failed naming it), and one per other error text.
fn failures(dumps: &[&Dump], mismatched: &BTreeSet<String>) -> Vec<Finding> {
    // key: the lost rank, or the error text
    let mut by: BTreeMap<(Option<usize>, String), Finding> = BTreeMap::new();
    for d in dumps {
        for op in &d.ops {
            if op.outcome != "error" || mismatched.contains(&op.name) {
                continue;
            }
            let error = op.error.clone().unwrap_or_default();
            let key = match op.lost_rank {
                Some(r) => (Some(r), String::new()),
                None => (None, error.clone()),
            };
            let at = op.done_us.unwrap_or(op.submitted_us);
            let f = by.entry(key).or_insert_with(|| Finding::Failed {
                name: op.name.clone(),
                ranks: Vec::new(),
                lost: op.lost_rank,
                error: error.clone(),
                at_us: at,
            });
            if let Finding::Failed {
                name,
                ranks,
                error: e,
                at_us,
                ..
            } = f
            {
                if !ranks.contains(&d.rank) {
                    ranks.push(d.rank);
                    ranks.sort_unstable();
                }
                if at < *at_us {
                    *at_us = at;
                    *name = op.name.clone();
                    *e = error;
                }
            }
        }
    }
    by.into_values().collect()
}

/// The collective with the highest round that every rank's record shows completed.
fn last_completed(dumps: &[&Dump]) -> Option<(String, String, u64)> {
    let mut common: Option<BTreeMap<(u64, String), String>> = None;
    for d in dumps {
        let done: BTreeMap<(u64, String), String> = d
            .ops
            .iter()
            .filter(|o| o.outcome == "ok")
            .filter_map(|o| Some(((o.round?, o.name.clone()), what(o))))
            .collect();
        common = Some(match common {
            None => done,
            Some(c) => c
                .into_iter()
                .filter(|(k, _)| done.contains_key(k))
                .collect(),
        });
    }
    common?
        .into_iter()
        .next_back()
        .map(|((round, name), what)| (name, what, round))
}

/// A rank's last operation, in words.
fn last_op(d: &Dump, written_us: i64) -> String {
    let Some(op) = d.ops.last() else {
        return "no operation recorded".to_string();
    };
    let state = match op.outcome.as_str() {
        "pending" if op.negotiated_us.is_none() => format!(
            "submitted {:.1} s before the records were written, not negotiated",
            secs(op.submitted_us, written_us)
        ),
        "pending" => "negotiated, still running".to_string(),
        "ok" => format!(
            "completed {:.1} s before the records were written",
            secs(op.done_us.unwrap_or(op.submitted_us), written_us)
        ),
        _ => format!(
            "failed: {}",
            op.error.as_deref().unwrap_or("(no error recorded)")
        ),
    };
    format!("{:?} ({}), {state}", op.name, what(op))
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::NeverSubmitted {
                name,
                what,
                lacking,
                have,
                ..
            } => {
                let verb = if lacking.len() == 1 { "has" } else { "have" };
                let wait = if have.len() == 1 { "waits" } else { "wait" };
                write!(
                    f,
                    "{} {verb} never submitted {name:?} ({what}), which {} submitted and {wait} \
                     on",
                    ranks_text(lacking),
                    ranks_text(have)
                )
            }
            Finding::Mismatch {
                name,
                field,
                sent,
                error,
                ..
            } => {
                if let [(odd, odd_ranks), (common, common_ranks)] = sent.as_slice() {
                    let verb = "sent";
                    write!(
                        f,
                        "{} {verb} {name:?} with {field} {odd} where {} sent {common}",
                        ranks_text(odd_ranks),
                        ranks_text(common_ranks)
                    )?;
                } else {
                    let parts: Vec<String> = sent
                        .iter()
                        .map(|(v, rs)| format!("{} sent {v}", ranks_text(rs)))
                        .collect();
                    write!(
                        f,
                        "the ranks disagree on the {field} of {name:?}: {}",
                        parts.join("; ")
                    )?;
                }
                if error.is_some() {
                    write!(f, "; it failed on every rank")?;
                }
                Ok(())
            }
            Finding::Failed {
                name,
                ranks,
                lost,
                error,
                ..
            } => match lost {
                Some(r) => write!(
                    f,
                    "rank {r} was lost: {name:?} failed first on {}: {error}",
                    ranks_text(ranks)
                ),
                None => write!(f, "{name:?} failed on {}: {error}", ranks_text(ranks)),
            },
        }
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let expected: Vec<usize> = match &self.members {
            Some(m) => m.clone(),
            None => (0..self.size).collect(),
        };
        let missing: Vec<usize> = expected
            .into_iter()
            .filter(|r| !self.ranks.contains(r))
            .collect();
        match &self.members {
            Some(m) => write!(
                f,
                "flight records of {} (of the process set of {})",
                ranks_text(&self.ranks),
                ranks_text(m)
            )?,
            None => write!(
                f,
                "flight records of {} (of {} ranks)",
                ranks_text(&self.ranks),
                self.size
            )?,
        }
        if !missing.is_empty() {
            write!(
                f,
                "; none from {} (gone before it could write, or another directory)",
                ranks_text(&missing)
            )?;
        }
        writeln!(f)?;
        for (reason, ranks) in self.reasons.iter().take(3) {
            writeln!(f, "  written by {} for: {reason}", ranks_text(ranks))?;
        }
        match self.findings.first() {
            None => writeln!(
                f,
                "no divergence: every rank's record agrees (nothing pending on some ranks only, \
                 no mismatch, no failure)"
            )?,
            Some(first) => {
                write!(f, "first divergence: {first}")?;
                writeln!(
                    f,
                    " ({:.1} s before the records were written)",
                    secs(first.at_us(), self.written_us)
                )?;
                for (r, op) in &self.last_ops {
                    writeln!(f, "  rank {r}'s last operation: {op}")?;
                }
                for later in self.findings.iter().skip(1).take(5) {
                    writeln!(f, "then: {later}")?;
                }
                if self.findings.len() > 6 {
                    writeln!(f, "... and {} more", self.findings.len() - 6)?;
                }
            }
        }
        match &self.last_completed {
            Some((name, what, round)) => writeln!(
                f,
                "last collective every rank completed: {name:?} ({what}, negotiation round \
                 {round})"
            ),
            None => writeln!(f, "no collective is completed in every rank's record"),
        }
    }
}

#[cfg(test)]
mod tests;
