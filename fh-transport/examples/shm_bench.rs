//! Allreduce bus bandwidth of the shared-memory backend, next to single-core memcpy bandwidth.
//!
//! ```text
//! cargo run --release -p fh-transport --example shm_bench -- [--np 2,4] [--sizes 4K,1M,64M,256M]
//!     [--slot BYTES] [--secs 1.0] [--spin-us 50] [--buffers 2]
//! ```
//!
//! The example re-runs itself once per rank. Bus bandwidth is `bytes / time * 2 (n - 1) / n`,
//! with the time of the slowest rank; an f32 sum of every size. The CPU time per operation (of
//! the busiest rank) is printed too: on a loaded machine the wall time also counts waiting for a
//! core, the CPU time only the work.

#[cfg(target_os = "linux")]
mod linux {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use fh_core::ReduceOp;
    use fh_transport::backend::shm::{ShmOptions, ShmTransport};
    use fh_transport::{CollectivesExt, Transport};

    fn parse_size(s: &str) -> usize {
        let n = fh_core::units::parse_size(s).unwrap_or_else(|e| panic!("{e}"));
        usize::try_from(n).expect("a size this machine can hold")
    }

    fn human(b: usize) -> String {
        match b {
            b if b >= 1 << 30 => format!("{} GiB", b >> 30),
            b if b >= 1 << 20 => format!("{} MiB", b >> 20),
            b if b >= 1 << 10 => format!("{} KiB", b >> 10),
            b => format!("{b} B"),
        }
    }

    struct Args {
        nps: Vec<usize>,
        sizes: Vec<usize>,
        slot: usize,
        secs: f64,
        spin_us: u64,
        buffers: usize,
    }

    fn args() -> Args {
        let mut a = Args {
            nps: vec![2, 4],
            sizes: ["4K", "1M", "64M", "256M"]
                .iter()
                .map(|s| parse_size(s))
                .collect(),
            slot: ShmOptions::default().slot_bytes,
            secs: 1.0,
            spin_us: ShmOptions::default().spin.as_micros() as u64,
            buffers: ShmOptions::default().buffers,
        };
        let argv: Vec<String> = std::env::args().skip(1).collect();
        let mut i = 0;
        while i < argv.len() {
            let v = argv.get(i + 1).cloned().unwrap_or_default();
            match argv[i].as_str() {
                "--np" => a.nps = v.split(',').map(|x| x.parse().expect("np")).collect(),
                "--sizes" => a.sizes = v.split(',').map(parse_size).collect(),
                "--slot" => a.slot = parse_size(&v),
                "--secs" => a.secs = v.parse().expect("secs"),
                "--spin-us" => a.spin_us = v.parse().expect("spin-us"),
                "--buffers" => a.buffers = v.parse().expect("buffers"),
                other => panic!("unknown argument {other}"),
            }
            i += 2;
        }
        a
    }

    /// CPU time used by this process (user + system), in seconds. On a loaded machine it tells
    /// how much work an operation needs, where the wall time also counts waiting for a core.
    fn cpu_secs() -> f64 {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the structure it is given.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) } != 0 {
            return 0.0;
        }
        // SAFETY: initialised by the successful call.
        let ru = unsafe { ru.assume_init() };
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }

    /// memcpy bandwidth (bytes copied per second), by wall time and by CPU time.
    fn memcpy_bw(size: usize, secs: f64) -> (f64, f64) {
        let src = vec![1u8; size];
        let mut dst = vec![0u8; size];
        dst.copy_from_slice(&src);
        let (start, cpu0) = (Instant::now(), cpu_secs());
        let mut n = 0;
        while start.elapsed().as_secs_f64() < secs || n < 3 {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            n += 1;
        }
        let bytes = (size * n) as f64;
        (
            bytes / start.elapsed().as_secs_f64(),
            bytes / (cpu_secs() - cpu0),
        )
    }

    fn rank_main(rank: usize, np: usize, token: &str, a: &Args) {
        let opts = ShmOptions {
            slot_bytes: a.slot,
            spin: Duration::from_micros(a.spin_us),
            buffers: a.buffers,
            timeout: Duration::from_secs(120),
            ..ShmOptions::default()
        };
        let mut world = ShmTransport::join(token, rank, np, opts).expect("join");
        let mut c = world.open("bench").expect("open");
        for &size in &a.sizes {
            let mut buf = vec![1.0f32; size / 4];
            // Warm up, and calibrate the number of iterations on rank 0's first timing.
            let t0 = Instant::now();
            c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            let mut once = [t0.elapsed().as_secs_f64()];
            c.allreduce_typed(&mut once, ReduceOp::Max).unwrap();
            let iters = ((a.secs / once[0].max(1e-7)) as usize).clamp(3, 20_000);
            c.barrier().unwrap();
            let (start, cpu0) = (Instant::now(), cpu_secs());
            for _ in 0..iters {
                c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            }
            let mut t = [
                start.elapsed().as_secs_f64() / iters as f64,
                (cpu_secs() - cpu0) / iters as f64,
            ];
            c.allreduce_typed(&mut t, ReduceOp::Max).unwrap();
            if rank == 0 {
                let bus = |secs: f64| size as f64 / secs * 2.0 * (np - 1) as f64 / np as f64 / 1e9;
                println!(
                    "shm  np={np}  {:>8}  {:>10.1} us  busbw {:>6.2} GB/s  | cpu {:>10.1} us/op/rank  busbw by cpu time {:>6.2} GB/s  ({iters} iters)",
                    human(size),
                    t[0] * 1e6,
                    bus(t[0]),
                    t[1] * 1e6,
                    bus(t[1]),
                );
            }
        }
        c.barrier().unwrap();
    }

    pub fn main() {
        let a = args();
        if let Ok(r) = std::env::var("FH_BENCH_RANK") {
            let np: usize = std::env::var("FH_BENCH_SIZE").unwrap().parse().unwrap();
            let token = std::env::var("FH_BENCH_TOKEN").unwrap();
            rank_main(r.parse().unwrap(), np, &token, &a);
            return;
        }
        for size in [64usize << 20, 256 << 20] {
            let (wall, cpu) = memcpy_bw(size, a.secs);
            println!(
                "memcpy (one core) {:>8}: {:.2} GB/s (by cpu time {:.2} GB/s)",
                human(size),
                wall / 1e9,
                cpu / 1e9
            );
        }
        let exe = std::env::current_exe().unwrap();
        let pass: Vec<String> = std::env::args().skip(1).collect();
        for &np in &a.nps {
            let token = format!("bench-{}-{np}", std::process::id());
            let mut kids: Vec<_> = (0..np)
                .map(|r| {
                    Command::new(&exe)
                        .args(&pass)
                        .env("FH_BENCH_RANK", r.to_string())
                        .env("FH_BENCH_SIZE", np.to_string())
                        .env("FH_BENCH_TOKEN", &token)
                        .stdout(if r == 0 {
                            Stdio::inherit()
                        } else {
                            Stdio::null()
                        })
                        .spawn()
                        .unwrap()
                })
                .collect();
            for k in &mut kids {
                let st = k.wait().unwrap();
                assert!(st.success(), "a rank failed: {st}");
            }
        }
    }
}

fn main() {
    #[cfg(target_os = "linux")]
    linux::main();
    #[cfg(not(target_os = "linux"))]
    eprintln!("the shared-memory backend needs Linux");
}
