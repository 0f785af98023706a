//! Shared-memory backend with one process per rank: this test binary re-runs itself as the
//! ranks (`child` below, selected by environment variables); a guard kills and reaps every
//! child, also when an assertion fails.
#![cfg(target_os = "linux")]

mod shm_common;
mod support;

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_transport::backend::shm::{self, ShmOptions, ShmTransport};
use fh_transport::{CollectivesExt, Transport, TransportError};
use shm_common::*;
use support::{rank_command, serial, Children};

const ROLE: &str = "FH_SHM_TEST_ROLE";
const RANK: &str = "FH_SHM_TEST_RANK";
const SIZE: &str = "FH_SHM_TEST_SIZE";
const TOKEN: &str = "FH_SHM_TEST_TOKEN";

// The tests of this file run one at a time (`serial`): a child's `join` removes stale
// segments, which would race with the test that leaves one behind on purpose.

impl Children {
    fn spawn(n: usize, role: &str, token: &str) -> Children {
        Self::spawn_with(n, role, token, |_| Vec::new())
    }

    fn spawn_with(
        n: usize,
        role: &str,
        token: &str,
        env: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Children {
        let mut kids = Children(Vec::new());
        for r in 0..n {
            let child = rank_command("child", false)
                .env(ROLE, role)
                .env(RANK, r.to_string())
                .env(SIZE, n.to_string())
                .env(TOKEN, token)
                .envs(env(r))
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn a rank");
            kids.0.push(child);
        }
        kids
    }
}

/// The launch variables of rank `rank` of `size`, all on this host as the local claim alone
/// says (`FH_LOCAL_*`, no `FH_CROSS_*`), rank 0 listening at `rendezvous`.
fn on_this_host(
    rank: usize,
    size: usize,
    rendezvous: &str,
    token: &str,
    timeout_s: u64,
) -> Vec<(&'static str, String)> {
    fh_job::LaunchInfo {
        cross_vars: None,
        timeout: Duration::from_secs(timeout_s),
        ..fh_job::LaunchInfo::for_rank(
            fh_job::Topology::single_host(rank, size),
            rendezvous,
            fh_job::JobToken::new(token),
        )
    }
    .to_vars()
}

fn env_usize(var: &str) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{var} not set"))
}

/// CPU time (user + system) this process has used.
fn cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the structure it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: initialised by the successful call above.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The body of a rank; does nothing when run as an ordinary test.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let (rank, size) = (env_usize(RANK), env_usize(SIZE));
    let token = std::env::var(TOKEN).expect("token");
    match role.as_str() {
        "suite" => {
            let mut t = ShmTransport::join(&token, rank, size, small_opts()).unwrap();
            let mut c = t.open("suite").unwrap();
            suite(&mut *c, 1234 + size as u64);
            // A second world on the same token (as after a re-init), with the default sizes.
            let mut t2 = ShmTransport::join(&token, rank, size, ShmOptions::default()).unwrap();
            let mut d = t2.open("default").unwrap();
            suite_allreduce(&mut *d, 99);
        }
        "kill" => {
            let mut t = ShmTransport::join(&token, rank, size, small_opts()).unwrap();
            let mut c = t.open("victim").unwrap();
            let mut buf = vec![1.0f32; 5000];
            for _ in 0..5 {
                c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            }
            if rank == size - 1 {
                // SAFETY: sending a signal to ourselves.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                unreachable!("SIGKILL did not kill the process");
            }
            let start = Instant::now();
            let err = loop {
                if let Err(e) = c.allreduce_typed(&mut buf, ReduceOp::Sum) {
                    break e;
                }
            };
            assert!(
                matches!(err, TransportError::PeerLost { rank: r, .. } if r == size - 1),
                "rank {rank}: expected PeerLost naming rank {}, got {err}",
                size - 1
            );
            assert!(
                start.elapsed() < small_opts().timeout,
                "the loss was only noticed at the timeout"
            );
        }
        "stall" => {
            // Rank 0 creates the segment and waits for a rank 1 that never comes.
            if rank == 0 {
                let opts = ShmOptions::with_timeout(Duration::from_secs(60));
                let mut t = ShmTransport::join(&token, rank, size, opts).unwrap();
                let _ = t.open("stalled");
            }
            std::thread::sleep(Duration::from_secs(60));
        }
        "idle" => {
            let mut t = ShmTransport::join(&token, rank, size, small_opts()).unwrap();
            let mut c = t.open("idle").unwrap();
            c.barrier().unwrap();
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                c.barrier().unwrap();
            } else {
                let (cpu0, wall0) = (cpu_time(), Instant::now());
                c.barrier().unwrap();
                let (cpu, wall) = (cpu_time() - cpu0, wall0.elapsed());
                assert!(wall >= Duration::from_millis(1000), "barrier did not wait");
                assert!(
                    cpu < wall / 4,
                    "waiting {wall:?} in a barrier used {cpu:?} of CPU: it should sleep"
                );
            }
        }
        "stop" => {
            // Started from the environment (the rendezvous starts the heartbeats, which the
            // shared-memory world runs on), with a timeout of 60 s.
            let mut t = fh_transport::from_env().unwrap();
            assert_eq!(t.backend(), "shm");
            let mut c = t.open("stopped").unwrap();
            let mut buf = vec![1.0f32; 5000];
            for _ in 0..5 {
                c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            }
            if rank == size - 1 {
                // SAFETY: sending a signal to ourselves; the parent kills us at the end.
                unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
                std::thread::sleep(Duration::from_secs(600));
            }
            let err = loop {
                if let Err(e) = c.allreduce_typed(&mut buf, ReduceOp::Sum) {
                    break e;
                }
            };
            assert!(
                matches!(err, TransportError::PeerLost { rank: r, .. } if r == size - 1),
                "rank {rank}: expected PeerLost naming rank {}, got {err}",
                size - 1
            );
        }
        "env" => {
            let mut t = fh_transport::from_env().unwrap();
            assert_eq!(t.backend(), "shm");
            assert_eq!((t.rank(), t.size()), (rank, size));
            let mut c = t.open("env").unwrap();
            suite_others(&mut *c, 5);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn suite_on_2_3_and_4_processes() {
    let _serial = serial();
    for n in 2..=4 {
        let tok = token();
        let mut kids = Children::spawn(n, "suite", &tok);
        let st = kids.wait_all(Duration::from_secs(240));
        assert!(st.iter().all(ExitStatus::success), "np {n}: {st:?}");
        assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
    }
}

#[test]
fn from_env_builds_a_shm_world() {
    let _serial = serial();
    {
        let choice = "shm";
        let tok = format!(
            "tok-5f1d0c3a-{:032x}",
            std::process::id() as u128 * 7919 + choice.len() as u128
        );
        let mut kids = Children::spawn_with(3, "env", &tok, |r| {
            let mut vars = vec![("FH_TRANSPORT", choice.to_string())];
            vars.extend(on_this_host(r, 3, "127.0.0.1:9", &tok, 20));
            vars
        });
        let st = kids.wait_all(Duration::from_secs(120));
        assert!(st.iter().all(ExitStatus::success), "{choice}: {st:?}");
        assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
    }
}

#[test]
fn killed_rank_is_named_without_a_hang() {
    let _serial = serial();
    let tok = token();
    let mut kids = Children::spawn(3, "kill", &tok);
    let st = kids.wait_all(Duration::from_secs(60));
    assert!(st[0].success() && st[1].success(), "survivors: {st:?}");
    assert_eq!(st[2].signal(), Some(libc::SIGKILL), "victim: {:?}", st[2]);
    assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
}

/// A rank stopped (SIGSTOP) with a timeout of 60 s is named by the others through the
/// heartbeats, far sooner than the timeout (the promise is 2 s; the bound leaves room for a
/// loaded machine, and still fails when the survivors wait for the timeout).
#[test]
fn a_stopped_rank_is_named_long_before_the_timeout() {
    let _serial = serial();
    let tok = format!("tok-5f1d0c3a-{:032x}", std::process::id() as u128 * 7907);
    let port = support::free_port().to_string();
    let rendezvous = format!("127.0.0.1:{port}");
    let mut kids = Children::spawn_with(3, "stop", &tok, |r| {
        let mut vars = vec![("FH_TRANSPORT", "shm".to_string())];
        vars.extend(on_this_host(r, 3, &rendezvous, &tok, 60));
        vars
    });
    let st = kids
        .wait_for(&[0, 1], Duration::from_secs(30), Duration::from_millis(10))
        .unwrap_or_else(|done| panic!("survivors still running after 30 s: {done:?}"));
    assert!(st.iter().all(ExitStatus::success), "survivors: {st:?}");
    let _ = kids.0[2].kill();
    let _ = kids.0[2].wait();
    assert_eq!(leftovers(&shm::segment_prefix(&tok)), Vec::<String>::new());
}

#[test]
fn waiting_ranks_sleep() {
    let _serial = serial();
    let tok = token();
    let mut kids = Children::spawn(2, "idle", &tok);
    let st = kids.wait_all(Duration::from_secs(60));
    assert!(st.iter().all(ExitStatus::success), "{st:?}");
}

#[test]
fn sigkill_of_every_rank_is_cleaned_up_at_next_start() {
    let _serial = serial();
    let tok = token();
    let prefix = shm::segment_prefix(&tok);
    let mut kids = Children::spawn(2, "stall", &tok);
    let start = Instant::now();
    // Wait until rank 0 has created the segment and recorded itself in it (a header word
    // and the first rank's pid are non-zero).
    let recorded = || {
        leftovers(&prefix).first().is_some_and(|name| {
            let bytes = std::fs::read(format!("/dev/shm/{name}")).unwrap_or_default();
            bytes.len() > 64 && bytes[64..68] != [0; 4]
        })
    };
    while !recorded() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no segment appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for c in &mut kids.0 {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let left = leftovers(&prefix);
    assert_eq!(
        left.len(),
        1,
        "the half-opened segment should remain: {left:?}"
    );
    // The next job's rank 0 removes it when it joins.
    let mut next = ShmTransport::join(&token(), 0, 1, ShmOptions::default()).unwrap();
    assert_eq!(leftovers(&prefix), Vec::<String>::new());
    let mut c = next.open("fresh").unwrap();
    let mut v = [3u8; 2];
    c.allreduce(&mut v, DType::U8, ReduceOp::Sum).unwrap();
    assert_eq!(v, [3, 3]);
}
