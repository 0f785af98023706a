//! Latency and CPU cost of one small named allreduce at a time (a profiling aid, not a test).
//!
//! ```text
//! cargo build --release -p fh-scheduler --example small_allreduce
//! FH_TRANSPORT=tcp target/release/fhrun -np 4 target/release/examples/small_allreduce [ops] [rounds]
//! ```
//!
//! Every rank allreduces two `f32` under one name, `ops` times back to back (submit, wait),
//! `rounds` times after a warm-up round; the engine's configuration comes from the
//! environment (`Config::from_env`: `FH_CALLER_ROUNDS`, `FH_SCHEDULE`, ...). Rank 0 prints, per
//! round, the slowest rank's time per allreduce and the CPU time every rank's threads used
//! per allreduce (summed over the ranks, from `/proc/self/task/*/schedstat`) and, per rank,
//! the share of the allreduces whose negotiation round the waiting caller ran itself
//! (`Config::caller_rounds`), then the medians. Where ranks outnumber cores, the latency
//! follows the CPU: this is the figure to look at under `perf record`. `fh-bench negotiation`
//! measures the same in its `8 B back to back` rows, beside the engine with its rounds on one
//! thread.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, Tensor};

/// Nanoseconds on a CPU of every live thread of this process.
fn threads_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn run(ops: usize, rounds: usize) -> Result<(), String> {
    let world = fh_transport::from_env().map_err(|e| format!("transport: {e}"))?;
    let backend = world.backend();
    let config = Config::from_env().map_err(|e| format!("config: {e}"))?;
    let caller_rounds = config.caller_rounds;
    let engine = Engine::start(world, config).map_err(|e| format!("engine: {e}"))?;
    let (rank, size) = (engine.rank(), engine.size());
    let err = |e: fh_scheduler::SchedulerError| e.to_string();
    let sum = AllreduceOptions::with_op(ReduceOp::Sum);
    let (mut lat, mut cpu) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        engine.barrier().map_err(err)?.wait().map_err(err)?;
        let cpu0 = threads_cpu_ns();
        let helped0 = engine.stats().caller_rounds;
        let t0 = Instant::now();
        for _ in 0..ops {
            let out = engine
                .allreduce("small", Tensor::from_slice(&[1.0f32; 2]), sum)
                .map_err(err)?
                .wait_timeout(Duration::from_secs(30))
                .map_err(err)?;
            let got = out.to_vec::<f32>().map_err(err)?;
            if got != [size as f32; 2] {
                return Err(format!("rank {rank}: the sum of ones is {got:?}"));
            }
        }
        let per_op_us = t0.elapsed().as_secs_f64() * 1e6 / ops as f64;
        let cpu_us = (threads_cpu_ns() - cpu0) as f64 * 1e-3 / ops as f64;
        // The share of the allreduces whose round the caller ran itself.
        let helped = (engine.stats().caller_rounds - helped0) as f64 / ops as f64;
        // The slowest rank's latency, every rank's CPU, both per allreduce, and the shares.
        let figures = engine
            .allgather(
                "small.figures",
                Tensor::from_slice(&[per_op_us, cpu_us, helped]),
            )
            .map_err(err)?
            .wait_timeout(Duration::from_secs(30))
            .map_err(err)?
            .to_vec::<f64>()
            .map_err(err)?;
        let slowest = figures.chunks(3).map(|c| c[0]).fold(0.0, f64::max);
        let all_cpu: f64 = figures.chunks(3).map(|c| c[1]).sum();
        let shares: Vec<String> = figures
            .chunks(3)
            .map(|c| format!("{:.0} %", 100.0 * c[2]))
            .collect();
        if round > 0 {
            lat.push(slowest);
            cpu.push(all_cpu);
            if rank == 0 {
                println!(
                    "round {round}: {slowest:.1} us per allreduce, {all_cpu:.1} us CPU of all \
                     ranks; rounds run by the caller, per rank: {}",
                    shares.join(", ")
                );
            }
        }
    }
    if rank == 0 {
        println!(
            "{size} ranks over {backend}, caller rounds {}: median {:.1} us per allreduce, {:.1} us CPU of all ranks ({:.1} per rank)",
            if caller_rounds { "on" } else { "off" },
            median(&mut lat),
            median(&mut cpu),
            median(&mut cpu) / size as f64
        );
    }
    engine.shutdown().map_err(|e| format!("shutdown: {e}"))?;
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let ops = args.next().and_then(Result::ok).unwrap_or(2000).max(1);
    let rounds = args.next().and_then(Result::ok).unwrap_or(5).max(1);
    match run(ops, rounds) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("small_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}
