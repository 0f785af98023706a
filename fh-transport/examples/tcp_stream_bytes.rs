//! How a large allreduce's bytes spread over a TCP communicator's streams: every rank a thread
//! of this process on 127.0.0.1, with every peer treated as on another host
//! ([`StreamSettings::everywhere`]), for each stream count given.
//!
//! ```text
//! cargo run --release -p fh-transport --example tcp_stream_bytes -- [--np 4] [--mib 64] [S...]
//! ```
//!
//! Prints rank 0's bytes sent to each peer on each stream (headers included) after one
//! allreduce of `--mib` MiB of f32 (default S: 1 4).

use std::net::TcpListener;
use std::time::Duration;

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::streams::{StreamSettings, DEFAULT_STRIPE_MIN};
use fh_transport::backend::tcp::{TcpOptions, TcpTransport};
use fh_transport::CollectivesExt;

fn per_stream_bytes(np: usize, streams: usize, mib: usize) -> Vec<Vec<u64>> {
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port();
    let ranks: Vec<_> = (0..np)
        .map(|rank| {
            std::thread::spawn(move || {
                let info = LaunchInfo {
                    rendezvous: Some(format!("127.0.0.1:{port}")),
                    token: Some(JobToken::new("tcp-stream-bytes-example")),
                    timeout: Duration::from_secs(60),
                    ..LaunchInfo::bare(rank, np)
                };
                let mut opts = TcpOptions::from_info(&info);
                opts.streams = StreamSettings::everywhere(streams, DEFAULT_STRIPE_MIN);
                let mut t = TcpTransport::connect(&info, opts).expect("joining");
                let mut c = t.open_tcp("bytes").expect("opening");
                let mut v = vec![1.0f32; (mib << 20) / 4];
                c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
                assert!(v.iter().all(|&x| x == np as f32));
                (0..np).map(|p| c.bytes_sent(p)).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<_> = ranks.into_iter().map(|h| h.join().expect("rank")).collect();
    all.swap_remove(0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let (np, mib) = (value("--np", 4), value("--mib", 64));
    let mut counts: Vec<usize> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || !args[i - 1].starts_with("--"))
        .filter_map(|(_, a)| a.parse().ok())
        .collect();
    if counts.is_empty() {
        counts = vec![1, 4];
    }
    println!("# one allreduce of {mib} MiB f32 over {np} ranks; rank 0's bytes sent per stream");
    for s in counts {
        for (peer, streams) in per_stream_bytes(np, s, mib).iter().enumerate() {
            if !streams.is_empty() {
                println!("S={s} to rank {peer}: {streams:?}");
            }
        }
    }
}
