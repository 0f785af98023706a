//! OpenMPI's `MPI_Allreduce` as a peer: a small C benchmark (`peers/mpi_allreduce.c`)
//! compiled with `mpicc` at bench time and run with `mpirun`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::runner::Children;

/// The C source, embedded so that the binary can build it wherever it runs.
const SOURCE: &str = include_str!("../peers/mpi_allreduce.c");

/// Why the peer is skipped when OpenMPI is missing.
pub const NOT_INSTALLED: &str =
    "skipped: OpenMPI not installed (apt-get install libopenmpi-dev openmpi-bin)";

fn found(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Compiles the peer into `dir`; `Err` says why it cannot be used.
pub fn build(dir: &Path) -> Result<PathBuf, String> {
    if !found("mpicc") || !found("mpirun") {
        return Err(NOT_INSTALLED.to_string());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let src = dir.join("mpi_allreduce.c");
    let exe = dir.join("mpi_allreduce");
    std::fs::write(&src, SOURCE).map_err(|e| format!("writing {}: {e}", src.display()))?;
    let out = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("running mpicc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mpicc failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(exe)
}

/// Runs the peer on `np` local ranks; `btl` restricts OpenMPI's transports (e.g. `self,tcp`).
/// Returns `(bytes, seconds per repeat)` per size.
#[allow(clippy::too_many_arguments)]
pub fn run(
    exe: &Path,
    np: usize,
    btl: Option<&str>,
    warmup: usize,
    repeats: usize,
    sizes: &[usize],
    log_dir: &Path,
    timeout: Duration,
) -> Result<Vec<(usize, Vec<f64>)>, String> {
    let mut c = Command::new("mpirun");
    c.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "--bind-to",
        "none",
    ])
    .args(["-np", &np.to_string()])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    if let Some(b) = btl {
        c.args(["--mca", "btl", b]);
    }
    c.arg(exe)
        .arg(warmup.to_string())
        .arg(repeats.to_string())
        .args(sizes.iter().map(|s| s.to_string()));
    let label = format!("openmpi-{}", btl.unwrap_or("default").replace(',', "-"));
    let mut children = Children::default();
    children.spawn(c, log_dir, &label)?;
    children.wait_all(timeout)?;
    let log = log_dir.join(format!("{label}.log"));
    let text =
        std::fs::read_to_string(&log).map_err(|e| format!("reading {}: {e}", log.display()))?;
    parse_output(&text)
}

#[derive(serde::Deserialize)]
struct Line {
    bytes: usize,
    seconds: Vec<f64>,
}

/// Parses the peer's JSON lines (other lines, such as OpenMPI warnings, are ignored).
pub fn parse_output(text: &str) -> Result<Vec<(usize, Vec<f64>)>, String> {
    let rows: Vec<(usize, Vec<f64>)> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("{\"bytes\""))
        .map(|l| {
            serde_json::from_str::<Line>(l)
                .map(|x| (x.bytes, x.seconds))
                .map_err(|e| format!("bad line from the OpenMPI peer '{l}': {e}"))
        })
        .collect::<Result<_, _>>()?;
    if rows.is_empty() {
        return Err(format!(
            "the OpenMPI peer printed no results: {}",
            text.lines().take(5).collect::<Vec<_>>().join(" | ")
        ));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_results_among_warnings() {
        let text = "WARNING: something\n{\"bytes\": 8, \"seconds\": [1e-05, 2e-05]}\n{\"bytes\": 4096, \"seconds\": []}\n";
        assert_eq!(
            parse_output(text).unwrap(),
            [(8, vec![1e-5, 2e-5]), (4096, vec![])]
        );
        assert!(parse_output("nothing").unwrap_err().contains("no results"));
    }
}
