//! `fh-selftest`: checks that the ranks of a job can talk to each other.
//!
//! Run it under any launcher (`fhrun -np 4 fh-selftest`, `mpirun`, `srun`, `torchrun`): it
//! builds the world from the environment with `fh_transport::from_env()`, prints this rank's
//! place in it, runs allreduces whose exact result it verifies element by element, a broadcast
//! and a barrier, and prints the allreduce bandwidth (rank 0). Exit status 0 when every check
//! passes, 1 on any error (the message names the lost rank when a peer died), 2 on bad usage,
//! 143 when terminated by SIGTERM.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use fh_core::{DType, ReduceOp};
use fh_transport::{CollectivesExt, Communicator, Transport};

/// Check that the ranks of a FastHorovod job can talk to each other, and how fast.
#[derive(Debug, Parser)]
#[command(name = "fh-selftest", version)]
struct Args {
    /// Allreduce iterations of the bandwidth phase.
    #[arg(long, default_value = "5", value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,

    /// Bytes per allreduce in the bandwidth phase (rounded down to whole f32 elements).
    #[arg(long, default_value = "4194304", value_parser = clap::value_parser!(u64).range(4..=(1u64 << 34)))]
    bytes: u64,

    /// Keep running verified allreduces until killed (prints progress every few seconds).
    #[arg(long = "loop")]
    looping: bool,
}

/// fh-selftest's errors: a message for the operator.
type Failure = String;

fn main() -> ExitCode {
    let args = Args::parse();
    // The runtime logs through `tracing`; show it at FH_LOG_LEVEL (default: warnings).
    let level = std::env::var("FH_LOG_LEVEL").unwrap_or_else(|_| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&level).unwrap_or_else(|_| {
        eprintln!("fh-selftest: FH_LOG_LEVEL={level:?} is not a log level; using warn");
        tracing_subscriber::EnvFilter::new("warn")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(fh_scheduler::config::log_colour())
        .init();
    // SIGTERM is taken by a watcher thread (blocked here, before any thread starts), so that a
    // rank stopped by its launcher can still report a lost peer it was already noticing.
    let terminated = Arc::new(AtomicBool::new(false));
    watch_sigterm(terminated.clone());
    let rank_hint = std::env::var("FH_RANK")
        .or_else(|_| std::env::var("OMPI_COMM_WORLD_RANK"))
        .or_else(|_| std::env::var("PMI_RANK"))
        .or_else(|_| std::env::var("SLURM_PROCID"))
        .or_else(|_| std::env::var("RANK"))
        .unwrap_or_else(|_| "?".into());
    match run(&args, &terminated) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) if terminated.load(Ordering::SeqCst) && msg.is_empty() => {
            eprintln!("fh-selftest: rank {rank_hint}: terminated by SIGTERM");
            ExitCode::from(143)
        }
        Err(msg) => {
            eprintln!("fh-selftest: rank {rank_hint}: FAILED: {msg}");
            ExitCode::from(1)
        }
    }
}

fn watch_sigterm(flag: Arc<AtomicBool>) {
    // SAFETY: sigset_t is plain data, initialized by sigemptyset before use; pthread_sigmask
    // only changes this thread's mask (inherited by threads created later).
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let spawned = std::thread::Builder::new()
        .name("sigterm".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is a valid sigset_t and `sig` a valid out-pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                flag.store(true, Ordering::SeqCst);
                // Give the main thread a moment to finish (or report) what it is doing.
                std::thread::sleep(Duration::from_millis(1000));
                eprintln!("fh-selftest: terminated by SIGTERM");
                std::process::exit(143);
            }
        });
    if let Err(e) = spawned {
        eprintln!("fh-selftest: cannot start the signal thread ({e}); SIGTERM will be ignored");
    }
}

/// Rank `rank`'s contribution at index `i`: small integers, so f32 sums are exact.
fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) * (i % 97 + 1)) as f32
}

/// The exact sum over `size` ranks at index `i`.
fn expected(size: usize, i: usize) -> f32 {
    ((i % 97 + 1) * size * (size + 1) / 2) as f32
}

/// Fills `buf` with this rank's values, allreduces it (Sum) and checks every element; returns
/// the time spent in the allreduce alone. With `sync`, a barrier separates filling from the
/// timed allreduce, so that every rank starts it together.
fn verified_allreduce(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    what: &str,
    sync: bool,
) -> Result<Duration, Failure> {
    let (rank, size) = (comm.rank(), comm.size());
    for (i, x) in buf.iter_mut().enumerate() {
        *x = value(rank, i);
    }
    if sync {
        comm.barrier()
            .map_err(|e| format!("{what}: barrier: {e}"))?;
    }
    let t0 = Instant::now();
    comm.allreduce(bytemuck::cast_slice_mut(buf), DType::F32, ReduceOp::Sum)
        .map_err(|e| format!("{what}: {e}"))?;
    let spent = t0.elapsed();
    if let Some((i, got)) = buf
        .iter()
        .enumerate()
        .find(|&(i, &x)| x != expected(size, i))
    {
        return Err(format!(
            "{what}: wrong result at element {i}: got {got}, expected {}",
            expected(size, i)
        ));
    }
    Ok(spent)
}

fn run(args: &Args, terminated: &AtomicBool) -> Result<(), Failure> {
    let started = Instant::now();
    let mut world: Box<dyn Transport> =
        fh_transport::from_env().map_err(|e| format!("cannot build the world: {e}"))?;
    let t = world.topology();
    println!(
        "fh-selftest: rank {} of {} (local {}/{}, cross {}/{}), backend {}, connected in {:.3} s",
        t.rank,
        t.size,
        t.local_rank,
        t.local_size,
        t.cross_rank,
        t.cross_size,
        world.backend(),
        started.elapsed().as_secs_f64()
    );
    let mut comm = world
        .open("selftest")
        .map_err(|e| format!("cannot open a communicator: {e}"))?;
    let comm: &mut dyn Communicator = comm.as_mut();

    // Correctness on awkward lengths.
    for n in [0usize, 1, 3, 1000, 4097] {
        let mut buf = vec![0f32; n];
        verified_allreduce(comm, &mut buf, &format!("allreduce of {n} f32"), false)?;
    }
    // Integer allreduce: every rank's rank, summed and maxed.
    let mut r = [t.rank as i64];
    comm.allreduce_typed(&mut r, ReduceOp::Sum)
        .map_err(|e| format!("i64 allreduce: {e}"))?;
    let want = (t.size * (t.size - 1) / 2) as i64;
    if r[0] != want {
        return Err(format!("i64 allreduce: got {}, expected {want}", r[0]));
    }
    // Broadcast from the last rank.
    let root = t.size - 1;
    let mut b: Vec<u8> = (0..1024)
        .map(|i| if t.rank == root { (i % 251) as u8 } else { 0 })
        .collect();
    comm.broadcast(&mut b, root)
        .map_err(|e| format!("broadcast from rank {root}: {e}"))?;
    if b.iter().enumerate().any(|(i, &x)| x != (i % 251) as u8) {
        return Err(format!("broadcast from rank {root}: wrong data"));
    }
    comm.barrier().map_err(|e| format!("barrier: {e}"))?;
    println!("fh-selftest: rank {}: collectives verified", t.rank);

    // Bandwidth.
    let n = (args.bytes / 4) as usize;
    let mut buf = vec![0f32; n];
    verified_allreduce(comm, &mut buf, "warm-up allreduce", true)?;
    let mut spent = Duration::ZERO;
    for it in 0..args.iters {
        spent += verified_allreduce(
            comm,
            &mut buf,
            &format!("allreduce {it} of {} bytes", n * 4),
            true,
        )?;
    }
    let secs = spent.as_secs_f64().max(1e-9);
    if t.rank == 0 {
        let algbw = (n * 4) as f64 * args.iters as f64 / secs;
        let busbw = algbw * 2.0 * (t.size as f64 - 1.0) / t.size as f64;
        println!(
            "fh-selftest: allreduce {} bytes x {} iters: {:.3} ms each, algbw {:.3} GB/s, busbw {:.3} GB/s",
            n * 4,
            args.iters,
            secs * 1e3 / args.iters as f64,
            algbw / 1e9,
            busbw / 1e9
        );
    }

    if args.looping {
        println!("fh-selftest: rank {}: looping", t.rank);
        let mut last = Instant::now();
        let mut count = 0u64;
        loop {
            if terminated.load(Ordering::SeqCst) {
                return Err(String::new());
            }
            verified_allreduce(comm, &mut buf, &format!("loop allreduce {count}"), false)?;
            count += 1;
            if last.elapsed() >= Duration::from_secs(5) {
                println!("fh-selftest: rank {}: {count} allreduces", t.rank);
                last = Instant::now();
            }
        }
    }
    println!("fh-selftest: rank {}: PASSED", t.rank);
    Ok(())
}
