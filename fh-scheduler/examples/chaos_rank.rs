//! One rank of the chaos checks across emulated hosts (`cargo xtask multihost chaos`): an
//! engine from the environment (`fh_transport::from_env`, `Config::from_env`) that trains as a
//! job does — each step a fused gradient group split over the channels and a small metric, the
//! results checked exactly — until the ranks agree that the time is up, or until a fault stops
//! it.
//!
//! ```text
//! chaos_rank [SECONDS] [AWAY_RANK AWAY_MS]
//! ```
//!
//! Prints `CHAOS-READY rank=R pid=P backend=B` after its first step, then one of
//! - `CHAOS-DONE rank=R steps=N` (exit 0): every step's results were exact;
//! - `CHAOS-ERROR rank=R t_ms=T lost=L msg=...` (exit 3): the engine stopped with an error
//!   naming rank `L` (`none` when it names none), at `T` ms since the Unix epoch;
//! - `CHAOS-WRONG rank=R ...` (exit 4): a result was wrong.
//!
//! Rank `AWAY_RANK` is away for `AWAY_MS` before each step (a rank that computes between
//! collectives, as a Python training step does): it must never be blamed.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, SchedulerError, Tensor};

/// Elements of the gradient group (1 MiB of f32: above a 256 KiB partition size, split over
/// the channels).
const GRAD: usize = 1 << 18;
/// The longest a handle is waited for: far beyond any bound the checks set.
const WAIT: Duration = Duration::from_secs(600);

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

enum End {
    Done(u64),
    Failed(SchedulerError),
    Wrong(String),
}

fn train(engine: &Engine, seconds: f64, away: Option<(usize, u64)>) -> End {
    let (rank, size) = (engine.rank(), engine.size());
    let start = std::time::Instant::now();
    let n = size as f32;
    for step in 0u64.. {
        if let Some((r, ms)) = away {
            if r == rank && step > 0 {
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        let k = (step % 7 + 1) as f32;
        let grad = vec![(rank as f32 + 1.0) * k; GRAD];
        let go = [f32::from(u8::from(start.elapsed().as_secs_f64() < seconds))];
        let mut g =
            match engine.allreduce(&format!("grad.{step}"), Tensor::from_slice(&grad), sum()) {
                Ok(h) => h,
                Err(e) => return End::Failed(e),
            };
        let mut m = match engine.allreduce(&format!("go.{step}"), Tensor::from_slice(&go), sum()) {
            Ok(h) => h,
            Err(e) => return End::Failed(e),
        };
        let got = g
            .wait_timeout(WAIT)
            .and_then(|t| t.to_vec::<f32>())
            .and_then(|g| {
                m.wait_timeout(WAIT)
                    .and_then(|t| t.to_vec::<f32>())
                    .map(|m| (g, m))
            });
        let (g, m) = match got {
            Ok(v) => v,
            Err(e) => return End::Failed(e),
        };
        let want = k * n * (n + 1.0) / 2.0;
        if let Some(i) = g.iter().position(|&x| x != want) {
            return End::Wrong(format!(
                "step {step}: grad[{i}] = {} instead of {want}",
                g[i]
            ));
        }
        if step == 0 {
            println!(
                "CHAOS-READY rank={rank} pid={} backend={}",
                std::process::id(),
                engine.backend()
            );
        }
        if m[0] < n {
            return End::Done(step + 1);
        }
    }
    End::Done(0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds: f64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(20.0);
    let away = match (args.get(1), args.get(2)) {
        (Some(r), Some(ms)) => r.parse().ok().zip(ms.parse().ok()),
        _ => None,
    };
    let rank_hint = std::env::var("FH_RANK").unwrap_or_else(|_| "?".into());
    let started = fh_transport::from_env()
        .map_err(SchedulerError::from)
        .and_then(|w| Engine::start(w, Config::from_env()?));
    let engine = match started {
        Ok(e) => e,
        Err(e) => {
            println!(
                "CHAOS-ERROR rank={rank_hint} t_ms={} lost={} msg=start: {e}",
                now_ms(),
                e.lost_rank().map_or("none".into(), |r| r.to_string())
            );
            return ExitCode::from(3);
        }
    };
    let rank = engine.rank();
    match train(&engine, seconds, away) {
        End::Done(steps) => match engine.shutdown() {
            Ok(()) => {
                println!("CHAOS-DONE rank={rank} steps={steps}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!(
                    "CHAOS-ERROR rank={rank} t_ms={} lost={} msg=shutdown: {e}",
                    now_ms(),
                    e.lost_rank().map_or("none".into(), |r| r.to_string())
                );
                ExitCode::from(3)
            }
        },
        End::Failed(e) => {
            println!(
                "CHAOS-ERROR rank={rank} t_ms={} lost={} msg={e}",
                now_ms(),
                e.lost_rank().map_or("none".into(), |r| r.to_string())
            );
            let _ = engine.shutdown();
            ExitCode::from(3)
        }
        End::Wrong(what) => {
            println!("CHAOS-WRONG rank={rank} {what}");
            ExitCode::from(4)
        }
    }
}
