//! Helpers shared by the multi-rank tests.
#![allow(dead_code)]

pub mod cases;
pub mod procs;
pub mod riding;

use std::sync::mpsc;
use std::time::Duration;

use fh_scheduler::{Config, Engine, Preset, SchedulerError};
use fh_transport::backend::local::LocalWorld;

/// Every wait in the tests is bounded by this.
pub const LIMIT: Duration = Duration::from_secs(30);

/// Run `f` on `n` in-process ranks, each with its own engine, and return the results in rank
/// order. Panics (failing the test) if any rank panics or the whole run exceeds [`LIMIT`].
pub fn run_world<T, F>(n: usize, config: Config, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(&Engine, usize) -> T + Send + Sync + 'static,
{
    run_world_with(n, config, f)
        .into_iter()
        .map(|(v, shut)| {
            shut.expect("clean shutdown");
            v
        })
        .collect()
}

/// Like [`run_world`], also returning each rank's `shutdown()` result.
pub fn run_world_with<T, F>(n: usize, config: Config, f: F) -> Vec<(T, Result<(), SchedulerError>)>
where
    T: Send + 'static,
    F: Fn(&Engine, usize) -> T + Send + Sync + 'static,
{
    run_world_each_with(n, |_| config.clone(), f)
}

/// Like [`run_world`], with rank `r`'s configuration `config(r)` (for settings that are a
/// local choice and may differ between ranks).
pub fn run_world_each<T, F>(n: usize, config: impl Fn(usize) -> Config, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(&Engine, usize) -> T + Send + Sync + 'static,
{
    run_world_each_with(n, config, f)
        .into_iter()
        .map(|(v, shut)| {
            shut.expect("clean shutdown");
            v
        })
        .collect()
}

/// Like [`run_world_each`], also returning each rank's `shutdown()` result.
pub fn run_world_each_with<T, F>(
    n: usize,
    config: impl Fn(usize) -> Config,
    f: F,
) -> Vec<(T, Result<(), SchedulerError>)>
where
    T: Send + 'static,
    F: Fn(&Engine, usize) -> T + Send + Sync + 'static,
{
    let f = std::sync::Arc::new(f);
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    for (r, t) in LocalWorld::with_timeout(n, Duration::from_secs(20))
        .into_iter()
        .enumerate()
    {
        let (f, tx, config) = (f.clone(), tx.clone(), config(r));
        threads.push(std::thread::spawn(move || {
            let engine = Engine::start(Box::new(t), config).expect("engine starts");
            let rank = engine.rank();
            let out = f(&engine, rank);
            let shut = engine.shutdown();
            let _ = tx.send((rank, (out, shut)));
        }));
    }
    drop(tx);
    let mut results: Vec<Option<(T, Result<(), SchedulerError>)>> = (0..n).map(|_| None).collect();
    let deadline = std::time::Instant::now() + LIMIT;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((r, v)) => results[r] = Some(v),
            Err(_) => {
                // A rank panicked (its sender dropped) or we ran out of time.
                for t in threads {
                    if t.is_finished() {
                        if let Err(p) = t.join() {
                            std::panic::resume_unwind(p);
                        }
                    }
                }
                panic!("ranks did not finish within {LIMIT:?} (deadlock?)");
            }
        }
    }
    for t in threads {
        t.join().expect("rank thread");
    }
    results
        .into_iter()
        .map(|r| r.expect("every rank reported"))
        .collect()
}

/// The configurations every multi-rank test covers.
pub fn configs() -> Vec<(String, Config)> {
    let mut v = vec![("horovod".to_string(), Config::preset(Preset::Horovod))];
    // Fused groups staged through the fusion buffer in pieces that cut tensors and elements'
    // natural boundaries (100 bytes: not a multiple of 8), whole, and in 256-byte pieces.
    for (k, stage) in [(1, 100), (2, 0), (4, 256)] {
        v.push((
            format!("fasthorovod-k{k}-stage{stage}"),
            Config::preset(Preset::FastHorovod)
                .channels(k)
                .fusion_threshold(4096)
                .partition_bytes(1024)
                .stage_bytes(stage),
        ));
    }
    // Back-pressure is off by default in these small worlds over threads (auto: on over a
    // network and from 64 ranks). On with
    // the preset's bounds, and at its most eager (any queued byte on a single channel, up to
    // 2 ms): pacing may change only when rounds start, never what they decide.
    v.push((
        "fasthorovod-k4-backpressure".to_string(),
        Config::preset(Preset::FastHorovod)
            .channels(4)
            .fusion_threshold(4096)
            .partition_bytes(1024)
            .backpressure(true),
    ));
    v.push((
        "fasthorovod-k1-backpressure-eager".to_string(),
        Config::preset(Preset::FastHorovod)
            .channels(1)
            .fusion_threshold(4096)
            .partition_bytes(1024)
            .backpressure(true)
            .backpressure_bounds(1, Duration::from_millis(2)),
    ));
    // Every group handed to the channel threads (no group run on the negotiation thread, no
    // polling for work before sleeping).
    v.push((
        "fasthorovod-k2-no-inline".to_string(),
        Config::preset(Preset::FastHorovod)
            .channels(2)
            .fusion_threshold(4096)
            .partition_bytes(1024)
            .inline_bytes(0)
            .control_spin(Duration::ZERO),
    ));
    // A tiny cache (eviction at capacity every step) and no cache (coordinator every round).
    for cap in [3, 0] {
        v.push((
            format!("fasthorovod-k2-cache{cap}"),
            Config::preset(Preset::FastHorovod)
                .channels(2)
                .cache_capacity(cap)
                .fusion_threshold(4096)
                .partition_bytes(1024),
        ));
    }
    v
}
