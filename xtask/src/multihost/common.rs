//! What the multi-host checks share: bounded runs of a command, ranks' ends, the last lines
//! of an output, programs on `PATH`, and the Python environment of the torch checks.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::RankEnd;

/// Every rank exited 0, or an error quoting the first that did not.
pub(crate) fn all_passed(ends: &[RankEnd]) -> Result<(), String> {
    for (rank, e) in ends.iter().enumerate() {
        match e.status {
            Some(s) if s.success() => {}
            Some(s) => {
                return Err(format!(
                    "rank {rank} exited with {s}; its output:\n{}",
                    tail(&e.output)
                ))
            }
            None => {
                return Err(format!(
                    "rank {rank} was still running at the deadline; its output:\n{}",
                    tail(&e.output)
                ))
            }
        }
    }
    Ok(())
}

/// The last lines of `s` (for error messages).
pub(crate) fn tail(s: &str) -> String {
    last_lines(s, 15)
}

/// The last `n` lines of `s`.
pub(crate) fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs `cmd`, at most `limit`, output to a file; returns the status (`None`: killed at the
/// deadline) and the output.
pub(crate) fn bounded(
    mut cmd: Command,
    log: &Path,
    limit: Duration,
) -> Result<(Option<ExitStatus>, String), String> {
    let file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let start = Instant::now();
    let status = loop {
        if let Ok(Some(s)) = child.try_wait() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((status, std::fs::read_to_string(log).unwrap_or_default()))
}

/// The Python of `target/fh-venv` when it can import `fasthorovod.torch` (the Python stages of
/// `cargo xtask test` make it), or why not.
pub(crate) fn torch_python(root: &Path) -> Result<PathBuf, String> {
    let py = root
        .join("target")
        .join("fh-venv")
        .join("bin")
        .join("python");
    let mut cmd = Command::new(&py);
    cmd.args(["-c", "import fasthorovod.torch"]);
    match bounded(
        cmd,
        &root.join("target").join("fh-import-check.log"),
        Duration::from_secs(120),
    ) {
        Ok((Some(s), _)) if s.success() => Ok(py),
        Ok((_, out)) => Err(format!(
            "{} cannot import fasthorovod.torch (the Python stages of `cargo xtask test` set it \
             up): {}",
            py.display(),
            tail(&out)
        )),
        Err(e) => Err(format!("no Python environment at {}: {e}", py.display())),
    }
}

/// Finds `prog` on `PATH`.
pub(crate) fn which(prog: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}
