//! `fh-elastic-probe`: a tiny elastic worker for fhrun's elastic tests (no Python).
//!
//! Under `fhrun --host-discovery-script ...` it asks the driver for each world
//! (`fh_transport::elastic::Client`), builds it over TCP, checks an allreduce and prints
//! `generation G rank R size S` once per world (over TCP, or `PROBE_TRANSPORT`); then it "trains": an allreduce every
//! `PROBE_STEP_MS` (default 100), rank 0 asking the driver for host updates and every rank
//! leaving the world at the same step when they changed (as Horovod's `commit()` does). A
//! failed collective (a lost peer) makes it register again. When the file named by
//! `PROBE_STOP` exists, every rank agrees at the next step and exits 0. `Removed` exits 0,
//! `Failed` exits 1.

use std::process::ExitCode;
use std::time::Duration;

use fh_core::ReduceOp;
use fh_transport::elastic::{self, Client, Membership};
use fh_transport::CollectivesExt;

enum Next {
    /// Register again (a lost peer, or the hosts changed).
    Again,
    /// Every rank agreed to stop.
    Stop,
}

fn world(
    a: &elastic::Assignment,
    base: &fh_transport::bootstrap::LaunchInfo,
    client: &mut Client,
    step: Duration,
    stop_file: Option<&str>,
) -> Result<Next, String> {
    let info = a.launch_info(base);
    let choice = std::env::var("PROBE_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    let mut world =
        fh_transport::world_for(&info, Some(&choice)).map_err(|e| format!("world: {e}"))?;
    let mut comm = world.open("probe").map_err(|e| format!("open: {e}"))?;
    let mut one = [1.0f64];
    comm.allreduce_typed(&mut one, ReduceOp::Sum)
        .map_err(|e| format!("allreduce: {e}"))?;
    let (rank, size) = (info.rank, info.size);
    println!(
        "generation {} rank {rank} size {size} sum {} worker {} pid {}",
        a.generation,
        one[0],
        client.worker(),
        std::process::id()
    );
    if one[0] as usize != size {
        return Err(format!("allreduce gave {} on {size} ranks", one[0]));
    }
    loop {
        std::thread::sleep(step);
        // [stop votes, host stamp seen by rank 0]
        let stop = stop_file.is_some_and(|f| std::path::Path::new(f).exists());
        let stamp = if rank == 0 {
            client
                .host_updates(a.hosts_stamp)
                .map_err(|e| format!("host updates: {e}"))?
                .stamp as f64
        } else {
            0.0
        };
        let mut v = [f64::from(u8::from(stop)), stamp];
        if let Err(e) = comm.allreduce_typed(&mut v, ReduceOp::Sum) {
            eprintln!("probe: generation {} lost a peer: {e}", a.generation);
            return Ok(Next::Again);
        }
        if v[0] > 0.0 {
            return Ok(Next::Stop);
        }
        if v[1] as u64 > a.hosts_stamp {
            println!("probe: hosts changed (stamp {}); re-forming", v[1]);
            return Ok(Next::Again);
        }
    }
}

fn main() -> ExitCode {
    let step = std::env::var("PROBE_STEP_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_millis(100), Duration::from_millis);
    let stop_file = std::env::var("PROBE_STOP").ok();
    let mut client = match Client::from_env() {
        Ok(Some(c)) => c,
        Ok(None) => {
            eprintln!("probe: not an elastic worker (FH_ELASTIC_ADDR is not set)");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("probe: {e}");
            return ExitCode::from(1);
        }
    };
    let base = match elastic::base_info() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("probe: {e}");
            return ExitCode::from(1);
        }
    };
    loop {
        match client.next_world() {
            Ok(Membership::Member(a)) => {
                match world(&a, &base, &mut client, step, stop_file.as_deref()) {
                    Ok(Next::Stop) => {
                        println!("probe: done in generation {}", a.generation);
                        return ExitCode::SUCCESS;
                    }
                    Ok(Next::Again) => {}
                    Err(e) => {
                        eprintln!("probe: generation {}: {e}; registering again", a.generation)
                    }
                }
            }
            Ok(Membership::Removed(why)) => {
                println!("probe: removed: {why}");
                return ExitCode::SUCCESS;
            }
            Ok(Membership::Failed(why)) => {
                eprintln!("probe: the job failed: {why}");
                return ExitCode::from(1);
            }
            Err(e) => {
                eprintln!("probe: {e}");
                return ExitCode::from(1);
            }
        }
    }
}
