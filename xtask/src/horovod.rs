//! `cargo xtask horovod`: real Horovod 0.28.1, built from its sdist into `target/hvd-venv`, as
//! the bench's Horovod peer (opt-in: not a stage of `cargo xtask test`; about 5 minutes of
//! compile on 2 cores).
//!
//! The environment sees the torch of `target/fh-venv` (and this worktree's `fasthorovod`)
//! through a `.pth` file, as the test environment does: nothing is installed twice. Horovod
//! 0.28.1 pins C++14 and torch ≥ 2.9's headers need C++20, so the two `CMakeLists.txt` that
//! set the standard for the core and the torch extension are patched to 20 before the build
//! ([`patch_cxx_standard`]); the build is CPU only, with the Gloo and MPI controllers. It ends
//! with `horovodrun --check-build` and a 2-rank allreduce under Gloo and under MPI. A second
//! run finds the stamp written after those checks and says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The Horovod release built.
pub(crate) const VERSION: &str = "0.28.1";

/// The tools the build needs, as `(program, Debian package)`.
pub(crate) const TOOLS: &[(&str, &str)] = &[
    ("cmake", "cmake"),
    ("g++", "g++"),
    ("pkg-config", "pkg-config"),
    ("mpicxx", "libopenmpi-dev"),
    ("mpirun", "openmpi-bin"),
];

/// Python packages the build and `horovodrun` need in the environment, with the module each
/// provides (torch comes from `target/fh-venv`).
pub(crate) const PY_PACKAGES: &[(&str, &str)] = &[
    ("wheel", "wheel"),
    ("packaging", "packaging"),
    ("psutil", "psutil"),
    ("cloudpickle", "cloudpickle"),
    ("pyyaml", "yaml"),
    ("cffi", "cffi"),
    ("numpy", "numpy"),
];

/// Horovod's build switches: PyTorch only, Gloo and MPI controllers; the CMake policy floor
/// matters only with CMake 4 (Gloo's old `cmake_minimum_required`).
pub(crate) const BUILD_ENV: &[(&str, &str)] = &[
    ("HOROVOD_WITH_PYTORCH", "1"),
    ("HOROVOD_WITHOUT_TENSORFLOW", "1"),
    ("HOROVOD_WITHOUT_MXNET", "1"),
    ("HOROVOD_WITH_GLOO", "1"),
    ("HOROVOD_WITH_MPI", "1"),
    ("CMAKE_POLICY_VERSION_MINIMUM", "3.5"),
    ("MAKEFLAGS", "-j2"),
];

/// The files of the sdist whose `set(CMAKE_CXX_STANDARD 14)` becomes 20 (the top file's `17`
/// line belongs to a TensorFlow-only target and stays).
pub(crate) const PATCHED: &[&str] = &["CMakeLists.txt", "horovod/torch/CMakeLists.txt"];

/// Open MPI refuses root without these.
pub(crate) const MPI_AS_ROOT: &[(&str, &str)] = &[
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
];

/// Longest the compile may take before it is stopped.
const BUILD_TIMEOUT: Duration = Duration::from_secs(45 * 60);

/// Where the environment lives.
pub(crate) fn venv(root: &Path) -> PathBuf {
    root.join("target").join("hvd-venv")
}

/// The environment's interpreter.
pub(crate) fn python(root: &Path) -> PathBuf {
    venv(root).join("bin").join("python")
}

/// The work directory: the sdist, its unpacked and patched tree, the build log.
fn work(root: &Path) -> PathBuf {
    root.join("target").join("hvd-build")
}

/// The stamp written after the checks passed: `horovod VERSION, torch T`.
fn stamp(root: &Path) -> PathBuf {
    venv(root).join("fh-horovod-built")
}

/// `text` with every `set(CMAKE_CXX_STANDARD 14)` line set to 20; how many lines changed. A
/// file already at 20 (patched before) is returned as it is; a file with neither is an error:
/// the sdist is not the one these facts are about.
pub(crate) fn patch_cxx_standard(text: &str, file: &str) -> Result<(String, usize), String> {
    let mut changed = 0;
    let mut already = false;
    let mut out = String::with_capacity(text.len() + 8);
    for line in text.split_inclusive('\n') {
        let body = line.trim();
        if body == "set(CMAKE_CXX_STANDARD 14)" {
            out.push_str(&line.replace("CMAKE_CXX_STANDARD 14", "CMAKE_CXX_STANDARD 20"));
            changed += 1;
        } else {
            already |= body == "set(CMAKE_CXX_STANDARD 20)";
            out.push_str(line);
        }
    }
    if changed == 0 && !already {
        return Err(format!(
            "{file}: no `set(CMAKE_CXX_STANDARD 14)` line to raise to 20 (is this Horovod \
             {VERSION}'s sdist?)"
        ));
    }
    Ok((out, changed))
}

/// What `horovodrun --check-build` does not list as available among PyTorch, MPI and Gloo.
pub(crate) fn check_build_lacks(text: &str) -> Vec<&'static str> {
    ["PyTorch", "MPI", "Gloo"]
        .into_iter()
        .filter(|want| {
            !text.lines().any(|l| {
                let l = l.trim();
                l.strip_prefix("[X]").map(str::trim) == Some(*want)
            })
        })
        .collect()
}

/// What to do about missing tools: the Debian packages to install (as root, with apt-get), or
/// an error naming each missing program and its package.
pub(crate) fn tools_plan(
    missing: &[(&str, &str)],
    root_user: bool,
    has_apt: bool,
) -> Result<Vec<String>, String> {
    let mut pkgs: Vec<String> = missing.iter().map(|(_, p)| p.to_string()).collect();
    pkgs.dedup();
    if pkgs.is_empty() || (root_user && has_apt) {
        return Ok(pkgs);
    }
    let names: Vec<String> = missing
        .iter()
        .map(|(t, p)| format!("`{t}` (package {p})"))
        .collect();
    Err(format!(
        "missing {}: install them (Debian: `apt-get install {}`){}",
        names.join(", "),
        pkgs.join(" "),
        if root_user {
            ", apt-get was not found"
        } else {
            ", or run this as root to have them installed"
        }
    ))
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Runs `c` to its end within `timeout` (killed with its process group on the deadline); its
/// standard output, or an error with the tail of both outputs.
fn run_capture(mut c: Command, what: &str, timeout: Duration) -> Result<String, String> {
    let base = std::env::temp_dir().join(format!("fh-hvd-{}-{}", std::process::id(), nonce()));
    let (out, err) = (base.with_extension("out"), base.with_extension("err"));
    let r = run_logged(&mut c, what, timeout, (&out, &err), None);
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let etext = std::fs::read_to_string(&err).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&err);
    match r {
        Ok(()) => Ok(text),
        Err(e) => Err(format!("{e}\n{}\n{}", tail(&text, 20), tail(&etext, 20))),
    }
}

fn nonce() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs `c` with stdout into `log` and stderr into `errlog` (the same file or not), in its own process group, within `timeout`;
/// with `progress`, prints the elapsed time and the log's last line every `progress` period.
fn run_logged(
    c: &mut Command,
    what: &str,
    timeout: Duration,
    (log, errlog): (&Path, &Path),
    progress: Option<Duration>,
) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let f = std::fs::File::create(log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let f2 = if errlog == log {
        f.try_clone()
    } else {
        std::fs::File::create(errlog)
    }
    .map_err(|e| format!("creating {}: {e}", errlog.display()))?;
    let mut child = c
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let start = Instant::now();
    let mut shown = start;
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(()),
            Ok(Some(s)) => return Err(format!("{what} failed ({s}); log: {}", log.display())),
            Ok(None) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
        if start.elapsed() > timeout {
            let _ = Command::new("kill")
                .args(["-KILL", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            return Err(format!(
                "{what} took over {} s and was stopped; log: {}",
                timeout.as_secs(),
                log.display()
            ));
        }
        if let Some(every) = progress {
            if shown.elapsed() >= every {
                shown = Instant::now();
                let text = std::fs::read_to_string(log).unwrap_or_default();
                // CMake's `[ 48%] Building ...` lines say how far it is; else the last line.
                let mut lines = text.lines().rev().map(str::trim);
                let last = lines
                    .clone()
                    .find(|l| l.starts_with('[') && l.contains("%]"))
                    .or_else(|| lines.find(|l| !l.is_empty()))
                    .unwrap_or("");
                let last: String = last.chars().take(110).collect();
                eprintln!("    {:>4} s  {last}", start.elapsed().as_secs());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `python -c CODE`, its output, within 2 minutes.
fn py(python: &Path, code: &str) -> Result<String, String> {
    let mut c = Command::new(python);
    c.args(["-c", code]);
    run_capture(
        c,
        &format!("{} -c ...", python.display()),
        Duration::from_secs(120),
    )
}

/// The environment's Horovod and torch versions, when `horovod.torch` imports.
fn built_versions(root: &Path) -> Option<String> {
    let p = python(root);
    if !p.is_file() {
        return None;
    }
    py(
        &p,
        "import horovod, horovod.torch, torch; print(f'horovod {horovod.__version__}, torch {torch.__version__}')",
    )
    .ok()
    .and_then(|o| o.lines().last().map(|l| l.trim().to_string()))
}

/// `cargo xtask horovod [--force]`.
pub(crate) fn run(root: &Path, args: &[String]) -> std::process::ExitCode {
    let force = args.iter().any(|a| a == "--force");
    if let Some(bad) = args.iter().find(|a| a.as_str() != "--force") {
        eprintln!("xtask horovod: unknown argument `{bad}` (only --force: rebuild)");
        return std::process::ExitCode::from(2);
    }
    let t = Instant::now();
    match build(root, force) {
        Ok(msg) => {
            eprintln!("xtask horovod: {msg} ({:.0} s)", t.elapsed().as_secs_f64());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xtask horovod: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn build(root: &Path, force: bool) -> Result<String, String> {
    const STEPS: usize = 7;
    let step = |i: usize, what: &str| eprintln!("==> [{i}/{STEPS}] {what}");
    if !force {
        if let (Ok(s), Some(v)) = (std::fs::read_to_string(stamp(root)), built_versions(root)) {
            if s.trim() == v {
                return Ok(format!(
                    "already built: {v} in {} (--force rebuilds)",
                    venv(root).display()
                ));
            }
            eprintln!(
                "    {} says `{}`, the environment has `{v}`: rebuilding",
                stamp(root).display(),
                s.trim()
            );
        }
    }
    let _ = std::fs::remove_file(stamp(root));

    step(1, "build tools (cmake, g++, pkg-config, Open MPI)");
    let missing: Vec<(&str, &str)> = TOOLS.iter().copied().filter(|(t, _)| !on_path(t)).collect();
    let pkgs = tools_plan(&missing, is_root(), on_path("apt-get"))?;
    if !pkgs.is_empty() {
        eprintln!("    apt-get install {}", pkgs.join(" "));
        let mut c = Command::new("apt-get");
        c.arg("update").env("DEBIAN_FRONTEND", "noninteractive");
        run_capture(c, "apt-get update", Duration::from_secs(600))?;
        let mut c = Command::new("apt-get");
        c.args(["install", "-y", "--no-install-recommends"])
            .args(&pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run_capture(c, "apt-get install", Duration::from_secs(1200))?;
        let still: Vec<&str> = TOOLS
            .iter()
            .filter(|(t, _)| !on_path(t))
            .map(|(t, _)| *t)
            .collect();
        if !still.is_empty() {
            return Err(format!(
                "after apt-get install, still missing: {}",
                still.join(", ")
            ));
        }
    }

    step(2, "torch: the project's environment target/fh-venv");
    crate::python::ensure_venv(root)?;
    let fh_python = crate::python::python(root);
    let sites = py(
        &fh_python,
        "import sys; print('\\n'.join(p for p in sys.path if p.endswith('site-packages')))",
    )?;
    let sites: Vec<&str> = sites
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();

    step(
        3,
        "the environment target/hvd-venv (seeing target/fh-venv's packages)",
    );
    let hp = python(root);
    if !hp.is_file() {
        let mut c = Command::new(&fh_python);
        c.args(["-m", "venv"]).arg(venv(root));
        run_capture(c, "python -m venv", Duration::from_secs(300))?;
    }
    let purelib = py(
        &hp,
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    )?;
    let pth = Path::new(purelib.trim()).join("zz-fh-venv.pth");
    std::fs::write(&pth, sites.join("\n") + "\n")
        .map_err(|e| format!("cannot write {}: {e}", pth.display()))?;
    let torch = py(&hp, "import torch; print(torch.__version__)").map_err(|e| {
        format!(
            "target/hvd-venv does not see torch through {}: {e}",
            pth.display()
        )
    })?;
    eprintln!("    torch {} seen through {}", torch.trim(), pth.display());
    let absent: Vec<&str> = PY_PACKAGES
        .iter()
        .filter(|(_, m)| py(&hp, &format!("import {m}")).is_err())
        .map(|(p, _)| *p)
        .collect();
    if !absent.is_empty() {
        eprintln!("    pip install {}", absent.join(" "));
        let mut c = Command::new(&hp);
        c.args(["-m", "pip", "install", "--disable-pip-version-check"])
            .args(&absent);
        run_capture(c, "pip install", Duration::from_secs(900)).map_err(|e| {
            format!(
                "{e}\n(the build needs {} from the package registry)",
                absent.join(" ")
            )
        })?;
    }

    step(4, &format!("the sdist of horovod {VERSION} (pip download)"));
    let work = work(root);
    std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let tarball = work.join(format!("horovod-{VERSION}.tar.gz"));
    if !tarball.is_file() {
        let mut c = Command::new(&hp);
        c.args([
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            ":all:",
            &format!("horovod=={VERSION}"),
            "-d",
        ])
        .arg(&work);
        run_capture(c, "pip download", Duration::from_secs(600))?;
        if !tarball.is_file() {
            return Err(format!(
                "pip download did not leave {} (the sdist of horovod {VERSION})",
                tarball.display()
            ));
        }
    }
    let src = work.join(format!("horovod-{VERSION}"));
    let _ = std::fs::remove_dir_all(&src);
    let mut c = Command::new("tar");
    c.arg("-xzf").arg(&tarball).arg("-C").arg(&work);
    run_capture(c, "tar -xzf", Duration::from_secs(300))?;

    step(
        5,
        "patch: CMAKE_CXX_STANDARD 14 -> 20 (torch's headers need C++20)",
    );
    for f in PATCHED {
        let p = src.join(f);
        let text =
            std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
        let (out, n) = patch_cxx_standard(&text, f)?;
        std::fs::write(&p, out).map_err(|e| format!("writing {}: {e}", p.display()))?;
        eprintln!("    {f}: {n} line(s)");
    }

    step(
        6,
        "build and install (pip, CPU only, Gloo and MPI; about 5 minutes on 2 free cores)",
    );
    let log = work.join("build.log");
    eprintln!("    log: {}", log.display());
    let mut c = Command::new(&hp);
    c.args([
        "-m",
        "pip",
        "install",
        "-v",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--no-build-isolation",
        "--no-deps",
    ])
    .arg(&src)
    .envs(BUILD_ENV.iter().copied());
    run_logged(
        &mut c,
        "building horovod",
        BUILD_TIMEOUT,
        (&log, &log),
        Some(Duration::from_secs(30)),
    )
    .map_err(|e| {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        format!("{e}\n{}", tail(&text, 25))
    })?;

    step(
        7,
        "check: horovodrun --check-build, a 2-rank allreduce under Gloo and MPI",
    );
    let hvdrun = venv(root).join("bin").join("horovodrun");
    let mut c = Command::new(&hvdrun);
    c.arg("--check-build");
    let out = run_capture(c, "horovodrun --check-build", Duration::from_secs(120))?;
    let lacks = check_build_lacks(&out);
    if !lacks.is_empty() {
        return Err(format!(
            "horovodrun --check-build does not list {} as available:\n{out}",
            lacks.join(", ")
        ));
    }
    let script = work.join("check_allreduce.py");
    std::fs::write(&script, CHECK_SCRIPT)
        .map_err(|e| format!("writing {}: {e}", script.display()))?;
    for mode in ["--gloo", "--mpi"] {
        let mut c = Command::new(&hvdrun);
        c.args(["-np", "2", "-H", "localhost:2", mode])
            .arg(&hp)
            .arg(&script)
            .envs(MPI_AS_ROOT.iter().copied())
            .env("OMP_NUM_THREADS", "1");
        let what = format!("horovodrun -np 2 {mode} (allreduce check)");
        let out = run_capture(c, &what, Duration::from_secs(300))?;
        for r in 0..2 {
            if !out.contains(&format!("allreduce ok rank {r} of 2")) {
                return Err(format!(
                    "{what}: rank {r} did not report a right sum:\n{out}"
                ));
            }
        }
        eprintln!("    {mode}: 2 ranks, allreduce right");
    }
    let v = built_versions(root)
        .ok_or_else(|| "horovod.torch does not import after the build".to_string())?;
    std::fs::write(stamp(root), format!("{v}\n"))
        .map_err(|e| format!("writing {}: {e}", stamp(root).display()))?;
    Ok(format!(
        "built {v} in {} (cargo xtask bench now runs the Horovod rows)",
        venv(root).display()
    ))
}

/// The 2-rank check: a sum and an average, compared with what they must be.
const CHECK_SCRIPT: &str = r#"import torch
import horovod.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
x = torch.arange(1000, dtype=torch.float32) + r
s = hvd.allreduce(x, op=hvd.Sum, name="check.sum")
want = torch.arange(1000, dtype=torch.float32) * n + n * (n - 1) / 2
assert torch.equal(s, want), (s[:4], want[:4])
a = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Average, name="check.avg")
assert torch.allclose(a, torch.full((3,), (n - 1) / 2)), a
print(f"allreduce ok rank {r} of {n}", flush=True)
hvd.shutdown()
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_is_raised_only_where_it_is_14() {
        let top = "cmake_minimum_required(VERSION 3.13)\nset(CMAKE_CXX_STANDARD 14)\n\
                   if(HAVE_TF)\n    set(CMAKE_CXX_STANDARD 17)\nendif()\n";
        let (out, n) = patch_cxx_standard(top, "CMakeLists.txt").unwrap();
        assert_eq!(n, 1);
        assert_eq!(
            out,
            "cmake_minimum_required(VERSION 3.13)\nset(CMAKE_CXX_STANDARD 20)\n\
             if(HAVE_TF)\n    set(CMAKE_CXX_STANDARD 17)\nendif()\n"
        );
        // Patched twice: unchanged, no error.
        let (again, n) = patch_cxx_standard(&out, "CMakeLists.txt").unwrap();
        assert_eq!((again.as_str(), n), (out.as_str(), 0));
        let err = patch_cxx_standard("set(CMAKE_CXX_STANDARD 17)\n", "x/CMakeLists.txt");
        assert!(err.unwrap_err().contains("x/CMakeLists.txt"));
    }

    #[test]
    fn check_build_must_list_torch_mpi_and_gloo() {
        let full = "Horovod v0.28.1:\n\nAvailable Frameworks:\n    [ ] TensorFlow\n    \
                    [X] PyTorch\n    [ ] MXNet\n\nAvailable Controllers:\n    [X] MPI\n    \
                    [X] Gloo\n";
        assert!(check_build_lacks(full).is_empty());
        let no_mpi = full.replace("[X] MPI", "[ ] MPI");
        assert_eq!(check_build_lacks(&no_mpi), ["MPI"]);
        assert_eq!(check_build_lacks(""), ["PyTorch", "MPI", "Gloo"]);
    }

    #[test]
    fn missing_tools_are_installed_as_root_or_named() {
        let missing = [("cmake", "cmake"), ("mpicxx", "libopenmpi-dev")];
        assert_eq!(
            tools_plan(&missing, true, true).unwrap(),
            ["cmake", "libopenmpi-dev"]
        );
        let e = tools_plan(&missing, false, true).unwrap_err();
        assert!(
            e.contains("`cmake` (package cmake)")
                && e.contains("apt-get install cmake libopenmpi-dev")
                && e.contains("as root"),
            "{e}"
        );
        assert!(tools_plan(&missing, true, false)
            .unwrap_err()
            .contains("apt-get was not found"));
        assert!(tools_plan(&[], false, false).unwrap().is_empty());
    }
}
