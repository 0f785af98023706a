//! The host discovery script: run every second, its output parsed into hosts.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::hosts::{parse_host_colon, Host};
use crate::sys;

/// How often the script runs.
pub const PERIOD: Duration = Duration::from_secs(1);
/// Longest one run of the script may take before it is killed and the run counts as failed.
pub const RUN_LIMIT: Duration = Duration::from_secs(10);
/// Most output read from one run.
const MAX_OUTPUT: usize = 1 << 20;

/// Parses the script's output: one `host` or `host:slots` a line (`default_slots` when a line
/// gives none); blank lines and `#` comments are skipped. A bad line is an error naming it.
pub fn parse(text: &str, default_slots: usize) -> Result<Vec<Host>, String> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let origin = format!("host discovery script output, line {} ({raw:?})", i + 1);
        if line.contains(char::is_whitespace) {
            return Err(format!(
                "{origin}: expected `host` or `host:slots`, one a line"
            ));
        }
        let (mut host, explicit) = parse_host_colon(line, &origin)?;
        if !explicit {
            host.slots = default_slots;
        }
        if hosts.iter().any(|h| h.name == host.name) {
            return Err(format!("{origin}: host '{}' is listed twice", host.name));
        }
        hosts.push(host);
    }
    Ok(hosts)
}

/// Runs `script` once, bounded by `limit`; returns its standard output.
pub fn run_once(script: &Path, limit: Duration) -> Result<String, String> {
    let name = script.display();
    let mut child = Command::new(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot run the host discovery script {name}: {e}"))?;
    let read = |s: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(s) = s {
                let _ = s.take(MAX_OUTPUT as u64).read_to_end(&mut out);
            }
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let out = read(child.stdout.take().map(|s| Box::new(s) as _));
    let err = read(child.stderr.take().map(|s| Box::new(s) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if Instant::now() >= deadline => {
                sys::kill_group(child.id(), libc::SIGKILL);
                let _ = child.wait();
                break Err(format!(
                    "the host discovery script {name} did not finish within {} s",
                    limit.as_secs_f64()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => break Err(format!("waiting for the host discovery script {name}: {e}")),
        }
    };
    // Whatever it left in its group goes too, so that the pipes close.
    sys::kill_group(child.id(), libc::SIGKILL);
    let status = status?;
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if !status.success() {
        let tail: String = stderr
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .chars()
            .take(300)
            .collect();
        return Err(format!(
            "the host discovery script {name} {}{}",
            crate::launch::describe(status),
            if tail.is_empty() {
                String::new()
            } else {
                format!(": {tail}")
            }
        ));
    }
    Ok(stdout)
}

/// Where an elastic job's hosts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `--host-discovery-script`: run every [`PERIOD`].
    Script(PathBuf),
    /// Fixed hosts (`--min-np` with `-H`, `--hostfile` or `-np`): they never change, but a
    /// lost one is blacklisted like a discovered one.
    Fixed(Vec<Host>),
}

impl Source {
    /// The hosts now: the script run once (bounded by [`RUN_LIMIT`]), or the fixed list.
    pub fn first(&self, default_slots: usize) -> Result<Vec<Host>, String> {
        match self {
            Source::Script(script) => {
                run_once(script, RUN_LIMIT).and_then(|t| parse(&t, default_slots))
            }
            Source::Fixed(hosts) => Ok(hosts.clone()),
        }
    }
}

/// The script run every [`PERIOD`] on a thread of its own; each result arrives on a channel.
/// Fixed hosts need no thread: they never change.
pub struct Discovery {
    stop: Arc<AtomicBool>,
    results: Option<mpsc::Receiver<Result<Vec<Host>, String>>>,
}

impl Discovery {
    /// Start running the script of `source` (nothing to run for fixed hosts).
    pub fn start(source: Source, default_slots: usize) -> std::io::Result<Discovery> {
        let stop = Arc::new(AtomicBool::new(false));
        let script = match source {
            Source::Script(script) => script,
            Source::Fixed(_) => {
                return Ok(Discovery {
                    stop,
                    results: None,
                })
            }
        };
        let (tx, rx) = mpsc::channel();
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("discovery".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    let began = Instant::now();
                    let found =
                        run_once(&script, RUN_LIMIT).and_then(|text| parse(&text, default_slots));
                    if tx.send(found).is_err() {
                        return;
                    }
                    let next = began + PERIOD;
                    while Instant::now() < next && !flag.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })?;
        Ok(Discovery {
            stop,
            results: Some(rx),
        })
    }

    /// Every result that has arrived.
    pub fn drain(&self) -> Vec<Result<Vec<Host>, String>> {
        self.results
            .as_ref()
            .map(|r| r.try_iter().collect())
            .unwrap_or_default()
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, slots: usize) -> Host {
        Host {
            name: name.into(),
            slots,
        }
    }

    #[test]
    fn hosts_and_slots() {
        assert_eq!(
            parse("h0\nh1:4\n\n  # a comment\nh2 # trailing\n[::1]:2\n", 2).unwrap(),
            vec![h("h0", 2), h("h1", 4), h("h2", 2), h("::1", 2)]
        );
        assert_eq!(parse("", 1).unwrap(), vec![]);
    }

    #[test]
    fn bad_lines_are_errors_naming_the_line() {
        for (text, line, wanted) in [
            ("h0\nh1:x\n", 2, "invalid slot count"),
            ("h0:0\n", 1, "0 slots"),
            ("h0\nh0:2\n", 2, "listed twice"),
            ("h0 slots=2\n", 1, "one a line"),
            (":3\n", 1, "empty host name"),
        ] {
            let e = parse(text, 1).unwrap_err();
            assert!(e.contains(&format!("line {line}")), "{text:?}: {e}");
            assert!(e.contains(wanted), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_run_is_bounded_and_a_failure_says_why() {
        let dir = std::env::temp_dir().join(format!("fh-discovery-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = |name: &str, body: &str| {
            use std::os::unix::fs::PermissionsExt;
            let p = dir.join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let ok = script("ok.sh", "echo h0:2; echo h1");
        assert_eq!(run_once(&ok, RUN_LIMIT).unwrap(), "h0:2\nh1\n");
        let slow = script("slow.sh", "sleep 30");
        let e = run_once(&slow, Duration::from_millis(300)).unwrap_err();
        assert!(e.contains("did not finish"), "{e}");
        let bad = script("bad.sh", "echo no hosts here >&2; exit 3");
        let e = run_once(&bad, RUN_LIMIT).unwrap_err();
        assert!(e.contains("code 3") && e.contains("no hosts here"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
