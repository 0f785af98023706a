//! How a large allreduce's bytes spread over a TCP communicator's streams, and how long it
//! takes: every rank a thread of this process on 127.0.0.1, the ranks split over two "hosts"
//! named by their host ids (so that the peers of the other half are remote and
//! `FH_TCP_STREAMS=auto` measures), optionally with every connection capped like a cloud's flow.
//!
//! ```text
//! cargo run --release -p fh-transport --example tcp_stream_bytes -- \
//!     [--np 4] [--mib 64] [--cap BYTES_PER_S] [--rounds 3] [S|auto ...]
//! ```
//!
//! For each stream setting (default `1 4 auto`), in turn and `--rounds` times over (interleaved,
//! so that a slow spell of a shared machine hits every setting): the streams rank 0 holds to a
//! remote peer, the median time of an allreduce of `--mib` MiB of f32, and every rank's bytes
//! sent to the next rank (the ring's links) on each stream (headers included) over one
//! allreduce.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::settings::{StreamCount, StreamSettings};
use fh_transport::backend::tcp::{TcpOptions, TcpTransport};
use fh_transport::{CollectivesExt, Communicator};

struct Run {
    streams: usize,
    secs: Vec<f64>,
    bytes: Vec<Vec<u64>>,
}

fn run(np: usize, count: StreamCount, mib: usize, cap: Option<u64>, reps: usize) -> Run {
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
                    timeout: Duration::from_secs(120),
                    host_id: Some(format!("host-{}", rank * 2 / np)),
                    ..LaunchInfo::bare(rank, np)
                };
                let mut opts = TcpOptions::from_info(&info);
                let mut s = StreamSettings::default();
                s.count = count;
                s.flow_cap = cap;
                opts.streams = s;
                let mut t = TcpTransport::connect(&info, opts).expect("joining");
                let mut c = t.open_tcp("bytes").expect("opening");
                let mut v = vec![1.0f32; (mib << 20) / 4];
                c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
                assert!(v.iter().all(|&x| x == np as f32));
                let bytes: Vec<Vec<u64>> = (0..np).map(|p| c.bytes_sent(p)).collect();
                let mut secs = Vec::new();
                for _ in 0..reps {
                    c.barrier().expect("barrier");
                    let t0 = Instant::now();
                    c.allreduce_typed(&mut v, ReduceOp::Sum).expect("allreduce");
                    secs.push(t0.elapsed().as_secs_f64());
                }
                Run {
                    streams: c.streams(np - 1),
                    secs,
                    bytes: vec![bytes[(rank + 1) % np].clone()],
                }
            })
        })
        .collect();
    let all: Vec<Run> = ranks.into_iter().map(|h| h.join().expect("rank")).collect();
    // Rank 0's streams and times; every rank's bytes to the next rank (the ring's links).
    Run {
        streams: all[0].streams,
        secs: all[0].secs.clone(),
        bytes: all.iter().map(|r| r.bytes[0].clone()).collect(),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let np: usize = value("--np").and_then(|v| v.parse().ok()).unwrap_or(4);
    let mib: usize = value("--mib").and_then(|v| v.parse().ok()).unwrap_or(64);
    let rounds: usize = value("--rounds").and_then(|v| v.parse().ok()).unwrap_or(3);
    let cap = value("--cap").map(|v| fh_core::units::parse_size(&v).expect("--cap: a rate"));
    let mut counts: Vec<StreamCount> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || !args[i - 1].starts_with("--"))
        .filter(|(_, a)| !a.starts_with("--"))
        .map(|(_, a)| match a.as_str() {
            "auto" => StreamCount::Auto,
            n => StreamCount::Fixed(n.parse().expect("a stream count or auto")),
        })
        .collect();
    if counts.is_empty() {
        counts = vec![
            StreamCount::Fixed(1),
            StreamCount::Fixed(4),
            StreamCount::Auto,
        ];
    }
    println!(
        "# {np} ranks on two emulated hosts, allreduce of {mib} MiB f32, per-flow cap {}",
        cap.map_or("none".into(), |c| format!("{} MB/s", c as f64 / 1e6))
    );
    for round in 0..rounds {
        for &count in &counts {
            let r = run(np, count, mib, cap, 3);
            let mut secs = r.secs.clone();
            secs.sort_by(f64::total_cmp);
            println!(
                "round {round} FH_TCP_STREAMS={count}: {} stream(s) across, allreduce median {:.1} ms",
                r.streams,
                secs[secs.len() / 2] * 1e3
            );
            if round == 0 {
                for (rank, streams) in r.bytes.iter().enumerate() {
                    println!("    rank {rank} -> rank {}: {streams:?}", (rank + 1) % np);
                }
            }
        }
    }
}
