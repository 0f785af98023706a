//! The few raw libc calls fhrun makes: signal masks, signal waiting, process-group kills.

use std::io;
use std::time::Duration;

/// The signals fhrun handles itself (blocked in every thread and taken with `sigtimedwait`),
/// but SIGHUP when fhrun started with it ignored ([`hangup_ignored`]).
pub const HANDLED: [libc::c_int; 8] = [
    libc::SIGUSR1,
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGTSTP,
    libc::SIGCONT,
    libc::SIGCHLD,
];

/// Whether SIGHUP was ignored when fhrun first looked (before it blocked anything): started
/// under `nohup`, fhrun and its ranks keep ignoring it, as any program would. (A blocked
/// signal is queued even when ignored, so fhrun would otherwise take it and stop the job.)
pub fn hangup_ignored() -> bool {
    static IGNORED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IGNORED.get_or_init(|| {
        // SAFETY: sigaction with a null new action only reads the current one into `old`.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut old) };
        rc == 0 && old.sa_sigaction == libc::SIG_IGN
    })
}

fn handled_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    let skip_hangup = hangup_ignored();
    // SAFETY: `set` is a valid sigset_t; the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in HANDLED {
            if !(s == libc::SIGHUP && skip_hangup) {
                libc::sigaddset(&mut set, s);
            }
        }
    }
    set
}

/// Blocks the handled signals in the calling thread (and every thread it creates afterwards), so
/// that they stay pending until [`wait_signal`] takes them. Call before spawning any thread.
pub fn block_handled_signals() -> io::Result<()> {
    let set = handled_set();
    // SAFETY: `set` is a valid, initialized sigset_t; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Waits up to `timeout` for one of the handled signals; `None` on timeout or interruption.
pub fn wait_signal(timeout: Duration) -> Option<libc::c_int> {
    let set = handled_set();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` and `ts` are valid for the call; a null siginfo pointer is allowed.
    let rc = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
    (rc > 0).then_some(rc)
}

/// Sends `sig` to the process group `pgid`. A group that no longer exists is not an error.
pub fn kill_group(pgid: u32, sig: libc::c_int) {
    if pgid == 0 || pgid > i32::MAX as u32 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; a negative pid addresses a group.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), sig);
    }
}

/// Code run in the forked child before `exec` (must stay async-signal-safe): die with SIGKILL
/// when fhrun dies, and start with an empty signal mask.
///
/// # Safety
/// Only call between fork and exec (from `CommandExt::pre_exec`).
pub unsafe fn child_setup(parent: libc::pid_t) -> io::Result<()> {
    // SAFETY: prctl/getppid/sigprocmask/_exit are async-signal-safe; pointers are valid.
    unsafe {
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        // fhrun died between fork and prctl: the death signal will never come, so go now.
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
    Ok(())
}

/// Make this process the reaper of its orphaned descendants (`PR_SET_CHILD_SUBREAPER`), so
/// that a rank's child whose parent died is re-parented to fhrun, which then finds and stops it.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The children of this process (from `/proc`), with whether each is a zombie.
pub fn children() -> Vec<(u32, bool)> {
    children_of(getpid() as u32)
}

/// The children of process `parent` (from `/proc`), with whether each is a zombie: from each
/// of its threads' `children` list, or, on a kernel without them, from every process's parent.
pub fn children_of(parent: u32) -> Vec<(u32, bool)> {
    if let Some(found) = children_listed(parent) {
        return found;
    }
    let me = parent;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name (field 2) is in parentheses and may hold spaces: parse after it.
            let mut rest = text[text.rfind(')')? + 1..].split_ascii_whitespace();
            let state = rest.next()?;
            let ppid: u32 = rest.next()?.parse().ok()?;
            (ppid == me).then_some((pid, state == "Z"))
        })
        .collect()
}

/// [`children_of`] from `/proc/PID/task/TID/children` (`None`: the kernel has no such lists).
fn children_listed(parent: u32) -> Option<Vec<(u32, bool)>> {
    let tasks = std::fs::read_dir(format!("/proc/{parent}/task")).ok()?;
    let mut pids: Vec<u32> = Vec::new();
    let mut listed = false;
    for t in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(t.path().join("children")) else {
            continue;
        };
        listed = true;
        pids.extend(
            text.split_ascii_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    if !listed {
        return None;
    }
    pids.sort_unstable();
    pids.dedup();
    let zombie = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|text| {
            text.rfind(')')
                .and_then(|i| text[i + 1..].split_ascii_whitespace().next())
                == Some("Z")
        })
    };
    Some(pids.into_iter().map(|p| (p, zombie(p))).collect())
}

/// The process group of `pid` (`None` if it is gone).
pub fn process_group(pid: u32) -> Option<u32> {
    let p = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
    // SAFETY: getpgid has no memory-safety preconditions.
    let g = unsafe { libc::getpgid(p) };
    u32::try_from(g).ok().filter(|&g| g > 0)
}

/// Reap `pid` if it has ended (never blocks).
pub fn reap(pid: u32) {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return;
    };
    let mut status = 0;
    // SAFETY: waitpid on one specific pid with a valid status pointer; WNOHANG never blocks.
    unsafe {
        libc::waitpid(p, &mut status, libc::WNOHANG);
    }
}

/// Sends `sig` to the process `pid`. A process that no longer exists is not an error.
pub fn kill_pid(pid: u32, sig: libc::c_int) {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return;
    };
    if p <= 0 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(p, sig);
    }
}

/// Stop this process (as the default action of SIGTSTP would) until a SIGCONT.
pub fn stop_self() {
    kill_pid(getpid() as u32, libc::SIGSTOP);
}

/// This process's id.
pub fn getpid() -> libc::pid_t {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// True when running as root (mpirun then needs --allow-run-as-root).
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The conventional name of a signal (`SIGKILL`), or `signal N`.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// Reads `n` random bytes from the kernel and returns them as lowercase hex.
pub fn random_hex(n: usize) -> io::Result<String> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_hex() {
        let a = random_hex(32).unwrap();
        let b = random_hex(32).unwrap();
        assert_eq!(a.len(), 64);
        assert!(a
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }

    #[test]
    fn names() {
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(63), "signal 63");
    }
}
