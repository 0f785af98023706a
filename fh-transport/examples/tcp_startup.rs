//! Start-up time of a TCP world whose ranks are threads of this process (127.0.0.1): the
//! rendezvous plus opening the first communicator and one small allreduce, for each size given
//! on the command line (default 4 16 64). Reports the median of a few runs.
//!
//! `cargo run --release -p fh-transport --example tcp_startup -- 4 16 64`

use std::net::TcpListener;
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::{TcpOptions, TcpTransport};
use fh_transport::CollectivesExt;

const TOKEN: &str = "tcp-startup-example-token-0123456789";

fn info(rank: usize, size: usize, port: u16) -> LaunchInfo {
    LaunchInfo {
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(JobToken::new(TOKEN)),
        timeout: Duration::from_secs(60),
        ..LaunchInfo::bare(rank, size)
    }
}

fn start(size: usize) -> Result<f64, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let info = info(rank, size, port);
            std::thread::spawn(move || -> Result<(), String> {
                let mut t = TcpTransport::connect(&info, TcpOptions::from_info(&info))
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                let mut c = t.open_tcp("startup").map_err(|e| e.to_string())?;
                let mut v = vec![1.0f32; 4];
                c.allreduce_typed(&mut v, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                if v[0] != size as f32 {
                    return Err(format!("rank {rank}: wrong sum {}", v[0]));
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "a rank panicked".to_string())??;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![4, 16, 64]
    } else {
        sizes
    };
    for size in sizes {
        let mut runs = Vec::new();
        for _ in 0..5 {
            match start(size) {
                Ok(s) => runs.push(s),
                Err(e) => {
                    println!("size {size}: failed: {e}");
                    break;
                }
            }
        }
        runs.sort_by(f64::total_cmp);
        if let Some(m) = runs.get(runs.len() / 2) {
            println!(
                "size {size:3}: start-up (rendezvous + first communicator + allreduce) median {:.1} ms over {} runs (min {:.1}, max {:.1})",
                m * 1e3,
                runs.len(),
                runs[0] * 1e3,
                runs[runs.len() - 1] * 1e3
            );
        }
    }
}
