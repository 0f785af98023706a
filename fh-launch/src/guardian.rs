//! The guardian: a small process that outlives fhrun by design, so that no rank or descendant
//! outlives fhrun even when fhrun is SIGKILLed.
//!
//! fhrun starts it (its own executable, with [`GUARDIAN_ARG`]) before the ranks, in a process
//! group of its own, and writes each rank's process-group id to its stdin as the rank starts.
//! When a rank ends (and fhrun has killed what was left in its group) fhrun writes `-<pgid>`, so
//! that an id the system may reuse is never signalled. When fhrun finishes normally it writes
//! `done` and the guardian exits. When its stdin ends
//! without `done` — fhrun died, however — the guardian SIGKILLs every listed process group:
//! each rank runs in its own group, which holds the rank and every descendant that did not
//! leave it (a shell wrapper's children included). The parent-death signal only reaches the
//! direct child; this reaches the rest.

use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::sys;

/// The hidden first argument that makes fhrun act as the guardian.
pub const GUARDIAN_ARG: &str = "--internal-fhrun-guardian";

/// The guardian's side: read process-group ids until `done` or the end of stdin.
pub fn serve() -> i32 {
    let mut groups: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let line = line.trim();
        if line == "done" {
            return 0;
        }
        if let Some(gone) = line.strip_prefix('-') {
            // That rank ended and its group was killed: its id may be reused, forget it.
            if let Ok(pgid) = gone.parse::<u32>() {
                groups.retain(|&g| g != pgid);
            }
        } else if let Ok(pgid) = line.parse::<u32>() {
            groups.push(pgid);
        }
    }
    // fhrun is gone without saying done: take every rank's group down.
    for &g in &groups {
        sys::kill_group(g, libc::SIGKILL);
    }
    0
}

/// fhrun's handle on its guardian.
pub struct Guardian {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Guardian {
    /// Start the guardian (this executable, re-run). `None` (with a warning) if it cannot be
    /// started: the job still runs, with the parent-death signal as the only safety net.
    pub fn start() -> Option<Guardian> {
        // /proc/self/exe runs this very binary even if its file was replaced or deleted since.
        let exe = if cfg!(target_os = "linux") {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe().ok()?
        };
        let spawned = Command::new(exe)
            .arg(GUARDIAN_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn();
        match spawned {
            Ok(mut child) => {
                let stdin = child.stdin.take();
                Some(Guardian { child, stdin })
            }
            Err(e) => {
                eprintln!(
                    "fhrun: warning: cannot start the guardian process ({e}); if fhrun is \
                     killed, descendants of the ranks may survive it"
                );
                None
            }
        }
    }

    /// Tell the guardian about a rank's process group.
    pub fn watch(&mut self, pgid: u32) {
        if let Some(s) = self.stdin.as_mut() {
            if writeln!(s, "{pgid}").and_then(|_| s.flush()).is_err() {
                self.stdin = None;
            }
        }
    }

    /// A rank's process group is gone (its id may be reused): stop watching it.
    pub fn forget(&mut self, pgid: u32) {
        if let Some(s) = self.stdin.as_mut() {
            if writeln!(s, "-{pgid}").and_then(|_| s.flush()).is_err() {
                self.stdin = None;
            }
        }
    }

    /// The guardian's pid (not a rank: fhrun's clean-up leaves it alone).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The job is over: let the guardian go without killing anything, and reap it.
    pub fn dismiss(mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = writeln!(s, "done").and_then(|_| s.flush());
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
