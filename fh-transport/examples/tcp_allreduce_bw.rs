//! Allreduce bus bandwidth and small-message latency over the transport chosen by the
//! environment (`FH_TRANSPORT`). Launching itself (`--np`), it runs TCP where that is unset;
//! under a launcher, set it (`FH_TRANSPORT=tcp fhrun …`): the default there, `auto`, picks
//! shared memory for ranks on one host.
//!
//! Either start it under a launcher (`fhrun -np 4 …`, or any launcher `LaunchInfo` reads), or
//! let it launch itself on this host:
//!
//! ```text
//! cargo run --release -p fh-transport --example tcp_allreduce_bw -- --np 4 [SIZES...]
//! ```
//!
//! SIZES are in bytes of f32 data (suffixes K and M allowed); the default is 4K 1M 64M.
//! Bus bandwidth follows nccl-tests: bytes / time × 2(n−1)/n, with the slowest rank's time.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_job::{JobToken, LaunchInfo, Topology};
use fh_transport::{Communicator, Result};

fn parse_size(s: &str) -> Option<usize> {
    fh_core::units::parse_size(s).ok()?.try_into().ok()
}

fn launch_self(np: usize, rest: &[String]) -> std::io::Result<bool> {
    let exe = std::env::current_exe()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let token = format!(
        "fh-example-{:016x}{:016x}",
        std::process::id(),
        port as u64 * 0x9e37_79b9
    );
    let mut children = Vec::new();
    for rank in 0..np {
        // Every rank on this host, said by the local claim alone.
        let launch = LaunchInfo {
            cross_vars: None,
            ..LaunchInfo::for_rank(
                Topology::single_host(rank, np),
                format!("127.0.0.1:{port}"),
                JobToken::new(token.clone()),
            )
        };
        let mut cmd = Command::new(&exe);
        if std::env::var_os("FH_TRANSPORT").is_none() {
            cmd.env("FH_TRANSPORT", "tcp");
        }
        let child = cmd
            .args(rest)
            .envs(launch.to_vars())
            .stdin(Stdio::null())
            .spawn()?;
        children.push(child);
    }
    let mut ok = true;
    for mut c in children {
        ok &= c.wait()?.success();
    }
    Ok(ok)
}

/// Run `iters` allreduces; returns the slowest rank's seconds per allreduce.
fn time_allreduce(c: &mut dyn Communicator, buf: &mut [u8], iters: usize) -> Result<f64> {
    c.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        c.allreduce(buf, DType::F32, ReduceOp::Sum)?;
    }
    let mut secs = [t0.elapsed().as_secs_f64() / iters as f64];
    c.allreduce(bytemuck_f64(&mut secs), DType::F64, ReduceOp::Max)?;
    Ok(secs[0])
}

fn bytemuck_f64(v: &mut [f64]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("FH_RANK").is_none() {
        if let Some(i) = args.iter().position(|a| a == "--np") {
            let np: usize = args
                .get(i + 1)
                .and_then(|s| s.parse().ok())
                .expect("--np needs a number of ranks");
            let mut rest = args.clone();
            rest.drain(i..i + 2);
            let ok = launch_self(np, &rest).expect("launching the ranks");
            std::process::exit(if ok { 0 } else { 1 });
        }
    }
    let sizes: Vec<usize> = {
        let given: Vec<usize> = args.iter().filter_map(|a| parse_size(a)).collect();
        if given.is_empty() {
            vec![4 << 10, 1 << 20, 64 << 20]
        } else {
            given
        }
    };
    let mut world = fh_transport::from_env().expect("joining the job");
    let (rank, n) = (world.rank(), world.size());
    let mut c = world.open("bench").expect("opening a communicator");
    if rank == 0 {
        println!(
            "# backend {} np {n}: allreduce f32 sum; bus bw = bytes/time * 2(n-1)/n",
            c.backend()
        );
        println!(
            "{:>12} {:>8} {:>12} {:>12} {:>12}",
            "bytes", "iters", "time_us", "algbw_GB/s", "busbw_GB/s"
        );
    }
    for &bytes in &sizes {
        let bytes = bytes / 4 * 4;
        let mut buf = vec![0u8; bytes];
        let iters = ((512usize << 20) / bytes.max(1)).clamp(5, 1000);
        // Warm-up (connections, page faults, caches).
        time_allreduce(&mut *c, &mut buf, (iters / 10).max(2)).expect("allreduce");
        let t = time_allreduce(&mut *c, &mut buf, iters).expect("allreduce");
        let algbw = bytes as f64 / t / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if rank == 0 {
            println!(
                "{bytes:>12} {iters:>8} {:>12.1} {algbw:>12.3} {busbw:>12.3}",
                t * 1e6
            );
        }
    }
    // The transport alone, without any algorithm: every rank sends 64 MiB to the next rank
    // while receiving 64 MiB from the previous one.
    if n > 1 {
        let bytes = 64usize << 20;
        let out = vec![1u8; bytes];
        let mut inp = vec![0u8; bytes];
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        c.barrier().expect("barrier");
        let t0 = Instant::now();
        for _ in 0..4 {
            c.send_recv(next, &out, prev, &mut inp).expect("send_recv");
        }
        let mut secs = [t0.elapsed().as_secs_f64() / 4.0];
        c.allreduce(bytemuck_f64(&mut secs), DType::F64, ReduceOp::Max)
            .expect("allreduce");
        if rank == 0 {
            println!(
                "# ring send_recv of 64 MiB per rank: {:.3} GB/s per link",
                bytes as f64 / secs[0] / 1e9
            );
        }
    }
    // Latency of an 8-byte allreduce: the median of single timed operations.
    let mut small = [0u8; 8];
    let mut samples = Vec::with_capacity(2000);
    c.barrier().expect("barrier");
    for i in 0..2200 {
        let t0 = Instant::now();
        c.allreduce(&mut small, DType::F32, ReduceOp::Sum)
            .expect("allreduce");
        if i >= 200 {
            samples.push(t0.elapsed());
        }
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    let mut worst = [median.as_secs_f64()];
    c.allreduce(bytemuck_f64(&mut worst), DType::F64, ReduceOp::Max)
        .expect("allreduce");
    if rank == 0 {
        println!(
            "# 8-byte allreduce latency: median {:.1} us (slowest rank's median)",
            Duration::from_secs_f64(worst[0]).as_secs_f64() * 1e6
        );
    }
}
