//! How close a loaded machine comes to a false alarm of the heartbeats (`fh_transport::liveness`):
//! ranks run allreduces for a while, one of them away between collectives (as a rank that
//! computes in Python), next to spinning processes that load every core; each rank reports
//! the longest gap between two heartbeats it heard from each peer, and whether anybody was
//! declared lost (a false alarm: nobody is frozen or cut off here).
//!
//! ```text
//! cargo run --release -p fh-transport --example heartbeat_gaps -- \
//!     [--ranks 4] [--seconds 60] [--spinners 8] [--bytes 4194304] [--away-ms 5000]
//! ```
//!
//! Without `FH_RANK` in the environment it starts `--ranks` processes of itself on 127.0.0.1
//! (TCP, or `FH_TRANSPORT` if set) and `--spinners` busy processes, and prints a summary; with
//! `FH_RANK` (and the other launch variables, e.g. from `cargo xtask cluster`) it runs one rank.
//! The heartbeats run with `FH_HEARTBEAT_TIMEOUT_SECONDS` and `FH_HEARTBEAT_INTERVAL_MS` as
//! set, else their defaults.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::CollectivesExt;

struct Args {
    ranks: usize,
    seconds: u64,
    spinners: usize,
    bytes: usize,
    away_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        ranks: 4,
        seconds: 60,
        spinners: 8,
        bytes: 4 << 20,
        away_ms: 5000,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).and_then(|v| v.parse::<u64>().ok());
        let Some(v) = v else {
            if argv[i] == "--spin" {
                spin();
            }
            panic!("usage: heartbeat_gaps [--ranks N] [--seconds S] [--spinners K] [--bytes B] [--away-ms A]");
        };
        match argv[i].as_str() {
            "--ranks" => a.ranks = v as usize,
            "--seconds" => a.seconds = v,
            "--spinners" => a.spinners = v as usize,
            "--bytes" => a.bytes = v as usize,
            "--away-ms" => a.away_ms = v,
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

/// A busy process: spins until killed.
fn spin() -> ! {
    let mut x: u64 = 1;
    loop {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        std::hint::black_box(x);
    }
}

fn main() {
    let a = args();
    if std::env::var("FH_RANK").is_ok() {
        rank(&a);
        return;
    }
    let exe = std::env::current_exe().expect("this program");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("address").port()
    };
    let mut kids: Vec<Child> = Vec::new();
    for _ in 0..a.spinners {
        kids.push(
            Command::new(&exe)
                .arg("--spin")
                .stdout(Stdio::null())
                .spawn()
                .expect("a spinner"),
        );
    }
    let token = format!("heartbeat-gaps-{:x}-{port:x}-token", std::process::id());
    let mut ranks = Vec::new();
    for r in 0..a.ranks {
        let launch = LaunchInfo {
            rendezvous: Some(format!("127.0.0.1:{port}")),
            token: Some(JobToken::new(token.clone())),
            ..LaunchInfo::bare(r, a.ranks)
        };
        let mut c = Command::new(&exe);
        c.args(std::env::args().skip(1))
            .envs(launch.to_vars())
            .env(
                "FH_TRANSPORT",
                std::env::var("FH_TRANSPORT").unwrap_or("tcp".into()),
            )
            .stdout(Stdio::piped());
        ranks.push(c.spawn().expect("a rank"));
    }
    let mut outs = Vec::new();
    for r in ranks {
        let o = r.wait_with_output().expect("a rank's end");
        outs.push(String::from_utf8_lossy(&o.stdout).to_string());
    }
    for mut k in kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    let mut worst = 0u64;
    let mut alarms = 0;
    for o in &outs {
        print!("{o}");
        for l in o.lines() {
            if let Some(v) = l.split("worst_ms=").nth(1) {
                worst = worst.max(
                    v.split_whitespace()
                        .next()
                        .unwrap_or("0")
                        .parse()
                        .unwrap_or(0),
                );
            }
            if l.contains("verdict=") && !l.contains("verdict=none") {
                alarms += 1;
            }
        }
    }
    println!(
        "SUMMARY ranks={} seconds={} spinners={} cores={} worst_gap_ms={worst} false_alarms={alarms}",
        a.ranks,
        a.seconds,
        a.spinners,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}

/// One rank: allreduces until the time is up, rank 1 away between them.
fn rank(a: &Args) {
    let mut t = fh_transport::from_env().expect("the world");
    let me = t.rank();
    let watch = t
        .liveness()
        .expect("heartbeats (FH_HEARTBEAT_TIMEOUT_SECONDS=0 turns them off)");
    let mut c = t.open("data").expect("a communicator");
    let mut buf = vec![1.0f32; (a.bytes / 4).max(1)];
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let mut steps = 0u64;
    let mut failed = None;
    loop {
        if me == 1 && a.away_ms > 0 {
            std::thread::sleep(Duration::from_millis(a.away_ms));
        }
        // The first element says whether this rank goes on: all stop together.
        buf.iter_mut().for_each(|x| *x = 1.0);
        buf[0] = f32::from(u8::from(Instant::now() < end));
        if let Err(e) = c.allreduce_typed(&mut buf, ReduceOp::Sum) {
            failed = Some(e.to_string());
            break;
        }
        steps += 1;
        if buf[0] < t.size() as f32 {
            break;
        }
    }
    let gaps: Vec<u64> = watch
        .longest_gaps()
        .iter()
        .map(|g| g.as_millis() as u64)
        .collect();
    let worst = gaps.iter().max().copied().unwrap_or(0);
    let verdict = watch.verdict().map_or("none".to_string(), |v| {
        format!("rank{}:{}", v.lost, v.detail.replace(' ', "_"))
    });
    println!(
        "GAPS rank={me} steps={steps} gaps_ms={gaps:?} worst_ms={worst} verdict={verdict} failed={}",
        failed.unwrap_or_else(|| "no".into()).replace(' ', "_")
    );
}
