//! Quick measurements (a report, not a test): workload replay and negotiation cost, in process.
//!
//! ```text
//! cargo run --release -p fh-scheduler --example replay -- replay fh-bench/workloads/resnet50.json [ranks] [backward_ms] [steps]
//! FH_TRANSPORT=mpi mpirun -np 4 -x FH_TRANSPORT target/release/examples/replay replay-env fh-bench/workloads/resnet50.json [backward_ms] [steps] [env]
//!     (`env`: only the configuration the environment's FH_* variables give, labelled `env`)
//!     (with FH_TIMELINE=PREFIX, rank 0 writes PREFIX.<schedule>.json for each schedule)
//! cargo run --release -p fh-scheduler --example replay -- negotiation [ranks]
//! cargo run --release -p fh-scheduler --example replay -- mechanics [ranks]
//! cargo run --release -p fh-scheduler --example replay -- latency [ranks]
//! target/release/fhrun -np 2 --transport shm -- target/release/examples/replay latency-env [iterations] [presets]
//! cargo run --release -p fh-scheduler --example replay -- idle [ranks]
//! ```
//!
//! Replay: each step releases the workload's gradients (backward order) over an emulated
//! backward pass of B ms — gradient i at B × (share₀ + … + shareᵢ), as fixed deadlines — and
//! measures the step time (backward start to last gradient reduced) and the exposed
//! communication (step − B), for `horovod` and `fasthorovod` with K = 1, 2, 4 channels.
//! `replay-env` runs the same replay with one process per rank, the world from
//! `fh_transport::from_env()` (any launcher: `mpirun` with `FH_TRANSPORT=mpi`, `fhrun`); build
//! with `--features fh-transport/mpi` for MPI. The polished version of this lives in fh-bench.
//!
//! `latency-env`: the latency of a small named allreduce through the engine, one process per
//! rank (world from `fh_transport::from_env()`): after a warm-up, N (default 2000) back-to-back
//! blocking allreduces of one f64 (8 bytes) under a fixed name; rank 0 prints the median, p90
//! and p99 of every rank's latencies, per preset (`fasthorovod,horovod` by default, or the
//! comma-separated list given), under the environment's `FH_*` settings (e.g. `fhrun -x
//! FH_INLINE_BYTES=0`).

use std::time::{Duration, Instant};

use fh_scheduler::{AllreduceOptions, Config, Engine, Preset, ReduceOp, Tensor};
use fh_transport::backend::local::LocalWorld;
use fh_transport::Transport;

#[path = "common/world.rs"]
#[allow(dead_code)]
mod world;

struct Grad {
    name: String,
    elements: usize,
    share: f64,
}

fn load(path: &str) -> Vec<Grad> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).expect("workload JSON");
    v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| Grad {
            name: t["name"].as_str().unwrap_or("?").to_string(),
            elements: t["elements"].as_u64().unwrap_or(0) as usize,
            share: t["compute_share"].as_f64().unwrap_or(0.0),
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The gradients' names, element counts and release deadlines within a backward pass of
/// `backward`.
fn schedule(grads: &[Grad], backward: Duration) -> Vec<(String, usize, Duration)> {
    let total_share: f64 = grads.iter().map(|g| g.share).sum();
    grads
        .iter()
        .scan(0.0, |acc, g| {
            *acc += g.share / total_share;
            Some((g.name.clone(), g.elements, backward.mul_f64(*acc)))
        })
        .collect()
}

/// One rank's replay: `steps` timed steps (after an untimed warm-up), each released on the
/// schedule; returns this rank's step times in ms.
fn replay_rank(engine: &Engine, shared: &[(String, usize, Duration)], steps: usize) -> Vec<f64> {
    let mut bufs: Vec<Option<Tensor>> = shared
        .iter()
        .map(|(_, n, _)| Some(Tensor::from_slice(&vec![1.0f32; *n])))
        .collect();
    let mut times = Vec::new();
    for step in 0..steps + 1 {
        // Align the ranks' backward starts.
        engine.barrier().unwrap().wait().unwrap();
        let start = Instant::now();
        let mut handles = Vec::with_capacity(shared.len());
        for (i, (name, _, at)) in shared.iter().enumerate() {
            let now = start.elapsed();
            if *at > now {
                std::thread::sleep(*at - now);
            }
            let t = bufs[i].take().expect("buffer");
            let opts = AllreduceOptions::with_op(ReduceOp::Average).priority(i as i64);
            handles.push(engine.allreduce(name, t, opts).unwrap());
        }
        for (i, h) in handles.into_iter().enumerate() {
            bufs[i] = Some(h.wait().unwrap());
        }
        if step > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times
}

fn replay(
    grads: &[Grad],
    ranks: usize,
    backward: Duration,
    steps: usize,
    cfg: Config,
) -> (f64, f64) {
    let shared = std::sync::Arc::new(schedule(grads, backward));
    let threads: Vec<_> = LocalWorld::new(ranks)
        .into_iter()
        .map(|t| {
            let (cfg, shared) = (cfg.clone(), shared.clone());
            std::thread::spawn(move || {
                let engine = Engine::start(Box::new(t), cfg).expect("start");
                let times = replay_rank(&engine, &shared, steps);
                engine.shutdown().unwrap();
                times
            })
        })
        .collect();
    let per_rank: Vec<Vec<f64>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // A step ends when the slowest rank has everything.
    let steps_ms: Vec<f64> = (0..steps)
        .map(|s| per_rank.iter().map(|v| v[s]).fold(0.0, f64::max))
        .collect();
    let m = median(steps_ms);
    (m, m - backward.as_secs_f64() * 1e3)
}

/// The world from the environment (one process per rank), with this rank, the rank count and
/// the backend's name.
fn env_world() -> (world::SharedWorld, usize, usize, String) {
    let world =
        world::SharedWorld::new(fh_transport::from_env().expect("transport from the environment"));
    let (rank, ranks, backend) = (
        world.topology_rank(),
        world.topology().size,
        world.backend_name().to_string(),
    );
    (world, rank, ranks, backend)
}

/// The replay across processes: the world from `fh_transport::from_env()` (one process per
/// rank, e.g. under `mpirun` with `FH_TRANSPORT=mpi`), every configuration in turn on it. The
/// ranks' step times are allgathered; rank 0 prints the table.
fn replay_env(path: &str, backward: Duration, steps: usize, configs: Vec<(String, Config)>) {
    let grads = load(path);
    let (world, rank, ranks, backend) = env_world();
    let shared = schedule(&grads, backward);
    if rank == 0 {
        println!(
            "replay {path} over {backend}: {} tensors, np={ranks}, backward {} ms, median of {steps} steps",
            grads.len(),
            backward.as_millis()
        );
        println!("{:>22} {:>12} {:>14}", "schedule", "step ms", "exposed ms");
    }
    for (label, mut cfg) in configs {
        // FH_TIMELINE=PREFIX: rank 0 writes one timeline per configuration, PREFIX.<label>.json.
        if let Ok(prefix) = std::env::var("FH_TIMELINE") {
            let slug: String = label
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            cfg = cfg.timeline(format!("{prefix}.{slug}.json"));
        }
        let engine = Engine::start(world.handle(), cfg).expect("start");
        let times = replay_rank(&engine, &shared, steps);
        let all = engine
            .allgather("replay.times", Tensor::from_slice(&times))
            .and_then(|mut h| h.wait_timeout(Duration::from_secs(60)))
            .and_then(|t| t.to_vec::<f64>())
            .expect("allgather of the step times");
        engine.shutdown().expect("shutdown");
        // A step ends when the slowest rank has everything.
        let steps_ms: Vec<f64> = (0..steps)
            .map(|s| (0..ranks).map(|r| all[r * steps + s]).fold(0.0, f64::max))
            .collect();
        let m = median(steps_ms);
        if rank == 0 {
            let exposed = m - backward.as_secs_f64() * 1e3;
            println!("{label:>22} {m:>12.1} {exposed:>14.1}");
        }
    }
}

fn replay_configs() -> Vec<(String, Config)> {
    let mut cfgs = vec![("horovod".to_string(), Config::preset(Preset::Horovod))];
    for k in [1, 2, 4] {
        cfgs.push((
            format!("fasthorovod K={k}"),
            Config::preset(Preset::FastHorovod).channels(k),
        ));
    }
    cfgs
}

fn negotiation(ranks: usize) {
    println!("negotiation cost, np={ranks}, tiny tensors all submitted at once (20 ms batching window so a round sees them all), 20 steps after a warm-up");
    println!(
        "{:>8} {:>12} {:>14} {:>16} {:>18}",
        "tensors", "mode", "rounds/step", "bytes/round", "neg. µs/round"
    );
    for &n in &[16usize, 256, 1024] {
        for (mode, cap) in [("coordinator", 0usize), ("bit-vector", 1024)] {
            let cfg = Config::preset(Preset::FastHorovod)
                .cache_capacity(cap)
                .batching_window(Duration::from_millis(20));
            let threads: Vec<_> = LocalWorld::new(ranks)
                .into_iter()
                .map(|t| {
                    let cfg = cfg.clone();
                    std::thread::spawn(move || {
                        let engine = Engine::start(Box::new(t), cfg).expect("start");
                        let step = |_: usize| {
                            let hs: Vec<_> = (0..n)
                                .map(|i| {
                                    engine
                                        .allreduce(
                                            &format!("t{i}"),
                                            Tensor::from_slice(&[1.0f32]),
                                            AllreduceOptions::default(),
                                        )
                                        .unwrap()
                                })
                                .collect();
                            for h in hs {
                                h.wait().unwrap();
                            }
                        };
                        step(0);
                        let before = engine.stats();
                        for s in 0..20 {
                            step(s);
                        }
                        let after = engine.stats();
                        engine.shutdown().unwrap();
                        (before, after)
                    })
                })
                .collect();
            let res: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            // Rank 1 (a non-coordinator) and rank 0 differ in bytes; report rank 0 (the larger).
            let (b, a) = &res[0];
            let rounds = (a.rounds - b.rounds).max(1);
            let bytes = a.negotiation_bytes_sent - b.negotiation_bytes_sent;
            let nt = (a.negotiation_time - b.negotiation_time).as_secs_f64() * 1e6;
            println!(
                "{:>8} {:>12} {:>14.1} {:>16.0} {:>18.1}",
                n,
                mode,
                rounds as f64 / 20.0,
                bytes as f64 / rounds as f64,
                nt / rounds as f64
            );
        }
    }
}

/// CPU time of this process (user + system), from /proc (Linux).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat (utime, stime) are at 11 and 12 after the command name.
    (ticks(11) + ticks(12)) / 100.0
}

fn idle(ranks: usize, preset: Preset, secs: u64) {
    let threads: Vec<_> = LocalWorld::new(ranks)
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let engine = Engine::start(Box::new(t), Config::preset(preset)).expect("start");
                engine
                    .allreduce(
                        "warm",
                        Tensor::from_slice(&[1.0f32]),
                        AllreduceOptions::default(),
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                std::thread::sleep(Duration::from_secs(secs) + Duration::from_millis(500));
                engine
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let used = cpu_seconds() - c0;
    let wall = t0.elapsed().as_secs_f64();
    for t in threads {
        let _ = t.join().unwrap().shutdown();
    }
    println!(
        "idle engine, np={ranks} in one process, {}: {:.2} % of a core per rank over {wall:.0} s",
        preset.name(),
        100.0 * used / wall / ranks as f64
    );
}

fn latency(ranks: usize, preset: Preset) {
    let threads: Vec<_> = LocalWorld::new(ranks)
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let engine = Engine::start(Box::new(t), Config::preset(preset)).expect("start");
                let mut v = Tensor::from_slice(&[1.0f64]);
                let mut lat = Vec::new();
                for i in 0..2000 {
                    let start = Instant::now();
                    v = engine
                        .allreduce("x", v, AllreduceOptions::with_op(ReduceOp::Sum))
                        .unwrap()
                        .wait()
                        .unwrap();
                    if i >= 100 {
                        lat.push(start.elapsed().as_secs_f64() * 1e6);
                    }
                }
                engine.shutdown().unwrap();
                median(lat)
            })
        })
        .collect();
    let m: Vec<f64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    println!(
        "named 8-byte allreduce, np={ranks}, {}: median {:.1} µs (rank 0)",
        preset.name(),
        m[0]
    );
}

/// The `q`-quantile (0..=1) of `v` (nearest rank).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// `latency-env`: the world from the environment, one process per rank; every preset in turn
/// times `iters` blocking allreduces of one f64 under a fixed name after a warm-up. Every
/// rank's latencies are gathered; rank 0 prints median, p90 and p99 over all of them and the
/// median of each rank.
fn latency_env(iters: usize, presets: &[Preset]) {
    let (world, rank, ranks, backend) = env_world();
    const WARMUP: usize = 200;
    for &preset in presets {
        // The preset's defaults under the environment's FH_* settings (e.g. FH_INLINE_BYTES,
        // FH_CONTROL_SPIN_US for comparisons).
        let cfg = Config::from_lookup(|k| match k {
            "FH_SCHEDULE" => Some(preset.name().to_string()),
            _ => std::env::var(k).ok(),
        })
        .expect("configuration from the environment");
        let engine = Engine::start(world.handle(), cfg).expect("start");
        let mut lat = Vec::with_capacity(iters);
        let wall = Instant::now();
        for i in 0..WARMUP + iters {
            let v = Tensor::from_slice(&[1.0f64 + i as f64]);
            let start = Instant::now();
            let v = engine
                .allreduce("latency.x", v, AllreduceOptions::with_op(ReduceOp::Sum))
                .and_then(|mut h| h.wait_timeout(Duration::from_secs(60)))
                .expect("allreduce");
            if i >= WARMUP {
                lat.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let got = v.to_vec::<f64>().expect("f64 result")[0];
            let expect = ranks as f64 * (1.0 + i as f64);
            assert_eq!(got, expect, "allreduce {i}: wrong result");
        }
        let wall = wall.elapsed().as_secs_f64();
        let all = engine
            .allgather("latency.all", Tensor::from_slice(&lat))
            .and_then(|mut h| h.wait_timeout(Duration::from_secs(60)))
            .and_then(|t| t.to_vec::<f64>())
            .expect("allgather of the latencies");
        engine.shutdown().expect("shutdown");
        if rank == 0 {
            let per_rank: Vec<String> = all
                .chunks(iters.max(1))
                .map(|c| format!("{:.1}", quantile(&mut c.to_vec(), 0.5)))
                .collect();
            let mut all = all;
            println!(
                "named 8-byte allreduce over {backend}, np={ranks}, {:<11} {iters} iters: median {:>6.1} µs  p90 {:>6.1} µs  p99 {:>6.1} µs  (per-rank medians {}; {:.0} ops/s)",
                preset.name(),
                quantile(&mut all, 0.5),
                quantile(&mut all, 0.9),
                quantile(&mut all, 0.99),
                per_rank.join(", "),
                (WARMUP + iters) as f64 / wall,
            );
        }
    }
}

/// The negotiation mechanics alone, on in-process communicators: a bit-vector round (build the
/// vector from the cache, one AND allreduce, rebuild the ready list) against a coordinator round
/// (encode requests, gather them, validate on rank 0, broadcast and decode the responses).
fn negotiation_mechanics(ranks: usize) {
    use fh_core::bitvec::NegotiationVec;
    use fh_core::cache::{Lookup, ResponseCache};
    use fh_core::message::{validate, CollectiveKind, Device, Request, Signature};
    use fh_core::{wire, DType};
    use fh_transport::{CollectivesExt, Transport};
    println!("negotiation mechanics alone, np={ranks}, median of 200 rounds (rank 0)");
    println!(
        "{:>8} {:>12} {:>16} {:>14}",
        "tensors", "mode", "bytes/round", "µs/round"
    );
    for &n in &[16usize, 256, 1024] {
        for mode in ["coordinator", "bit-vector"] {
            let threads: Vec<_> = LocalWorld::new(ranks)
                .into_iter()
                .map(|mut t| {
                    std::thread::spawn(move || {
                        let mut comm = t.open("neg").unwrap();
                        let (rank, size) = (t.rank(), t.size());
                        let reqs: Vec<Request> = (0..n)
                            .map(|i| Request {
                                name: format!("layer{i}.weight").into(),
                                rank: rank as u32,
                                sig: Signature {
                                    kind: CollectiveKind::Allreduce,
                                    dtype: DType::F32,
                                    shape: vec![256, 256],
                                    device: Device::Cpu,
                                    op: ReduceOp::Average,
                                    root: 0,
                                    prescale: 1.0,
                                    postscale: 1.0,
                                },
                                priority: i as i64,
                                group: None,
                            })
                            .collect();
                        let mut cache = ResponseCache::new(1024);
                        for r in &reqs {
                            cache.insert(std::sync::Arc::new(
                                validate(std::slice::from_ref(r)).unwrap(),
                            ));
                        }
                        let mut times = Vec::new();
                        let mut bytes = 0usize;
                        for it in 0..220 {
                            comm.barrier().unwrap();
                            let start = Instant::now();
                            let ready = if mode == "bit-vector" {
                                let mut v = NegotiationVec::new(cache.capacity());
                                for r in &reqs {
                                    if let Lookup::Hit(s) =
                                        cache.lookup(&r.name, &r.sig, r.group.as_ref())
                                    {
                                        v.set_slot(s, true);
                                    }
                                }
                                let mut b = v.to_bytes();
                                bytes = b.len();
                                comm.allreduce(&mut b, DType::U8, ReduceOp::BitAnd).unwrap();
                                let agreed =
                                    NegotiationVec::from_bytes(&b, cache.capacity()).unwrap();
                                let slots: Vec<usize> = agreed.pending_slots().collect();
                                slots.iter().filter_map(|&s| cache.get(s).cloned()).count()
                            } else {
                                let enc = wire::encode_requests(&reqs);
                                let mut lens = vec![0u8; 8 * size];
                                comm.allgather(&(enc.len() as u64).to_le_bytes(), &mut lens)
                                    .unwrap();
                                let counts: Vec<usize> = lens
                                    .chunks_exact(8)
                                    .map(|c| u64::from_le_bytes(c.try_into().unwrap()) as usize)
                                    .collect();
                                let mut all = vec![0u8; counts.iter().sum()];
                                comm.allgatherv(&enc, &mut all, &counts).unwrap();
                                let mut out = Vec::new();
                                bytes = enc.len() + 8;
                                if rank == 0 {
                                    let mut table: std::collections::HashMap<
                                        std::sync::Arc<str>,
                                        Vec<Request>,
                                    > = Default::default();
                                    let mut off = 0;
                                    for &c in &counts {
                                        for q in wire::decode_requests(&all[off..off + c]).unwrap()
                                        {
                                            table.entry(q.name.clone()).or_default().push(q);
                                        }
                                        off += c;
                                    }
                                    let resps: Vec<_> = reqs
                                        .iter()
                                        .filter_map(|r| validate(&table[&r.name]))
                                        .collect();
                                    out = wire::encode_responses(&resps);
                                    bytes += out.len() + 8;
                                }
                                let mut len = (out.len() as u64).to_le_bytes();
                                comm.broadcast(&mut len, 0).unwrap();
                                out.resize(u64::from_le_bytes(len) as usize, 0);
                                comm.broadcast(&mut out, 0).unwrap();
                                wire::decode_responses(&out).unwrap().len()
                            };
                            assert_eq!(ready, n);
                            if it >= 20 {
                                times.push(start.elapsed().as_secs_f64() * 1e6);
                            }
                        }
                        (median(times), bytes)
                    })
                })
                .collect();
            let res: Vec<(f64, usize)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            println!("{:>8} {:>12} {:>16} {:>14.1}", n, mode, res[0].1, res[0].0);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("idle") => {
            let n = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
            idle(n, Preset::FastHorovod, 5);
            idle(n, Preset::Horovod, 5);
        }
        Some("latency") => {
            let n = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
            latency(n, Preset::FastHorovod);
            latency(n, Preset::Horovod);
        }
        Some("latency-env") => {
            let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
            let presets: Vec<Preset> = args
                .get(3)
                .map_or("fasthorovod,horovod", String::as_str)
                .split(',')
                .map(|p| match p {
                    "horovod" => Preset::Horovod,
                    "fasthorovod" => Preset::FastHorovod,
                    other => panic!("unknown preset '{other}' (fasthorovod or horovod)"),
                })
                .collect();
            latency_env(iters, &presets);
        }
        Some("mechanics") => {
            negotiation_mechanics(args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4))
        }
        Some("negotiation") => negotiation(args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4)),
        Some("replay-env") => {
            let path = args.get(2).expect("workload path");
            let b = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(100u64);
            let steps = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5);
            let configs = match args.get(5).map(String::as_str) {
                // Only the environment's configuration (FH_SCHEDULE, FH_CHANNELS, FH_BACKPRESSURE…).
                Some("env") => vec![(
                    "env".to_string(),
                    Config::from_env().expect("configuration from the environment"),
                )],
                _ => replay_configs(),
            };
            replay_env(path, Duration::from_millis(b), steps, configs);
        }
        Some("replay") => {
            let path = args.get(2).expect("workload path");
            let ranks = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(4);
            let b = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(100u64);
            let steps = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(5);
            let grads = load(path);
            let backward = Duration::from_millis(b);
            println!("replay {path}: {} tensors, np={ranks}, backward {b} ms, median of {steps} steps", grads.len());
            println!("{:>22} {:>12} {:>14}", "schedule", "step ms", "exposed ms");
            for (label, cfg) in replay_configs() {
                let (step, exposed) = replay(&grads, ranks, backward, steps, cfg);
                println!("{label:>22} {step:>12.1} {exposed:>14.1}");
            }
        }
        _ => eprintln!("usage: replay (replay WORKLOAD [ranks] [backward_ms] [steps] | replay-env WORKLOAD [backward_ms] [steps] [env] | negotiation [ranks] | mechanics [ranks] | latency [ranks] | latency-env [iterations] [presets] | idle [ranks])"),
    }
}
