//! Ranks on other hosts without MPI: fhrun starts, through an rsh agent (`ssh` by default;
//! `--rsh-agent` or `FH_RSH_AGENT`), one *remote part* per other host — fhrun itself on that
//! host, run as `fhrun --internal-fhrun-remote` — which starts that host's ranks with the
//! machinery of a local job (process groups, a guardian, prefixed output, notices, fail fast).
//!
//! Nothing secret is on a command line: the remote part's command line is only the path of
//! fhrun and [`REMOTE_ARG`]; everything else — the working directory, the ranks, the command,
//! and the ranks' environment with the job token (each rank's launch variables written by
//! fhrun with [`fh_job::LaunchInfo::to_vars`]) — goes in a [`Part`] over the agent's stdin,
//! which then stays open as a control channel: a line `signal N` makes the remote part send
//! signal N to its ranks (fhrun forwards SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1 that
//! way), and the end of stdin — the agent gone because fhrun stopped it or died (fhrun's
//! guardian kills the agent's process group) — makes it stop its ranks (SIGTERM, then SIGKILL
//! after the grace).
//! When its ranks have ended, the remote part sends back on its stdout the flight records and
//! timelines they wrote (into a directory of its own on its host: [`crate::gather`]), which
//! fhrun keeps in its job directory with its own ranks'; and while they run, a moment after
//! each `SIGUSR1` it passed on to them, the flight records they wrote (so that fhrun has every
//! host's records of a stuck job).
//! The remote part exits with its job's status, which the agent returns to fhrun; a failure
//! there stops the whole job (fail fast across hosts).
//!
//! fhrun must be at the same path on every host (as Horovod's launcher assumes of Python).

use std::io::{BufRead, Read};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::gather::{self, PartDir};
use crate::launch::{self, LocalJob, RankSpec};
use crate::{observe, sys};

/// The hidden first argument that makes fhrun act as a remote part.
pub const REMOTE_ARG: &str = "--internal-fhrun-remote";

/// Variables of fhrun's own environment that the remote ranks get too (besides the `FH_*`
/// ones fhrun sets and the ones named with `-x`), so that a command found here is found there.
pub const FORWARDED_VARS: &[&str] = &["PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV"];

/// What a remote part runs: sent on the agent's stdin, one `key value` line each, ended by
/// `go`. Values are escaped (`\\` and `\n`), so any value fits on a line. The first line is
/// `version RELEASE`, the sending fhrun's release: a remote part of another release refuses
/// the job, naming both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Directory the ranks start in.
    pub cwd: String,
    /// The ranks' command and its arguments.
    pub command: Vec<String>,
    /// Variables every rank of the part gets.
    pub env: Vec<(String, String)>,
    /// The global ranks of this part (their launch variables are in [`Part::own_env`]).
    pub ranks: Vec<usize>,
    /// An elastic part's workers instead of ranks: their ids (`host:slot`), each given as
    /// `FH_ELASTIC_WORKER` and used as its output prefix; no `FH_RANK`/`FH_LOCAL_RANK` (an
    /// elastic worker's rank comes from its driver, per generation).
    pub workers: Vec<String>,
    /// Variables of one rank or elastic worker only: `(index in ranks or workers, name,
    /// value)`: a rank's launch variables (`FH_RANK`, `FH_LOCAL_RANK`, ..., as
    /// [`fh_job::LaunchInfo::to_vars`] writes them), an elastic worker's Horovod launch
    /// variables of its slot.
    pub own_env: Vec<(usize, String, String)>,
    /// The marker of the lines that report each rank's end on stdout
    /// ([`LocalJob::report_exits`]); elastic parts only.
    pub report: Option<String>,
    /// The marker under which the part sends back its ranks' files ([`crate::gather`]): it
    /// gives them a directory of its own for each of `gather_dirs` in place of fhrun's.
    pub gather: Option<String>,
    /// What it gathers: `flight` (the ranks' `FH_FLIGHT_DIR`) and `timeline` (their
    /// `FH_TIMELINE`, a file per rank).
    pub gather_dirs: Vec<String>,
    /// Prefix output lines with the rank.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
    /// Say more.
    pub verbose: bool,
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            other => return Err(format!("bad escape \\{other:?} in {s:?}")),
        }
    }
    Ok(out)
}

impl Part {
    /// The text sent on the agent's stdin (ends with `go`).
    pub fn encode(&self) -> String {
        let mut t = format!("version {}\n", fh_core::RELEASE);
        t += &format!("cwd {}\n", escape(&self.cwd));
        for a in &self.command {
            t += &format!("arg {}\n", escape(a));
        }
        for (k, v) in &self.env {
            t += &format!("env {}={}\n", escape(k), escape(v));
        }
        for r in &self.ranks {
            t += &format!("rank {r}\n");
        }
        for w in &self.workers {
            t += &format!("worker {}\n", escape(w));
        }
        for (i, k, v) in &self.own_env {
            t += &format!("own {i} {}={}\n", escape(k), escape(v));
        }
        if let Some(m) = &self.report {
            t += &format!("report {}\n", escape(m));
        }
        if let Some(m) = &self.gather {
            t += &format!("gather {}\n", escape(m));
        }
        for d in &self.gather_dirs {
            t += &format!("gather_dir {}\n", escape(d));
        }
        t += &format!(
            "prefix {}\ngrace_ms {}\nverbose {}\ngo\n",
            u8::from(self.prefix),
            self.kill_grace.as_millis(),
            u8::from(self.verbose)
        );
        t
    }

    /// Reads a part from `input` up to its `go` line; a part from an fhrun of another release
    /// is an error naming both.
    pub fn decode(input: &mut impl BufRead) -> Result<Part, String> {
        let mut part = Part {
            cwd: String::new(),
            command: Vec::new(),
            env: Vec::new(),
            ranks: Vec::new(),
            workers: Vec::new(),
            own_env: Vec::new(),
            report: None,
            gather: None,
            gather_dirs: Vec::new(),
            prefix: true,
            kill_grace: Duration::from_secs(2),
            verbose: false,
        };
        let mut line = String::new();
        let mut first = true;
        loop {
            line.clear();
            let n = input
                .read_line(&mut line)
                .map_err(|e| format!("reading the job from stdin: {e}"))?;
            if n == 0 {
                return Err("stdin ended before the job was complete (no `go`)".into());
            }
            let l = line.trim_end_matches('\n');
            if std::mem::take(&mut first) {
                check_release(l)?;
                continue;
            }
            if l == "go" {
                break;
            }
            let (key, value) = l.split_once(' ').unwrap_or((l, ""));
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| format!("`{key}` wants a number, not {v:?}"))
            };
            match key {
                "cwd" => part.cwd = unescape(value)?,
                "arg" => part.command.push(unescape(value)?),
                "env" => {
                    let (k, v) = value
                        .split_once('=')
                        .ok_or_else(|| format!("`env` wants NAME=VALUE, not {value:?}"))?;
                    part.env.push((unescape(k)?, unescape(v)?));
                }
                "rank" => part.ranks.push(num(value)? as usize),
                "worker" => part.workers.push(unescape(value)?),
                "own" => {
                    let (i, kv) = value
                        .split_once(' ')
                        .ok_or_else(|| format!("`own` wants INDEX NAME=VALUE, not {value:?}"))?;
                    let (k, v) = kv
                        .split_once('=')
                        .ok_or_else(|| format!("`own` wants INDEX NAME=VALUE, not {value:?}"))?;
                    part.own_env
                        .push((num(i)? as usize, unescape(k)?, unescape(v)?));
                }
                "report" => part.report = Some(unescape(value)?),
                "gather" => part.gather = Some(unescape(value)?),
                "gather_dir" if crate::gather::DIRS.contains(&value) => {
                    part.gather_dirs.push(value.to_string())
                }
                "gather_dir" => {
                    return Err(format!("`gather_dir` names no known directory: {value:?}"))
                }
                "prefix" => part.prefix = num(value)? != 0,
                "grace_ms" => part.kill_grace = Duration::from_millis(num(value)?),
                "verbose" => part.verbose = num(value)? != 0,
                other => return Err(format!("unknown line `{other}` in the job")),
            }
        }
        let members = part.ranks.len().max(part.workers.len());
        if let Some((i, k, _)) = part.own_env.iter().find(|(i, ..)| *i >= members) {
            return Err(format!(
                "`own {i} {k}=…` names rank or worker {i}, but the job has {members}"
            ));
        }
        if part.command.is_empty() || part.ranks.is_empty() == part.workers.is_empty() {
            return Err(
                "the job names no command, or not exactly one of ranks and elastic workers".into(),
            );
        }
        Ok(part)
    }

    /// The local job this part runs: each rank with its launch variables first, then the
    /// part's (so that what the user gave with `-x` wins, as on fhrun's own host); or each
    /// elastic worker with the part's variables, its own, and its `FH_ELASTIC_WORKER` (and no
    /// rank variable).
    pub fn job(&self) -> LocalJob {
        let own = |i: usize| {
            self.own_env
                .iter()
                .filter(move |(j, ..)| *j == i)
                .map(|(_, k, v)| (k.clone(), v.clone()))
        };
        let workers = self.workers.iter().enumerate().map(|(i, w)| {
            let mut env = self.env.clone();
            env.extend(own(i));
            env.push((fh_job::elastic::WORKER_VAR.into(), w.clone()));
            RankSpec {
                rank: i,
                env,
                tag: Some(w.clone()),
            }
        });
        let ranks = self
            .ranks
            .iter()
            .enumerate()
            .map(|(local, &rank)| {
                let mut env: Vec<(String, String)> = own(local).collect();
                env.extend(self.env.iter().cloned());
                RankSpec {
                    rank,
                    env,
                    tag: None,
                }
            })
            .chain(workers)
            .collect();
        LocalJob {
            command: self.command.clone(),
            ranks,
            remotes: Vec::new(),
            prefix: self.prefix,
            kill_grace: self.kill_grace,
            timeout: None,
            verbose: self.verbose,
            report_exits: self.report.clone(),
            record_requests: None,
        }
    }
}

/// The first line of a job: the sending fhrun's release, which must be this one's.
fn check_release(line: &str) -> Result<(), String> {
    let mine = fh_core::RELEASE;
    match line.strip_prefix("version ") {
        Some(theirs) if theirs == mine => Ok(()),
        Some(theirs) => Err(format!(
            "this host's fhrun is FastHorovod {mine}, but the fhrun that sent the job is \
             FastHorovod {theirs}: install the same FastHorovod version on every host (fhrun \
             must be at the same path on each)"
        )),
        None => Err(format!(
            "the job does not start with the sending fhrun's version: that fhrun is older than \
             this host's, FastHorovod {mine}; install the same FastHorovod version on every host"
        )),
    }
}

/// The remote part's side: read the job, run it, obey the control channel.
pub fn serve() -> i32 {
    // Blocked before any thread starts, so that the control thread's signals to this process
    // are taken by the job's loop (launch::run blocks them too; doing it twice is harmless).
    if let Err(e) = sys::block_handled_signals() {
        eprintln!("fhrun (remote part): cannot set up signal handling: {e}");
        return 1;
    }
    let mut stdin = std::io::BufReader::new(std::io::stdin());
    let part = match Part::decode(&mut stdin) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "fhrun (remote part on {}): {e}",
                crate::hosts::this_hostname()
            );
            return 1;
        }
    };
    if let Err(e) = std::env::set_current_dir(&part.cwd) {
        eprintln!(
            "fhrun (remote part on {}): cannot change to {}: {e} (the ranks start in the \
             directory fhrun was started in, which must exist on every host)",
            crate::hosts::this_hostname(),
            part.cwd
        );
        return 1;
    }
    let control = std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            let me = std::process::id();
            let mut line = String::new();
            loop {
                line.clear();
                match stdin.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if let Some(sig) = line
                            .trim()
                            .strip_prefix("signal ")
                            .and_then(|s| s.parse::<i32>().ok())
                        {
                            sys::kill_pid(me, sig);
                        }
                    }
                }
            }
            // fhrun (or its agent) is gone: stop the ranks as on SIGTERM.
            sys::kill_pid(me, libc::SIGTERM);
            let _ = stdin.read(&mut [0u8; 1]);
        });
    if let Err(e) = control {
        eprintln!("fhrun (remote part): cannot start the control thread: {e}");
        return 1;
    }
    let who = format!("fhrun (remote part on {})", crate::hosts::this_hostname());
    let mut part = part;
    let dir = part
        .gather
        .is_some()
        .then(|| gather_here(&mut part, &who))
        .flatten();
    let dir = Arc::new(Mutex::new(dir));
    let mut job = part.job();
    if let Some(marker) = &part.gather {
        let window = launch::RECORD_WINDOW;
        job.record_requests =
            gather::send_on_request(dir.clone(), marker.clone(), who.clone(), window);
    }
    let code = launch::run(&job);
    // The last send (a line at a time: the output of whatever the ranks left running goes on).
    let last = dir.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let (Some(dir), Some(marker)) = (last, &part.gather) {
        dir.send_and_remove(marker, &mut std::io::stdout(), &who);
    }
    code
}

/// A directory of the part's own on this host for its ranks' flight records and timelines
/// (fhrun's job directory is on fhrun's host), their variables pointed there.
fn gather_here(part: &mut Part, who: &str) -> Option<PartDir> {
    match PartDir::create(&part.gather_dirs) {
        Ok(dir) => {
            // An elastic part's workers (which report their ends) write per generation.
            let elastic = part.report.is_some();
            let vars = observe::rank_vars(dir.dir("flight"), dir.dir("timeline"), elastic);
            part.env.retain(|(k, _)| !vars.iter().any(|(v, _)| v == k));
            part.env.extend(vars);
            Some(dir)
        }
        Err(e) => {
            eprintln!(
                "{who}: warning: cannot make a directory under {} for the ranks' flight \
                 records and timelines ({e}); they stay on this host",
                std::env::temp_dir().display()
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef";

    /// Where the part's `local`-th rank sits: ranks 4-6 of 7, on the second of two hosts.
    fn place(local: usize) -> fh_job::Topology {
        fh_job::Topology {
            rank: 4 + local,
            size: 7,
            local_rank: local,
            local_size: 3,
            cross_rank: 1,
            cross_size: 2,
        }
    }

    fn part() -> Part {
        Part {
            cwd: "/work/a dir".into(),
            command: vec!["python".into(), "-c".into(), "print('a\\nb')\nx".into()],
            env: vec![
                ("PATH".into(), "/opt/bin".into()),
                ("ODD".into(), "a=b\\c\nd".into()),
            ],
            ranks: vec![4, 5, 6],
            workers: Vec::new(),
            own_env: (0..3)
                .flat_map(|local| {
                    fh_job::LaunchInfo::for_rank(
                        place(local),
                        "node0:29500",
                        fh_job::JobToken::new(TOKEN),
                    )
                    .to_vars()
                    .into_iter()
                    .map(move |(k, v)| (local, k.to_string(), v))
                })
                .collect(),
            report: None,
            gather: Some("fhrun-files-abc".into()),
            gather_dirs: vec!["flight".into(), "timeline".into()],
            prefix: false,
            kill_grace: Duration::from_millis(1500),
            verbose: true,
        }
    }

    #[test]
    fn a_part_survives_the_trip() {
        let p = part();
        let text = p.encode();
        let mut input = std::io::Cursor::new(format!("{text}signal 2\n"));
        assert_eq!(Part::decode(&mut input).unwrap(), p);
        // The control channel's lines are left for the control thread.
        let mut rest = String::new();
        input.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "signal 2\n");
    }

    #[test]
    fn every_value_is_on_one_line() {
        let p = part();
        let text = p.encode();
        // The gather marker and its two directories: 3 more lines.
        assert_eq!(
            text.lines().count(),
            1 + 1 + 3 + 2 + 3 + p.own_env.len() + 3 + 3 + 1
        );
        assert!(text.contains("env ODD=a=b\\\\c\\nd\n"));
    }

    /// A rank's environment, last value of each name.
    fn env_of(job: &LocalJob, i: usize) -> impl Fn(&str) -> Option<String> + '_ {
        move |k| {
            job.ranks[i]
                .env
                .iter()
                .rev()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn ranks_get_their_global_and_local_numbers() {
        let job = part().job();
        let ranks: Vec<usize> = job.ranks.iter().map(|r| r.rank).collect();
        assert_eq!(ranks, [4, 5, 6]);
        assert_eq!(env_of(&job, 2)("FH_RANK").as_deref(), Some("6"));
        assert_eq!(env_of(&job, 2)("FH_LOCAL_RANK").as_deref(), Some("2"));
        assert_eq!(env_of(&job, 0)("FH_JOB_TOKEN").as_deref(), Some(TOKEN));
        assert_eq!(env_of(&job, 0)("PATH").as_deref(), Some("/opt/bin"));
        // What each rank reads is the launch fhrun wrote for it, and no other rank's.
        for local in 0..3 {
            let info = fh_job::LaunchInfo::from_vars(env_of(&job, local)).unwrap();
            assert_eq!(info.topology(), place(local));
            assert_eq!(info.launcher, fh_job::launch::Launcher::Fhrun);
            assert_eq!(info.rendezvous.as_deref(), Some("node0:29500"));
            assert_eq!(info.token.as_ref().map(|t| t.expose()), Some(TOKEN));
        }
    }

    #[test]
    fn what_every_rank_gets_wins_over_a_ranks_launch_variables() {
        // A token the user gives with `-x` replaces fhrun's, as on fhrun's own host.
        let mut p = part();
        p.env
            .push(("FH_JOB_TOKEN".into(), "the-users-own-token-0123".into()));
        let job = p.job();
        for local in 0..3 {
            assert_eq!(
                env_of(&job, local)("FH_JOB_TOKEN").as_deref(),
                Some("the-users-own-token-0123")
            );
        }
    }

    #[test]
    fn an_elastic_part_names_workers_not_ranks() {
        let mut p = part();
        p.ranks.clear();
        p.workers = vec!["h1:0".into(), "h1:1".into()];
        p.own_env = vec![
            (0, "HOROVOD_RANK".into(), "2".into()),
            (1, "HOROVOD_RANK".into(), "3".into()),
            (1, "ODD".into(), "x=\ny".into()),
        ];
        p.report = Some("fhrun-exit-abc".into());
        let text = p.encode();
        assert_eq!(Part::decode(&mut std::io::Cursor::new(text)).unwrap(), p);
        let job = p.job();
        assert_eq!(job.report_exits.as_deref(), Some("fhrun-exit-abc"));
        let env = &job.ranks[1].env;
        let get = |k: &str| {
            env.iter()
                .rev()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("FH_ELASTIC_WORKER"), Some("h1:1"));
        assert_eq!(get("HOROVOD_RANK"), Some("3"));
        assert_eq!(get("ODD"), Some("x=\ny"));
        let first = &job.ranks[0].env;
        assert!(first.contains(&("HOROVOD_RANK".into(), "2".into())));
        assert!(!first.iter().any(|(k, _)| k == "MINE"));
        assert_eq!(get("FH_RANK"), None);
        assert_eq!(get("FH_LOCAL_RANK"), None);
        assert_eq!(job.ranks[1].tag.as_deref(), Some("h1:1"));
    }

    #[test]
    fn broken_input_is_an_error() {
        for (text, wanted) in [
            ("cwd /\narg x\nrank 0\n", "no `go`"),
            ("cwd /\ngo\n", "no command"),
            ("cwd /\narg x\nrank 0\nworker h:0\ngo\n", "exactly one"),
            (
                "cwd /\narg x\nworker h:0\nown 1 A=b\ngo\n",
                "names rank or worker 1",
            ),
            (
                "cwd /\narg x\nrank 0\nown 1 A=b\ngo\n",
                "names rank or worker 1",
            ),
            (
                "cwd /\narg x\nworker h:0\nown 0 A\ngo\n",
                "INDEX NAME=VALUE",
            ),
            ("cwd /\narg x\nrank zero\ngo\n", "wants a number"),
            ("bogus 1\ngo\n", "unknown line `bogus`"),
            ("env NOEQUALS\ngo\n", "NAME=VALUE"),
            ("gather_dir ../etc\ngo\n", "no known directory"),
        ] {
            let text = format!("version {}\n{text}", fh_core::RELEASE);
            let err = Part::decode(&mut std::io::Cursor::new(&text)).unwrap_err();
            assert!(err.contains(wanted), "{text:?}: {err}");
        }
    }

    #[test]
    fn a_job_from_an_fhrun_of_another_release_is_refused_naming_both() {
        let text = part().encode();
        assert!(text.starts_with(&format!("version {}\n", fh_core::RELEASE)));
        let other = text.replacen(fh_core::RELEASE, "0.0.1-other", 1);
        let err = Part::decode(&mut std::io::Cursor::new(other)).unwrap_err();
        assert!(
            err.contains(&format!(
                "this host's fhrun is FastHorovod {}",
                fh_core::RELEASE
            )),
            "{err}"
        );
        assert!(
            err.contains("sent the job is FastHorovod 0.0.1-other"),
            "{err}"
        );
        // An older fhrun's job starts without the line.
        let older = text.split_once('\n').unwrap().1;
        let err = Part::decode(&mut std::io::Cursor::new(older)).unwrap_err();
        assert!(err.contains("older than this host's"), "{err}");
    }
}
