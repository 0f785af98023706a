//! The scheduler's multi-rank suite across processes, under any launcher: the world comes from
//! `fh_transport::from_env()` (so `FH_TRANSPORT=mpi mpirun -np N`, `fhrun -np N`, ...), and each
//! configuration's engine is built in code with [`Config`].
//!
//! ```text
//! cargo build -p fh-scheduler --example sched_suite --features fh-transport/mpi
//! FH_TRANSPORT=mpi mpirun -np 3 -x FH_TRANSPORT target/debug/examples/sched_suite [options]
//! target/debug/fhrun -np 3 --transport tcp -- target/debug/examples/sched_suite [options]
//! ```
//!
//! Options: `--schedule all|horovod|fasthorovod` (default all), `--channels 1,2,4` (the
//! FastHorovod channel counts), `--steps N` (3), `--tensors N` (24), `--delay-us N` (300, the
//! largest random delay before each submission), `--seed S` (default: from the clock; rank 0's
//! is used and printed).
//!
//! For each configuration: `steps` steps, each submitting — in a per-rank random order, with
//! small random delays — `tensors` named allreduces (random lengths, f32/f64/i32,
//! sum/average/max/min), a broadcast, an allgather (rows differ per rank), an alltoall with
//! uneven splits, a reducescatter with uneven rows and a grouped allreduce; every result is
//! compared with the reference each rank computes from the deterministic inputs of all ranks.
//! Then a shape mismatch (the same error on every rank while another tensor proceeds), a
//! duplicate in-flight name (refused), and a consistency check: the hash of each rank's group log,
//! stats counters and mismatch message is allgathered and must be identical on every rank. Last a
//! join: every rank but the last joins at once, the last one's allreduce proceeds with zeros from
//! the joined ranks, and every join names the last rank. Exits non-zero on any difference (every
//! rank learns of every other rank's failures); every wait is bounded, and a failed wait exits at
//! once (the launcher ends the job).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::process::ExitCode;
use std::time::Duration;

use fh_scheduler::{
    AllreduceOptions, Config, DType, Engine, GroupHandle, Handle, Preset, ReduceOp, SchedulerError,
    Tensor,
};

#[path = "../tests/common/cases.rs"]
mod cases;
#[path = "common/world.rs"]
mod world;

use cases::{as_f64, first_difference, make, reference, Lcg, Spec, DTYPES, OPS};
use world::SharedWorld;

/// Every wait is bounded by this.
const LIMIT: Duration = Duration::from_secs(60);

struct Opts {
    configs: Vec<(String, Config)>,
    steps: usize,
    tensors: usize,
    delay_us: u64,
    seed: u64,
}

fn parse_args() -> Result<Opts, String> {
    let mut schedule = "all".to_string();
    let mut channels = vec![1, 2, 4];
    let (mut steps, mut tensors, mut delay_us) = (3, 24, 300);
    let mut seed = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        let num = |s: String| s.parse::<u64>().map_err(|e| format!("{a} {s}: {e}"));
        match a.as_str() {
            "--schedule" => schedule = val()?,
            "--channels" => {
                channels = val()?
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--channels {s}: {e}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--steps" => steps = num(val()?)? as usize,
            "--tensors" => tensors = num(val()?)? as usize,
            "--delay-us" => delay_us = num(val()?)?,
            "--seed" => seed = Some(num(val()?)?),
            _ => {
                return Err(format!(
                    "unknown argument {a} (see the example's documentation)"
                ))
            }
        }
    }
    let mut configs = Vec::new();
    if matches!(schedule.as_str(), "all" | "horovod") {
        configs.push(("horovod".to_string(), Config::preset(Preset::Horovod)));
    }
    if matches!(schedule.as_str(), "all" | "fasthorovod") {
        for k in channels {
            // Small fusion and partition sizes, so that fusion and splitting across channels
            // happen with these small tensors.
            configs.push((
                format!("fasthorovod K={k}"),
                Config::preset(Preset::FastHorovod)
                    .channels(k)
                    .fusion_threshold(16 * 1024)
                    .partition_bytes(4 * 1024),
            ));
        }
    }
    if configs.is_empty() {
        return Err(format!(
            "--schedule {schedule}: expected all, horovod or fasthorovod"
        ));
    }
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            % 1_000_000_007
    });
    Ok(Opts {
        configs,
        steps,
        tensors,
        delay_us,
        seed,
    })
}

/// Wait for `h`, bounded; a failure here is fatal (peers may be blocked).
fn wait(mut h: Handle, what: &str) -> Result<Tensor, String> {
    let name = h.name().to_string();
    h.wait_timeout(LIMIT)
        .map_err(|e| format!("{what} '{name}': {e}"))
}

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

/// The check of one non-allreduce submission.
enum Pending {
    Allreduce(usize, Handle),
    Exact(Handle, Tensor),
    Group(GroupHandle, Vec<Tensor>),
}

/// Compare and describe the first difference.
fn compare(label: &str, got: &Tensor, want: &Tensor) -> Option<String> {
    if got == want {
        return None;
    }
    let (g, w) = (as_f64(got), as_f64(want));
    let at = first_difference(&g, &w).unwrap_or(0);
    Some(format!(
        "{label}: got shape {:?} {:?}, expected shape {:?} {:?}; element {at} is {:?}, expected {:?}",
        got.shape(),
        got.dtype(),
        want.shape(),
        want.dtype(),
        g.get(at),
        w.get(at)
    ))
}

fn i32_rows(cols: usize, rows: Vec<i32>) -> Tensor {
    let r = rows.len() / cols;
    Tensor::from_vec(vec![r, cols], rows).expect("rows * cols elements")
}

/// One step's submissions on this rank, in a random order; returns what to check.
fn submit_step(
    e: &Engine,
    specs: &[Spec],
    step: usize,
    seed: u64,
    rng: &mut Lcg,
    delay_us: u64,
) -> Result<Vec<(String, Pending)>, String> {
    let (rank, n) = (e.rank(), e.size());
    let nt = specs.len();
    let mut out = Vec::new();
    for op in rng.permutation(nt + 5) {
        if delay_us > 0 {
            std::thread::sleep(Duration::from_micros(rng.next() % delay_us));
        }
        let sub = |r: Result<Handle, SchedulerError>, what: &str| {
            r.map_err(|e| format!("submitting {what} at step {step}: {e}"))
        };
        let entry = if op < nt {
            let h = sub(
                e.allreduce(
                    &format!("t{op}"),
                    make(specs[op], rank, step, op),
                    AllreduceOptions::with_op(specs[op].op),
                ),
                "an allreduce",
            )?;
            (format!("t{op} {:?}", specs[op]), Pending::Allreduce(op, h))
        } else if op == nt {
            let root = (step + seed as usize) % n;
            let v = |r: usize| (r * 10 + step) as f64;
            let h = sub(
                e.broadcast("bc", Tensor::from_slice(&[v(rank); 4]), root),
                "bc",
            )?;
            let label = format!("broadcast from {root}");
            (label, Pending::Exact(h, Tensor::from_slice(&[v(root); 4])))
        } else if op == nt + 1 {
            let rows = |r: usize| (r + step) % 3;
            let v = |r: usize| vec![(r * 100 + step) as i32; rows(r) * 2];
            let want: Vec<i32> = (0..n).flat_map(v).collect();
            let h = sub(e.allgather("ag", i32_rows(2, v(rank))), "ag")?;
            ("allgather".into(), Pending::Exact(h, i32_rows(2, want)))
        } else if op == nt + 2 {
            // Rank s sends (s + d + step) % 3 rows to rank d; row j is [s*1000 + d*10 + j, step].
            let count = |s: usize, d: usize| (s + d + step) % 3;
            let rows = |s: usize, d: usize| {
                (0..count(s, d)).flat_map(move |j| [(s * 1000 + d * 10 + j) as i32, step as i32])
            };
            let mine: Vec<i32> = (0..n).flat_map(|d| rows(rank, d)).collect();
            let want: Vec<i32> = (0..n).flat_map(|s| rows(s, rank)).collect();
            let splits = (0..n).map(|d| count(rank, d)).collect();
            let h = sub(e.alltoall("a2a", i32_rows(2, mine), Some(splits)), "a2a")?;
            ("alltoall".into(), Pending::Exact(h, i32_rows(2, want)))
        } else if op == nt + 3 {
            // 2n + 1 rows of 3: rank r gets d/n rows, plus one if r < d % n.
            let d = 2 * n + 1;
            let my_rows = |r: usize| d / n + usize::from(r < d % n);
            let x = |r: usize, i: usize| (r + i + step) as f32;
            let input: Vec<f32> = (0..d * 3).map(|i| x(rank, i)).collect();
            let first: usize = (0..rank).map(my_rows).sum();
            let want: Vec<f32> = (first * 3..(first + my_rows(rank)) * 3)
                .map(|i| (0..n).map(|r| x(r, i)).sum())
                .collect();
            let t = Tensor::from_vec(vec![d, 3], input).expect("d * 3 elements");
            let h = sub(e.reduce_scatter("rs", t, ReduceOp::Sum), "rs")?;
            let want = Tensor::from_vec(vec![my_rows(rank), 3], want).expect("rows * 3");
            ("reducescatter".into(), Pending::Exact(h, want))
        } else {
            let lens = [5usize, 17, 1];
            let x = |r: usize, m: usize, i: usize| (r + m + i + step) as f32;
            let mine = lens
                .iter()
                .enumerate()
                .map(|(m, &l)| {
                    Tensor::from_slice(&(0..l).map(|i| x(rank, m, i)).collect::<Vec<_>>())
                })
                .collect();
            let want = lens
                .iter()
                .enumerate()
                .map(|(m, &l)| {
                    Tensor::from_slice(
                        &(0..l)
                            .map(|i| (0..n).map(|r| x(r, m, i)).sum::<f32>())
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            let h = e
                .grouped_allreduce("grp", mine, sum())
                .map_err(|err| format!("submitting grp at step {step}: {err}"))?;
            ("grouped allreduce".into(), Pending::Group(h, want))
        };
        out.push(entry);
    }
    Ok(out)
}

/// Run every check for one configuration; value mismatches go to `fails`, anything that may
/// leave peers blocked is returned as an error.
fn run_config(
    world: &SharedWorld,
    label: &str,
    cfg: Config,
    o: &Opts,
    fails: &mut Vec<String>,
) -> Result<(), String> {
    let e = Engine::start(world.handle(), cfg.record_groups(true))
        .map_err(|err| format!("starting the engine: {err}"))?;
    let (rank, n) = (e.rank(), e.size());
    let before = fails.len();
    // Rank 0's seed for everybody.
    let seed = e
        .broadcast("suite.seed", Tensor::from_slice(&[o.seed as i64]), 0)
        .map_err(|err| err.to_string())
        .and_then(|h| wait(h, "broadcast"))?
        .to_vec::<i64>()
        .map_err(|err| err.to_string())?[0] as u64;
    if rank == 0 {
        println!("sched_suite {label}: np={n} seed {seed} (rerun with --seed {seed})");
    }
    let mut shared = Lcg(seed);
    let specs: Vec<Spec> = (0..o.tensors)
        .map(|_| Spec {
            len: [0, 1, 7, 100, 1000, 3000][shared.next() as usize % 6]
                + shared.next() as usize % 50,
            dtype: DTYPES[shared.next() as usize % DTYPES.len()],
            op: OPS[shared.next() as usize % OPS.len()],
        })
        .collect();
    let mut rng = Lcg::for_rank(seed, rank);
    for step in 0..o.steps {
        for (what, p) in submit_step(&e, &specs, step, seed, &mut rng, o.delay_us)? {
            let here = format!("{label} rank {rank} step {step} {what}");
            match p {
                Pending::Allreduce(t, h) => {
                    let got = as_f64(&wait(h, &here)?);
                    let want = reference(specs[t], n, step, t);
                    if let Some(i) = first_difference(&got, &want) {
                        fails.push(format!(
                            "{here}: element {i} is {:?}, expected {:?} (lengths {} / {})",
                            got.get(i),
                            want.get(i),
                            got.len(),
                            want.len()
                        ));
                    }
                }
                Pending::Exact(h, want) => {
                    let got = wait(h, &here)?;
                    fails.extend(compare(&here, &got, &want));
                }
                Pending::Group(mut h, want) => {
                    let got = h
                        .wait_timeout(LIMIT)
                        .map_err(|err| format!("{here}: {err}"))?;
                    if got.len() != want.len() {
                        fails.push(format!(
                            "{here}: {} members back, expected {}",
                            got.len(),
                            want.len()
                        ));
                    }
                    for (m, (g, w)) in got.iter().zip(&want).enumerate() {
                        fails.extend(compare(&format!("{here} member {m}"), g, w));
                    }
                }
            }
        }
    }

    // A shape mismatch fails that name on every rank, with the same message, while another
    // tensor proceeds.
    let here = format!("{label} rank {rank}");
    let mut bad = e
        .allreduce(
            "suite.bad",
            Tensor::zeros(DType::F32, vec![rank + 3, 2]).map_err(|x| x.to_string())?,
            sum(),
        )
        .map_err(|err| format!("{here}: submitting suite.bad: {err}"))?;
    let ok = e
        .allreduce(
            "suite.ok",
            Tensor::from_slice(&[rank as f32 + 1.0; 6]),
            sum(),
        )
        .map_err(|err| format!("{here}: submitting suite.ok: {err}"))?;
    let mismatch = match bad.wait_timeout(LIMIT) {
        Err(err) if err.is_mismatch() => err.to_string(),
        Err(err) => {
            return Err(format!(
                "{here}: suite.bad failed with a non-mismatch error: {err}"
            ))
        }
        Ok(_) => {
            fails.push(format!(
                "{here}: the shape mismatch on suite.bad was not reported"
            ));
            String::new()
        }
    };
    let want = Tensor::from_slice(&[(n * (n + 1) / 2) as f32; 6]);
    fails.extend(compare(
        &format!("{here} suite.ok"),
        &wait(ok, &here)?,
        &want,
    ));

    // A duplicate in-flight name is refused (rank 0 tries before anyone else submits it).
    let dup_opts = sum();
    let h = if rank == 0 {
        let h = e
            .allreduce("suite.dup", Tensor::from_slice(&[1i32; 3]), dup_opts)
            .map_err(|err| format!("{here}: submitting suite.dup: {err}"))?;
        match e.allreduce("suite.dup", Tensor::from_slice(&[1i32; 3]), sum()) {
            Err(SchedulerError::DuplicateName { name }) if name == "suite.dup" => {}
            other => fails.push(format!(
                "{here}: a second suite.dup in flight was not refused as a duplicate: {other:?}"
            )),
        }
        wait(e.barrier().map_err(|x| x.to_string())?, &here)?;
        h
    } else {
        wait(e.barrier().map_err(|x| x.to_string())?, &here)?;
        e.allreduce("suite.dup", Tensor::from_slice(&[1i32; 3]), dup_opts)
            .map_err(|err| format!("{here}: submitting suite.dup: {err}"))?
    };
    let want = Tensor::from_slice(&[n as i32; 3]);
    fails.extend(compare(
        &format!("{here} suite.dup"),
        &wait(h, &here)?,
        &want,
    ));

    // Every rank formed the same groups, counted the same, and saw the same mismatch message.
    // Round counts and negotiation bytes/time legitimately differ with timing and role (a
    // faster rank's next submission can start a round that a slower rank counts before its
    // snapshot); the counters hashed here change only when every rank has submitted a name.
    let s = e.stats();
    let log = e.group_log();
    let key = format!(
        "{log:?}|{mismatch}|completed {} fused {} cache_hits {} coordinator_responses {}",
        s.completed, s.fused_groups, s.cache_hits, s.coordinator_responses
    );
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    let mine = [hasher.finish() as i64, (fails.len() - before) as i64];
    let all = wait(
        e.allgather("suite.check", Tensor::from_slice(&mine))
            .map_err(|x| x.to_string())?,
        &here,
    )?
    .to_vec::<i64>()
    .map_err(|x| x.to_string())?;
    let differ: Vec<usize> = (0..n).filter(|&r| all.get(2 * r) != all.first()).collect();
    if !differ.is_empty() {
        fails.push(format!(
            "{here}: ranks {differ:?} differ from rank 0 in group log, stats or mismatch message \
             (this rank: {} groups, {key:.300})",
            log.len()
        ));
    }
    let others: Vec<usize> = (0..n)
        .filter(|&r| r != rank && all.get(2 * r + 1).is_some_and(|&c| c > 0))
        .collect();
    if !others.is_empty() {
        fails.push(format!("{here}: ranks {others:?} reported failures"));
    }

    // Join: every rank but the last runs out of data at once; the last rank's allreduce then
    // proceeds with zeros from the joined ranks (so its sum is its own value, n), and once it
    // joins too, every rank's join names it as the rank that joined last.
    let last = n - 1;
    if rank == last {
        let h = e
            .allreduce(
                "suite.after_join",
                Tensor::from_slice(&[(rank + 1) as f32; 4]),
                sum(),
            )
            .map_err(|err| format!("{here}: submitting suite.after_join: {err}"))?;
        fails.extend(compare(
            &format!("{here} suite.after_join"),
            &wait(h, &here)?,
            &Tensor::from_slice(&[n as f32; 4]),
        ));
    }
    let joined = wait(e.join().map_err(|x| x.to_string())?, &here)?
        .to_vec::<i64>()
        .map_err(|x| x.to_string())?;
    if joined != [last as i64] {
        fails.push(format!(
            "{here}: join returned {joined:?}, expected [{last}] (the rank that joined last)"
        ));
    }
    e.shutdown()
        .map_err(|err| format!("{here}: shutdown: {err}"))?;
    if rank == 0 && fails.len() == before {
        println!(
            "sched_suite {label}: np={n} ok ({} steps x {} allreduces + 5 other collectives, {} groups, mismatch, duplicate and join checks)",
            o.steps,
            o.tensors,
            log.len()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sched_suite: {e}");
            return ExitCode::from(2);
        }
    };
    let world = match fh_transport::from_env() {
        Ok(w) => SharedWorld::new(w),
        Err(e) => {
            eprintln!("sched_suite: transport: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, backend) = (world.topology_rank(), world.backend_name());
    let mut fails = Vec::new();
    for (label, cfg) in &opts.configs {
        if let Err(e) = run_config(&world, label, cfg.clone(), &opts, &mut fails) {
            eprintln!("sched_suite rank {rank} over {backend}: FATAL {e}");
            for f in &fails {
                eprintln!("sched_suite: FAILED {f}");
            }
            // Do not tear the world down: peers may be blocked in a collective; the launcher
            // ends the job.
            std::process::exit(1);
        }
    }
    if fails.is_empty() {
        if rank == 0 {
            println!(
                "sched_suite over {backend}: passed ({} configurations)",
                opts.configs.len()
            );
        }
        ExitCode::SUCCESS
    } else {
        for f in &fails {
            eprintln!("sched_suite: FAILED {f}");
        }
        ExitCode::FAILURE
    }
}
