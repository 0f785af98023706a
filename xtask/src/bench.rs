//! `cargo xtask bench`: build `fh-bench` in release mode and run its suite.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use crate::cargo;

pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!("cargo xtask bench: builds fh-bench (release) and runs `fh-bench suite ARGS`:\n");
    }
    let target_dir: PathBuf = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    eprintln!("==> cargo build --release -p fh-bench");
    let built = Command::new(cargo())
        .current_dir(root)
        .args(["build", "--release", "-p", "fh-bench"])
        .status();
    match built {
        Ok(s) if s.success() => {}
        Ok(s) => {
            eprintln!("xtask bench: building fh-bench failed ({s})");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("xtask bench: could not run cargo: {e}");
            return ExitCode::FAILURE;
        }
    }
    let exe = target_dir.join("release").join("fh-bench");
    let mut cmd = Command::new(&exe);
    cmd.current_dir(root)
        .arg("suite")
        .args(args)
        .env("FH_BENCH_TARGET_DIR", &target_dir);
    // The Python peers (PyTorch DDP, Horovod, fasthorovod.torch) run under the project's
    // environment when `cargo xtask test` has made one, unless FH_BENCH_PYTHON names another.
    let venv_python = crate::python::python(root);
    if std::env::var_os("FH_BENCH_PYTHON").is_none() && venv_python.is_file() {
        eprintln!(
            "==> Python peers under {} (FH_BENCH_PYTHON overrides)",
            venv_python.display()
        );
        cmd.env("FH_BENCH_PYTHON", &venv_python);
    }
    let status = cmd.status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("xtask bench: fh-bench {s}");
            ExitCode::from(s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("xtask bench: could not start {}: {e}", exe.display());
            ExitCode::FAILURE
        }
    }
}
