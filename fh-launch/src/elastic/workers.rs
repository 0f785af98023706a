//! A host's workers as one *part*: `fhrun --internal-fhrun-remote` on that host (through the
//! rsh agent, exactly as a non-elastic job's other hosts; for this machine the same child
//! process started directly), with the part's job on its stdin, which stays open as the
//! control channel. The part reports each worker's end on its stdout under a random marker
//! ([`crate::launch::LocalJob::report_exits`]); every other line is the workers' output.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::launch::{self, RemoteSpec};
use crate::mpi::shell_quote;
use crate::output::{pump, Sink};
use crate::remote::{Part, REMOTE_ARG};
use crate::sys;

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Exited with this code.
    Exit(i32),
    /// Killed by this signal.
    Signal(i32),
    /// Its part ended without reporting it.
    PartGone,
}

impl End {
    /// Whether this is a clean end (exit 0).
    pub fn success(self) -> bool {
        self == End::Exit(0)
    }

    /// `killed by SIGKILL`, `exited with code 3`.
    pub fn describe(self) -> String {
        match self {
            End::Exit(c) => format!("exited with code {c}"),
            End::Signal(s) => format!("killed by {}", sys::signal_name(s)),
            End::PartGone => "ended with its host's part".into(),
        }
    }
}

/// A worker's end, read from its part's stdout.
#[derive(Debug, Clone)]
pub struct Exit {
    /// The worker's id.
    pub worker: String,
    /// How it ended.
    pub end: End,
}

/// Parses a report line `MARKER ID exit N` / `MARKER ID signal N`.
pub fn parse_report(line: &str, marker: &str) -> Option<Exit> {
    let rest = line.strip_prefix(marker)?.strip_prefix(' ')?;
    let mut words = rest.split(' ');
    let worker = words.next()?.to_string();
    let kind = words.next()?;
    let n: i32 = words.next()?.trim_end().parse().ok()?;
    let end = match kind {
        "exit" => End::Exit(n),
        "signal" => End::Signal(n),
        _ => return None,
    };
    Some(Exit { worker, end })
}

/// What a part's stdout relay tells the driver.
#[derive(Debug, Clone)]
pub enum Report {
    /// A worker of the part ended.
    Exit(Exit),
    /// The part's stdout ended: every report it wrote has been sent before this.
    Closed,
}

/// What every part of the job shares.
#[derive(Debug, Clone)]
pub struct PartContext {
    /// fhrun's own path (the part runs it).
    pub exe: String,
    /// The rsh agent's command line, without the host.
    pub agent: Vec<String>,
    /// The directory the workers start in.
    pub cwd: String,
    /// The workers' command.
    pub command: Vec<String>,
    /// Variables every worker gets (FH_ELASTIC_ADDR, the token, knobs, -x ...).
    pub env: Vec<(String, String)>,
    /// Variables of fhrun's environment a remote part's workers get too.
    pub forwarded: Vec<(String, String)>,
    /// Prefix output lines.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
    /// Say more.
    pub verbose: bool,
    /// The marker of exit reports.
    pub marker: String,
    /// Where another host's part sends its workers' flight records and timelines back
    /// ([`crate::gather`]; `None`: no job directory). A part on this machine writes there
    /// itself.
    pub gather: Option<crate::gather::Gather>,
}

/// A running part.
pub struct PartProc {
    /// Its host.
    pub host: String,
    /// The part's (or its agent's) process, in a process group of its own.
    pub child: Option<Child>,
    /// Its pid (= process-group id).
    pub pid: u32,
    control: Option<ChildStdin>,
    /// When fhrun began stopping it, and when it gets SIGKILL.
    pub stopping: Option<Instant>,
    /// The part's own exit status once reaped.
    pub status: Option<ExitStatus>,
    /// Whether its stdout ended ([`Report::Closed`] received): no exit report is still on
    /// its way. A part can be reaped before its relay has read the reports it wrote last.
    pub reports_closed: bool,
}

impl PartProc {
    /// Start `workers` (`host:slot` ids, each with variables of its own) on `host`; `local`:
    /// this machine (no agent). Exit reports go to `exits`, with `index` (this part's index in
    /// the driver's list).
    pub fn start(
        ctx: &PartContext,
        host: &str,
        local: bool,
        workers: Vec<(String, Vec<(String, String)>)>,
        index: usize,
        exits: &mpsc::Sender<(usize, Report)>,
    ) -> Result<PartProc, String> {
        let mut env = if local {
            Vec::new()
        } else {
            ctx.forwarded.clone()
        };
        env.extend(ctx.env.iter().cloned());
        env.push(("HOROVOD_HOSTNAME".into(), host.to_string()));
        let gather = ctx.gather.as_ref().filter(|_| !local);
        let part = Part {
            cwd: ctx.cwd.clone(),
            command: ctx.command.clone(),
            env,
            ranks: Vec::new(),
            own_env: workers
                .iter()
                .enumerate()
                .flat_map(|(i, (_, env))| env.iter().map(move |(k, v)| (i, k.clone(), v.clone())))
                .collect(),
            workers: workers.into_iter().map(|(id, _)| id).collect(),
            report: Some(ctx.marker.clone()),
            gather: gather.map(|g| g.marker.clone()),
            gather_dirs: gather
                .iter()
                .flat_map(|g| &g.dirs)
                .map(|(d, _)| d.clone())
                .collect(),
            prefix: ctx.prefix,
            kill_grace: ctx.kill_grace,
            verbose: ctx.verbose,
        };
        let argv = if local {
            vec![ctx.exe.clone(), REMOTE_ARG.to_string()]
        } else {
            let mut a = ctx.agent.clone();
            a.push(host.to_string());
            a.push(shell_quote(&ctx.exe));
            a.push(REMOTE_ARG.to_string());
            a
        };
        let label = format!("the workers on {host}");
        let spec = RemoteSpec {
            label: label.clone(),
            argv,
            input: part.encode(),
            gather: None,
        };
        let (mut child, control) = launch::spawn_remote(&spec)
            .map_err(|e| format!("cannot start {label} (`{}`): {e}", spec.argv[0]))?;
        let pid = child.id();
        let mut relayed = false;
        if let Some(out) = child.stdout.take() {
            let tx = exits.clone();
            let marker = ctx.marker.clone();
            let files = gather.cloned().map(|g| (g, label.clone()));
            relayed = std::thread::Builder::new()
                .name("part-stdout".into())
                .spawn(move || relay(out, std::io::stdout(), &marker, files, index, &tx))
                .is_ok();
        }
        if let Some(err) = child.stderr.take() {
            let _ = std::thread::Builder::new()
                .name("part-stderr".into())
                .spawn(move || pump(err, Sink::Stderr, String::new()));
        }
        Ok(PartProc {
            host: host.to_string(),
            child: Some(child),
            pid,
            control: Some(control),
            stopping: None,
            status: None,
            reports_closed: !relayed,
        })
    }

    /// Whether the part still runs.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Ask the part to send `sig` to its workers.
    pub fn signal(&mut self, sig: i32) {
        if let Some(c) = self.control.as_mut() {
            if writeln!(c, "signal {sig}").and_then(|_| c.flush()).is_err() {
                self.control = None;
            }
        }
    }

    /// Stop the part: SIGTERM to its workers now, SIGKILL to the part after `grace` (see
    /// [`PartProc::poll`]).
    pub fn stop(&mut self, now: Instant) {
        self.stop_with(now, libc::SIGTERM);
    }

    /// [`PartProc::stop`] with `sig` in place of SIGTERM (a signal fhrun got, forwarded).
    pub fn stop_with(&mut self, now: Instant, sig: i32) {
        if self.stopping.is_none() && self.running() {
            self.stopping = Some(now);
            self.signal(sig);
        }
    }

    /// Reap the part if it ended (returns its status then); SIGKILL it when it outlived its
    /// stop by `grace` (its workers die with it: parent-death signal and the part's
    /// guardian).
    pub fn poll(&mut self, now: Instant, grace: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                self.control = None;
                sys::kill_group(self.pid, libc::SIGKILL);
                self.status = Some(status);
                Some(status)
            }
            Ok(None) => {
                if self.stopping.is_some_and(|t| now >= t + grace) {
                    sys::kill_group(self.pid, libc::SIGKILL);
                }
                None
            }
            Err(_) => {
                sys::kill_group(self.pid, libc::SIGKILL);
                let _ = child.wait();
                self.child = None;
                self.control = None;
                None
            }
        }
    }
}

/// Copy a part's stdout to `out`, taking out its exit reports and (`files`: where, and the
/// part's name) the files it sends back ([`crate::gather`]), and say [`Report::Closed`] when
/// it ends (after every report it carried, and every file).
fn relay(
    input: impl std::io::Read,
    mut out: impl Write,
    marker: &str,
    files: Option<(crate::gather::Gather, String)>,
    index: usize,
    exits: &mpsc::Sender<(usize, Report)>,
) {
    let mut files = files
        .as_ref()
        .map(|(g, who)| crate::gather::Relay::new(g, who));
    let mut r = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        if let Some(e) = parse_report(text.trim_end_matches('\n'), marker) {
            let _ = exits.send((index, Report::Exit(e)));
            continue;
        }
        match files.as_mut() {
            Some(f) => f.line(&line, &mut out),
            None => {
                let _ = out.write_all(&line).and_then(|_| out.flush());
            }
        }
    }
    drop(files);
    let _ = exits.send((index, Report::Closed));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_parsed_and_only_under_the_marker() {
        let m = "fhrun-exit-0123";
        let e = parse_report("fhrun-exit-0123 h1:0 signal 9", m).unwrap();
        assert_eq!((e.worker.as_str(), e.end), ("h1:0", End::Signal(9)));
        assert_eq!(
            parse_report("fhrun-exit-0123 h:2 exit 0", m).unwrap().end,
            End::Exit(0)
        );
        assert!(parse_report("[h1:0]<stdout>:fhrun-exit-0123 h1:0 exit 0", m).is_none());
        assert!(parse_report("fhrun-exit-9999 h1:0 exit 0", m).is_none());
        assert!(parse_report("fhrun-exit-0123 h1:0 quit 0", m).is_none());
        assert!(parse_report("fhrun-exit-0123 h1:0 exit x", m).is_none());
        assert_eq!(End::Signal(9).describe(), "killed by SIGKILL");
        assert!(End::Exit(0).success() && !End::Exit(1).success());
    }

    #[test]
    fn the_relay_passes_output_on_and_says_closed_after_every_report() {
        let m = "fhrun-exit-77";
        let input = "hello\nfhrun-exit-77 h:0 exit 0\nworld\nfhrun-exit-77 h:1 signal 15\n";
        let (tx, rx) = mpsc::channel();
        let mut out = Vec::new();
        relay(input.as_bytes(), &mut out, m, None, 4, &tx);
        assert_eq!(String::from_utf8(out).unwrap(), "hello\nworld\n");
        let got: Vec<String> = rx
            .try_iter()
            .map(|(i, r)| match r {
                Report::Exit(e) => format!("{i} {} {:?}", e.worker, e.end),
                Report::Closed => format!("{i} closed"),
            })
            .collect();
        assert_eq!(got, ["4 h:0 Exit(0)", "4 h:1 Signal(15)", "4 closed"]);
    }
}
