//! Data-parallel training of a tiny model (linear regression, SGD) over N in-process ranks.
//!
//! Each rank owns a shard of a synthetic data set; every step it computes its local gradient,
//! averages it across ranks with named asynchronous allreduces, and applies the same update.
//! The initial weights are broadcast from rank 0. At the end every rank holds bit-identical
//! weights, close to the ones that generated the data.
//!
//! ```text
//! cargo run -p fh-scheduler --example train_tiny -- [ranks] [steps] [fasthorovod|horovod]
//! ```

use std::time::Duration;

use fh_scheduler::{AllreduceOptions, Config, Engine, Preset, Tensor};
use fh_transport::backend::local::LocalWorld;

/// Features per sample.
pub const DIM: usize = 8;
const SAMPLES_PER_RANK: usize = 64;
const LR: f64 = 0.1;
const WAIT: Duration = Duration::from_secs(30);

/// The weights that generate the data: `y = TRUE_W · x + TRUE_B`.
pub fn true_weights() -> (Vec<f64>, f64) {
    ((0..DIM).map(|i| (i as f64 - 3.5) / 2.0).collect(), 0.75)
}

/// A deterministic per-rank data shard.
fn shard(rank: usize) -> Vec<(Vec<f64>, f64)> {
    let (w, b) = true_weights();
    let mut s = 0x243F_6A88_85A3_08D3u64 ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    };
    (0..SAMPLES_PER_RANK)
        .map(|_| {
            let x: Vec<f64> = (0..DIM).map(|_| next()).collect();
            let y = x.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>() + b + 0.01 * next();
            (x, y)
        })
        .collect()
}

/// What one rank ends with: weights (w..., b), first and last global loss.
pub type Outcome = Result<(Vec<f64>, f64, f64), String>;

/// Train on one rank; returns the final weights (w..., b) and the first and last global loss.
pub fn train_rank(engine: &Engine, steps: usize) -> Outcome {
    let rank = engine.rank();
    let data = shard(rank);
    // Rank 0 initialises; everyone starts from its weights.
    let init: Vec<f64> = (0..=DIM)
        .map(|i| if rank == 0 { 0.1 * i as f64 } else { f64::NAN })
        .collect();
    let mut params = engine
        .broadcast("init", Tensor::from_slice(&init), 0)
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<f64>())
        .map_err(|e| e.to_string())?;
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let (w, b) = params.split_at(DIM);
        let mut gw = vec![0.0; DIM];
        let mut gb = 0.0;
        let mut loss = 0.0;
        for (x, y) in &data {
            let err = x.iter().zip(w).map(|(a, b)| a * b).sum::<f64>() + b[0] - y;
            loss += err * err;
            for (g, xi) in gw.iter_mut().zip(x) {
                *g += 2.0 * err * xi / data.len() as f64;
            }
            gb += 2.0 * err / data.len() as f64;
        }
        loss /= data.len() as f64;
        // Submit the gradients asynchronously (bias first, as a backward pass would), then wait.
        let avg = AllreduceOptions::default();
        let hb = engine.allreduce("grad.b", Tensor::from_slice(&[gb]), avg);
        let hw = engine.allreduce("grad.w", Tensor::from_slice(&gw), avg);
        let hl = engine.allreduce("loss", Tensor::from_slice(&[loss]), avg);
        let get = |h: Result<fh_scheduler::Handle, fh_scheduler::SchedulerError>| {
            h.and_then(|mut h| h.wait_timeout(WAIT))
                .and_then(|t| t.to_vec::<f64>())
                .map_err(|e| e.to_string())
        };
        let (gb, gw, l) = (get(hb)?, get(hw)?, get(hl)?);
        if step == 0 {
            first = l[0];
        }
        last = l[0];
        for (p, g) in params.iter_mut().zip(gw.iter().chain(&gb)) {
            *p -= LR * g;
        }
    }
    Ok((params, first, last))
}

/// Train on `ranks` in-process ranks; returns each rank's result.
pub fn train(ranks: usize, steps: usize, config: Config) -> Vec<Outcome> {
    let threads: Vec<_> = LocalWorld::new(ranks)
        .into_iter()
        .map(|t| {
            let config = config.clone();
            std::thread::spawn(move || {
                let engine = Engine::start(Box::new(t), config).map_err(|e| e.to_string())?;
                let out = train_rank(&engine, steps);
                engine.shutdown().map_err(|e| e.to_string())?;
                out
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap_or_else(|_| Err("rank panicked".into())))
        .collect()
}

#[allow(dead_code)]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ranks = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let steps = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    let preset = match args.get(3).map(String::as_str) {
        Some("horovod") => Preset::Horovod,
        _ => Preset::FastHorovod,
    };
    let results = train(ranks, steps, Config::preset(preset));
    let mut weights = None;
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok((p, first, last)) => {
                println!("rank {rank}: loss {first:.5} -> {last:.6}");
                match &weights {
                    None => weights = Some(p.clone()),
                    Some(w) if w == p => {}
                    Some(_) => {
                        eprintln!("rank {rank} ended with different weights!");
                        std::process::exit(1);
                    }
                }
            }
            Err(e) => {
                eprintln!("rank {rank} failed: {e}");
                std::process::exit(1);
            }
        }
    }
    let (w, b) = true_weights();
    println!(
        "weights identical on all {ranks} ranks: {:?}",
        weights.unwrap_or_default()
    );
    println!("generating weights:                 {w:?} + {b}");
}
