//! The wheel as a user gets it: installed with pip into a fresh virtual environment outside
//! the source tree, with no Rust toolchain on PATH and nothing built (`--only-binary :all:`),
//! then a 2-rank job and the ranks suite (`fh-torch/tests/ranks`, copied out of the tree)
//! launched by the wheel's own `fhrun`. A stage of `cargo xtask test` (with the torch of
//! `target/fh-venv`, seen through a `.pth` file: nothing is downloaded) and the cell of
//! `cargo xtask compat` (with a torch of its own).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::python;

/// A directory removed (with everything in it) when dropped.
pub(crate) struct Scratch(PathBuf);

impl Scratch {
    /// A fresh directory under the system's temporary directory, outside the source tree.
    pub(crate) fn new(tag: &str) -> Result<Scratch, String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("fh-{tag}-{}-{nanos:08x}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| format!("cannot create {}: {e}", p.display()))?;
        Ok(Scratch(p))
    }

    /// Its path.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A virtual environment the wheel is installed into.
pub(crate) struct Env {
    /// Its root.
    pub venv: PathBuf,
    /// Its interpreter.
    pub python: PathBuf,
    /// PATH for everything run in it: its `bin/` and the system's, no Rust toolchain.
    pub path: String,
}

impl Env {
    /// The wheel's `fhrun`, as pip installed it.
    pub(crate) fn fhrun(&self) -> PathBuf {
        self.venv.join("bin").join("fhrun")
    }

    /// A command run in the environment: its PATH, no `PYTHONPATH`, from `cwd`.
    pub(crate) fn command(&self, program: impl AsRef<std::ffi::OsStr>, cwd: &Path) -> Command {
        let mut c = Command::new(program);
        c.current_dir(cwd)
            .env("PATH", &self.path)
            .env("VIRTUAL_ENV", &self.venv)
            .env_remove("PYTHONPATH")
            .env_remove("PYTHONHOME")
            .env_remove("CARGO_TARGET_DIR")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("OMP_NUM_THREADS", "1")
            .env("FH_TIMEOUT_SECONDS", "30");
        c
    }
}

/// Directories a PATH without a Rust toolchain keeps, after the environment's own `bin/`.
const SYSTEM_PATH: &[&str] = &["/usr/local/bin", "/usr/bin", "/bin"];

/// Whether `name` is an executable in one of `dirs`.
fn on_path(name: &str, dirs: &[PathBuf]) -> bool {
    dirs.iter().any(|d| d.join(name).is_file())
}

fn run_quiet(mut c: Command, what: &str) -> Result<String, String> {
    match c.output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => Err(format!(
            "{what} failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("{what}: cannot start: {e}")),
    }
}

/// A fresh virtual environment at `venv` made by `base` (pip from its own bundle, offline),
/// seeing the directories of `sites` after its own site-packages (a `.pth` file).
pub(crate) fn make(base: &Path, venv: &Path, sites: &[PathBuf]) -> Result<Env, String> {
    let _ = std::fs::remove_dir_all(venv);
    let mut c = Command::new(base);
    c.args(["-m", "venv"]).arg(venv);
    run_quiet(c, &format!("{} -m venv {}", base.display(), venv.display()))?;
    let python = venv.join("bin").join("python");
    let mut dirs = vec![venv.join("bin")];
    dirs.extend(
        SYSTEM_PATH
            .iter()
            .map(PathBuf::from)
            .filter(|d| !on_path("cargo", std::slice::from_ref(d)))
            .filter(|d| !on_path("rustc", std::slice::from_ref(d))),
    );
    let path = std::env::join_paths(&dirs)
        .map_err(|e| format!("bad PATH: {e}"))?
        .to_string_lossy()
        .into_owned();
    let env = Env {
        venv: venv.to_path_buf(),
        python,
        path,
    };
    if !sites.is_empty() {
        let mut c = env.command(&env.python, venv);
        c.args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ]);
        let purelib = run_quiet(c, "asking the environment for its site-packages")?;
        let pth = Path::new(purelib.trim()).join("fh-outside-sites.pth");
        let lines: Vec<String> = sites.iter().map(|s| s.display().to_string()).collect();
        std::fs::write(&pth, lines.join("\n") + "\n")
            .map_err(|e| format!("cannot write {}: {e}", pth.display()))?;
    }
    Ok(env)
}

/// `pip install` of `wheel` into `env`, from the file alone (`--no-index`) and binary only
/// (`--only-binary :all:`: nothing is compiled); with `no_deps`, torch is not looked at.
/// Returns how long pip took.
pub(crate) fn install(env: &Env, wheel: &Path, no_deps: bool) -> Result<Duration, String> {
    let mut c = env.command(&env.python, &env.venv);
    c.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-index",
        "--only-binary",
        ":all:",
    ]);
    if no_deps {
        c.arg("--no-deps");
    }
    c.arg(wheel);
    let t = Instant::now();
    run_quiet(c, &format!("pip install {}", wheel.display()))?;
    Ok(t.elapsed())
}

/// The site-packages directory that holds the torch `python` imports.
pub(crate) fn torch_site(python: &Path) -> Result<PathBuf, String> {
    let mut c = Command::new(python);
    c.args([
        "-c",
        "import os, torch; print(os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))))",
    ]);
    let out = run_quiet(c, &format!("{} -c 'import torch'", python.display()))?;
    Ok(PathBuf::from(out.trim()))
}

/// Entries of a site-packages directory that a view of its torch leaves out: FastHorovod
/// itself (the wheel brings its own), the packaging tools (the environment has its own) and
/// `.pth` files.
fn left_out(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    [
        "fasthorovod",
        "pip",
        "setuptools",
        "_distutils_hack",
        "pkg_resources",
        "wheel",
        "maturin",
    ]
    .iter()
    .any(|p| lower == *p || lower.starts_with(&format!("{p}-")))
        || lower.ends_with(".pth")
        || lower == "__pycache__"
}

/// A view of `site` (symbolic links, nothing copied) at `into` without FastHorovod: torch and
/// what it needs, and pytest, exactly as installed there.
pub(crate) fn view_without_fasthorovod(site: &Path, into: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(into);
    std::fs::create_dir_all(into).map_err(|e| format!("cannot create {}: {e}", into.display()))?;
    let entries =
        std::fs::read_dir(site).map_err(|e| format!("cannot list {}: {e}", site.display()))?;
    for e in entries.flatten() {
        let name = e.file_name();
        if left_out(&name.to_string_lossy()) {
            continue;
        }
        std::os::unix::fs::symlink(e.path(), into.join(&name))
            .map_err(|err| format!("cannot link {}: {err}", e.path().display()))?;
    }
    Ok(())
}

/// Copy `from` into `to` recursively (`__pycache__` left out).
fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    let entries =
        std::fs::read_dir(from).map_err(|e| format!("cannot list {}: {e}", from.display()))?;
    for e in entries.flatten() {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_name() == "__pycache__" {
            continue;
        }
        if src.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst)
                .map_err(|err| format!("cannot copy {}: {err}", src.display()))?;
        }
    }
    Ok(())
}

/// The Python sources the suites need, copied to `into` in the tree's layout (`tests/ranks`,
/// `examples`), so that nothing is imported from the checkout.
pub(crate) fn copy_suites(root: &Path, into: &Path) -> Result<(), String> {
    let torch = root.join("fh-torch");
    copy_tree(
        &torch.join("tests").join("ranks"),
        &into.join("tests").join("ranks"),
    )?;
    copy_tree(&torch.join("examples"), &into.join("examples"))
}

/// What pytest's closing line counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    pub passed: u32,
    pub failed: u32,
    pub skipped: u32,
    pub errors: u32,
}

/// The counts of rank 0's closing pytest line (`[0]<stdout>:12 passed, 1 skipped in 3.4s`,
/// with or without fhrun's prefix and pytest's `=` rule); `None` when there is none.
pub(crate) fn parse_counts(output: &str) -> Option<Counts> {
    let mut found = None;
    for line in output.lines() {
        let text = match line.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some(("0", after)) => after.split_once(':').map_or(after, |(_, t)| t),
                _ => continue,
            },
            None => line,
        };
        let text = text.trim().trim_matches('=').trim();
        let Some((counts, time)) = text.rsplit_once(" in ") else {
            continue;
        };
        // `4.56s`, or past a minute `61.13s (0:01:01)`.
        let seconds = time.split_once(" (").map_or(time, |(s, _)| s).trim_end();
        if !seconds.ends_with('s') || seconds[..seconds.len() - 1].parse::<f64>().is_err() {
            continue;
        }
        let mut c = Counts::default();
        let mut any = false;
        for part in counts.split(", ") {
            let Some((n, what)) = part.trim().split_once(' ') else {
                any = false;
                break;
            };
            let Ok(n) = n.parse::<u32>() else {
                any = false;
                break;
            };
            match what {
                "passed" => c.passed += n,
                "failed" => c.failed += n,
                "skipped" => c.skipped += n,
                "error" | "errors" => c.errors += n,
                _ => {}
            }
            any = true;
        }
        if any {
            found = Some(c);
        }
    }
    found
}

/// The ranks suite at `np` ranks, launched by the environment's `fhrun` from `work` (which
/// holds [`copy_suites`]). Returns rank 0's counts and whether every rank passed; the output
/// goes to `log`.
pub(crate) fn ranks_suite(
    env: &Env,
    work: &Path,
    np: usize,
    log: &Path,
) -> Result<(Counts, bool), String> {
    let mut c = env.command(env.fhrun(), work);
    c.args(["-np", &np.to_string(), "--timeout", "900"])
        .arg(&env.python)
        .args([
            "-m",
            "pytest",
            "tests/ranks",
            "-q",
            "-p",
            "no:cacheprovider",
        ]);
    let out = run_logged(c, log)?;
    let counts = parse_counts(&out.1).ok_or_else(|| {
        format!(
            "no pytest summary from rank 0 (see {}); its end:\n{}",
            log.display(),
            tail(&out.1, 30)
        )
    })?;
    Ok((counts, out.0))
}

/// Runs `c`, its stdout and stderr together into `log`; returns success and the output.
fn run_logged(mut c: Command, log: &Path) -> Result<(bool, String), String> {
    let file =
        std::fs::File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
    let err = file
        .try_clone()
        .map_err(|e| format!("cannot reopen {}: {e}", log.display()))?;
    let shown = format!("{c:?}");
    let status = c
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .status()
        .map_err(|e| format!("cannot start {shown}: {e}"))?;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    Ok((status.success(), text))
}

/// The last `n` lines of `text`.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The checks that the environment's `fasthorovod` and `fhrun` are the wheel's, of this
/// release, and that nothing comes from the checkout at `root`.
pub(crate) fn check_installed(env: &Env, root: &Path, cwd: &Path) -> Result<String, String> {
    let release = env!("CARGO_PKG_VERSION");
    let mut c = env.command(env.fhrun(), cwd);
    c.arg("--version");
    let said = run_quiet(c, "the wheel's fhrun --version")?;
    if !said.starts_with(&format!("fhrun {release} ")) {
        return Err(format!(
            "the wheel's fhrun says {said:?}, expected {release}"
        ));
    }
    let code = "import sys, fasthorovod, fasthorovod.torch, torch\n\
                print(fasthorovod.__file__)\n\
                print(fasthorovod.__version__, torch.__version__)\n\
                print('\\n'.join(sys.path))";
    let mut c = env.command(&env.python, cwd);
    c.args(["-c", code]);
    let out = run_quiet(c, "import fasthorovod.torch in the environment")?;
    let mut lines = out.lines();
    let file = lines.next().unwrap_or_default();
    let versions = lines.next().unwrap_or_default().to_string();
    if !Path::new(file).starts_with(&env.venv) {
        return Err(format!(
            "fasthorovod was imported from {file}, not from the wheel in {}",
            env.venv.display()
        ));
    }
    let sources = root.join("fh-torch");
    if let Some(p) = lines.find(|p| Path::new(p).starts_with(&sources)) {
        return Err(format!(
            "the checkout's Python sources are importable: {p} is on sys.path"
        ));
    }
    let dirs: Vec<PathBuf> = std::env::split_paths(&env.path).collect();
    for tool in ["cargo", "rustc"] {
        if on_path(tool, &dirs) {
            return Err(format!("{tool} is on the environment's PATH {}", env.path));
        }
    }
    let (ours, torch) = versions.split_once(' ').unwrap_or((&versions, "?"));
    Ok(format!(
        "{}; fasthorovod {ours} from the wheel, torch {torch}",
        said.trim()
    ))
}

/// The 2-rank jobs: the example `train_synthetic_cnn.py` under the wheel's fhrun, whose two
/// ranks must end with bit-identical parameters, and the wheel's `fh-selftest`.
pub(crate) fn two_rank_job(env: &Env, work: &Path, log: &Path) -> Result<(), String> {
    let mut c = env.command(env.fhrun(), work);
    c.args(["-np", "2", "--timeout", "300"])
        .arg(&env.python)
        .args([
            "examples/train_synthetic_cnn.py",
            "--steps",
            "10",
            "--save",
            "params-{rank}.pt",
        ]);
    let (ok, out) = run_logged(c, log)?;
    if !ok {
        return Err(format!(
            "the 2-rank job failed (see {}):\n{}",
            log.display(),
            tail(&out, 30)
        ));
    }
    let mut c = env.command(&env.python, work);
    c.args([
        "-c",
        "import torch\n\
         a, b = (torch.load(f'params-{r}.pt') for r in (0, 1))\n\
         assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), 'differ'",
    ]);
    run_quiet(c, "comparing the two ranks' parameters")?;
    // The wheel's other binary: every collective, without Python.
    let mut c = env.command(env.fhrun(), work);
    c.args(["-np", "2", "--timeout", "120", "fh-selftest"]);
    run_quiet(c, "fhrun -np 2 fh-selftest").map(|_| ())
}

/// The stage of `cargo xtask test`: `wheel` into a fresh environment that sees the torch of
/// `target/fh-venv`, then the checks, the 2-rank job and the ranks suite at np 2, their logs in
/// `logs`. Returns a line for the summary.
pub(crate) fn stage(root: &Path, wheel: &Path, logs: &Path) -> Result<String, String> {
    let scratch = Scratch::new("wheel-env")?;
    let dir = scratch.path();
    let fh_python = python::python(root);
    let site = torch_site(&fh_python)?;
    let view = dir.join("torch-site");
    view_without_fasthorovod(&site, &view)?;
    let mut c = Command::new(&fh_python);
    c.args([
        "-c",
        "import os, sys; print(os.path.join(sys.base_prefix, 'bin', 'python%d.%d' % sys.version_info[:2]))",
    ]);
    let base = PathBuf::from(run_quiet(c, "finding target/fh-venv's interpreter")?.trim());
    let t = Instant::now();
    let env = make(&base, &dir.join("venv"), &[view])?;
    let made = t.elapsed();
    // --no-deps: the torch it requires is there, but pip would also judge torch's own
    // requirements, which an environment's history can leave unmet (torch 2.15 asks for a
    // newer setuptools than the one venv bundles); `import fasthorovod.torch` below checks
    // that the torch is a supported one.
    let took = install(&env, wheel, true)?;
    eprintln!(
        "    environment made in {made:.1?}; pip installed the wheel in {took:.1?} (no \
         compiler, nothing downloaded)"
    );
    let work = dir.join("work");
    copy_suites(root, &work)?;
    let said = check_installed(&env, root, &work)?;
    eprintln!("    {said}");
    std::fs::create_dir_all(logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
    let t = Instant::now();
    two_rank_job(&env, &work, &logs.join("job-np2.log"))?;
    eprintln!(
        "    2-rank job (train_synthetic_cnn.py): ranks equal, {:.1?}",
        t.elapsed()
    );
    let t = Instant::now();
    let log = logs.join("ranks-np2.log");
    let (counts, ok) = ranks_suite(&env, &work, 2, &log)?;
    let line = format!(
        "pip install {took:.1?}; ranks suite np 2: {} passed, {} failed, {} skipped ({:.0?})",
        counts.passed,
        counts.failed + counts.errors,
        counts.skipped,
        t.elapsed()
    );
    if !ok || counts.failed + counts.errors > 0 || counts.passed == 0 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        return Err(format!(
            "{line}; see {}:\n{}",
            log.display(),
            tail(&text, 40)
        ));
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zeros_closing_line_is_counted() {
        let out = "[1]<stdout>:5 passed in 1.00s\n\
                   [0]<stdout>:....s.F\n\
                   [0]<stdout>:= 12 passed, 2 failed, 3 skipped, 1 error in 4.56s =\n";
        assert_eq!(
            parse_counts(out),
            Some(Counts {
                passed: 12,
                failed: 2,
                skipped: 3,
                errors: 1
            })
        );
        assert_eq!(
            parse_counts("7 passed, 1 warning in 0.5s\n"),
            Some(Counts {
                passed: 7,
                ..Counts::default()
            })
        );
        assert_eq!(
            parse_counts("[0]<stdout>:collected 3 items in here\n"),
            None
        );
        assert_eq!(parse_counts("[1]<stdout>:5 passed in 1.00s\n"), None);
        // A run of over a minute: pytest adds the time as H:MM:SS.
        assert_eq!(
            parse_counts("[0]<stdout>:498 passed, 13 skipped, 2 warnings in 61.13s (0:01:01)\n"),
            Some(Counts {
                passed: 498,
                skipped: 13,
                ..Counts::default()
            })
        );
    }

    #[test]
    fn the_view_of_torch_leaves_fasthorovod_and_the_packaging_tools_out() {
        for name in [
            "fasthorovod",
            "fasthorovod-0.1.0.dist-info",
            "pip",
            "pip-23.2.1.dist-info",
            "setuptools",
            "distutils-precedence.pth",
            "zz-main-venv.pth",
            "__pycache__",
        ] {
            assert!(left_out(name), "{name}");
        }
        for name in [
            "torch",
            "torch-2.15.0.dist-info",
            "nvidia",
            "pytest",
            "pipdeptree",
            "wheelhouse",
        ] {
            assert!(!left_out(name), "{name}");
        }
    }
}
