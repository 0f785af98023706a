//! `cargo xtask wheel`: the binary wheel of `fasthorovod` for Linux x86_64 (manylinux_2_17,
//! through zig), with `fhrun` and `fh-selftest` inside, and its sdist.
//!
//! maturin builds the pieces and checks each against the manylinux policy: the extension
//! (`fh-torch`, abi3 for every CPython from 3.9 on) and, as a wheel of binaries, `fh-launch`.
//! `wheel unpack`/`wheel pack` then put `fhrun` and `fh-selftest` into the extension's wheel as
//! scripts (`fasthorovod-V.data/scripts/`: pip installs them beside the environment's python,
//! as `horovodrun` comes with Horovod), and `auditwheel show` checks the wheel that results,
//! binaries included. The tools come from the package registry into a virtual environment of
//! their own under `target/wheel/tools`, at the versions pinned in [`TOOLS`].

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use crate::python;

/// The build tools, pinned to versions known to build a compliant wheel together (maturin's
/// zig support follows zig's releases; a newer zig may need a newer maturin).
pub(crate) const TOOLS: &[&str] = &[
    "maturin==1.16.0",
    "ziglang==0.17.1",
    "wheel==0.48.0",
    "auditwheel==6.8.2",
];

/// The glibc the wheel is built for: `manylinux_2_17` (CentOS 7 and every later distribution).
pub(crate) const MANYLINUX: &str = "manylinux_2_17";

/// The binaries of `fh-launch` the wheel carries.
pub(crate) const SCRIPTS: &[&str] = &["fhrun", "fh-selftest"];

/// What a build left: the wheel and the sdist.
pub(crate) struct Built {
    /// The binary wheel.
    pub wheel: PathBuf,
    /// The source distribution (it builds the extension only: a Rust toolchain, no fhrun).
    pub sdist: PathBuf,
}

/// Where the build keeps its tools, pieces and results.
pub(crate) fn dir(root: &Path) -> PathBuf {
    target_dir(root).join("wheel")
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, else `target/`).
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    let test = match args.first().map(String::as_str) {
        None => false,
        Some("--test") if args.len() == 1 => true,
        Some(a) => {
            let help = a == "-h" || a == "--help";
            if !help {
                eprintln!("xtask wheel: unexpected argument `{a}`");
            }
            eprintln!(
                "cargo xtask wheel [--test]: builds target/wheel/dist/fasthorovod-VERSION-cp39-\
                 abi3-{MANYLINUX}_x86_64.whl (the extension, fhrun and fh-selftest; for every \
                 CPython >= 3.9 and every supported torch) and the sdist, with {} from the \
                 package registry (in target/wheel/tools). --test: then install it into a fresh \
                 environment outside the tree that sees target/fh-venv's torch, and run a \
                 2-rank job and the ranks suite at np 2 with its fhrun (a stage of `cargo xtask \
                 test`)",
                TOOLS.join(" ")
            );
            return ExitCode::from(if help { 0 } else { 2 });
        }
    };
    let started = Instant::now();
    let built = match build(root) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("xtask wheel: {e}");
            return ExitCode::FAILURE;
        }
    };
    let size = std::fs::metadata(&built.wheel)
        .map(|m| m.len())
        .unwrap_or(0);
    eprintln!(
        "\n==> wheel: {} ({:.1} MB) and {} in {:.0?}\n    install it on every node: pip install \
         {}   (then: fhrun -np 2 python train.py)",
        built.wheel.display(),
        size as f64 / 1e6,
        built.sdist.display(),
        started.elapsed(),
        built.wheel.display()
    );
    if !test {
        return ExitCode::SUCCESS;
    }
    eprintln!("\n==> the wheel in a fresh environment outside the tree");
    if let Err(e) = python::ensure_venv(root) {
        eprintln!("xtask wheel --test: {e}");
        return ExitCode::FAILURE;
    }
    match crate::wheel_env::stage(root, &built.wheel, &dir(root).join("logs")) {
        Ok(line) => {
            eprintln!("==> {line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xtask wheel --test: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One step of the build, announced with its number and timed.
fn step<T>(n: usize, what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    const STEPS: usize = 6;
    eprintln!("==> wheel [{n}/{STEPS}] {what}");
    let t = Instant::now();
    let r = f();
    eprintln!("    [{n}/{STEPS}] {:.1?}", t.elapsed());
    r
}

fn run_ok(mut c: Command) -> Result<(), String> {
    let shown = format!("{c:?}");
    match c.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("{shown} exited with {s}")),
        Err(e) => Err(format!("could not start {shown}: {e}")),
    }
}

fn output(mut c: Command) -> Result<String, String> {
    let shown = format!("{c:?}");
    match c.output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => Err(format!(
            "{shown} exited with {}: {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("could not start {shown}: {e}")),
    }
}

/// The files in `dir` whose names start with `prefix` and end with `suffix`.
fn files(dir: &Path, prefix: &str, suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(suffix))
        })
        .collect();
    found.sort();
    found
}

fn one(dir: &Path, prefix: &str, suffix: &str) -> Result<PathBuf, String> {
    let found = files(dir, prefix, suffix);
    match &found[..] {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "expected one {prefix}*{suffix} in {}, found {found:?}",
            dir.display()
        )),
    }
}

fn fresh(dir: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// The tools' environment, made (or brought to [`TOOLS`]) when needed; returns its `bin/`.
fn tools(root: &Path) -> Result<PathBuf, String> {
    let venv = dir(root).join("tools");
    let bin = venv.join("bin");
    let stamp = venv.join("fh-tools.txt");
    let wanted = TOOLS.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && bin.join("maturin").is_file() {
        eprintln!("    {} has {}", venv.display(), TOOLS.join(" "));
        return Ok(bin);
    }
    let base = python::base_python()?;
    eprintln!("    creating {} with {base}", venv.display());
    let _ = std::fs::remove_dir_all(&venv);
    let mut c = Command::new(&base);
    c.args(["-m", "venv"]).arg(&venv);
    run_ok(c)?;
    eprintln!(
        "    installing {} (about 70 MB to download)",
        TOOLS.join(" ")
    );
    let mut c = Command::new(bin.join("python"));
    c.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ])
    .args(TOOLS);
    run_ok(c).map_err(|e| {
        format!("{e}: the wheel's build tools come from the package registry (PyPI)")
    })?;
    std::fs::write(&stamp, wanted).map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    Ok(bin)
}

/// Build the wheel and the sdist into `target/wheel/dist` (see the module documentation).
pub(crate) fn build(root: &Path) -> Result<Built, String> {
    let out = dir(root);
    let (parts, dist, work) = (out.join("parts"), out.join("dist"), out.join("work"));
    let bin = step(1, "build tools (maturin, zig, wheel, auditwheel)", || {
        tools(root)
    })?;
    // The tools' bin first: maturin finds zig (`python -m ziglang`) through the python there.
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let maturin = |args: &[&str]| {
        let mut c = Command::new(bin.join("maturin"));
        c.current_dir(root).args(args).env("PATH", &path);
        c
    };
    fresh(&dist)?;
    fresh(&parts)?;
    let sdist = step(2, "sdist of fh-torch (maturin sdist)", || {
        run_ok(maturin(&[
            "sdist",
            "-m",
            "fh-torch/Cargo.toml",
            "-o",
            &dist.to_string_lossy(),
        ]))?;
        one(&dist, "fasthorovod-", ".tar.gz")
    })?;
    let zig_build = |manifest: &str, extra: &[&str]| {
        let mut args = vec![
            "build",
            "--release",
            "--strip",
            "-m",
            manifest,
            "--zig",
            "--compatibility",
            MANYLINUX,
            "--auditwheel",
            "check",
        ];
        args.extend_from_slice(extra);
        let parts = parts.to_string_lossy().into_owned();
        let mut c = maturin(&args);
        c.args(["-o", &parts]);
        c
    };
    let python = bin.join("python");
    let ext = step(
        3,
        &format!("the extension, fh-torch (release, zig, {MANYLINUX}, abi3; minutes when cold)"),
        || {
            run_ok(zig_build(
                "fh-torch/Cargo.toml",
                &["-i", &python.to_string_lossy()],
            ))?;
            one(&parts, "fasthorovod-", ".whl")
        },
    )?;
    let launcher = step(
        4,
        &format!("fhrun and fh-selftest, fh-launch (release, zig, {MANYLINUX})"),
        || {
            run_ok(zig_build("fh-launch/Cargo.toml", &["-b", "bin"]))?;
            one(&parts, "fh_launch-", ".whl")
        },
    )?;
    let wheel = step(5, "fhrun into the wheel (wheel unpack, wheel pack)", || {
        assemble(&python, &ext, &launcher, &work, &dist)
    })?;
    step(6, "checks: versions, auditwheel show", || {
        check(&bin, &wheel, &work)
    })?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(Built { wheel, sdist })
}

/// The version in a wheel's file name (`name-VERSION-...`).
fn wheel_version(wheel: &Path) -> Option<String> {
    let name = wheel.file_name()?.to_str()?;
    name.split('-').nth(1).map(str::to_string)
}

fn assemble(
    python: &Path,
    ext: &Path,
    launcher: &Path,
    work: &Path,
    dist: &Path,
) -> Result<PathBuf, String> {
    let (v_ext, v_launch) = (wheel_version(ext), wheel_version(launcher));
    if v_ext.is_none() || v_ext != v_launch {
        return Err(format!(
            "the extension's wheel ({}) and fh-launch's ({}) are not of one version",
            ext.display(),
            launcher.display()
        ));
    }
    let version = v_ext.unwrap_or_default();
    fresh(work)?;
    for w in [ext, launcher] {
        let mut c = Command::new(python);
        c.args(["-m", "wheel", "unpack", "-d"]).arg(work).arg(w);
        output(c)?;
    }
    let tree = work.join(format!("fasthorovod-{version}"));
    let from = work
        .join(format!("fh_launch-{version}"))
        .join(format!("fh_launch-{version}.data"))
        .join("scripts");
    let to = tree
        .join(format!("fasthorovod-{version}.data"))
        .join("scripts");
    std::fs::create_dir_all(&to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    for s in SCRIPTS {
        std::fs::copy(from.join(s), to.join(s))
            .map_err(|e| format!("cannot copy {s} from fh-launch's wheel: {e}"))?;
    }
    let mut c = Command::new(python);
    c.args(["-m", "wheel", "pack", "-d"]).arg(dist).arg(&tree);
    output(c)?;
    one(dist, "fasthorovod-", ".whl")
}

fn check(bin: &Path, wheel: &Path, work: &Path) -> Result<(), String> {
    let release = env!("CARGO_PKG_VERSION");
    let version = wheel_version(wheel).unwrap_or_default();
    if version != release {
        return Err(format!(
            "the wheel is version {version}, the workspace {release}"
        ));
    }
    let fhrun = work
        .join(format!("fasthorovod-{version}"))
        .join(format!("fasthorovod-{version}.data"))
        .join("scripts")
        .join("fhrun");
    let mut c = Command::new(&fhrun);
    c.arg("--version");
    let said = output(c)?;
    if !said.starts_with(&format!("fhrun {release} ")) {
        return Err(format!(
            "the wheel's fhrun says {said:?}, the wheel is {release}"
        ));
    }
    eprintln!("    {}", said.trim());
    let mut c = Command::new(bin.join("auditwheel"));
    c.arg("show").arg(wheel);
    let shown = output(c)?;
    let flat = shown.split_whitespace().collect::<Vec<_>>().join(" ");
    eprintln!("    auditwheel: {}", flat.split(". ").next().unwrap_or(""));
    let claim = format!("consistent with the following platform tag: \"{MANYLINUX}_x86_64\"");
    if !flat.contains(&claim) {
        return Err(format!(
            "auditwheel does not find the wheel {MANYLINUX}-compliant (fhrun included):\n{shown}"
        ));
    }
    Ok(())
}
