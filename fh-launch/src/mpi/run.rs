//! Running `mpirun` as fhrun's child (`--mpi`), so that fhrun is there when it ends: to merge
//! the ranks' timelines and keep their flight records ([`crate::observe::JobDir::finish`]).
//!
//! mpirun starts, watches and stops the ranks itself; fhrun only stands around it. mpirun runs
//! in a process group of its own (as fhrun's ranks do), its output straight to fhrun's (mpirun
//! tags the lines itself), its stdin fhrun's unless that is a terminal (read from a background
//! group it would stop mpirun; fhrun's own ranks get no stdin either). fhrun passes on what it
//! gets: SIGINT, SIGTERM, SIGHUP and SIGQUIT to mpirun (which stops the ranks), a second one
//! as SIGKILL; SIGUSR1 (mpirun forwards it to every rank: each writes its flight record);
//! Ctrl-Z and SIGCONT. At `--timeout` the ranks get SIGUSR1 first, then mpirun SIGTERM, then
//! SIGKILL after the kill grace. fhrun's exit status is mpirun's (128 + N for a signal N that
//! stopped fhrun, 124 for the timeout). If fhrun itself is SIGKILLed, mpirun dies with it
//! (the parent-death signal), and fhrun's guardian kills the process groups of the ranks
//! mpirun started on this machine (fhrun tells it each group it sees among mpirun's
//! children, every 200 ms at most; mpirun leaves its ranks running when it is killed). Ranks
//! of other hosts are mpirun's daemons' business there.

use std::io::IsTerminal;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

use super::MpiCommand;
use crate::guardian::Guardian;
use crate::launch::{self, describe, status_code, EXIT_TIMEOUT, RECORD_WINDOW};
use crate::sys;

/// What fhrun's flags say about the job's end.
pub(crate) struct Supervision {
    /// Time between SIGTERM and SIGKILL.
    pub(crate) kill_grace: Duration,
    /// Stop the job after this long.
    pub(crate) timeout: Option<Duration>,
    /// Say more.
    pub(crate) verbose: bool,
}

/// fhrun stopping the job.
struct Stopping {
    /// fhrun's exit status.
    code: i32,
    /// When mpirun gets SIGTERM (after the ranks had time to write their flight records).
    term_at: Option<Instant>,
    /// When mpirun's process group gets SIGKILL (`None`: it did).
    kill_at: Option<Instant>,
}

/// Run `mpirun` (at `exe`) with `cmd`'s arguments and environment to its end; fhrun's exit
/// status.
pub(crate) fn run(exe: &Path, cmd: &MpiCommand, how: &Supervision) -> i32 {
    if let Err(e) = sys::block_handled_signals() {
        eprintln!("fhrun: cannot set up signal handling: {e}");
        return 1;
    }
    // Ranks that mpirun leaves behind when it dies come to fhrun, which stops them at the end.
    if let Err(e) = sys::become_subreaper() {
        if how.verbose {
            eprintln!("fhrun: cannot become a subreaper ({e}); orphans of mpirun go to init");
        }
    }
    let mut command = Command::new(exe);
    command
        .args(&cmd.argv[1..])
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .env_remove(crate::notice::NOTICE_VAR)
        .process_group(0);
    if std::io::stdin().is_terminal() {
        command.stdin(Stdio::null());
    }
    let parent = sys::getpid();
    // SAFETY: child_setup only makes async-signal-safe calls.
    unsafe {
        command.pre_exec(move || sys::child_setup(parent));
    }
    let mut guardian = Guardian::start();
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            if let Some(g) = guardian {
                g.dismiss();
            }
            eprintln!("fhrun: cannot run {}: {e}", exe.display());
            return match e.kind() {
                std::io::ErrorKind::NotFound => 127,
                _ => 126,
            };
        }
    };
    let pid = child.id();
    if let Some(g) = guardian.as_mut() {
        g.watch(pid);
    }
    if how.verbose {
        eprintln!("fhrun: started mpirun (pid {pid})");
    }
    // The process groups of mpirun's children (its ranks on this machine) the guardian knows.
    let mut watched: Vec<u32> = Vec::new();
    let started = Instant::now();
    let deadline = how.timeout.map(|t| started + t);
    let mut stopping: Option<Stopping> = None;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) => {
                eprintln!("fhrun: cannot wait for mpirun (pid {pid}): {e}; stopping it");
                sys::kill_group(pid, libc::SIGKILL);
                let _ = child.wait();
                break None;
            }
        }
        if let Some(g) = guardian.as_mut() {
            watch_ranks(g, pid, &mut watched);
        }
        let now = Instant::now();
        if let Some(s) = stopping.as_mut() {
            if s.term_at.is_some_and(|t| now >= t) {
                s.term_at = None;
                sys::kill_pid(pid, libc::SIGTERM);
            }
            if s.kill_at.is_some_and(|t| now >= t) {
                if how.verbose {
                    eprintln!("fhrun: mpirun (pid {pid}) still running; sending SIGKILL");
                }
                s.kill_at = None;
                sys::kill_group(pid, libc::SIGKILL);
            }
        } else if deadline.is_some_and(|d| now >= d) {
            eprintln!(
                "fhrun: the job timed out after {:.1} s (--timeout); stopping mpirun",
                started.elapsed().as_secs_f64()
            );
            // First the flight records (mpirun passes SIGUSR1 on to every rank), then SIGTERM.
            sys::kill_pid(pid, libc::SIGUSR1);
            stopping = Some(Stopping {
                code: EXIT_TIMEOUT,
                term_at: Some(now + RECORD_WINDOW),
                kill_at: Some(now + RECORD_WINDOW + how.kill_grace),
            });
        }
        let mut wait = Duration::from_millis(200);
        match &stopping {
            Some(s) => {
                for t in s.term_at.iter().chain(&s.kill_at) {
                    wait = wait.min(t.saturating_duration_since(now));
                }
            }
            None => {
                if let Some(d) = deadline {
                    wait = wait.min(d.saturating_duration_since(now));
                }
            }
        }
        match sys::wait_signal(wait.max(Duration::from_millis(1))) {
            Some(libc::SIGUSR1) => sys::kill_pid(pid, libc::SIGUSR1),
            Some(libc::SIGTSTP) => {
                sys::kill_pid(pid, libc::SIGTSTP);
                sys::stop_self();
            }
            Some(libc::SIGCONT) => sys::kill_pid(pid, libc::SIGCONT),
            Some(sig @ (libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT)) => {
                match stopping.as_mut() {
                    // mpirun stops the ranks itself (SIGTERM, then SIGKILL).
                    None => {
                        eprintln!("fhrun: received {}; stopping mpirun", sys::signal_name(sig));
                        sys::kill_pid(pid, sig);
                        stopping = Some(Stopping {
                            code: 128 + sig,
                            term_at: None,
                            kill_at: Some(Instant::now() + how.kill_grace * 2),
                        });
                    }
                    Some(s) => {
                        if s.kill_at.is_some() {
                            eprintln!(
                                "fhrun: received {} again; killing mpirun",
                                sys::signal_name(sig)
                            );
                            s.term_at = None;
                            s.kill_at = Some(Instant::now());
                        }
                    }
                }
            }
            _ => {}
        }
    };
    // Whatever mpirun left in its process group goes with it; ranks it left in groups of
    // their own came to fhrun, which stops them now.
    sys::kill_group(pid, libc::SIGKILL);
    if let Some(g) = guardian.as_mut() {
        g.forget(pid);
    }
    launch::stop_orphans(&guardian, how.kill_grace);
    if let Some(g) = guardian {
        g.dismiss();
    }
    match (stopping, status) {
        (Some(s), _) => s.code,
        (None, Some(status)) => {
            if how.verbose || !status.success() {
                eprintln!("fhrun: mpirun (pid {pid}) {}", describe(status));
            }
            status_code(status)
        }
        (None, None) => 1,
    }
}

/// Tell the guardian the process groups of mpirun's (`mpirun`'s) children that it does not
/// know yet, and forget those of children gone (`watched`: the groups it knows).
fn watch_ranks(guardian: &mut Guardian, mpirun: u32, watched: &mut Vec<u32>) {
    let groups: Vec<u32> = sys::children_of(mpirun)
        .into_iter()
        .filter(|&(_, zombie)| !zombie)
        .filter_map(|(p, _)| sys::process_group(p))
        // mpirun's own group is watched already, and fhrun's must never be.
        .filter(|&g| g != mpirun && g != sys::getpid() as u32)
        .collect();
    for &g in &groups {
        if !watched.contains(&g) {
            guardian.watch(g);
            watched.push(g);
        }
    }
    watched.retain(|g| {
        let alive = groups.contains(g);
        if !alive {
            guardian.forget(*g);
        }
        alive
    });
}
