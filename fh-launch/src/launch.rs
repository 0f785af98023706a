//! Running a job's ranks on this machine: spawn, prefix output, watch, fail fast, forward
//! signals, reap everything.

use std::io::Write;
use std::process::{Child, ChildStdin};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::guardian::Guardian;
use crate::notice::{Notice, NoticeChannel};
use crate::output::Sink;
use crate::sys;

mod process;

pub(crate) use process::{describe, spawn_output, spawn_pump, spawn_remote, status_code};
use process::{report_exit, spawn_rank, stop_group};

/// Exit status of fhrun when the job ran past `--timeout`.
pub const EXIT_TIMEOUT: i32 = 124;

/// One rank to start.
#[derive(Debug, Clone)]
pub struct RankSpec {
    /// The rank.
    pub rank: usize,
    /// Variables set for it (on top of fhrun's environment).
    pub env: Vec<(String, String)>,
    /// What its output lines and messages call it instead of its rank (an elastic worker's
    /// `host:slot`, which has no fixed rank).
    pub tag: Option<String>,
}

impl LocalJob {
    /// The job's world size: `FH_SIZE` of its ranks (which counts the other hosts' ranks
    /// too: a notice names a lost rank of any host), or, without it, this machine's highest
    /// rank + 1.
    fn world_size(&self) -> usize {
        let local = self.ranks.iter().map(|r| r.rank + 1).max().unwrap_or(0);
        self.ranks
            .iter()
            .flat_map(|r| &r.env)
            .find(|(k, _)| k == "FH_SIZE")
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .map_or(local, |n| n.max(local))
    }
}

impl RankSpec {
    /// `[3]`'s `3`, or the tag.
    fn name(&self) -> String {
        self.tag.clone().unwrap_or_else(|| self.rank.to_string())
    }

    /// `rank 3`, or `worker h1:0`.
    fn label(&self) -> String {
        match &self.tag {
            Some(t) => format!("worker {t}"),
            None => format!("rank {}", self.rank),
        }
    }
}

/// The ranks of another host, started through the rsh agent (see [`crate::remote`]).
#[derive(Debug, Clone)]
pub struct RemoteSpec {
    /// What fhrun calls it in messages, e.g. `ranks 4-7 on node2`.
    pub label: String,
    /// The agent's command line: agent, its options, the host, the remote part's command.
    pub argv: Vec<String>,
    /// What the remote part reads on its stdin ([`crate::remote::Part::encode`]).
    pub input: String,
    /// Where the flight records and timelines the part sends back go (its stdout's lines
    /// under the marker, taken out of the output: [`crate::gather`]).
    pub gather: Option<crate::gather::Gather>,
}

/// A job: ranks on this machine, and remote parts on other hosts.
#[derive(Debug, Clone)]
pub struct LocalJob {
    /// The command and its arguments (the same for every rank).
    pub command: Vec<String>,
    /// The ranks on this machine.
    pub ranks: Vec<RankSpec>,
    /// The other hosts' ranks.
    pub remotes: Vec<RemoteSpec>,
    /// Prefix output lines with the rank.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
    /// Kill the job after this long.
    pub timeout: Option<Duration>,
    /// Say more.
    pub verbose: bool,
    /// Report every rank's end on stdout as a line `MARKER NAME exit CODE` or
    /// `MARKER NAME signal N` (an elastic part tells its driver; see `crate::elastic`).
    pub report_exits: Option<String>,
    /// Told each time the ranks were asked for their flight records (`SIGUSR1` passed on): a
    /// remote part then sends them to fhrun while the job runs ([`crate::gather`]).
    pub record_requests: Option<mpsc::Sender<()>>,
}

/// Why fhrun is stopping the job.
#[derive(Debug, Clone, Copy)]
enum StopReason {
    /// A rank failed (its exit status becomes fhrun's).
    RankFailed(i32),
    /// This rank said it is failing (a notice; its exit status becomes fhrun's if it ends
    /// before fhrun signals it, else 1).
    RankNotice(usize),
    /// fhrun got this signal.
    Signal(i32),
    /// `--timeout` expired.
    Timeout,
}

struct Stopping {
    reason: StopReason,
    /// When the pending SIGTERM goes out (after a rank failed, the others get a moment to
    /// notice the lost peer and say so themselves).
    term_at: Option<Instant>,
    kill_at: Instant,
    killed: bool,
    /// A signal asked fhrun to stop after the stop began (see the signal handling).
    signalled: bool,
}

/// After a rank fails, how long the other ranks may take to notice (a lost peer is reported
/// at once over the transports) and exit on their own before fhrun sends them SIGTERM.
const REPORT_WINDOW: Duration = Duration::from_millis(1000);

/// After a rank's notice that it fails, how long the others may take to end on their own
/// before fhrun sends them SIGTERM. Shorter than [`REPORT_WINDOW`]: the cause is known, and the
/// failing rank tells the others right after its notice (its atexit `hvd.shutdown()`, within
/// milliseconds), so their own errors come well within it; its interpreter's finalization
/// (a second or more with torch loaded, after stdout and stderr are flushed) is not waited for.
const NOTICE_WINDOW: Duration = Duration::from_millis(500);

/// At `--timeout`, how long the ranks have to write their flight records (fhrun sends them
/// `SIGUSR1` first) before fhrun sends them SIGTERM.
pub(crate) const RECORD_WINDOW: Duration = Duration::from_millis(1000);

/// The longest fhrun sleeps between two looks at the notice pipe (a SIGCHLD or a signal for
/// fhrun wakes it earlier).
const NOTICE_POLL: Duration = Duration::from_millis(50);

struct Rank {
    rank: usize,
    /// `rank N`, or a remote part's label.
    label: String,
    pid: u32,
    child: Option<Child>,
    /// A remote part's control channel (its agent's stdin): signals go there as `signal N`.
    control: Option<ChildStdin>,
}

impl Rank {
    /// Asks the rank to write its flight record and print its stacks: `SIGUSR1` to its process
    /// (not its group: a wrapper around it keeps running), or, for a remote part, to its ranks.
    fn request_record(&mut self) {
        match self.control.as_mut() {
            Some(_) => self.signal(libc::SIGUSR1),
            None => sys::kill_pid(self.pid, libc::SIGUSR1),
        }
    }

    /// Sends `sig` to the rank's process group, or asks a remote part to send it to its ranks.
    fn signal(&mut self, sig: i32) {
        match self.control.as_mut() {
            Some(c) => {
                if writeln!(c, "signal {sig}").and_then(|_| c.flush()).is_err() {
                    self.control = None;
                }
            }
            None => stop_group(self.pid, sig),
        }
    }
}

/// Runs the job to completion and returns fhrun's exit status.
pub fn run(job: &LocalJob) -> i32 {
    if let Err(e) = sys::block_handled_signals() {
        eprintln!("fhrun: cannot set up signal handling: {e}");
        return 1;
    }
    // Orphaned descendants of the ranks come to fhrun, which stops them at the end; the
    // guardian stops the ranks' process groups if fhrun itself is killed.
    if let Err(e) = sys::become_subreaper() {
        if job.verbose {
            eprintln!("fhrun: cannot become a subreaper ({e}); orphans of the ranks go to init");
        }
    }
    let mut guardian = Guardian::start();
    // An elastic part's workers get no notice pipe: a worker's engine that loses a peer
    // notifies the launcher naming the lost rank, which there is a rank of the generation's
    // world, not of this part — and the driver, not the part, decides what a loss means (the
    // survivors re-form the world; only a worker's own end counts, reported by its exit).
    let notices = match (job.report_exits.is_some(), NoticeChannel::open()) {
        (true, _) => None,
        (false, Ok(n)) => Some(n),
        (false, Err(e)) => {
            if job.verbose {
                eprintln!(
                    "fhrun: cannot open the notice pipe ({e}); a failing rank is blamed by its \
                     exit alone"
                );
            }
            None
        }
    };
    let code = run_ranks(job, guardian.as_mut(), notices);
    stop_orphans(&guardian, job.kill_grace);
    if let Some(g) = guardian {
        g.dismiss();
    }
    code
}

/// Stop and reap every remaining child of fhrun but the guardian: descendants of the ranks that
/// were orphaned and re-parented to fhrun (fhrun is a subreaper) and left their rank's process
/// group. SIGTERM first, SIGKILL after `grace` (at most 2 s).
pub(crate) fn stop_orphans(guardian: &Option<Guardian>, grace: Duration) {
    let keep = guardian.as_ref().map(Guardian::pid);
    let others = || -> Vec<(u32, bool)> {
        sys::children()
            .into_iter()
            .filter(|(p, _)| Some(*p) != keep)
            .collect()
    };
    let mut signalled = false;
    let deadline = Instant::now() + grace.min(Duration::from_secs(2));
    loop {
        let left = others();
        for &(pid, zombie) in &left {
            if zombie {
                sys::reap(pid);
            } else if !signalled {
                sys::kill_pid(pid, libc::SIGTERM);
            }
        }
        signalled = true;
        if left.iter().all(|&(_, z)| z) {
            return;
        }
        if Instant::now() >= deadline {
            for (pid, _) in others() {
                sys::kill_pid(pid, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(20));
            for (pid, _) in others() {
                sys::reap(pid);
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run_ranks(
    job: &LocalJob,
    mut guardian: Option<&mut Guardian>,
    mut notices: Option<NoticeChannel>,
) -> i32 {
    let started = Instant::now();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut pumps = 0usize;
    let mut ranks: Vec<Rank> = Vec::with_capacity(job.ranks.len());
    let mut stopping: Option<Stopping> = None;
    let mut exit_code = 0;

    for spec in &job.ranks {
        match spawn_rank(job, spec, notices.as_ref()) {
            Ok(mut child) => {
                let pid = child.id();
                if let Some(g) = guardian.as_mut() {
                    g.watch(pid);
                }
                if job.verbose {
                    eprintln!("fhrun: started {} (pid {pid})", spec.label());
                }
                let streams = [
                    child.stdout.take().map(|s| {
                        (
                            Box::new(s) as Box<dyn std::io::Read + Send>,
                            Sink::Stdout,
                            "stdout",
                        )
                    }),
                    child.stderr.take().map(|s| {
                        (
                            Box::new(s) as Box<dyn std::io::Read + Send>,
                            Sink::Stderr,
                            "stderr",
                        )
                    }),
                ];
                for (src, sink, name) in streams.into_iter().flatten() {
                    let prefix = format!("[{}]<{name}>:", spec.name());
                    let thread = format!("rank{}-{name}", spec.name());
                    let whose = spec.label();
                    if spawn_pump(thread, src, sink, prefix, &done_tx, &whose) {
                        pumps += 1;
                    }
                }
                ranks.push(Rank {
                    rank: spec.rank,
                    label: spec.label(),
                    pid,
                    child: Some(child),
                    control: None,
                });
            }
            Err(e) => {
                eprintln!(
                    "fhrun: cannot start {} (`{}`): {e}",
                    spec.label(),
                    job.command[0]
                );
                exit_code = match e.kind() {
                    std::io::ErrorKind::NotFound => 127,
                    std::io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                let now = Instant::now();
                stopping = Some(Stopping {
                    reason: StopReason::RankFailed(exit_code),
                    term_at: Some(now + REPORT_WINDOW),
                    kill_at: now + REPORT_WINDOW + job.kill_grace,
                    killed: false,
                    signalled: false,
                });
                break;
            }
        }
    }
    // The other hosts' parts, unless a local rank already failed to start.
    let remotes = if stopping.is_none() {
        &job.remotes[..]
    } else {
        &[]
    };
    for spec in remotes {
        match spawn_remote(spec) {
            Ok((mut child, control)) => {
                let pid = child.id();
                if let Some(g) = guardian.as_mut() {
                    g.watch(pid);
                }
                if job.verbose {
                    eprintln!("fhrun: started {} (agent pid {pid})", spec.label);
                }
                let streams = [
                    child
                        .stdout
                        .take()
                        .map(|s| (Box::new(s) as Box<dyn std::io::Read + Send>, Sink::Stdout)),
                    child
                        .stderr
                        .take()
                        .map(|s| (Box::new(s) as Box<dyn std::io::Read + Send>, Sink::Stderr)),
                ];
                for (src, sink) in streams.into_iter().flatten() {
                    let thread = "remote-output".to_string();
                    let started = match (&spec.gather, sink) {
                        (Some(g), Sink::Stdout) => {
                            let (g, who) = (g.clone(), spec.label.clone());
                            spawn_output(thread, &done_tx, &spec.label, move || {
                                crate::gather::relay(src, std::io::stdout(), &g, &who)
                            })
                        }
                        _ => spawn_pump(thread, src, sink, String::new(), &done_tx, &spec.label),
                    };
                    if started {
                        pumps += 1;
                    }
                }
                ranks.push(Rank {
                    rank: usize::MAX,
                    label: spec.label.clone(),
                    pid,
                    child: Some(child),
                    control: Some(control),
                });
            }
            Err(e) => {
                eprintln!(
                    "fhrun: cannot start {} (`{}`): {e}",
                    spec.label, spec.argv[0]
                );
                exit_code = 1;
                let now = Instant::now();
                stopping = Some(Stopping {
                    reason: StopReason::RankFailed(exit_code),
                    term_at: Some(now + REPORT_WINDOW),
                    kill_at: now + REPORT_WINDOW + job.kill_grace,
                    killed: false,
                    signalled: false,
                });
                break;
            }
        }
    }
    drop(done_tx);
    // Only the ranks write notices: fhrun's copy of the write end goes.
    if let Some(n) = notices.as_mut() {
        n.close_write();
    }

    let deadline = job.timeout.map(|t| started + t);
    loop {
        // Notices first: one written before a rank's exit is seen before that exit, and before
        // the exits of the others it caused.
        let said = notices
            .as_mut()
            .map(|n| n.drain(job.world_size()))
            .unwrap_or_default();
        for Notice { rank, reason, at } in said {
            let pid = ranks.iter().find(|r| r.rank == rank).map_or(0, |r| r.pid);
            if stopping.is_some() {
                if job.verbose {
                    eprintln!("fhrun: rank {rank} (pid {pid}) also failed: {reason}");
                }
                continue;
            }
            eprintln!("fhrun: rank {rank} (pid {pid}) {reason}; stopping the other ranks");
            exit_code = 1;
            stopping = Some(Stopping {
                reason: StopReason::RankNotice(rank),
                term_at: Some(at + NOTICE_WINDOW),
                kill_at: at + NOTICE_WINDOW + job.kill_grace,
                killed: false,
                signalled: false,
            });
        }

        // Reap whatever has ended.
        for r in ranks.iter_mut() {
            let Some(child) = r.child.as_mut() else {
                continue;
            };
            let status = match child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => {
                    // Not expected (only fhrun reaps its children); do not spin on it.
                    eprintln!(
                        "fhrun: cannot wait for {} (pid {}): {e}; no longer watching it",
                        r.label, r.pid
                    );
                    r.child = None;
                    sys::kill_group(r.pid, libc::SIGKILL);
                    continue;
                }
            };
            r.child = None;
            r.control = None;
            if let Some(marker) = &job.report_exits {
                report_exit(marker, r, status);
            }
            // Whatever the rank left running in its process group goes with it.
            sys::kill_group(r.pid, libc::SIGKILL);
            if let Some(g) = guardian.as_mut() {
                g.forget(r.pid);
            }
            if let Some(Stopping {
                reason: StopReason::RankNotice(blamed),
                term_at: Some(_),
                ..
            }) = &stopping
            {
                // The rank that said it fails ended on its own: its status is fhrun's.
                if *blamed == r.rank && !status.success() {
                    exit_code = status_code(status);
                }
            }
            let blame = !status.success() && stopping.is_none();
            if job.verbose && !blame {
                eprintln!("fhrun: {} (pid {}) {}", r.label, r.pid, describe(status));
            }
            if blame {
                eprintln!(
                    "fhrun: {} (pid {}) {}; stopping the other ranks",
                    r.label,
                    r.pid,
                    describe(status)
                );
                exit_code = status_code(status);
                let now = Instant::now();
                stopping = Some(Stopping {
                    reason: StopReason::RankFailed(exit_code),
                    term_at: Some(now + REPORT_WINDOW),
                    kill_at: now + REPORT_WINDOW + job.kill_grace,
                    killed: false,
                    signalled: false,
                });
            }
        }
        if ranks.iter().all(|r| r.child.is_none()) {
            break;
        }

        let now = Instant::now();
        if let Some(s) = stopping.as_mut() {
            if s.term_at.is_some_and(|t| now >= t) {
                s.term_at = None;
                for r in ranks.iter_mut().filter(|r| r.child.is_some()) {
                    r.signal(libc::SIGTERM);
                }
            }
            if !s.killed && now >= s.kill_at {
                for r in ranks.iter().filter(|r| r.child.is_some()) {
                    if job.verbose {
                        eprintln!(
                            "fhrun: {} (pid {}) still running after {:?}; sending SIGKILL",
                            r.label, r.pid, job.kill_grace
                        );
                    }
                    sys::kill_group(r.pid, libc::SIGKILL);
                }
                s.killed = true;
            }
        } else if let Some(d) = deadline {
            if now >= d {
                eprintln!(
                    "fhrun: the job timed out after {:.1} s (--timeout); stopping all ranks",
                    started.elapsed().as_secs_f64()
                );
                exit_code = EXIT_TIMEOUT;
                // First the flight records (and stacks) of the ranks, then SIGTERM.
                for r in ranks.iter_mut().filter(|r| r.child.is_some()) {
                    r.request_record();
                }
                stopping = Some(Stopping {
                    reason: StopReason::Timeout,
                    term_at: Some(now + RECORD_WINDOW),
                    kill_at: now + RECORD_WINDOW + job.kill_grace,
                    killed: false,
                    signalled: false,
                });
            }
        }

        // Sleep until a signal (a child ended, or the user's Ctrl-C) or the next deadline.
        let mut wait = if notices.is_some() {
            NOTICE_POLL
        } else {
            Duration::from_millis(200)
        };
        if let Some(s) = &stopping {
            if let Some(t) = s.term_at {
                wait = wait.min(t.saturating_duration_since(now));
            }
            if !s.killed {
                wait = wait.min(s.kill_at.saturating_duration_since(now));
            }
        } else if let Some(d) = deadline {
            wait = wait.min(d.saturating_duration_since(now));
        }
        let sig = sys::wait_signal(wait.max(Duration::from_millis(1)));
        match sig {
            // Passed on: each rank writes its flight record and prints its stacks.
            Some(libc::SIGUSR1) => {
                for r in ranks.iter_mut().filter(|r| r.child.is_some()) {
                    r.request_record();
                }
                if let Some(tx) = &job.record_requests {
                    let _ = tx.send(());
                }
            }
            // Ctrl-Z: the ranks (in process groups of their own) stop with fhrun.
            // (Remote parts are not stopped: their agent's control channel would stop too.)
            Some(libc::SIGTSTP) => {
                for r in ranks
                    .iter()
                    .filter(|r| r.child.is_some() && r.control.is_none())
                {
                    sys::kill_group(r.pid, libc::SIGTSTP);
                }
                sys::stop_self();
            }
            Some(libc::SIGCONT) => {
                for r in ranks
                    .iter()
                    .filter(|r| r.child.is_some() && r.control.is_none())
                {
                    sys::kill_group(r.pid, libc::SIGCONT);
                }
            }
            _ => {}
        }
        if let Some(sig @ (libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT)) = sig {
            match stopping.as_mut() {
                None => {
                    eprintln!(
                        "fhrun: received {}; stopping all ranks",
                        sys::signal_name(sig)
                    );
                    exit_code = 128 + sig;
                    stopping = Some(begin_stop(
                        &mut ranks,
                        sig,
                        StopReason::Signal(sig),
                        job.kill_grace,
                    ));
                }
                Some(s) if !s.signalled && !matches!(s.reason, StopReason::Signal(_)) => {
                    // The first signal while a failure stops the job (an elastic driver
                    // stopping this part as a worker of it failed, or a user's Ctrl-C): the
                    // pending SIGTERM goes out now, with the whole grace before SIGKILL. Only
                    // a second signal ends the patience.
                    let now = Instant::now();
                    if s.term_at.is_some() {
                        s.term_at = Some(now);
                    }
                    if !s.killed {
                        s.kill_at = s.kill_at.max(now + job.kill_grace);
                    }
                    s.signalled = true;
                }
                Some(s) => {
                    // A second request: no more patience.
                    if !s.killed {
                        eprintln!(
                            "fhrun: received {} again; killing all ranks",
                            sys::signal_name(sig)
                        );
                        s.term_at = None;
                        s.kill_at = Instant::now();
                    }
                }
            }
        }
    }

    // Let the output threads drain what the ranks wrote; bounded, in case some process outside
    // the ranks' process groups still holds a pipe open.
    let drain_deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        let left = drain_deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    if let Some(s) = &stopping {
        if job.verbose {
            let why = match s.reason {
                StopReason::RankFailed(code) => format!("a rank failed; exit status {code}"),
                StopReason::RankNotice(rank) => {
                    format!("rank {rank} failed; exit status {exit_code}")
                }
                StopReason::Signal(sig) => format!("fhrun received {}", sys::signal_name(sig)),
                StopReason::Timeout => "timed out".to_string(),
            };
            eprintln!("fhrun: all ranks stopped ({why})");
        }
    }
    exit_code
}

fn begin_stop(ranks: &mut [Rank], sig: i32, reason: StopReason, grace: Duration) -> Stopping {
    for r in ranks.iter_mut().filter(|r| r.child.is_some()) {
        r.signal(sig);
    }
    Stopping {
        reason,
        term_at: None,
        kill_at: Instant::now() + grace,
        killed: false,
        signalled: false,
    }
}
