//! Heap allocations per collective on the engine's hot path (a report, not a test).
//!
//! ```text
//! cargo run --release -p fh-scheduler --example allocs -- [ranks] [steps]
//! ```
//!
//! `ranks` in-process ranks (threads over `LocalWorld`) each run steps of blocking
//! allreduces of one f64 under fixed names, 1 and then 64 per step (submitted together,
//! then waited for), after a warm-up, so every round is a cache hit; a counting global
//! allocator counts every allocation in the process (engine threads, in-process transport,
//! the callers, including the tensors they make) over the timed steps. Printed:
//! allocations per tensor per rank, for the `fasthorovod` and `horovod` presets. It uses the
//! public API only, so the same file measures older versions of the engine too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use fh_scheduler::{AllreduceOptions, Config, Engine, Preset, ReduceOp, Tensor};
use fh_transport::backend::local::LocalWorld;

/// The system allocator, counting allocations (reallocations count as one).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARMUP: usize = 200;

fn run(ranks: usize, iters: usize, per_step: usize, preset: Preset) -> f64 {
    // Every rank ends its warm-up before the count starts, and its timed part before it ends.
    let start = Arc::new(Barrier::new(ranks + 1));
    let end = Arc::new(Barrier::new(ranks + 1));
    let threads: Vec<_> = LocalWorld::new(ranks)
        .into_iter()
        .map(|t| {
            let (start, end) = (Arc::clone(&start), Arc::clone(&end));
            std::thread::spawn(move || {
                let engine = Engine::start(Box::new(t), Config::preset(preset)).expect("start");
                let opts = AllreduceOptions::with_op(ReduceOp::Sum);
                let names: Vec<String> = (0..per_step).map(|k| format!("allocs.{k}")).collect();
                let step = |i: usize| {
                    let handles: Vec<_> = names
                        .iter()
                        .map(|n| {
                            let t = Tensor::from_slice(&[i as f64]);
                            engine.allreduce(n, t, opts).expect("allreduce")
                        })
                        .collect();
                    for mut h in handles {
                        let out = h
                            .wait_timeout(Duration::from_secs(60))
                            .expect("allreduce result");
                        assert_eq!(out.to_vec::<f64>().expect("f64")[0], (ranks * i) as f64);
                    }
                };
                for i in 0..WARMUP {
                    step(i);
                }
                start.wait();
                for i in 0..iters {
                    step(i);
                }
                end.wait();
                engine.shutdown().expect("shutdown");
            })
        })
        .collect();
    start.wait();
    let before = ALLOCS.load(Relaxed);
    end.wait();
    let after = ALLOCS.load(Relaxed);
    for t in threads {
        t.join().expect("rank thread");
    }
    (after - before) as f64 / (iters * ranks * per_step) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ranks = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    for per_step in [1, 64] {
        for preset in [Preset::FastHorovod, Preset::Horovod] {
            let per_op = run(ranks, iters, per_step, preset);
            println!(
                "allocations per tensor per rank, np={ranks} in process, {per_step:>2} 8-byte allreduces per step, {:<11}: {per_op:.1} ({iters} steps, cache hits)",
                preset.name()
            );
        }
    }
}
