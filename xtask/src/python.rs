//! The Python half of `cargo xtask test`: a virtual environment under `target/` with PyTorch,
//! maturin and pytest from the package registry; the `fasthorovod` wheel of
//! `cargo xtask wheel` installed into it; the pytest suites of `fh-torch/tests` on 1, 2 and 3
//! ranks, the launch tests, the chaos suite and the random-kill elastic stage.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What the environment needs from the package registry (torch brings NVIDIA's NCCL wheel,
/// which the GPU loader test uses).
pub(crate) const PACKAGES: &[&str] = &["torch", "maturin>=1.9.4,<2", "pytest"];

/// Where the environment lives.
pub(crate) fn venv(root: &Path) -> PathBuf {
    root.join("target").join("fh-venv")
}

/// The environment's interpreter.
pub(crate) fn python(root: &Path) -> PathBuf {
    venv(root).join("bin").join("python")
}

fn ok(c: &mut Command) -> bool {
    c.output().map(|o| o.status.success()).unwrap_or(false)
}

/// The interpreter virtual environments are made with: `PYTHON`, else `python3`; it must be
/// 3.9 or newer, with the venv module.
pub(crate) fn base_python() -> Result<String, String> {
    let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if ok(Command::new(&base).args(["-c", "import sys, venv; assert sys.version_info >= (3, 9)"])) {
        Ok(base)
    } else {
        Err(format!(
            "`{base}` (3.9 or newer, with the venv module) is needed: install it (Debian: \
             `apt-get install python3 python3-venv`) or point PYTHON at one"
        ))
    }
}

/// Make sure the environment exists and has [`PACKAGES`]; returns an error saying exactly what
/// is missing and how to get it.
pub(crate) fn ensure_venv(root: &Path) -> Result<(), String> {
    let py = python(root);
    let has_all = |py: &Path| ok(Command::new(py).args(["-c", "import torch, maturin, pytest"]));
    if py.is_file() && has_all(&py) {
        eprintln!("    {} has torch, maturin and pytest", venv(root).display());
        return Ok(());
    }
    if !py.is_file() {
        let base = base_python()?;
        eprintln!("    creating {} with {base}", venv(root).display());
        let status = Command::new(&base)
            .args(["-m", "venv"])
            .arg(venv(root))
            .status()
            .map_err(|e| format!("cannot run {base}: {e}"))?;
        if !status.success() {
            return Err(format!("`{base} -m venv {}` failed", venv(root).display()));
        }
    }
    eprintln!(
        "    installing {} into {} (about 3 GB on a fresh machine)",
        PACKAGES.join(" "),
        venv(root).display()
    );
    let status = Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PACKAGES)
        .status()
        .map_err(|e| format!("cannot run pip: {e}"))?;
    if !status.success() || !has_all(&py) {
        return Err(format!(
            "`{} -m pip install {}` failed: the PyTorch suite needs these packages from the \
             package registry",
            py.display(),
            PACKAGES.join(" ")
        ));
    }
    Ok(())
}

/// `pip install WHEEL` into the environment (replacing any `fasthorovod` there; torch stays).
pub(crate) fn install_wheel(root: &Path, wheel: &Path) -> Command {
    let mut c = Command::new(python(root));
    c.current_dir(root)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--force-reinstall",
            "--no-deps",
            "--no-index",
        ])
        .arg(wheel);
    c
}

fn pytest(root: &Path, c: &mut Command, dir: &str) {
    c.current_dir(root)
        .args(["-m", "pytest", dir, "-q", "-p", "no:cacheprovider"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("OMP_NUM_THREADS", "1")
        .env("FH_TIMEOUT_SECONDS", "30");
}

/// The per-rank suite on `np` ranks under fhrun (`np` = 1: a single process, no launcher).
pub(crate) fn ranks_suite(root: &Path, np: usize) -> Command {
    let py = python(root);
    let mut c = if np == 1 {
        Command::new(&py)
    } else {
        let mut c = Command::new(root.join("target").join("debug").join("fhrun"));
        c.args(["-np", &np.to_string(), "--timeout", "900"])
            .arg(&py);
        c
    };
    pytest(root, &mut c, "fh-torch/tests/ranks");
    c
}

/// CUDA tensors on a real GPU, one process (`fh-torch/tests/gpu`): each test skips, saying
/// why, without a GPU, without a `cuda` build of the wheel, or without `FH_CUDA=1`.
pub(crate) fn gpu_suite(root: &Path) -> Command {
    let mut c = Command::new(python(root));
    pytest(root, &mut c, "fh-torch/tests/gpu");
    c.arg("-rs");
    c
}

/// The suite that launches jobs itself (fhrun, torchrun, killed ranks, the example).
pub(crate) fn launch_suite(root: &Path) -> Command {
    let mut c = Command::new(python(root));
    pytest(root, &mut c, "fh-torch/tests/launch");
    c
}

/// Runs of the chaos suite in `cargo xtask test` (its CI mode; about 5 minutes on 2 cores).
pub(crate) const CHAOS_RUNS: u32 = 60;

/// The chaos suite (`fh-torch/tests/chaos`): at np 4, one rank killed, stopped or raising at a
/// random moment, every survivor (and fhrun) must end naming it in bounded time. Runs
/// [`CHAOS_RUNS`] runs from a fresh seed (printed, for replay), or `FH_CHAOS_RUNS` when that
/// asks for more (a soak).
pub(crate) fn chaos_suite(root: &Path) -> Command {
    let runs = std::env::var("FH_CHAOS_RUNS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map_or(CHAOS_RUNS, |n| n.max(CHAOS_RUNS));
    let mut c = Command::new(python(root));
    pytest(root, &mut c, "fh-torch/tests/chaos");
    c.env("FH_CHAOS_RUNS", runs.to_string());
    c
}

/// Runs of the random-kill elastic stage in `cargo xtask test` (its CI mode: about 400 s of
/// CPU, mostly the workers' `import torch`; 4 to 9 minutes on the shared 2-core VM).
pub(crate) const EKILL_RUNS: u32 = 50;

/// The random-kill elastic stage (`fh-torch/tests/elastic_kill`): elastic jobs under `fhrun
/// --host-discovery-script` on loopback hosts, a worker SIGKILLed at a random moment; every
/// run must finish equal to the replay of its committed worlds (or fail naming the cause
/// where the plan leaves too few workers). Runs [`EKILL_RUNS`] runs from a fresh seed
/// (printed, for replay), or `FH_EKILL_RUNS` when that asks for more (the long mode).
pub(crate) fn elastic_kill_suite(root: &Path) -> Command {
    let runs = std::env::var("FH_EKILL_RUNS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map_or(EKILL_RUNS, |n| n.max(EKILL_RUNS));
    let mut c = Command::new(python(root));
    pytest(root, &mut c, "fh-torch/tests/elastic_kill");
    c.env("FH_EKILL_RUNS", runs.to_string());
    c
}
