//! The harness shared by the multi-process tests (`hier_procs`, `shm_procs`, `tcp_multiprocess`):
//! the test binary re-runs itself as the ranks, with the `FH_*` environment a launcher would
//! set; a guard kills and reaps every child when dropped, also when an assertion fails, and
//! every wait is bounded. Each test file includes it with `mod support;`.
#![allow(dead_code)]

use std::process::{Child, Command, ExitStatus};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Held by the tests of one file that must run one at a time (a poisoned lock is taken over).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    fh_job::launch::free_local_port().expect("an ephemeral port")
}

/// This test binary, set to run only the test `name` (an ignored one with `ignored`), with
/// its output shown, as one child rank.
pub fn rank_command(name: &str, ignored: bool) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact"]);
    if ignored {
        cmd.arg("--ignored");
    }
    cmd.args(["--nocapture", "--test-threads=1"]);
    cmd
}

/// Where one rank sits, as a launcher's `FH_*` environment tells it.
pub struct Place {
    pub rank: usize,
    pub size: usize,
    pub local_rank: usize,
    pub local_size: usize,
    pub cross_rank: usize,
    pub cross_size: usize,
}

/// The launch a launcher gives the rank at `place` of a job, written as fhrun writes it
/// ([`fh_job::LaunchInfo::for_rank`]); hosts simulated on this machine are named.
pub fn launch_at(
    place: &Place,
    rendezvous: &str,
    token: &str,
    timeout_s: u32,
) -> fh_job::LaunchInfo {
    let topology = fh_job::Topology {
        rank: place.rank,
        size: place.size,
        local_rank: place.local_rank,
        local_size: place.local_size,
        cross_rank: place.cross_rank,
        cross_size: place.cross_size,
    };
    let mut info = fh_job::LaunchInfo::for_rank(topology, rendezvous, fh_job::JobToken::new(token));
    info.timeout = std::time::Duration::from_secs(timeout_s.into());
    // Hosts simulated on this machine are told apart by name: the facts say one host.
    if place.cross_size > 1 {
        info.host_id = Some(format!("simulated-host-{}", place.cross_rank));
    }
    info
}

/// Set the `FH_*` environment a launcher would give the rank at `place` of a job
/// ([`launch_at`]'s variables) and `FH_TRANSPORT`.
pub fn launcher_env(
    cmd: &mut Command,
    place: &Place,
    transport: &str,
    rendezvous: &str,
    token: &str,
    timeout_s: u32,
) {
    let info = launch_at(place, rendezvous, token, timeout_s);
    cmd.env("FH_TRANSPORT", transport).envs(info.to_vars());
}

/// Kills and reaps the children it holds when dropped.
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Children {
    /// Wait for the children in `which` to exit, at most `limit`: their statuses in the order
    /// of `which`, or on timeout what is known of them so far.
    pub fn wait_for(
        &mut self,
        which: &[usize],
        limit: Duration,
        poll: Duration,
    ) -> Result<Vec<ExitStatus>, Vec<Option<ExitStatus>>> {
        let deadline = Instant::now() + limit;
        let mut done: Vec<Option<ExitStatus>> = vec![None; which.len()];
        loop {
            for (&i, d) in which.iter().zip(done.iter_mut()) {
                if d.is_none() {
                    *d = self.0[i].try_wait().expect("try_wait");
                }
            }
            if done.iter().all(Option::is_some) {
                return Ok(done.into_iter().flatten().collect());
            }
            if Instant::now() >= deadline {
                return Err(done);
            }
            std::thread::sleep(poll);
        }
    }

    /// Wait for every child to exit, at most `limit`; statuses by spawn order.
    pub fn wait_all(&mut self, limit: Duration) -> Vec<ExitStatus> {
        let all: Vec<usize> = (0..self.0.len()).collect();
        self.wait_for(&all, limit, Duration::from_millis(10))
            .unwrap_or_else(|done| panic!("ranks still running after {limit:?}: {done:?}"))
    }
}
