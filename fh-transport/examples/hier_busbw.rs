//! Allreduce bus bandwidth of the hierarchical backend against plain TCP, with several hosts
//! simulated on this machine (ranks get `FH_CROSS_*`/`FH_LOCAL_*` as if on separate hosts and
//! meet over 127.0.0.1).
//!
//! ```text
//! cargo run --release -p fh-transport --example hier_busbw -- [--hosts 2] [--per-host 2] [SIZE]
//! ```
//!
//! SIZE is the f32 vector in bytes (suffixes K and M allowed; default 64M). Each transport
//! (`hier`, then `tcp`) runs in a fresh set of processes. Bus bandwidth follows nccl-tests:
//! bytes / time × 2(n−1)/n, with the slowest rank's time. On one machine the "network" is the
//! loopback, so this measures the work each scheme does, not a real network.
#[cfg(target_os = "linux")]
fn main() {
    imp::main();
}

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("the hierarchical backend needs Linux");
}

#[cfg(target_os = "linux")]
mod imp {
    use std::process::{Command, Stdio};
    use std::time::Instant;

    use fh_core::{DType, ReduceOp};
    use fh_job::{JobToken, LaunchInfo, Topology};
    use fh_transport::{Communicator, Result};

    fn parse_size(s: &str) -> Option<usize> {
        fh_core::units::parse_size(s).ok()?.try_into().ok()
    }

    fn flag(args: &[String], name: &str, default: usize) -> usize {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(|v| v.parse().expect("a number"))
            .unwrap_or(default)
    }

    fn launch(transport: &str, hosts: usize, per_host: usize, bytes: usize) -> bool {
        let exe = std::env::current_exe().expect("own path");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let token = format!("fh-example-{:016x}{:016x}", std::process::id(), port);
        let size = hosts * per_host;
        let mut children = Vec::new();
        for rank in 0..size {
            let place = Topology {
                rank,
                size,
                local_rank: rank % per_host,
                local_size: per_host,
                cross_rank: rank / per_host,
                cross_size: hosts,
            };
            let mut launch = LaunchInfo::for_rank(
                place,
                format!("127.0.0.1:{port}"),
                JobToken::new(token.clone()),
            );
            // The simulated hosts share this machine: name them, or the facts say one host.
            launch.host_id = Some(format!("simulated-host-{}", rank / per_host));
            let child = Command::new(&exe)
                .arg(bytes.to_string())
                .env("FH_TRANSPORT", transport)
                .envs(launch.to_vars())
                .stdin(Stdio::null())
                .spawn()
                .expect("spawn a rank");
            children.push(child);
        }
        let mut ok = true;
        for mut c in children {
            ok &= c.wait().map(|s| s.success()).unwrap_or(false);
        }
        ok
    }

    /// Seconds per allreduce, the slowest rank's.
    fn time_allreduce(c: &mut dyn Communicator, buf: &mut [u8], iters: usize) -> Result<f64> {
        c.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            c.allreduce(buf, DType::F32, ReduceOp::Sum)?;
        }
        let mut secs = [t0.elapsed().as_secs_f64() / iters as f64];
        c.allreduce(
            bytemuck::cast_slice_mut(&mut secs),
            DType::F64,
            ReduceOp::Max,
        )?;
        Ok(secs[0])
    }

    fn rank_main(bytes: usize) {
        let mut world = fh_transport::from_env().expect("joining the job");
        let t = world.topology();
        let mut c = world.open("bench").expect("opening a communicator");
        let bytes = bytes / 4 * 4;
        let mut buf = vec![0u8; bytes];
        let iters = ((1usize << 30) / bytes.max(1)).clamp(3, 1000);
        time_allreduce(&mut *c, &mut buf, 2).expect("allreduce");
        let secs = time_allreduce(&mut *c, &mut buf, iters).expect("allreduce");
        let n = t.size as f64;
        let busbw = bytes as f64 / secs / 1e9 * 2.0 * (n - 1.0) / n;
        if t.rank == 0 {
            println!(
                "{:>5} {:>6} {:>9} {:>12} {:>6} {:>10.1} {:>11.3}",
                c.backend(),
                t.cross_size,
                t.size / t.cross_size.max(1),
                bytes,
                iters,
                secs * 1e6,
                busbw
            );
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        // The positional argument: not a flag, nor a flag's value.
        let bytes = (0..args.len())
            .filter(|&i| !args[i].starts_with('-') && (i == 0 || !args[i - 1].starts_with('-')))
            .find_map(|i| parse_size(&args[i]))
            .unwrap_or(64 << 20);
        if std::env::var_os("FH_RANK").is_some() {
            rank_main(bytes);
            return;
        }
        let hosts = flag(&args, "--hosts", 2);
        let per_host = flag(&args, "--per-host", 2);
        println!(
            "{:>5} {:>6} {:>9} {:>12} {:>6} {:>10} {:>11}",
            "back", "hosts", "per_host", "bytes", "iters", "time_us", "busbw_GB/s"
        );
        for transport in ["hier", "tcp"] {
            if !launch(transport, hosts, per_host, bytes) {
                eprintln!("the {transport} run failed");
                std::process::exit(1);
            }
        }
    }
}
