//! What the elastic tests share: the probe worker, a discovery script whose host list a test
//! rewrites, the probe's printed pids, and fhrun started on them.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use super::{Running, TempDir, FHRUN};

/// The worker of the elastic tests.
pub const PROBE: &str = env!("CARGO_BIN_EXE_fh-elastic-probe");
/// How long an elastic test waits for fhrun.
pub const LIMIT: Duration = Duration::from_secs(60);

/// A discovery script printing `dir/hosts`, which the test rewrites (atomically).
pub fn discovery(dir: &TempDir, hosts: &[&str]) -> String {
    set_hosts(dir, hosts);
    let script = dir.path().join("discover.sh");
    std::fs::write(&script, format!("#!/bin/sh\ncat '{}/hosts'\n", dir.str())).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script.to_str().unwrap().to_string()
}

/// Rewrite the host list (atomically).
pub fn set_hosts(dir: &TempDir, hosts: &[&str]) {
    let tmp = dir.path().join("hosts.new");
    std::fs::write(&tmp, hosts.join("\n") + "\n").unwrap();
    std::fs::rename(tmp, dir.path().join("hosts")).unwrap();
}

/// The pid the probe of `worker` printed for `generation`.
pub fn probe_pid(stdout: &str, generation: u64, worker: &str) -> Option<i32> {
    stdout.lines().find_map(|l| {
        let (_, rest) = l.split_once(">:")?;
        let rest = rest.strip_prefix(&format!("generation {generation} "))?;
        let (_, pid) = rest.split_once(&format!(" worker {worker} pid "))?;
        pid.trim().parse().ok()
    })
}

/// Every probe pid printed.
pub fn all_pids(stdout: &str) -> Vec<i32> {
    stdout
        .lines()
        .filter_map(|l| l.rsplit_once(" pid ")?.1.trim().parse().ok())
        .collect()
}

/// fhrun with `script` as its discovery, `extra` flags and the probe as the command; its
/// job directory (where a lost generation's flight records stay) under `dir`.
pub fn start(script: &str, dir: &TempDir, extra: &[&str]) -> Running {
    let stop = format!("PROBE_STOP={}/stop", dir.str());
    let mut args = vec!["--host-discovery-script", script];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-x", &stop, "--kill-grace", "1", "--timeout", "120", PROBE]);
    Running::start_cmd(Command::new(FHRUN).args(&args).env("TMPDIR", dir.path()))
}

/// Asserts that none of the workers `pids` outlives fhrun (waiting up to 10 s for them to go);
/// kills any that did.
pub fn no_worker_left(pids: &[i32]) {
    super::none_left(pids, "workers");
}
