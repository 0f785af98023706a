//! The collectives sweep: every collective over every transport, then OpenMPI's allreduce.

use std::path::Path;

use indicatif::ProgressBar;

use super::Options;
use crate::collectives::{algbw_gbps, busbw_gbps, Case, Collective, StreamTimes};
use crate::mpi_peer;
use crate::plots::fmt_bytes;
use crate::record::{CollRow, RunRecord, Skipped, StreamRow};
use crate::runner::{Job, RankOutput, Runner};
use crate::stats::Quantity;

/// Run the sweep over `runners` (named by transport) at `sizes`, adding rows (or what was
/// skipped) to `record`.
pub(super) fn run(
    opts: &Options,
    runners: &[(String, Runner)],
    sizes: &[usize],
    work_dir: &Path,
    bar: &ProgressBar,
    record: &mut RunRecord,
) {
    let warmup = 1;
    for (tname, runner) in runners {
        for c in Collective::ALL {
            bar.set_message(format!("collectives: {c} over {tname}"));
            let mut cases: Vec<Case> = sizes
                .iter()
                .map(|&bytes| Case {
                    collective: c,
                    bytes,
                })
                .collect();
            if opts.quick && opts.sizes.is_empty() && c == Collective::Allreduce {
                cases.push(Case {
                    collective: c,
                    bytes: 64 << 20,
                });
            }
            let job = Job::Collectives {
                cases,
                warmup,
                repeats: opts.repeats,
            };
            match runner.run(&format!("collectives-{tname}-{c}"), &job) {
                Ok(outs) => record
                    .collectives
                    .extend(aggregate_collectives(tname, opts.np, &outs)),
                Err(e) => record.skipped.push(Skipped::failed(
                    "collectives",
                    format!("{c} over {tname}"),
                    e,
                )),
            }
            bar.inc(1);
        }
        for (bytes, stage) in stream_jobs() {
            bar.set_message(format!(
                "collectives: concurrent {}allreduces of {} over {tname}",
                if stage.is_some() { "staged " } else { "" },
                fmt_bytes(bytes as f64)
            ));
            let job = Job::Streams {
                bytes,
                streams: stream_counts(),
                stage,
                warmup,
                repeats: stream_repeats(opts.repeats, bytes),
            };
            let name = match stage {
                Some(p) => format!("streams-{tname}-{bytes}-staged{p}"),
                None => format!("streams-{tname}-{bytes}"),
            };
            match runner.run(&name, &job) {
                Ok(outs) => record
                    .streams
                    .extend(aggregate_streams(tname, opts.np, &outs)),
                Err(e) => record.skipped.push(Skipped::failed(
                    "collectives",
                    format!("concurrent allreduces of {bytes} bytes over {tname}"),
                    e,
                )),
            }
            bar.inc(1);
        }
    }
    if !opts.no_peers {
        bar.set_message("collectives: OpenMPI MPI_Allreduce");
        let mut mpi_sizes = sizes.to_vec();
        if opts.quick && opts.sizes.is_empty() {
            mpi_sizes.push(64 << 20);
        }
        match mpi_peer::build(&opts.out.join("peers")) {
            Err(why) => {
                record.skipped.push(Skipped {
                    suite: "collectives".into(),
                    what: "OpenMPI MPI_Allreduce".into(),
                    reason: why,
                });
                bar.inc(2);
            }
            Ok(exe) => {
                for (name, btl) in [("openmpi", None), ("openmpi-tcp", Some("self,tcp"))] {
                    bar.set_message(format!("collectives: {name} MPI_Allreduce"));
                    match mpi_peer::run(
                        &exe,
                        opts.np,
                        btl,
                        warmup,
                        opts.repeats,
                        &mpi_sizes,
                        &work_dir_for(work_dir),
                        opts.job_timeout,
                    ) {
                        Ok(rows) => {
                            for (bytes, secs) in rows {
                                record.collectives.push(coll_row(
                                    name,
                                    Collective::Allreduce,
                                    opts.np,
                                    bytes,
                                    &secs,
                                ));
                            }
                        }
                        Err(e) => record.skipped.push(Skipped::failed(
                            "collectives",
                            format!("{name} MPI_Allreduce"),
                            e,
                        )),
                    }
                    bar.inc(1);
                }
            }
        }
    }
}

/// Bytes of each concurrent allreduce, one measurement per size: the engine's default
/// partition size (what its channels carry at once when a large tensor is split across them)
/// and two sizes of fused groups, where the ranks' hand-offs weigh more than their copies.
pub const STREAM_SIZES: &[usize] = &[256 << 10, 1 << 20, 16 << 20];

/// Bytes of the staged group measured concurrently: a fused group of the engine's default
/// partition size, run through its stage piece.
pub const STAGED_GROUP: usize = 16 << 20;

/// The concurrent measurements, as (bytes, stage piece): plain allreduces of each of
/// [`STREAM_SIZES`], then a staged fused group of [`STAGED_GROUP`] through the engine's default
/// stage piece (`FH_STAGE_BYTES`) packed, reduced and unpacked a piece at a time, as the
/// engine runs fused groups on one host (which the model's staged groups are charged by).
pub fn stream_jobs() -> Vec<(usize, Option<usize>)> {
    let mut v: Vec<(usize, Option<usize>)> = STREAM_SIZES.iter().map(|&b| (b, None)).collect();
    let stage = super::host::stage_bytes();
    if stage > 0 && stage < STAGED_GROUP {
        v.push((STAGED_GROUP, Some(stage)));
    }
    v
}

/// Fewest timed repeats of each concurrent allreduce count.
pub const STREAM_REPEATS: usize = 9;

/// Timed repeats of each concurrent allreduce count of `bytes`: the counts are interleaved, and
/// a ratio of two medians wants more samples than a row, the more the smaller the allreduce
/// (a slow spell of a shared host is long against it): [`STREAM_REPEATS`] at 16 MiB and
/// proportionally more below, up to 100; never fewer than `asked`.
pub fn stream_repeats(asked: usize, bytes: usize) -> usize {
    let by_size = STREAM_REPEATS * (16 << 20) / bytes.max(1);
    by_size.clamp(STREAM_REPEATS, 100).max(asked)
}

/// The concurrent allreduce counts measured: the channel counts the replay compares.
pub fn stream_counts() -> Vec<usize> {
    crate::replay::CHANNEL_COUNTS.to_vec()
}

/// Per stream count, the slowest rank's time of each repeat; then the figures.
pub fn aggregate_streams(transport: &str, np: usize, outs: &[RankOutput]) -> Vec<StreamRow> {
    let per_rank: Vec<&Vec<StreamTimes>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Streams(s) => Some(s),
            _ => None,
        })
        .collect();
    let Some(first) = per_rank.first() else {
        return vec![];
    };
    first
        .iter()
        .zip(slowest_per_repeat(&per_rank, |s| &s.seconds))
        .map(|(st, secs)| {
            let agg: Vec<f64> = secs
                .iter()
                .map(|&t| algbw_gbps(st.streams * st.bytes, t))
                .collect();
            StreamRow {
                transport: transport.to_string(),
                np,
                bytes: st.bytes,
                streams: st.streams,
                stage: st.stage,
                time: Quantity::from_samples(&secs, "s").scaled(1e3, "ms"),
                aggregate_algbw: Quantity::from_samples(&agg, "GB/s"),
            }
        })
        .collect()
}

/// One row from per-repeat seconds (already the slowest rank's).
pub fn coll_row(transport: &str, c: Collective, np: usize, bytes: usize, secs: &[f64]) -> CollRow {
    let alg: Vec<f64> = secs.iter().map(|&s| algbw_gbps(bytes, s)).collect();
    let bus: Vec<f64> = secs.iter().map(|&s| busbw_gbps(c, bytes, s, np)).collect();
    CollRow {
        transport: transport.to_string(),
        collective: c.name().to_string(),
        np,
        bytes,
        time: Quantity::from_samples(secs, "s").scaled(1e6, "us"),
        algbw: Quantity::from_samples(&alg, "GB/s"),
        busbw: Quantity::from_samples(&bus, "GB/s"),
    }
}

/// Per case and repeat, the slowest rank's time; then the figures.
pub fn aggregate_collectives(transport: &str, np: usize, outs: &[RankOutput]) -> Vec<CollRow> {
    slowest_case_seconds(outs)
        .into_iter()
        .map(|(case, bytes, secs)| coll_row(transport, case.collective, np, bytes, &secs))
        .collect()
}

/// Per case of a collectives job: the case, the size used and the slowest rank's seconds of
/// every repeat.
pub fn slowest_case_seconds(outs: &[RankOutput]) -> Vec<(Case, usize, Vec<f64>)> {
    let per_rank: Vec<&Vec<crate::collectives::CaseTimes>> = outs
        .iter()
        .filter_map(|o| match o {
            RankOutput::Collectives(c) => Some(c),
            _ => None,
        })
        .collect();
    let Some(first) = per_rank.first() else {
        return vec![];
    };
    first
        .iter()
        .zip(slowest_per_repeat(&per_rank, |c| &c.seconds))
        .map(|(case, secs)| (case.case.clone(), case.bytes, secs))
        .collect()
}

/// For each measurement `i` of the first rank's list, the slowest rank's seconds of every
/// repeat (`seconds` reads a measurement's per-repeat times; ranks missing one are skipped).
fn slowest_per_repeat<T>(per_rank: &[&Vec<T>], seconds: impl Fn(&T) -> &[f64]) -> Vec<Vec<f64>> {
    let Some(first) = per_rank.first() else {
        return vec![];
    };
    (0..first.len())
        .map(|i| {
            (0..seconds(&first[i]).len())
                .map(|j| {
                    per_rank
                        .iter()
                        .filter_map(|r| r.get(i).and_then(|m| seconds(m).get(j)))
                        .copied()
                        .fold(0.0, f64::max)
                })
                .collect()
        })
        .collect()
}

/// `dir`, created if need be.
fn work_dir_for(dir: &Path) -> std::path::PathBuf {
    let _ = std::fs::create_dir_all(dir);
    dir.to_path_buf()
}
