//! What fhrun keeps of a job to look inside it afterwards: a private directory per job where
//! the ranks write their flight records (`FH_FLIGHT_DIR`, unless the user names one) and, for
//! `--timeline-filename FILE`, their own timelines, which fhrun merges into FILE at the end
//! (one track per rank, one clock). When the job failed, or a rank wrote its flight record for
//! a stall or on SIGUSR1, fhrun keeps the records and says where, and when the job failed it
//! prints what `fhrun --explain DIR` says about them. Other hosts' ranks write theirs on their
//! host, and their remote parts send them back into this directory ([`crate::gather`]); under
//! `--mpi` they stay on their host unless the directory is shared ([`crate::mpi`]). An
//! elastic job's ranks, renumbered at each world, write in a subdirectory per generation
//! (`flight/gen-N`, `timeline/gen-N`; the runtime puts the generation for
//! [`fh_scheduler::elastic::GENERATION_PLACEHOLDER`]), and fhrun merges a timeline per
//! generation.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use fh_scheduler::flight::{dump, explain};

/// The job's directory and what fhrun put in the ranks' environment for it.
pub(crate) struct JobDir {
    path: PathBuf,
    /// The flight directory fhrun chose (`None`: the user named one, or none could be made).
    flight: Option<PathBuf>,
    /// `--timeline-filename`: the merged file, and the directory of the ranks' own files.
    timeline: Option<(PathBuf, PathBuf)>,
    /// An elastic job's: the ranks write in a subdirectory per generation (`gen-N`).
    elastic: bool,
    /// [`JobDir::finish`] ran (else the drop removes the directory).
    finished: bool,
}

/// The subdirectory of the flight and timeline directories where an elastic job's world of
/// each generation writes (the runtime puts the generation for the placeholder).
fn generation_dir() -> String {
    format!("gen-{}", fh_scheduler::elastic::GENERATION_PLACEHOLDER)
}

/// The placeholder a timeline path may hold for the rank (`FH_TIMELINE=/tmp/tl-{rank}.json`).
pub(crate) const RANK_PLACEHOLDER: &str = "{rank}";

impl JobDir {
    /// A fresh directory of this user's, closed to others, under the system's temporary
    /// directory. `user_flight_dir`: the user set `FH_FLIGHT_DIR` (fhrun keeps out of it).
    /// `timeline`: `--timeline-filename` (unless it already names a file per rank).
    /// `elastic`: an elastic job's (a subdirectory per generation).
    pub(crate) fn create(
        user_flight_dir: bool,
        timeline: Option<&Path>,
        elastic: bool,
    ) -> std::io::Result<Self> {
        let tag = crate::sys::random_hex(6)?;
        let path = std::env::temp_dir().join(format!("fhrun-{}-{tag}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        let timeline = timeline
            .filter(|t| !t.to_string_lossy().contains(RANK_PLACEHOLDER))
            .map(|t| (t.to_path_buf(), path.join("timeline")));
        Ok(JobDir {
            flight: (!user_flight_dir).then(|| path.join("flight")),
            timeline,
            path,
            elastic,
            finished: false,
        })
    }

    /// The variables every rank gets for it (replacing those of the same names), and
    /// `FH_SUMMARY=1`: each rank says in one line what it did when it ends (unless the user
    /// set `FH_SUMMARY`).
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if std::env::var_os("FH_SUMMARY").is_none() {
            env.push(("FH_SUMMARY".into(), "1".into()));
        }
        env.extend(rank_vars(
            self.flight.as_deref(),
            self.timeline.as_ref().map(|(_, d)| d.as_path()),
            self.elastic,
        ));
        env
    }

    /// The directories whose files other hosts' parts send back, by the names they travel
    /// under ([`crate::gather`]): `flight` and `timeline`, those fhrun chose.
    pub(crate) fn gathered(&self) -> Vec<(String, PathBuf)> {
        let mut dirs = Vec::new();
        if let Some(f) = &self.flight {
            dirs.push(("flight".to_string(), f.clone()));
        }
        if let Some((_, d)) = &self.timeline {
            dirs.push(("timeline".to_string(), d.clone()));
        }
        dirs
    }

    /// After an `--mpi` job with ranks on other hosts, before [`JobDir::finish`]: when fewer
    /// than `np` ranks' timelines, or (the job `failed`) flight records, are here, say where the
    /// others are. mpirun brings no files back: the ranks of other hosts wrote theirs under the
    /// same path on their own host, which this host sees only when it is shared.
    pub(crate) fn note_other_hosts(&self, np: usize, failed: bool) {
        let count = |dir: &Path| {
            std::fs::read_dir(dir).map_or(0, |entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| {
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        name.starts_with("rank-") && name.ends_with(".json")
                    })
                    .count()
            })
        };
        let short = self.timeline.as_ref().is_some_and(|(_, d)| count(d) < np)
            || (failed && self.flight.as_deref().is_some_and(|f| count(f) < np));
        if short {
            eprintln!(
                "fhrun: the ranks on other hosts wrote their flight records and timelines under \
                 {} on their own hosts, which mpirun does not bring back: fhrun sees them only \
                 where that directory is shared (run fhrun with TMPDIR on a shared filesystem), \
                 else they stay there",
                self.path.display()
            );
        }
    }

    /// After the job: merge the timeline, say where the flight records are (and, when the job
    /// failed, what they show), and remove what is left of the directory.
    pub(crate) fn finish(mut self, failed: bool) {
        self.finished = true;
        if self.elastic {
            return self.finish_elastic(failed);
        }
        if let Some((out, dir)) = &self.timeline {
            merge_timeline(dir, out, "");
        }
        let mut keep = false;
        if let Some(flight) = &self.flight {
            // Kept when the job failed, or when a rank wrote its record for a stall or on
            // request; a job that ended well, whose ranks only recorded errors they got and
            // handled (a test's deliberate mismatch, say), leaves nothing behind. The world's
            // engine's records and each process set's engine's (in `set-*`) alike.
            let all = dump::read_all(flight)
                .ok()
                .filter(|all| failed || asked_for(all));
            if let Some(all) = all {
                keep = true;
                say_where(&all, flight, "");
                if failed {
                    for line in explain::explain_all(&all).lines() {
                        eprintln!("fhrun: {line}");
                    }
                }
            }
        }
        self.clean_up(keep);
    }

    /// [`JobDir::finish`] of an elastic job, whose worlds wrote in a subdirectory per
    /// generation: a merged timeline per generation (`FILE` → `FILE`'s stem `.gen-N` and its
    /// extension), and the flight records of each generation kept when the job failed, when
    /// they were asked for (a stall, SIGUSR1), or when that generation's world was lost to a
    /// failure (an engine stopped on an error) which the job outlived. What the latest of the
    /// lost generations (or a failed job's last) shows is printed.
    fn finish_elastic(self, failed: bool) {
        if let Some((out, dir)) = &self.timeline {
            let gens = dump::generations(dir);
            if gens.is_empty() {
                merge_timeline(dir, out, "");
            }
            for (g, d) in gens {
                merge_timeline(&d, &generation_file(out, g), &format!("generation {g}: "));
            }
        }
        let mut keep = false;
        if let Some(flight) = &self.flight {
            let gens: Vec<(u64, Vec<dump::Records>)> = dump::generations(flight)
                .into_iter()
                .filter_map(|(g, d)| Some((g, dump::read_all(&d).ok()?)))
                .collect();
            let last = gens.last().map(|(g, _)| *g);
            let lost = |all: &[dump::Records]| {
                all.iter()
                    .flat_map(|r| &r.dumps)
                    .any(|d| d.stopped.is_some())
            };
            let mut explained = None;
            for (g, all) in &gens {
                if failed || asked_for(all) || lost(all) {
                    keep = true;
                    say_where(all, flight, &format!("generation {g}: "));
                    if lost(all) || (failed && Some(*g) == last) {
                        explained = Some((*g, all));
                    }
                }
            }
            if let Some((g, all)) = explained {
                for line in explain::explain_all(all).lines() {
                    eprintln!("fhrun: generation {g}: {line}");
                }
            }
        }
        self.clean_up(keep);
    }

    /// Remove the directory, or, when the flight records are `keep`, what else is in it.
    fn clean_up(&self, keep: bool) {
        if keep {
            if let Some((_, dir)) = &self.timeline {
                let _ = std::fs::remove_dir_all(dir);
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Whether a rank wrote its record for a stall or on request (SIGUSR1).
fn asked_for(all: &[dump::Records]) -> bool {
    all.iter()
        .flat_map(|r| &r.dumps)
        .any(|d| d.reason.starts_with("stall") || d.reason == "SIGUSR1")
}

/// Say where each engine's records of `all` are (`label`: what they are, e.g. a generation),
/// and how to explain every record under `flight`.
fn say_where(all: &[dump::Records], flight: &Path, label: &str) {
    for r in all {
        let ranks: Vec<usize> = r.dumps.iter().map(|d| d.rank).collect();
        let whose = match &r.set {
            None => format!("{} ranks ({})", ranks.len(), list(&ranks)),
            Some(m) => format!(
                "process set {{{}}} ({} ranks: {})",
                list(m),
                ranks.len(),
                list(&ranks)
            ),
        };
        eprintln!(
            "fhrun: {label}flight records of {whose} are in {}; `fhrun --explain {}` names \
             the first divergence",
            r.dir.display(),
            flight.display()
        );
    }
}

/// Generation `g`'s merged timeline of an elastic job: `out` with `.gen-G` before its
/// extension (`tl.json` → `tl.gen-3.json`).
fn generation_file(out: &Path, g: u64) -> PathBuf {
    let stem = out.file_stem().unwrap_or_default().to_string_lossy();
    let name = match out.extension() {
        Some(ext) => format!("{stem}.gen-{g}.{}", ext.to_string_lossy()),
        None => format!("{stem}.gen-{g}"),
    };
    out.with_file_name(name)
}

impl Drop for JobDir {
    /// A job that never ran (fhrun stopped before it): nothing of it is kept.
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The ranks' variables for a flight directory and a directory of per-rank timelines;
/// `elastic`: in a subdirectory of each per generation (`gen-{generation}`).
pub(crate) fn rank_vars(
    flight: Option<&Path>,
    timeline: Option<&Path>,
    elastic: bool,
) -> Vec<(String, String)> {
    let per_generation = |d: &Path| match elastic {
        true => d.join(generation_dir()),
        false => d.to_path_buf(),
    };
    let mut env = Vec::new();
    if let Some(f) = flight {
        env.push((
            "FH_FLIGHT_DIR".into(),
            per_generation(f).display().to_string(),
        ));
    }
    if let Some(dir) = timeline {
        let pattern = per_generation(dir).join(format!("rank-{RANK_PLACEHOLDER}.json"));
        env.push(("FH_TIMELINE".into(), pattern.display().to_string()));
    }
    env
}

fn list(ranks: &[usize]) -> String {
    let v: Vec<String> = ranks.iter().map(usize::to_string).collect();
    v.join(", ")
}

/// Merge the ranks' timelines in `dir` into `out`, saying what happened (after `label`).
fn merge_timeline(dir: &Path, out: &Path, label: &str) {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    if files.is_empty() {
        eprintln!(
            "fhrun: {label}no rank wrote a timeline, so {} was not written (did the ranks \
             start the runtime?)",
            out.display()
        );
        return;
    }
    match fh_scheduler::timeline_merge(&files, out) {
        Ok(n) => eprintln!(
            "fhrun: {label}timeline of {} ranks ({n} events) written to {}",
            files.len(),
            out.display()
        ),
        Err(e) => eprintln!("fhrun: {label}cannot merge the ranks' timelines: {e}"),
    }
}

/// `fhrun --explain DIR`: print what the flight records in DIR show; fhrun's exit status.
pub(crate) fn explain_dir(dir: &Path) -> i32 {
    match explain::explain_dir(dir) {
        Ok(text) => {
            print!("{text}");
            0
        }
        Err(e) => {
            eprintln!("fhrun: {e}");
            1
        }
    }
}
