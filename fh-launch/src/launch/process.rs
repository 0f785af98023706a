//! Starting a job's processes and reading their ends: a rank or a remote part in a process
//! group of its own, its output threads, its exit status as fhrun reports it, and the signals
//! that stop a rank's group.

use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;

use super::{LocalJob, Rank, RankSpec, RemoteSpec};
use crate::notice::{NoticeChannel, NOTICE_VAR};
use crate::output::{pump, Sink};
use crate::sys;

/// Starts a remote part: its agent in a process group of its own, the part's job on its stdin,
/// its output copied as it is (the remote part prefixes its ranks' lines itself).
pub(crate) fn spawn_remote(spec: &RemoteSpec) -> std::io::Result<(Child, ChildStdin)> {
    let mut cmd = Command::new(&spec.argv[0]);
    cmd.args(&spec.argv[1..])
        .env_remove(NOTICE_VAR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let parent = sys::getpid();
    // SAFETY: child_setup only makes async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || sys::child_setup(parent));
    }
    let mut child = cmd.spawn()?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    if let Err(e) = stdin
        .write_all(spec.input.as_bytes())
        .and_then(|_| stdin.flush())
    {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok((child, stdin))
}

/// fhrun's exit code for a rank's exit status.
pub(crate) fn status_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 1,
    }
}

pub(crate) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", sys::signal_name(s)),
        _ => format!("ended with status {status}"),
    }
}

pub(super) fn spawn_rank(
    job: &LocalJob,
    spec: &RankSpec,
    notices: Option<&NoticeChannel>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(&job.command[0]);
    cmd.args(&job.command[1..])
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .process_group(0);
    if job.prefix {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    // The notice pipe's write end, or no variable at all (not one inherited from a launcher
    // around fhrun, whose descriptor the rank does not have).
    let notice_fd = notices.and_then(|n| Some((n.write_fd()?, n.env_value()?)));
    match &notice_fd {
        Some((_, value)) => cmd.env(NOTICE_VAR, value),
        None => cmd.env_remove(NOTICE_VAR),
    };
    let notice_fd = notice_fd.map(|(fd, _)| fd);
    let parent = sys::getpid();
    // SAFETY: child_setup and inherit_in_child only make async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            sys::child_setup(parent)?;
            if let Some(fd) = notice_fd {
                NoticeChannel::inherit_in_child(fd)?;
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Tells an elastic driver on stdout that `r` ended (see [`LocalJob::report_exits`]).
pub(super) fn report_exit(marker: &str, r: &Rank, status: ExitStatus) {
    let name = r.label.strip_prefix("worker ").unwrap_or(&r.label);
    let what = match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "exit 1".to_string(),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{marker} {name} {what}").and_then(|_| out.flush());
}

/// Sends `sig` to a rank's process group, then SIGCONT: a stopped process (SIGSTOP, a hung
/// rank's stand-in, or Ctrl-Z) acts on `sig` only once it runs again, and would otherwise
/// last until the SIGKILL after the kill grace.
pub(super) fn stop_group(pgid: u32, sig: i32) {
    sys::kill_group(pgid, sig);
    sys::kill_group(pgid, libc::SIGCONT);
}

/// Copy `src` to `sink` (each line after `prefix`) on a thread of its own named `thread`, which
/// says so on `done` when the stream ends. Returns whether the thread started; when it cannot,
/// says so naming `whose` output it was.
pub(crate) fn spawn_pump(
    thread: String,
    src: Box<dyn std::io::Read + Send>,
    sink: Sink,
    prefix: String,
    done: &mpsc::Sender<()>,
    whose: &str,
) -> bool {
    spawn_output(thread, done, whose, move || pump(src, sink, prefix))
}

/// Run `relay` (which copies an output stream to its end) on a thread of its own named
/// `thread`, which says so on `done` when it returns. Returns whether the thread started; when
/// it cannot, says so naming `whose` output it was.
pub(crate) fn spawn_output(
    thread: String,
    done: &mpsc::Sender<()>,
    whose: &str,
    relay: impl FnOnce() + Send + 'static,
) -> bool {
    let tx = done.clone();
    let spawned = std::thread::Builder::new().name(thread).spawn(move || {
        relay();
        let _ = tx.send(());
    });
    match spawned {
        Ok(_) => true,
        Err(e) => {
            eprintln!("fhrun: cannot start the output thread of {whose}: {e}");
            false
        }
    }
}
