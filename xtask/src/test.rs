//! `cargo xtask test`: the whole suite, as stages, with a one-line summary at the end.

use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use crate::{cargo, multihost, python, tidy, wheel, wheel_env};

/// Debian packages the suites need. `openmpi-bin libopenmpi-dev libclang-dev`: the MPI suite
/// (the `mpi` crate builds its bindings with libclang against `mpicc`) and fh-bench's OpenMPI
/// peer (`mpicc`, `mpirun`); `fonts-dejavu-core`: the font fh-bench's PNG plots use;
/// `nftables`: the packet loss and partitions of the chaos checks across hosts and the
/// emulated cloud's per-flow caps; `iptables`: its NFQUEUE target, which holds packets for the
/// emulated cluster's round-trip time (this kernel's nftables has no `queue`).
pub(crate) const BASE_PACKAGES: &[&str] = &[
    "openmpi-bin",
    "libopenmpi-dev",
    "libclang-dev",
    "fonts-dejavu-core",
    "nftables",
    "iptables",
];

/// A stage's commands, from the workspace root.
type Commands = fn(&Path) -> Vec<Command>;

/// A suite run after `cargo test --workspace`, needing system packages.
pub(crate) struct ExtraSuite {
    /// Short name, shown in the stage list.
    pub name: &'static str,
    /// Debian packages it needs; the suite is skipped (with a message) when any is missing.
    pub packages: &'static [&'static str],
    /// The commands to run, in order, from the workspace root; the suite fails on the first
    /// command that fails.
    pub commands: fn(&Path) -> Vec<Command>,
}

/// **Hook for the integrator:** the suites run after `cargo test --workspace`.
///
/// The MPI suite goes here, e.g.
///
/// ```text
/// ExtraSuite {
///     name: "mpi",
///     packages: &["openmpi-bin", "libopenmpi-dev", "libclang-dev"],
///     commands: |root| {
///         let mut build = Command::new(crate::cargo());
///         build.current_dir(root).args(["test", "-p", "fh-transport", "--features", "mpi", "--no-run"]);
///         let mut run = Command::new("mpirun");
///         run.current_dir(root).args(["--oversubscribe", "--allow-run-as-root", "-np", "2", ...]);
///         vec![build, run]
///     },
/// }
/// ```
pub(crate) fn extra_suites() -> Vec<ExtraSuite> {
    vec![
        ExtraSuite {
            name: "gpu path without a GPU (--features cuda: clippy, tests, engine device path; NCCL bindings)",
            packages: &["libclang-dev"],
            commands: |root| {
                let cmd = |args: &[&str]| {
                    let mut c = Command::new(cargo());
                    c.current_dir(root).args(args);
                    c
                };
                vec![
                    cmd(&[
                        "clippy",
                        "-p",
                        "fh-transport",
                        "--features",
                        "cuda",
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ]),
                    cmd(&[
                        "test",
                        "-p",
                        "fh-transport",
                        "--features",
                        "cuda",
                        "--lib",
                        "cuda::",
                    ]),
                    cmd(&[
                        "test",
                        "-p",
                        "fh-transport",
                        "--features",
                        "cuda",
                        "--test",
                        "cuda_gpu",
                    ]),
                    // The engine's device path (fh-scheduler and fh-torch feature `cuda`).
                    cmd(&[
                        "clippy",
                        "-p",
                        "fh-scheduler",
                        "-p",
                        "fh-torch",
                        "--features",
                        "fh-scheduler/cuda,fh-torch/cuda",
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ]),
                    cmd(&[
                        "test",
                        "-p",
                        "fh-scheduler",
                        "--features",
                        "cuda",
                        "--lib",
                        "--test",
                        "device",
                    ]),
                    cmd(&["test", "-p", "xtask", "--features", "nccl-bindings", "nccl"]),
                ]
            },
        },
        ExtraSuite {
            name: "mpi suite (mpirun np 2-4, fhrun --mpi, scheduler over MPI)",
            packages: &["openmpi-bin", "libopenmpi-dev", "libclang-dev"],
            commands: |root| {
                let mut c = Command::new("bash");
                c.current_dir(root)
                    .arg("fh-transport/tests/mpi/run.sh")
                    .env("CARGO", cargo());
                vec![c]
            },
        },
    ]
}

#[derive(Debug)]
enum Outcome {
    Passed,
    /// Passed, with a note for the summary (e.g. how many of its checks were skipped).
    PassedNoting(String),
    Failed(String),
    Skipped(String),
}

struct Stage {
    name: String,
    outcome: Outcome,
    took: Duration,
}

pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    if let Some(a) = args.first() {
        eprintln!("xtask test: unexpected argument `{a}` (it takes none)");
        return ExitCode::from(2);
    }
    let started = Instant::now();
    let mut stages: Vec<Stage> = Vec::new();
    let suites = extra_suites();

    // 1. Prerequisites (Debian packages).
    let mut wanted: Vec<&str> = BASE_PACKAGES.to_vec();
    for s in &suites {
        for p in s.packages {
            if !wanted.contains(p) {
                wanted.push(p);
            }
        }
    }
    let t = Instant::now();
    let (outcome, missing) = prerequisites(&wanted);
    stages.push(Stage {
        name: "prerequisites".into(),
        outcome,
        took: t.elapsed(),
    });

    // 2. Formatting.
    stages.push(stage("cargo fmt --all -- --check", || {
        let mut c = Command::new(cargo());
        c.current_dir(root).args(["fmt", "--all", "--", "--check"]);
        run_cmd(c)
    }));

    // 3. Tidy (in-process; the same checks are `#[test]`s in xtask).
    stages.push(stage("tidy", || {
        let failures = tidy::run_all(root);
        for f in &failures {
            eprintln!("tidy: {f}");
        }
        if failures.is_empty() {
            Outcome::Passed
        } else {
            Outcome::Failed(format!("{} tidy check(s) failed", failures.len()))
        }
    }));

    // 3b. Lints, as warnings-are-errors (the default features; the feature-gated code is
    //     linted by its own suite below).
    stages.push(stage("cargo clippy --workspace --all-targets", || {
        let mut c = Command::new(cargo());
        c.current_dir(root).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]);
        run_cmd(c)
    }));

    // 4. The workspace's tests: every target, then the doc tests (`--all-targets` has none).
    stages.push(stage("cargo test --workspace --all-targets", || {
        let mut c = Command::new(cargo());
        c.current_dir(root)
            .args(["test", "--workspace", "--all-targets"]);
        run_cmd(c)
    }));
    stages.push(stage("cargo test --workspace --doc", || {
        let mut c = Command::new(cargo());
        c.current_dir(root).args(["test", "--workspace", "--doc"]);
        run_cmd(c)
    }));

    // 5. PyTorch: a virtual environment under target/ (torch, maturin, pytest from the
    //    registry); the wheel (`cargo xtask wheel`, what users install) into it; pytest on 1,
    //    2 and 3 ranks; the wheel in a fresh environment outside the tree, launched by its own
    //    fhrun; the launch tests, then the chaos suite (CI mode: python::CHAOS_RUNS runs) and
    //    the random-kill elastic stage (python::EKILL_RUNS runs).
    let venv = stage(
        "python environment (target/fh-venv: torch, maturin, pytest)",
        || match python::ensure_venv(root) {
            Ok(()) => Outcome::Passed,
            Err(e) => Outcome::Failed(e),
        },
    );
    let venv_ok = matches!(venv.outcome, Outcome::Passed);
    stages.push(venv);
    let mut wheel = None;
    let install_name =
        "the wheel (cargo xtask wheel: manylinux_2_17, fhrun inside) into target/fh-venv; clippy";
    if venv_ok {
        stages.push(stage(install_name, || {
            let mut fhrun = Command::new(cargo());
            fhrun.current_dir(root).args(["build", "-p", "fh-launch"]);
            let mut lint = Command::new(cargo());
            lint.current_dir(root)
                .args([
                    "clippy",
                    "-p",
                    "fh-torch",
                    "--features",
                    "python",
                    "--all-targets",
                ])
                .args(["--", "-D", "warnings"])
                .env("PYO3_PYTHON", python::python(root));
            for c in [fhrun, lint] {
                match run_cmd(c) {
                    Outcome::Passed => {}
                    other => return other,
                }
            }
            let built = match wheel::build(root) {
                Ok(b) => b,
                Err(e) => return Outcome::Failed(e),
            };
            let outcome = run_cmd(python::install_wheel(root, &built.wheel));
            if matches!(outcome, Outcome::Passed) {
                wheel = Some(built.wheel);
            }
            outcome
        }));
    } else {
        stages.push(Stage {
            name: install_name.into(),
            outcome: Outcome::Failed("the step before it failed".into()),
            took: Duration::ZERO,
        });
    }
    let python_stages: [(&str, Commands); 2] = [
        (
            "pytest fh-torch/tests/ranks and tests/gpu (skips without a GPU), one process",
            |root| vec![python::ranks_suite(root, 1), python::gpu_suite(root)],
        ),
        (
            "pytest fh-torch/tests/ranks under fhrun -np 2, -np 3",
            |root| vec![python::ranks_suite(root, 2), python::ranks_suite(root, 3)],
        ),
    ];
    let later_stages: [(&str, Commands); 3] = [
        ("pytest fh-torch/tests/launch", |root| {
            vec![python::launch_suite(root)]
        }),
        (
            "pytest fh-torch/tests/chaos (killed, stopped, raising ranks)",
            |root| vec![python::chaos_suite(root)],
        ),
        (
            "pytest fh-torch/tests/elastic_kill (elastic jobs, a worker SIGKILLed at random)",
            |root| vec![python::elastic_kill_suite(root)],
        ),
    ];
    let run_commands = |name: &str, commands: Commands| {
        stage(name, || {
            for c in commands(root) {
                match run_cmd(c) {
                    Outcome::Passed => {}
                    other => return other,
                }
            }
            Outcome::Passed
        })
    };
    let skipped_after_failure = |name: &str| Stage {
        name: name.into(),
        outcome: Outcome::Failed("the step before it failed".into()),
        took: Duration::ZERO,
    };
    for (name, commands) in python_stages {
        stages.push(match wheel {
            Some(_) => run_commands(name, commands),
            None => skipped_after_failure(name),
        });
    }
    let outside = "the wheel in a fresh environment outside the tree (its fhrun; 2-rank job, ranks suite np 2)";
    stages.push(match &wheel {
        Some(w) => stage(outside, || {
            match wheel_env::stage(root, w, &crate::wheel::dir(root).join("logs")) {
                Ok(line) => {
                    eprintln!("==> {line}");
                    Outcome::PassedNoting(line)
                }
                Err(e) => Outcome::Failed(e),
            }
        }),
        None => skipped_after_failure(outside),
    });
    for (name, commands) in later_stages {
        stages.push(match wheel {
            Some(_) => run_commands(name, commands),
            None => skipped_after_failure(name),
        });
    }

    // 6. Extra suites (MPI, GPU path without a GPU, ...), skipped when their packages are
    //    missing.
    for suite in &suites {
        let lacking: Vec<&str> = suite
            .packages
            .iter()
            .copied()
            .filter(|p| missing.contains(p))
            .collect();
        if !lacking.is_empty() {
            let msg = format!(
                "missing Debian packages {}; install them as root with `apt-get install {}` \
                 (cargo xtask test does this itself when run as root)",
                lacking.join(" "),
                lacking.join(" ")
            );
            eprintln!("==> {}: skipped: {msg}", suite.name);
            stages.push(Stage {
                name: suite.name.into(),
                outcome: Outcome::Skipped(msg),
                took: Duration::ZERO,
            });
            continue;
        }
        stages.push(stage(suite.name, || {
            for c in (suite.commands)(root) {
                match run_cmd(c) {
                    Outcome::Passed => {}
                    other => return other,
                }
            }
            Outcome::Passed
        }));
    }

    // 7. Across hosts: the emulated cluster's checks (skipped, and counted, where the machine
    //    cannot run network namespaces).
    stages.push(stage(
        "multi-host on an emulated cluster (network namespaces)",
        || match multihost::run(root, None) {
            multihost::Verdict::Passed(s) => {
                eprintln!("==> {s}");
                Outcome::PassedNoting(s)
            }
            multihost::Verdict::Failed(s) => Outcome::Failed(s),
            multihost::Verdict::Skipped(s) => {
                eprintln!("==> skipped: {s}");
                Outcome::Skipped(s)
            }
        },
    ));

    // Summary.
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    eprintln!("\n==> summary ({:.0?} in all)", started.elapsed());
    for s in &stages {
        let (word, detail) = match &s.outcome {
            Outcome::Passed => {
                passed += 1;
                ("ok     ", String::new())
            }
            Outcome::PassedNoting(note) => {
                passed += 1;
                ("ok     ", format!(": {note}"))
            }
            Outcome::Failed(why) => {
                failed += 1;
                ("FAILED ", format!(": {why}"))
            }
            Outcome::Skipped(why) => {
                skipped += 1;
                ("skipped", format!(": {why}"))
            }
        };
        eprintln!(
            "  {word} {:<40} {:>7.1?}{detail}",
            s.name,
            Duration::from_millis(s.took.as_millis() as u64)
        );
    }
    if skipped > 0 {
        println!("summary: {passed} passed, {failed} failed, {skipped} skipped");
    } else {
        println!("summary: {passed} passed, {failed} failed");
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn stage(name: &str, f: impl FnOnce() -> Outcome) -> Stage {
    eprintln!("\n==> {name}");
    let t = Instant::now();
    let outcome = f();
    if let Outcome::Failed(why) = &outcome {
        eprintln!("==> {name}: FAILED: {why}");
    }
    Stage {
        name: name.to_string(),
        outcome,
        took: t.elapsed(),
    }
}

fn run_cmd(mut c: Command) -> Outcome {
    let shown = format!("{c:?}");
    match c.status() {
        Ok(s) if s.success() => Outcome::Passed,
        Ok(s) => Outcome::Failed(format!("{shown} exited with {s}")),
        Err(e) => Outcome::Failed(format!("could not start {shown}: {e}")),
    }
}

/// Checks the Debian packages; installs the missing ones when root. Returns the stage's
/// outcome and the packages still missing afterwards.
fn prerequisites<'a>(wanted: &[&'a str]) -> (Outcome, Vec<&'a str>) {
    eprintln!("==> prerequisites: Debian packages {}", wanted.join(" "));
    if Command::new("dpkg-query")
        .arg("--version")
        .output()
        .is_err()
    {
        let msg = format!(
            "not a Debian system (no dpkg-query): cannot check for {}; suites needing them are skipped",
            wanted.join(" ")
        );
        eprintln!("    {msg}");
        return (Outcome::Skipped(msg), wanted.to_vec());
    }
    let missing = missing_packages(wanted);
    if missing.is_empty() {
        eprintln!("    all installed");
        return (Outcome::Passed, missing);
    }
    if !is_root() {
        let msg = format!(
            "missing Debian packages: {m}; not root, so not installing them: run `sudo apt-get install {m}`; \
             the suites that need them are skipped",
            m = missing.join(" ")
        );
        eprintln!("    {msg}");
        return (Outcome::Skipped(msg), missing);
    }
    eprintln!("    installing {} with apt-get", missing.join(" "));
    let update = Command::new("apt-get")
        .args(["update", "-qq"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status();
    if !matches!(update, Ok(s) if s.success()) {
        eprintln!("    warning: `apt-get update` failed ({update:?}); trying the install anyway");
    }
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    let status = install.status();
    let still = missing_packages(wanted);
    if still.is_empty() {
        (Outcome::Passed, still)
    } else {
        let msg = format!(
            "`apt-get install {}` did not install {} ({status:?})",
            missing.join(" "),
            still.join(" ")
        );
        (Outcome::Failed(msg), still)
    }
}

fn missing_packages<'a>(wanted: &[&'a str]) -> Vec<&'a str> {
    wanted
        .iter()
        .copied()
        .filter(|p| {
            let out = Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output();
            !matches!(out, Ok(o) if o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
