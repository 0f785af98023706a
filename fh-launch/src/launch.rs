//! Running a job's ranks on this machine: spawn, prefix output, watch, fail fast, forward
//! signals, reap everything.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::guardian::Guardian;
use crate::notice::NoticeChannel;
use crate::sys;

mod process;
mod watch;

pub(crate) use process::{describe, spawn_output, spawn_pump, spawn_remote, status_code};
use watch::{run_ranks, Rank};

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

/// At `--timeout`, how long the ranks have to write their flight records (fhrun sends them
/// `SIGUSR1` first) before fhrun sends them SIGTERM.
pub(crate) const RECORD_WINDOW: Duration = Duration::from_millis(1000);

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
