//! Helpers shared by fhrun's integration tests: bounded runs, a guard that kills and reaps
//! fhrun, temporary directories, process liveness.
#![allow(dead_code)]

pub mod elastic;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const FHRUN: &str = env!("CARGO_BIN_EXE_fhrun");

/// Whether Open MPI's `mpirun` is on `PATH` (tests of `--mpi` skip without it).
pub fn mpirun_on_path() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false)
}

/// A running fhrun whose output is collected; killed (SIGKILL) and reaped on drop. Its ranks
/// die with it (PR_SET_PDEATHSIG).
pub struct Running {
    child: Option<Child>,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    out_now: Shared,
    err_now: Shared,
}

/// What a finished fhrun left.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

type Shared = Arc<Mutex<Vec<u8>>>;

fn collect(mut r: impl Read + Send + 'static, into: Shared) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => into.lock().unwrap().extend_from_slice(&buf[..n]),
            }
        }
        let v = into.lock().unwrap();
        String::from_utf8_lossy(&v).into_owned()
    })
}

impl Running {
    pub fn start(args: &[&str]) -> Self {
        Self::start_cmd(Command::new(FHRUN).args(args))
    }

    /// Starts `cmd` (fhrun) as a user's terminal would: with SIGINT, SIGQUIT, SIGTERM and
    /// SIGHUP at their default actions, whatever this test process inherited (a suite started
    /// in the background of a script has SIGINT and SIGQUIT ignored, which its ranks' shells
    /// then could not trap).
    pub fn start_cmd(cmd: &mut Command) -> Self {
        use std::os::unix::process::CommandExt;
        // SAFETY: signal(2) is async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(|| {
                for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP] {
                    libc::signal(sig, libc::SIG_DFL);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start fhrun");
        let out_now = Shared::default();
        let err_now = Shared::default();
        let out = collect(child.stdout.take().unwrap(), out_now.clone());
        let err = collect(child.stderr.take().unwrap(), err_now.clone());
        Running {
            child: Some(child),
            out: Some(out),
            err: Some(err),
            out_now,
            err_now,
        }
    }

    /// fhrun's stdout so far.
    pub fn stdout_now(&self) -> String {
        String::from_utf8_lossy(&self.out_now.lock().unwrap()).into_owned()
    }

    /// fhrun's stderr so far.
    pub fn stderr_now(&self) -> String {
        String::from_utf8_lossy(&self.err_now.lock().unwrap()).into_owned()
    }

    /// Waits (bounded) until `cond(stdout, stderr)` holds on the output so far; panics with the
    /// output if it does not within `limit` or if fhrun ends first.
    pub fn wait_for(&mut self, limit: Duration, cond: impl Fn(&str, &str) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            let out = String::from_utf8_lossy(&self.out_now.lock().unwrap()).into_owned();
            let err = String::from_utf8_lossy(&self.err_now.lock().unwrap()).into_owned();
            if cond(&out, &err) {
                return;
            }
            let ended = self.child.as_mut().unwrap().try_wait().unwrap().is_some();
            assert!(
                !ended && Instant::now() < deadline,
                "condition not met (fhrun ended: {ended})\nstdout:\n{out}\nstderr:\n{err}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Waits at most `limit` for fhrun to end; panics (after killing it) if it does not.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.as_mut().unwrap().kill();
                let _ = self.child.as_mut().unwrap().wait();
                panic!("fhrun did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        self.child = None;
        let stdout = join_bounded(self.out.take().unwrap(), deadline);
        let stderr = join_bounded(self.err.take().unwrap(), deadline);
        Finished {
            status,
            stdout,
            stderr,
        }
    }
}

fn join_bounded(h: JoinHandle<String>, deadline: Instant) -> String {
    // fhrun has exited; its pipes close unless a leftover process holds them. Give that case a
    // bounded grace, then report it as a test failure.
    let until = deadline.max(Instant::now() + Duration::from_secs(5));
    while !h.is_finished() {
        assert!(
            Instant::now() < until,
            "fhrun's output pipe is still held open after fhrun exited: a rank survived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    h.join().unwrap()
}

impl Drop for Running {
    /// A test that fails midway: SIGTERM fhrun (it stops its ranks' process groups, grandchildren
    /// included), SIGKILL it if it is not gone in 5 s (its ranks then die by PDEATHSIG), reap.
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our own, not yet reaped, child.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs fhrun to completion, at most `limit`.
pub fn fhrun(args: &[&str], limit: Duration) -> Finished {
    Running::start(args).wait(limit)
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "fhrun-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    pub fn str(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// True when `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks existence.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesized command name.
        Ok(s) => s
            .rsplit_once(") ")
            .map(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
            .unwrap_or(true),
        Err(_) => false,
    }
}

/// Waits (bounded) until every pid is gone; returns the survivors.
pub fn survivors_after(pids: &[i32], limit: Duration) -> Vec<i32> {
    let deadline = Instant::now() + limit;
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills leftover pids (so a failing test does not leak processes).
pub fn kill_all(pids: &[i32]) {
    for &p in pids {
        // SAFETY: plain kill(2).
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
}

/// Waits (bounded) for `dir/name` files to exist and returns the pid each holds.
pub fn read_pids(dir: &Path, names: &[String], limit: Duration) -> Vec<i32> {
    let deadline = Instant::now() + limit;
    names
        .iter()
        .map(|n| loop {
            if let Ok(s) = std::fs::read_to_string(dir.join(n)) {
                if let Ok(p) = s.trim().parse() {
                    break p;
                }
            }
            assert!(Instant::now() < deadline, "{n} did not appear in {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        })
        .collect()
}

/// Lines of `text` that start with `[rank]<stream>:`, as (rank, rest).
pub fn prefixed<'a>(text: &'a str, stream: &str) -> Vec<(usize, &'a str)> {
    text.lines()
        .filter_map(|l| {
            let l = l.strip_prefix('[')?;
            let (rank, rest) = l.split_once(']')?;
            let rest = rest.strip_prefix(&format!("<{stream}>:"))?;
            Some((rank.parse().ok()?, rest))
        })
        .collect()
}

/// The flight record rank `rank` of `size` "writes": one completed allreduce.
pub fn flight_record(rank: usize, size: usize) -> String {
    use fh_scheduler::flight::dump::{Dump, OpRecord, FORMAT};
    let dump = Dump {
        format: FORMAT.into(),
        rank,
        size,
        reason: "engine stopped: a peer was lost".into(),
        written_unix_us: 1_700_000_000_000_000,
        capacity: 4096,
        recorded: 1,
        stall: None,
        stopped: Some("a peer was lost".into()),
        ops: vec![OpRecord {
            seq: 1,
            name: "allreduce.warmup".into(),
            kind: "allreduce".into(),
            dtype: "f32".into(),
            shape: vec![2],
            ndim: 1,
            bytes: 8,
            submitted_us: 1_700_000_000_000_000,
            negotiated_us: Some(1_700_000_000_000_100),
            round: Some(1),
            started_us: Some(1_700_000_000_000_200),
            done_us: Some(1_700_000_000_000_300),
            channel: Some(0),
            waiting_on: Vec::new(),
            outcome: "ok".into(),
            error: None,
            lost_rank: None,
        }],
        members: None,
    };
    serde_json::to_string(&dump).unwrap()
}

/// An rsh agent (`dir/agent.sh`) that runs a "far host"'s command here, in a mount namespace
/// of its own where `dir/near` — fhrun's `TMPDIR` in the tests that use it — is an empty
/// tmpfs (as on another host, fhrun's job directory is not there), with `TMPDIR=dir/far`.
/// Returns the agent and `dir/near`; `None`: this machine cannot run it (no `unshare -m`).
pub fn far_host_agent(dir: &TempDir) -> Option<(PathBuf, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let ok = Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: needs `unshare -m` (root) to hide fhrun's directory from a far host");
        return None;
    }
    let (near, far) = (dir.path().join("near"), dir.path().join("far"));
    for d in [&near, &far] {
        std::fs::create_dir_all(d).unwrap();
    }
    let agent = dir.path().join("agent.sh");
    std::fs::write(
        &agent,
        format!(
            "#!/bin/bash\nshift\nexec unshare -m sh -c 'mount -t tmpfs fh-far \"$0\" && \
             TMPDIR=\"$1\" exec sh -c \"$2\"' '{}' '{}' \"$*\"\n",
            near.display(),
            far.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    Some((agent, near))
}

/// The one job directory fhrun made under `tmp` (its `TMPDIR`).
pub fn only_job_dir(tmp: &Path) -> PathBuf {
    let kept: Vec<_> = std::fs::read_dir(tmp).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    kept[0].path()
}

/// A JSON file's contents.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Asserts that none of `pids` outlives fhrun (waiting up to 10 s for them to go), `what`
/// naming them in the failure; kills any that did.
pub fn none_left(pids: &[i32], what: &str) {
    let left = survivors_after(pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(
        left.is_empty(),
        "{what} outlived fhrun: {left:?} of {pids:?}"
    );
}
