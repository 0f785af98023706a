//! Allreduce bus bandwidth of the MPI transport (and, for comparison, of the TCP transport
//! started inside the same `mpirun` job), f32 sum, 4 KiB / 1 MiB / 64 MiB.
//!
//! ```text
//! cargo build --release -p fh-transport --features mpi --example mpi_busbw
//! mpirun -np 2 --oversubscribe --bind-to none target/release/examples/mpi_busbw [mpi|tcp|both]
//! ```
//!
//! Method (the same as a raw `MPI_Allreduce` loop): 3 warm-up calls, then 3 trials of `iters`
//! back-to-back allreduces (`iters` = 256 MiB / size, clamped to 8..=2000) after a barrier; a
//! trial's time is the slowest rank's; the best trial is reported. Bus bandwidth is
//! `2 (n - 1) / n * bytes / time` (NCCL's definition). Results are reported, never asserted.

use std::time::Instant;

use fh_core::{DType, ReduceOp};
use fh_job::launch::LaunchInfo;
use fh_transport::backend::mpi::MpiTransport;
use fh_transport::{CollectivesExt, Communicator, Transport};

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

fn time_allreduce(comm: &mut dyn Communicator, ctl: &mut dyn Communicator, bytes: usize) -> f64 {
    let n = bytes / 4;
    let rank = comm.rank();
    let mut buf: Vec<f32> = (0..n).map(|i| ((rank + i) % 7) as f32).collect();
    let iters = ((256usize << 20) / bytes).clamp(8, 2000);
    let b = bytemuck::cast_slice_mut::<f32, u8>(&mut buf);
    for _ in 0..3 {
        comm.allreduce(b, DType::F32, ReduceOp::Sum)
            .expect("warm-up allreduce");
    }
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        ctl.barrier().expect("barrier");
        let t0 = Instant::now();
        for _ in 0..iters {
            comm.allreduce(b, DType::F32, ReduceOp::Sum)
                .expect("allreduce");
        }
        let mut dt = [t0.elapsed().as_secs_f64() / iters as f64];
        ctl.allreduce_typed(&mut dt, ReduceOp::Max)
            .expect("max of times");
        best = best.min(dt[0]);
    }
    best
}

fn report(name: &str, size: usize, bytes: usize, t: f64) {
    let busbw = 2.0 * (size - 1) as f64 / size as f64 * bytes as f64 / t / 1e9;
    println!(
        "{name:<8} np={size} {bytes:>9} B: {:>9.1} us  busbw {busbw:>7.3} GB/s",
        t * 1e6
    );
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "both".into());
    let mut world = MpiTransport::new().expect("MPI transport");
    let (rank, size) = (world.rank(), world.size());
    let mut ctl = world.open("control").expect("open control");
    if which == "mpi" || which == "both" {
        let mut comm = world.open("data").expect("open data");
        for bytes in SIZES {
            let t = time_allreduce(comm.as_mut(), ctl.as_mut(), bytes);
            if rank == 0 {
                report("fh-mpi", size, bytes, t);
            }
        }
    }
    if which == "tcp" || which == "both" {
        // Rank 0 picks a free port and a token; MPI tells the others.
        let mut msg = [0u8; 2 + 32];
        if rank == 0 {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let port = l.local_addr().expect("addr").port();
            msg[..2].copy_from_slice(&port.to_le_bytes());
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(1);
            let token = format!(
                "fh-example-{:032x}",
                seed ^ (u128::from(std::process::id()) << 64)
            );
            msg[2..].copy_from_slice(&token.as_bytes()[..32]);
        }
        ctl.broadcast(&mut msg, 0).expect("broadcast rendezvous");
        let port = u16::from_le_bytes([msg[0], msg[1]]);
        let token = String::from_utf8_lossy(&msg[2..]).into_owned();
        let addr = format!("127.0.0.1:{port}");
        let info = LaunchInfo::from_vars(|name| match name {
            "FH_RENDEZVOUS_ADDR" => Some(addr.clone()),
            "FH_JOB_TOKEN" => Some(token.clone()),
            _ => std::env::var(name).ok(),
        })
        .expect("launch info from the mpirun environment");
        let mut tcp = fh_transport::world_for(&info, Some("tcp")).expect("TCP world");
        let mut comm = tcp.open("data").expect("open tcp data");
        for bytes in SIZES {
            let t = time_allreduce(comm.as_mut(), ctl.as_mut(), bytes);
            if rank == 0 {
                report("fh-tcp", size, bytes, t);
            }
        }
    }
}
