//! The loop that watches a running job: it starts the ranks and the other hosts' parts,
//! takes the ranks' notices, reaps their ends, stops the job when one fails, times out or
//! fhrun gets a signal (SIGTERM after a window for the others to report, SIGKILL after the
//! grace), and passes signals on.

use std::io::Write;
use std::process::{Child, ChildStdin};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::process::{report_exit, spawn_rank, stop_group};
use super::{
    describe, spawn_output, spawn_pump, spawn_remote, status_code, LocalJob, RankSpec, RemoteSpec,
    EXIT_TIMEOUT, RECORD_WINDOW,
};
use crate::guardian::Guardian;
use crate::notice::{Notice, NoticeChannel};
use crate::output::Sink;
use crate::sys;

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

/// The longest fhrun sleeps between two looks at the notice pipe (a SIGCHLD or a signal for
/// fhrun wakes it earlier).
const NOTICE_POLL: Duration = Duration::from_millis(50);

pub(super) struct Rank {
    pub(super) rank: usize,
    /// `rank N`, or a remote part's label.
    pub(super) label: String,
    pub(super) pid: u32,
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

impl Stopping {
    /// The stop after a rank failed with `code` (or could not start): the others get
    /// [`REPORT_WINDOW`] to notice and say so, then SIGTERM, then SIGKILL after `grace`.
    fn after_failure(code: i32, grace: Duration) -> Stopping {
        let now = Instant::now();
        Stopping {
            reason: StopReason::RankFailed(code),
            term_at: Some(now + REPORT_WINDOW),
            kill_at: now + REPORT_WINDOW + grace,
            killed: false,
            signalled: false,
        }
    }
}

/// A job while it runs: its ranks and parts, and how far its stop has gone.
struct Running<'a> {
    job: &'a LocalJob,
    guardian: Option<&'a mut Guardian>,
    notices: Option<NoticeChannel>,
    ranks: Vec<Rank>,
    stopping: Option<Stopping>,
    exit_code: i32,
    /// Output threads started (each says when it is done).
    pumps: usize,
    started: Instant,
}

/// Runs the job's ranks and parts until every one has ended; returns fhrun's exit status.
pub(super) fn run_ranks(
    job: &LocalJob,
    guardian: Option<&mut Guardian>,
    notices: Option<NoticeChannel>,
) -> i32 {
    let mut run = Running {
        job,
        guardian,
        notices,
        ranks: Vec::with_capacity(job.ranks.len()),
        stopping: None,
        exit_code: 0,
        pumps: 0,
        started: Instant::now(),
    };
    let (done_tx, done_rx) = mpsc::channel::<()>();
    run.start(&done_tx);
    drop(done_tx);
    // Only the ranks write notices: fhrun's copy of the write end goes.
    if let Some(n) = run.notices.as_mut() {
        n.close_write();
    }
    let deadline = job.timeout.map(|t| run.started + t);
    loop {
        // Notices first: one written before a rank's exit is seen before that exit, and before
        // the exits of the others it caused.
        run.take_notices();
        run.reap();
        if run.ranks.iter().all(|r| r.child.is_none()) {
            break;
        }
        let now = Instant::now();
        run.advance(now, deadline);
        // Sleep until a signal (a child ended, or the user's Ctrl-C) or the next deadline.
        let sig = sys::wait_signal(run.sleep_for(now, deadline));
        run.on_signal(sig);
    }
    run.drain(&done_rx);
    run.exit_code
}

impl Running<'_> {
    /// Starts the local ranks, then the other hosts' parts; the first that cannot start stops
    /// the job (with the later ones not started).
    fn start(&mut self, done_tx: &mpsc::Sender<()>) {
        let job = self.job;
        for spec in &job.ranks {
            if let Err(e) = self.start_rank(spec, done_tx) {
                eprintln!(
                    "fhrun: cannot start {} (`{}`): {e}",
                    spec.label(),
                    job.command[0]
                );
                self.exit_code = match e.kind() {
                    std::io::ErrorKind::NotFound => 127,
                    std::io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                self.stopping = Some(Stopping::after_failure(self.exit_code, job.kill_grace));
                return;
            }
        }
        for spec in &job.remotes {
            if let Err(e) = self.start_remote(spec, done_tx) {
                eprintln!(
                    "fhrun: cannot start {} (`{}`): {e}",
                    spec.label, spec.argv[0]
                );
                self.exit_code = 1;
                self.stopping = Some(Stopping::after_failure(1, job.kill_grace));
                return;
            }
        }
    }

    /// Starts one local rank, its output prefixed with its name.
    fn start_rank(&mut self, spec: &RankSpec, done_tx: &mpsc::Sender<()>) -> std::io::Result<()> {
        let mut child = spawn_rank(self.job, spec, self.notices.as_ref())?;
        let pid = child.id();
        if let Some(g) = self.guardian.as_mut() {
            g.watch(pid);
        }
        if self.job.verbose {
            eprintln!("fhrun: started {} (pid {pid})", spec.label());
        }
        for (src, sink) in outputs(&mut child) {
            let name = match sink {
                Sink::Stdout => "stdout",
                Sink::Stderr => "stderr",
            };
            let prefix = format!("[{}]<{name}>:", spec.name());
            let thread = format!("rank{}-{name}", spec.name());
            if spawn_pump(thread, src, sink, prefix, done_tx, &spec.label()) {
                self.pumps += 1;
            }
        }
        self.ranks.push(Rank {
            rank: spec.rank,
            label: spec.label(),
            pid,
            child: Some(child),
            control: None,
        });
        Ok(())
    }

    /// Starts another host's part: its output as it is, its files taken out of its stdout
    /// when the job gathers them.
    fn start_remote(
        &mut self,
        spec: &RemoteSpec,
        done_tx: &mpsc::Sender<()>,
    ) -> std::io::Result<()> {
        let (mut child, control) = spawn_remote(spec)?;
        let pid = child.id();
        if let Some(g) = self.guardian.as_mut() {
            g.watch(pid);
        }
        if self.job.verbose {
            eprintln!("fhrun: started {} (agent pid {pid})", spec.label);
        }
        for (src, sink) in outputs(&mut child) {
            let thread = "remote-output".to_string();
            let started = match (&spec.gather, sink) {
                (Some(g), Sink::Stdout) => {
                    let (g, who) = (g.clone(), spec.label.clone());
                    spawn_output(thread, done_tx, &spec.label, move || {
                        crate::gather::relay(src, std::io::stdout(), &g, &who)
                    })
                }
                _ => spawn_pump(thread, src, sink, String::new(), done_tx, &spec.label),
            };
            if started {
                self.pumps += 1;
            }
        }
        self.ranks.push(Rank {
            rank: usize::MAX,
            label: spec.label.clone(),
            pid,
            child: Some(child),
            control: Some(control),
        });
        Ok(())
    }

    /// Takes the ranks' notices: the first one stops the job, blaming its rank.
    fn take_notices(&mut self) {
        let size = self.job.world_size();
        let said = self
            .notices
            .as_mut()
            .map(|n| n.drain(size))
            .unwrap_or_default();
        for Notice { rank, reason, at } in said {
            let pid = self
                .ranks
                .iter()
                .find(|r| r.rank == rank)
                .map_or(0, |r| r.pid);
            if self.stopping.is_some() {
                if self.job.verbose {
                    eprintln!("fhrun: rank {rank} (pid {pid}) also failed: {reason}");
                }
                continue;
            }
            eprintln!("fhrun: rank {rank} (pid {pid}) {reason}; stopping the other ranks");
            self.exit_code = 1;
            self.stopping = Some(Stopping {
                reason: StopReason::RankNotice(rank),
                term_at: Some(at + NOTICE_WINDOW),
                kill_at: at + NOTICE_WINDOW + self.job.kill_grace,
                killed: false,
                signalled: false,
            });
        }
    }

    /// Reaps whatever has ended; the first failure stops the job, blaming it.
    fn reap(&mut self) {
        let job = self.job;
        for r in self.ranks.iter_mut() {
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
            if let Some(g) = self.guardian.as_mut() {
                g.forget(r.pid);
            }
            if let Some(Stopping {
                reason: StopReason::RankNotice(blamed),
                term_at: Some(_),
                ..
            }) = &self.stopping
            {
                // The rank that said it fails ended on its own: its status is fhrun's.
                if *blamed == r.rank && !status.success() {
                    self.exit_code = status_code(status);
                }
            }
            let blame = !status.success() && self.stopping.is_none();
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
                self.exit_code = status_code(status);
                self.stopping = Some(Stopping::after_failure(self.exit_code, job.kill_grace));
            }
        }
    }

    /// Moves a stop on (SIGTERM, then SIGKILL, when their times come), or starts one at the
    /// `--timeout` deadline (the ranks' flight records first).
    fn advance(&mut self, now: Instant, deadline: Option<Instant>) {
        let job = self.job;
        if let Some(s) = self.stopping.as_mut() {
            if s.term_at.is_some_and(|t| now >= t) {
                s.term_at = None;
                for r in self.ranks.iter_mut().filter(|r| r.child.is_some()) {
                    r.signal(libc::SIGTERM);
                }
            }
            if !s.killed && now >= s.kill_at {
                for r in self.ranks.iter().filter(|r| r.child.is_some()) {
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
        } else if deadline.is_some_and(|d| now >= d) {
            eprintln!(
                "fhrun: the job timed out after {:.1} s (--timeout); stopping all ranks",
                self.started.elapsed().as_secs_f64()
            );
            self.exit_code = EXIT_TIMEOUT;
            // First the flight records (and stacks) of the ranks, then SIGTERM.
            for r in self.ranks.iter_mut().filter(|r| r.child.is_some()) {
                r.request_record();
            }
            self.stopping = Some(Stopping {
                reason: StopReason::Timeout,
                term_at: Some(now + RECORD_WINDOW),
                kill_at: now + RECORD_WINDOW + job.kill_grace,
                killed: false,
                signalled: false,
            });
        }
    }

    /// How long to sleep: until the next look at the notices, or the stop's or the timeout's
    /// next step.
    fn sleep_for(&self, now: Instant, deadline: Option<Instant>) -> Duration {
        let mut wait = if self.notices.is_some() {
            NOTICE_POLL
        } else {
            Duration::from_millis(200)
        };
        if let Some(s) = &self.stopping {
            if let Some(t) = s.term_at {
                wait = wait.min(t.saturating_duration_since(now));
            }
            if !s.killed {
                wait = wait.min(s.kill_at.saturating_duration_since(now));
            }
        } else if let Some(d) = deadline {
            wait = wait.min(d.saturating_duration_since(now));
        }
        wait.max(Duration::from_millis(1))
    }

    /// Acts on a signal fhrun received: passes SIGUSR1, Ctrl-Z and SIGCONT on; a stopping
    /// signal stops the job, and a second one kills it.
    fn on_signal(&mut self, sig: Option<i32>) {
        let job = self.job;
        match sig {
            // Passed on: each rank writes its flight record and prints its stacks.
            Some(libc::SIGUSR1) => {
                for r in self.ranks.iter_mut().filter(|r| r.child.is_some()) {
                    r.request_record();
                }
                if let Some(tx) = &job.record_requests {
                    let _ = tx.send(());
                }
            }
            // Ctrl-Z: the ranks (in process groups of their own) stop with fhrun.
            // (Remote parts are not stopped: their agent's control channel would stop too.)
            Some(libc::SIGTSTP) => {
                for r in self.local_running() {
                    sys::kill_group(r.pid, libc::SIGTSTP);
                }
                sys::stop_self();
            }
            Some(libc::SIGCONT) => {
                for r in self.local_running() {
                    sys::kill_group(r.pid, libc::SIGCONT);
                }
            }
            Some(sig @ (libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT)) => {
                self.on_stop_signal(sig)
            }
            _ => {}
        }
    }

    /// The local ranks still running (not the remote parts).
    fn local_running(&self) -> impl Iterator<Item = &Rank> {
        self.ranks
            .iter()
            .filter(|r| r.child.is_some() && r.control.is_none())
    }

    fn on_stop_signal(&mut self, sig: i32) {
        let grace = self.job.kill_grace;
        match self.stopping.as_mut() {
            None => {
                eprintln!(
                    "fhrun: received {}; stopping all ranks",
                    sys::signal_name(sig)
                );
                self.exit_code = 128 + sig;
                self.stopping = Some(begin_stop(
                    &mut self.ranks,
                    sig,
                    StopReason::Signal(sig),
                    grace,
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
                    s.kill_at = s.kill_at.max(now + grace);
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

    /// Lets the output threads drain what the ranks wrote; bounded, in case some process
    /// outside the ranks' process groups still holds a pipe open.
    fn drain(&self, done_rx: &mpsc::Receiver<()>) {
        let drain_deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..self.pumps {
            let left = drain_deadline.saturating_duration_since(Instant::now());
            if done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        if let (Some(s), true) = (&self.stopping, self.job.verbose) {
            let why = match s.reason {
                StopReason::RankFailed(code) => format!("a rank failed; exit status {code}"),
                StopReason::RankNotice(rank) => {
                    format!("rank {rank} failed; exit status {}", self.exit_code)
                }
                StopReason::Signal(sig) => format!("fhrun received {}", sys::signal_name(sig)),
                StopReason::Timeout => "timed out".to_string(),
            };
            eprintln!("fhrun: all ranks stopped ({why})");
        }
    }
}

/// A child's stdout and stderr, each with where its lines go.
fn outputs(child: &mut Child) -> impl Iterator<Item = (Box<dyn std::io::Read + Send>, Sink)> {
    let out = child
        .stdout
        .take()
        .map(|s| (Box::new(s) as _, Sink::Stdout));
    let err = child
        .stderr
        .take()
        .map(|s| (Box::new(s) as _, Sink::Stderr));
    out.into_iter().chain(err)
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
