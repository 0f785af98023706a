//! `cargo xtask compat`: the one wheel of `cargo xtask wheel` against several PyTorch releases
//! and Python versions: for each pair that PyTorch publishes a wheel for, a fresh environment
//! with that torch (from the package registry, `--no-deps` plus what torch needs to import:
//! its CUDA libraries, which PyPI's Linux torch links, and its small Python dependencies; not
//! triton, which only `torch.compile` uses), the wheel installed with pip, and the ranks suite
//! at np 2 under the wheel's own `fhrun` ([`crate::wheel_env`]). Prints the table (torch ×
//! Python → passed/failed) and writes it into README.md between its compat markers.
//!
//! Downloads are kept in `target/compat/wheels` (several GB: PyPI's torch wheels carry CUDA)
//! and installed from there; each environment is removed once its suite has run.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use crate::wheel_env::{self, Counts, Env, Scratch};
use crate::{python, wheel};

/// The torch between the oldest claimed and the newest: 2.8, the last release with wheels for
/// Python 3.9 (the oldest Python the wheel supports), so that it runs on both Pythons.
pub(crate) const MIDDLE_TORCH: &str = "2.8.0";

/// README.md's markers around the table.
const BEGIN: &str = "<!-- compat table: written by `cargo xtask compat` -->";
const END: &str = "<!-- end of compat table -->";

/// One Python interpreter found on this machine.
#[derive(Debug, Clone)]
struct Interpreter {
    minor: u32,
    path: PathBuf,
    version: String,
}

/// The result of one (torch, Python) pair.
enum Cell {
    /// PyTorch publishes no wheel of this release for this Python.
    NoWheel,
    /// The suite ran: rank 0's counts, whether every rank passed, how long setting up (torch
    /// fetched and installed, the wheel installed) and the suite took, and the environment's
    /// size.
    Ran(Counts, bool, (Duration, Duration), u64),
    /// Setting up failed before the suite could run.
    Broken(String),
}

fn dir(root: &Path) -> PathBuf {
    root.join("target").join("compat")
}

pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    let mut torches: Option<Vec<String>> = None;
    let mut pythons: Option<Vec<PathBuf>> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.next()) {
            ("--torch", Some(v)) => torches = Some(v.split(',').map(str::to_string).collect()),
            ("--python", Some(v)) => pythons = Some(v.split(',').map(PathBuf::from).collect()),
            _ => {
                eprintln!(
                    "cargo xtask compat [--torch V1,V2,..] [--python PATH1,PATH2,..]: the wheel \
                     against torch (default: the oldest claimed, {MIDDLE_TORCH} and the newest on \
                     the registry) on Python (default: the oldest >= 3.9 and the newest found: \
                     PATH, pyenv, /usr/bin), the ranks suite at np 2 for each; writes the table \
                     into README.md. Several GB of downloads, cached in target/compat."
                );
                return ExitCode::from(if a == "-h" || a == "--help" { 0 } else { 2 });
            }
        }
    }
    match compat(root, torches, pythons) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("xtask compat: {e}");
            ExitCode::FAILURE
        }
    }
}

fn compat(
    root: &Path,
    torches: Option<Vec<String>>,
    pythons: Option<Vec<PathBuf>>,
) -> Result<bool, String> {
    let started = Instant::now();
    // Only the default matrix goes into the README; a chosen one into target/compat alone.
    let whole = torches.is_none() && pythons.is_none();
    if whole {
        write_readme(root, None)?;
    }
    let built = wheel::build(root)?;
    let interpreters = match pythons {
        Some(paths) => paths
            .iter()
            .map(|p| probe(p).ok_or_else(|| format!("{} is not a working Python", p.display())))
            .collect::<Result<Vec<_>, _>>()?,
        None => {
            let all = find_pythons();
            eprintln!(
                "==> Pythons found: {}",
                all.iter()
                    .map(|i| format!("{} ({})", i.version, i.path.display()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            match (all.first(), all.last()) {
                (Some(a), Some(b)) if a.minor != b.minor => vec![a.clone(), b.clone()],
                (Some(a), _) => vec![a.clone()],
                _ => return Err("no Python 3.9 or newer found".into()),
            }
        }
    };
    let torches = match torches {
        Some(t) => t,
        None => vec![
            format!("{}.0", claimed_min(root)?),
            MIDDLE_TORCH.to_string(),
            newest_torch(root)?,
        ],
    };
    let cache = dir(root).join("wheels");
    std::fs::create_dir_all(&cache)
        .map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    let logs = dir(root).join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
    let mut table: Vec<(String, String, Cell)> = Vec::new();
    for t in &torches {
        for py in &interpreters {
            eprintln!("\n==> torch {t} on Python {}", py.version);
            let cell = one_pair(root, &built.wheel, t, py, &cache, &logs);
            match &cell {
                Cell::NoWheel => eprintln!("    no torch {t} wheel for Python {}", py.version),
                Cell::Ran(c, ok, (setup, suite), size) => eprintln!(
                    "    {} passed, {} failed, {} skipped{} (set up in {setup:.0?}, suite \
                     {suite:.0?}; environment {:.1} GB)",
                    c.passed,
                    c.failed + c.errors,
                    c.skipped,
                    if *ok { "" } else { "; a rank failed" },
                    *size as f64 / 1e9
                ),
                Cell::Broken(e) => eprintln!("    could not run: {e}"),
            }
            table.push((t.clone(), py.version.clone(), cell));
        }
    }
    let text = render(&built.wheel, &torches, &interpreters, &table);
    eprintln!("\n{text}");
    let cache_size = du(&cache);
    eprintln!(
        "==> {:.0?} in all; download cache {} holds {:.1} GB",
        started.elapsed(),
        cache.display(),
        cache_size as f64 / 1e9
    );
    std::fs::write(dir(root).join("table.md"), &text)
        .map_err(|e| format!("cannot write the table: {e}"))?;
    if whole {
        write_readme(root, Some(&text))?;
    } else {
        eprintln!(
            "==> the table is in target/compat/table.md (README.md takes only the default \
             matrix)"
        );
    }
    let all_ok = table.iter().all(|(_, _, c)| match c {
        Cell::NoWheel => true,
        Cell::Ran(c, ok, ..) => *ok && c.failed + c.errors == 0 && c.passed > 0,
        Cell::Broken(_) => false,
    });
    Ok(all_ok)
}

/// The oldest torch the package claims, `X.Y`, from `torch>=X.Y` in fh-torch/pyproject.toml.
fn claimed_min(root: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(root.join("fh-torch").join("pyproject.toml"))
        .map_err(|e| format!("cannot read fh-torch/pyproject.toml: {e}"))?;
    text.split("\"torch>=")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .map(str::to_string)
        .ok_or_else(|| "fh-torch/pyproject.toml states no `torch>=` requirement".into())
}

/// The newest torch on the registry (`pip index versions torch`).
fn newest_torch(root: &Path) -> Result<String, String> {
    let mut c = Command::new(python::python(root));
    c.args([
        "-m",
        "pip",
        "index",
        "versions",
        "torch",
        "--disable-pip-version-check",
    ]);
    let out = c
        .output()
        .map_err(|e| format!("cannot ask the registry for torch's versions: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("torch (")?.strip_suffix(')'))
        .map(str::to_string)
        .ok_or_else(|| format!("`pip index versions torch` said: {text}"))
}

/// A Python's minor version and full version, if it runs and is 3.9 or newer.
fn probe(path: &Path) -> Option<Interpreter> {
    let out = Command::new(path)
        .args([
            "-c",
            "import sys, venv, ensurepip; print(sys.version_info[1], sys.version.split()[0])",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (minor, version) = text.trim().split_once(' ')?;
    let minor: u32 = minor.parse().ok()?;
    (minor >= 9 && version.starts_with("3.")).then(|| Interpreter {
        minor,
        path: path.to_path_buf(),
        version: version.to_string(),
    })
}

/// Every CPython 3.9+ this machine has, one per minor version, oldest first: `python3.N` on
/// PATH, pyenv's versions (`$PYENV_ROOT`, else `~/.pyenv`), `/usr/bin`, `/usr/local/bin`.
fn find_pythons() -> Vec<Interpreter> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    let path_dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")));
    let mut pyenv_bins: Vec<PathBuf> = pyenv
        .and_then(|p| std::fs::read_dir(p.join("versions")).ok())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .collect();
    pyenv_bins.sort();
    for minor in 9..=30 {
        let name = format!("python3.{minor}");
        for d in path_dirs
            .iter()
            .chain(&pyenv_bins)
            .chain(&[PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        {
            let p = d.join(&name);
            if p.is_file() {
                candidates.push(p);
            }
        }
    }
    let mut found: Vec<Interpreter> = Vec::new();
    for c in candidates {
        if let Some(i) = probe(&c) {
            if !found.iter().any(|f| f.minor == i.minor) {
                found.push(i);
            }
        }
    }
    found.sort_by_key(|i| i.minor);
    found
}

/// Bytes under `p` (files only, links not followed).
fn du(p: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if meta.is_dir() {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| du(&e.path()))
            .sum()
    } else if meta.is_file() {
        meta.len()
    } else {
        0
    }
}

fn pip(env: &Env) -> Command {
    let mut c = env.command(&env.python, &env.venv);
    c.args(["-m", "pip", "--disable-pip-version-check"]);
    c
}

/// `pip download` into `cache` (files already there are kept, not fetched again), then
/// `pip install` from `cache` alone. `what` is `torch==V` (`--no-deps`) or `-r FILE`.
fn fetch_and_install(env: &Env, cache: &Path, what: &[&str], no_deps: bool) -> Result<(), String> {
    let mut c = pip(env);
    c.args(["download", "--quiet", "--only-binary", ":all:", "-d"])
        .arg(cache);
    if no_deps {
        c.arg("--no-deps");
    }
    c.args(what);
    let o = c.output().map_err(|e| format!("cannot run pip: {e}"))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let mut c = pip(env);
    c.args(["install", "--quiet", "--no-index", "--find-links"])
        .arg(cache);
    if no_deps {
        c.arg("--no-deps");
    }
    c.args(what);
    let o = c.output().map_err(|e| format!("cannot run pip: {e}"))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    Ok(())
}

fn one_pair(
    root: &Path,
    wheel: &Path,
    torch: &str,
    py: &Interpreter,
    cache: &Path,
    logs: &Path,
) -> Cell {
    let t = Instant::now();
    let scratch = match Scratch::new("compat") {
        Ok(s) => s,
        Err(e) => return Cell::Broken(e),
    };
    let env = match wheel_env::make(&py.path, &scratch.path().join("venv"), &[]) {
        Ok(e) => e,
        Err(e) => return Cell::Broken(e),
    };
    // torch alone first: a release without a wheel for this Python ends the pair here.
    let spec = format!("torch=={torch}");
    if let Err(e) = fetch_and_install(&env, cache, &[&spec], true) {
        if e.contains("No matching distribution") {
            return Cell::NoWheel;
        }
        return Cell::Broken(format!("pip install {spec}: {e}"));
    }
    // What torch needs to import, from its own metadata (pip evaluates the markers), less
    // triton; and pytest for the suite.
    let reqs = scratch.path().join("torch-needs.txt");
    let mut c = env.command(&env.python, &env.venv);
    c.args([
        "-c",
        "import importlib.metadata as m, sys\n\
         keep = [r for r in m.requires('torch') or [] if not r.lower().startswith('triton')]\n\
         open(sys.argv[1], 'w').write('\\n'.join(keep + ['pytest']) + '\\n')",
    ])
    .arg(&reqs);
    if let Err(e) = c.output().map_err(|e| e.to_string()).and_then(|o| {
        o.status
            .success()
            .then_some(())
            .ok_or_else(|| String::from_utf8_lossy(&o.stderr).into_owned())
    }) {
        return Cell::Broken(format!("reading torch's requirements: {e}"));
    }
    let reqs_arg = reqs.to_string_lossy().into_owned();
    if let Err(e) = fetch_and_install(&env, cache, &["-r", &reqs_arg], false) {
        return Cell::Broken(format!("installing what torch {torch} needs: {e}"));
    }
    if let Err(e) = wheel_env::install(&env, wheel, true) {
        return Cell::Broken(e);
    }
    let work = scratch.path().join("work");
    if let Err(e) = wheel_env::copy_suites(root, &work) {
        return Cell::Broken(e);
    }
    match wheel_env::check_installed(&env, root, &work) {
        Ok(said) => eprintln!("    {said}"),
        Err(e) => return Cell::Broken(e),
    }
    let size = du(&env.venv);
    let setup = t.elapsed();
    let log = logs.join(format!("torch-{torch}-py{}.log", py.version));
    match wheel_env::ranks_suite(&env, &work, 2, &log) {
        Ok((counts, ok)) => Cell::Ran(counts, ok, (setup, t.elapsed() - setup), size),
        Err(e) => Cell::Broken(e),
    }
}

/// The table, in Markdown, with the wheel it tested.
fn render(
    wheel: &Path,
    torches: &[String],
    pythons: &[Interpreter],
    table: &[(String, String, Cell)],
) -> String {
    let name = wheel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut t = format!(
        "From `cargo xtask compat` on {}: one wheel,\n`{name}`,\nthe ranks suite \
         (`fh-torch/tests/ranks`) at np 2 under its `fhrun` (rank 0's counts):\n\n| torch |",
        today()
    );
    for p in pythons {
        t += &format!(" Python {} |", p.version);
    }
    t += "\n|---|";
    t += &"---|".repeat(pythons.len());
    t += "\n";
    for torch in torches {
        t += &format!("| {torch} |");
        for p in pythons {
            let cell = table
                .iter()
                .find(|(tv, pv, _)| tv == torch && *pv == p.version)
                .map(|(_, _, c)| c);
            t += &match cell {
                Some(Cell::Ran(c, ok, ..)) => format!(
                    " {} passed, {} failed{}{} |",
                    c.passed,
                    c.failed + c.errors,
                    if c.skipped > 0 {
                        format!(", {} skipped", c.skipped)
                    } else {
                        String::new()
                    },
                    if *ok { "" } else { " (a rank failed)" }
                ),
                Some(Cell::NoWheel) => " no torch wheel for this Python |".to_string(),
                Some(Cell::Broken(_)) => " could not run (see the log) |".to_string(),
                None => " — |".to_string(),
            };
        }
        t += "\n";
    }
    t
}

/// Today's date (UTC), `YYYY-MM-DD` (`date -u`).
fn today() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "today".into())
}

/// Puts `table` between README.md's compat markers (`None`: only checks that they are there).
fn write_readme(root: &Path, table: Option<&str>) -> Result<(), String> {
    let path = root.join("README.md");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read README.md: {e}"))?;
    let (Some(b), Some(e)) = (text.find(BEGIN), text.find(END)) else {
        return Err(format!("README.md has no compat markers ({BEGIN} … {END})"));
    };
    let Some(table) = table else {
        return Ok(());
    };
    let new = format!("{}{BEGIN}\n{table}{}", &text[..b], &text[e..]);
    std::fs::write(&path, new).map_err(|e| format!("cannot write README.md: {e}"))?;
    eprintln!("==> README.md: table written");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_every_pair() {
        let py = |v: &str| Interpreter {
            minor: v[2..].parse().unwrap(),
            path: PathBuf::from("/x"),
            version: format!("{v}.0"),
        };
        let pythons = [py("3.9"), py("3.13")];
        let torches = ["2.1.0".to_string(), "2.15.0".to_string()];
        let counts = Counts {
            passed: 10,
            failed: 1,
            skipped: 2,
            errors: 0,
        };
        let table = vec![
            (
                "2.1.0".into(),
                "3.9.0".into(),
                Cell::Ran(counts, false, (Duration::ZERO, Duration::ZERO), 0),
            ),
            ("2.1.0".into(), "3.13.0".into(), Cell::NoWheel),
            ("2.15.0".into(), "3.9.0".into(), Cell::Broken("x".into())),
        ];
        let t = render(Path::new("/d/fh.whl"), &torches, &pythons, &table);
        assert!(
            t.contains("| torch | Python 3.9.0 | Python 3.13.0 |"),
            "{t}"
        );
        assert!(
            t.contains("| 2.1.0 | 10 passed, 1 failed, 2 skipped (a rank failed) | no torch wheel for this Python |"),
            "{t}"
        );
        assert!(
            t.contains("| 2.15.0 | could not run (see the log) | — |"),
            "{t}"
        );
    }
}
