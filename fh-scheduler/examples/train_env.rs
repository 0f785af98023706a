//! `train_tiny` across processes: the world comes from `fh_transport::from_env()` and the
//! engine's configuration from `Config::from_env()` (`FH_SCHEDULE`, `FH_CHANNELS`, ...), so the
//! same program runs under `fhrun` (TCP) and under `mpirun` with `FH_TRANSPORT=mpi`:
//!
//! ```text
//! cargo build -p fh-scheduler --example train_env --features fh-transport/mpi
//! FH_TRANSPORT=mpi FH_SCHEDULE=horovod mpirun -np 3 -x FH_TRANSPORT -x FH_SCHEDULE \
//!     target/debug/examples/train_env [steps]
//! ```
//!
//! Exits non-zero unless every rank ends with bit-identical weights (checked by broadcasting
//! rank 0's) and the global loss fell at least tenfold.

use std::process::ExitCode;
use std::time::Duration;

use fh_scheduler::{Config, Engine, Tensor};

#[path = "train_tiny.rs"]
#[allow(dead_code)]
mod train_tiny;

fn run(steps: usize) -> Result<String, String> {
    let world = fh_transport::from_env().map_err(|e| format!("transport: {e}"))?;
    let backend = world.backend();
    let config = Config::from_env().map_err(|e| format!("config: {e}"))?;
    let schedule = std::env::var("FH_SCHEDULE").unwrap_or_else(|_| "default".into());
    let engine = Engine::start(world, config).map_err(|e| format!("engine: {e}"))?;
    let (rank, size) = (engine.rank(), engine.size());
    let (params, first, last) = train_tiny::train_rank(&engine, steps)?;
    let root: Vec<f64> = engine
        .broadcast("final", Tensor::from_slice(&params), 0)
        .and_then(|mut h| h.wait_timeout(Duration::from_secs(30)))
        .and_then(|t| t.to_vec::<f64>())
        .map_err(|e| format!("final broadcast: {e}"))?;
    engine.shutdown().map_err(|e| format!("shutdown: {e}"))?;
    let same = root.len() == params.len()
        && root
            .iter()
            .zip(&params)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        return Err(format!("rank {rank}: weights differ from rank 0's"));
    }
    let fell_tenfold = last < first / 10.0;
    if !fell_tenfold {
        return Err(format!(
            "rank {rank}: loss {first} -> {last} did not fall tenfold"
        ));
    }
    Ok(format!(
        "train_env rank {rank}/{size} over {backend} (FH_SCHEDULE={schedule}): loss {first:.5} -> {last:.6}, weights identical"
    ))
}

fn main() -> ExitCode {
    let steps = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    match run(steps) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_env: {e}");
            ExitCode::FAILURE
        }
    }
}
