//! `fh-elastic-probe`: a tiny elastic worker for fhrun's elastic tests (no Python).
//!
//! Under `fhrun --host-discovery-script ...` it asks the driver for each world and starts an
//! engine on it (`fh_scheduler::elastic::Elastic`, as a Rust user's elastic loop does: the
//! engine's own failure handling, its notices to the launcher included, takes part), checks
//! an allreduce and prints
//! `generation G rank R size S` once per world (over TCP, or `PROBE_TRANSPORT`); then it "trains": an allreduce every
//! `PROBE_STEP_MS` (default 100), rank 0 asking the driver for host updates and every rank
//! leaving the world at the same step when they changed (as Horovod's `commit()` does). A
//! failed collective (a lost peer) makes it register again. When the file named by
//! `PROBE_STOP` exists, every rank agrees at the next step and exits 0. `Removed` exits 0,
//! `Failed` exits 1. `PROBE_LINGER_MS`: how long a rank waits after that agreement before it
//! exits (the last seconds of a job, e.g. writing a checkpoint; default 0). The engines'
//! configuration is the environment's (`FH_*`), as a real worker's.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fh_scheduler::elastic::{Assignment, Elastic, ElasticStart};
use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, SchedulerError, Tensor};

enum Next {
    /// Register again (a lost peer, or the hosts changed).
    Again,
    /// Every rank agreed to stop.
    Stop,
}

/// A Sum allreduce of `v` through the engine.
fn sum(engine: &Engine, name: &str, v: &[f64]) -> Result<Vec<f64>, SchedulerError> {
    engine
        .allreduce(
            name,
            Tensor::from_slice(v),
            AllreduceOptions::with_op(ReduceOp::Sum),
        )?
        .wait()?
        .to_vec::<f64>()
}

/// Set by the `SIGUSR1` handler: write the flight record at the next step (as a worker's
/// runtime does on the signal fhrun passes on).
static RECORD_ASKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    RECORD_ASKED.store(true, Ordering::SeqCst);
}

/// Runs one generation's world until the ranks agree to stop or re-form.
fn world(
    a: &Assignment,
    engine: &Engine,
    elastic: &mut Elastic,
    worker: &str,
    step: Duration,
    stop_file: Option<&str>,
) -> Result<Next, String> {
    let (rank, size) = (a.topology.rank, a.topology.size);
    let one = sum(engine, "probe.hello", &[1.0]).map_err(|e| format!("allreduce: {e}"))?;
    println!(
        "generation {} rank {rank} size {size} sum {} worker {worker} pid {}",
        a.generation,
        one[0],
        std::process::id()
    );
    if one[0] as usize != size {
        return Err(format!("allreduce gave {} on {size} ranks", one[0]));
    }
    for n in 0u64.. {
        std::thread::sleep(step);
        if RECORD_ASKED.swap(false, Ordering::SeqCst) {
            match engine.write_flight_record("SIGUSR1") {
                Ok(Some(path)) => println!("probe: flight record written to {}", path.display()),
                Ok(None) => println!("probe: no flight directory (FH_FLIGHT_DIR is not set)"),
                Err(e) => eprintln!("probe: no flight record: {e}"),
            }
        }
        // [stop votes, host stamp seen by rank 0]
        let stop = stop_file.is_some_and(|f| std::path::Path::new(f).exists());
        let stamp = if rank == 0 {
            elastic
                .host_updates(a.hosts_stamp)
                .map_err(|e| format!("host updates: {e}"))?
                .stamp as f64
        } else {
            0.0
        };
        let v = match sum(
            engine,
            &format!("probe.step{n}"),
            &[f64::from(u8::from(stop)), stamp],
        ) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("probe: generation {} lost a peer: {e}", a.generation);
                return Ok(Next::Again);
            }
        };
        if v[0] > 0.0 {
            return Ok(Next::Stop);
        }
        if v[1] as u64 > a.hosts_stamp {
            println!("probe: hosts changed (stamp {}); re-forming", v[1]);
            return Ok(Next::Again);
        }
    }
    unreachable!("the step counter does not run out")
}

fn main() -> ExitCode {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGUSR1,
            on_sigusr1 as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let step = std::env::var("PROBE_STEP_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_millis(100), Duration::from_millis);
    let stop_file = std::env::var("PROBE_STOP").ok();
    let linger = std::env::var("PROBE_LINGER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    let worker = std::env::var("FH_ELASTIC_WORKER").unwrap_or_default();
    let mut elastic = match Elastic::from_env() {
        Ok(Some(e)) => e,
        Ok(None) => {
            eprintln!("probe: not an elastic worker (FH_ELASTIC_ADDR is not set)");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("probe: {e}");
            return ExitCode::from(1);
        }
    };
    // The runtime's knobs from the environment, as a worker's runtime reads them (fhrun's
    // flight directory and timeline per generation among them).
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("probe: {e}");
            return ExitCode::from(2);
        }
    };
    let transport = std::env::var("PROBE_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    elastic.set_transport_choice(Some(transport));
    loop {
        match elastic.start(config.clone()) {
            Ok(ElasticStart::Started { engine, assignment }) => {
                let next = world(
                    &assignment,
                    &engine,
                    &mut elastic,
                    &worker,
                    step,
                    stop_file.as_deref(),
                );
                let _ = engine.close();
                match next {
                    Ok(Next::Stop) => {
                        println!("probe: done in generation {}", assignment.generation);
                        std::thread::sleep(linger);
                        return ExitCode::SUCCESS;
                    }
                    Ok(Next::Again) => {}
                    Err(e) => eprintln!(
                        "probe: generation {}: {e}; registering again",
                        assignment.generation
                    ),
                }
            }
            Ok(ElasticStart::Removed(why)) => {
                println!("probe: removed: {why}");
                return ExitCode::SUCCESS;
            }
            Err(SchedulerError::ElasticFailed { reason }) => {
                eprintln!("probe: the job failed: {reason}");
                return ExitCode::from(1);
            }
            Err(e) => eprintln!("probe: a world failed to form: {e}; registering again"),
        }
    }
}
