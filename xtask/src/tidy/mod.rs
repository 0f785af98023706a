//! Structural checks of the repository, run by `cargo xtask tidy`, by `cargo xtask test` and as
//! ordinary `#[test]`s (`cargo test -p xtask`).
//!
//! - **Layering**: each crate's direct dependencies respect DESIGN.md's "must not know" column
//!   (see `layering::RULES`); parsed from the crates' `Cargo.toml` files.
//! - Every library crate has `#![deny(missing_docs)]`.
//! - No printing (`println!`, `eprintln!`, `dbg!`, ...) and no `process::exit` in library code.
//! - CUDA and NCCL bindings (`cudarc`, `fh-nccl-sys`) only in fh-transport, and `cudarc`
//!   loaded at run time with an explicit CUDA version (the `cuda` feature needs no toolkit).
//! - The README's first lines give the two commands and then the Install section; `.ci/run`
//!   calls `cargo xtask test`; `ARCHITECTURE.md` mentions every crate.
//! - One release: every crate takes the workspace's version (the wheel's, `fhrun`'s and the
//!   release the ranks compare); the supported PyTorch is stated alike in
//!   `fh-torch/pyproject.toml`, `fasthorovod/_compat.py` and the README.

mod imports;
mod layering;
mod sockets;

use layering::{check_cudarc_features, check_layering};
use std::fs;
use std::path::{Path, PathBuf};

/// The commands the README's first lines must give.
const README_COMMANDS: &[&str] = &["cargo xtask bench --quick", "cargo xtask test"];
/// How many of the README's first lines are searched.
const README_HEAD_LINES: usize = 12;
/// The heading the README's first lines must reach, right after the commands.
const README_INSTALL: &str = "## Install";
/// Macros and calls that library code must not use.
const FORBIDDEN_IN_LIBRARIES: &[&str] = &[
    "println!(",
    "print!(",
    "eprintln!(",
    "eprint!(",
    "dbg!(",
    "process::exit(",
    "io::stderr(",
    "io::stdout(",
];

/// The few places where a library writes to the terminal itself, each with its reason:
/// (file relative to the root, forbidden call).
const DIRECT_OUTPUT_ALLOWED: &[(&str, &str)] = &[
    // Rank 0's one-time notice that the job token was derived, not given: a `tracing` event
    // would go unseen (no subscriber) in exactly the launches it is about.
    ("fh-job/src/launch/derived.rs", "io::stderr("),
    // Whether stderr is a terminal, for the colour of log lines: asks, writes nothing.
    ("fh-scheduler/src/config/colour.rs", "io::stderr("),
];

/// A workspace member.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    /// Directory, relative to the root (e.g. `fh-core`).
    pub dir: String,
    /// Package name.
    pub name: String,
    /// Its `Cargo.toml` text.
    pub manifest: String,
}

/// Runs every check; returns one message per failure.
pub(crate) fn run_all(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    out.extend(check_layering(root));
    out.extend(check_missing_docs(root));
    out.extend(check_no_print_in_libraries(root));
    out.extend(check_readme(root));
    out.extend(check_ci_script(root));
    out.extend(check_architecture(root));
    out.extend(imports::check_import_circles(root));
    out.extend(imports::check_no_glob_parent_imports(root));
    out.extend(sockets::check_socket_owners(root));
    out.extend(check_cudarc_features(root));
    out.extend(check_one_release(root));
    out.extend(check_torch_range(root));
    out
}

fn read(path: &Path) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// The workspace members listed in the root `Cargo.toml`.
pub(crate) fn members(root: &Path) -> Result<Vec<Member>, String> {
    let text = read(&root.join("Cargo.toml"))?;
    let dirs = parse_members(&text)
        .ok_or_else(|| "root Cargo.toml has no `members = [...]` list".to_string())?;
    dirs.into_iter()
        .map(|dir| {
            let manifest = read(&root.join(&dir).join("Cargo.toml"))?;
            let name = package_name(&manifest)
                .ok_or_else(|| format!("{dir}/Cargo.toml has no [package] name"))?;
            Ok(Member {
                dir,
                name,
                manifest,
            })
        })
        .collect()
}

/// Parses `members = [ "a", "b" ]` (possibly over several lines).
pub(crate) fn parse_members(text: &str) -> Option<Vec<String>> {
    let start = text.find("members")?;
    let rest = &text[start..];
    let open = rest.find('[')?;
    let close = rest[open..].find(']')? + open;
    Some(
        rest[open + 1..close]
            .lines()
            .flat_map(|line| strip_comment(line).split(','))
            .map(|s| s.trim().trim_matches('"').to_string())
            .filter(|s| !s.is_empty())
            .collect(),
    )
}

fn strip_comment(line: &str) -> &str {
    match line.find('#') {
        Some(i) => &line[..i],
        None => line,
    }
}

/// The `name` of the `[package]` section.
pub(crate) fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines() {
        let l = strip_comment(line).trim();
        if l.starts_with('[') {
            in_package = l == "[package]";
            continue;
        }
        if in_package {
            if let Some((k, v)) = l.split_once('=') {
                if k.trim() == "name" {
                    return Some(v.trim().trim_matches('"').to_string());
                }
            }
        }
    }
    None
}

/// The names of a manifest's normal and build dependencies (all targets), not dev-dependencies.
pub(crate) fn dependencies(manifest: &str) -> Vec<String> {
    let mut deps = Vec::new();
    let mut in_deps = false;
    let mut depth: i32 = 0;
    for line in manifest.lines() {
        let l = strip_comment(line).trim();
        if depth == 0 && l.starts_with('[') && !l.starts_with("[[") {
            let header = l.trim_start_matches('[').trim_end_matches(']').trim();
            // `dependencies`, `build-dependencies`, `target.'cfg(..)'.dependencies`, and the
            // table form `dependencies.foo`.
            let parts: Vec<&str> = header.rsplitn(2, '.').collect();
            let last = parts[0];
            let is_deps = |s: &str| s == "dependencies" || s == "build-dependencies";
            in_deps = false;
            if is_deps(header) || (header.starts_with("target.") && is_deps(last)) {
                in_deps = true;
            } else if let Some(name) = header
                .strip_prefix("dependencies.")
                .or_else(|| header.strip_prefix("build-dependencies."))
            {
                deps.push(name.trim_matches('"').to_string());
            } else if header.starts_with("target.") {
                for kind in [".dependencies.", ".build-dependencies."] {
                    if let Some(i) = header.find(kind) {
                        deps.push(header[i + kind.len()..].trim_matches('"').to_string());
                    }
                }
            }
            continue;
        }
        if l.starts_with("[[") && depth == 0 {
            in_deps = false;
            continue;
        }
        if in_deps && depth == 0 {
            if let Some((key, _)) = l.split_once('=') {
                let name = key
                    .split('.')
                    .next()
                    .unwrap_or(key)
                    .trim()
                    .trim_matches('"');
                if !name.is_empty() {
                    deps.push(name.to_string());
                }
            }
        }
        for c in l.chars() {
            match c {
                '{' | '[' => depth += 1,
                '}' | ']' => depth -= 1,
                _ => {}
            }
        }
        if depth < 0 {
            depth = 0;
        }
    }
    deps
}

/// Members that are libraries (have `src/lib.rs`).
fn library_members(root: &Path) -> Result<Vec<Member>, String> {
    Ok(members(root)?
        .into_iter()
        .filter(|m| root.join(&m.dir).join("src/lib.rs").is_file())
        .collect())
}

/// Whether a crate root's text denies missing docs.
pub(crate) fn denies_missing_docs(lib_rs: &str) -> bool {
    lib_rs.lines().any(|l| {
        let l = l.trim();
        l.starts_with("#![deny(") && l.contains("missing_docs")
    })
}

/// Every library crate has `#![deny(missing_docs)]`.
pub(crate) fn check_missing_docs(root: &Path) -> Vec<String> {
    let libs = match library_members(root) {
        Ok(l) => l,
        Err(e) => return vec![e],
    };
    let mut out = Vec::new();
    for m in libs {
        let path = root.join(&m.dir).join("src/lib.rs");
        match read(&path) {
            Ok(text) if denies_missing_docs(&text) => {}
            Ok(_) => out.push(format!(
                "{}/src/lib.rs lacks `#![deny(missing_docs)]` (every library crate documents its public items)",
                m.dir
            )),
            Err(e) => out.push(e),
        }
    }
    out
}

/// The forbidden calls in one library source file: `(line number, what)`. Comment lines are
/// ignored, and so is everything from a `#[cfg(test)] mod` onwards (test modules come last).
pub(crate) fn forbidden_calls(source: &str) -> Vec<(usize, &'static str)> {
    let mut out = Vec::new();
    let mut prev_cfg_test = false;
    for (i, line) in source.lines().enumerate() {
        let l = line.trim();
        if prev_cfg_test && (l.starts_with("mod ") || l.starts_with("pub(crate) mod ")) {
            break;
        }
        if l.starts_with("#[cfg(test)]") {
            prev_cfg_test = true;
            continue;
        }
        if !l.is_empty() {
            prev_cfg_test = false;
        }
        if l.starts_with("//") {
            continue;
        }
        let code = match l.find("//") {
            Some(j) => &l[..j],
            None => l,
        };
        for f in FORBIDDEN_IN_LIBRARIES {
            if let Some(pos) = code.find(f) {
                // `eprint!(` contains `print!(`: report the longest name only once.
                let before = code[..pos].chars().last();
                if matches!(before, Some(c) if c.is_alphanumeric() || c == '_') {
                    continue;
                }
                out.push((i + 1, *f));
            }
        }
    }
    out
}

pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "bin") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "main.rs")
        {
            out.push(p);
        }
    }
}

/// No printing and no `process::exit` in library crates' `src/` (binaries under `src/bin/` and
/// `main.rs` excluded).
pub(crate) fn check_no_print_in_libraries(root: &Path) -> Vec<String> {
    let libs = match library_members(root) {
        Ok(l) => l,
        Err(e) => return vec![e],
    };
    let mut out = Vec::new();
    for m in libs {
        let mut files = Vec::new();
        rust_files(&root.join(&m.dir).join("src"), &mut files);
        files.sort();
        for f in files {
            let Ok(text) = fs::read_to_string(&f) else {
                continue;
            };
            for (line, what) in forbidden_calls(&text) {
                let rel = f.strip_prefix(root).unwrap_or(&f);
                let rel_str = rel.to_string_lossy().replace('\\', "/");
                if DIRECT_OUTPUT_ALLOWED.contains(&(rel_str.as_str(), what)) {
                    continue;
                }
                out.push(format!(
                    "{}:{line}: `{}` in library code (use `tracing`, and return errors instead of exiting)",
                    rel.display(),
                    what.trim_end_matches('(')
                ));
            }
        }
    }
    out
}

/// The README's first lines give `cargo xtask bench --quick` and `cargo xtask test`.
pub(crate) fn check_readme(root: &Path) -> Vec<String> {
    let text = match read(&root.join("README.md")) {
        Ok(t) => t,
        Err(e) => return vec![e],
    };
    readme_problems(&text)
}

pub(crate) fn readme_problems(text: &str) -> Vec<String> {
    let head: String = text
        .lines()
        .take(README_HEAD_LINES)
        .collect::<Vec<_>>()
        .join("\n");
    let mut out: Vec<String> = README_COMMANDS
        .iter()
        .filter(|c| !head.contains(*c))
        .map(|c| format!("README.md's first {README_HEAD_LINES} lines do not give `{c}`"))
        .collect();
    if !head.lines().any(|l| l.trim_end() == README_INSTALL) {
        out.push(format!(
            "README.md's first {README_HEAD_LINES} lines do not reach its `{README_INSTALL}` \
             section (it comes right after the two commands)"
        ));
    }
    out
}

/// Every workspace crate takes the workspace's version: one release for the wheel, `fhrun`
/// and the ranks (`fh_core::RELEASE`).
pub(crate) fn check_one_release(root: &Path) -> Vec<String> {
    match members(root) {
        Ok(ms) => ms
            .iter()
            .filter(|m| !takes_workspace_version(&m.manifest))
            .map(|m| {
                format!(
                    "{}/Cargo.toml does not take `version.workspace = true`: every crate is of \
                     the one release that fhrun, the wheel and the ranks compare",
                    m.dir
                )
            })
            .collect(),
        Err(e) => vec![e],
    }
}

pub(crate) fn takes_workspace_version(manifest: &str) -> bool {
    let mut in_package = false;
    for line in manifest.lines().map(strip_comment).map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package && line.replace(' ', "") == "version.workspace=true" {
            return true;
        }
    }
    false
}

/// The supported PyTorch, `X.Y`, as each place states it: `torch>=X.Y` in
/// `fh-torch/pyproject.toml`, `TORCH_MIN = (X, Y)` in `fasthorovod/_compat.py`, `torch>=X.Y`
/// in the README.
pub(crate) fn check_torch_range(root: &Path) -> Vec<String> {
    let read_all = || -> Result<(String, String, String), String> {
        Ok((
            read(&root.join("fh-torch/pyproject.toml"))?,
            read(&root.join("fh-torch/python/fasthorovod/_compat.py"))?,
            read(&root.join("README.md"))?,
        ))
    };
    match read_all() {
        Ok((pyproject, compat, readme)) => torch_range_problems(&pyproject, &compat, &readme),
        Err(e) => vec![e],
    }
}

pub(crate) fn torch_range_problems(pyproject: &str, compat: &str, readme: &str) -> Vec<String> {
    let Some(claimed) = pyproject
        .split("\"torch>=")
        .nth(1)
        .and_then(|r| r.split('"').next())
    else {
        return vec!["fh-torch/pyproject.toml states no `torch>=X.Y` dependency".into()];
    };
    let mut out = Vec::new();
    let tuple = format!("TORCH_MIN = ({})", claimed.replace('.', ", "));
    if !compat.contains(&tuple) {
        out.push(format!(
            "fasthorovod/_compat.py does not say `{tuple}` (pyproject.toml: torch>={claimed})"
        ));
    }
    if !readme.contains(&format!("torch>={claimed}")) {
        out.push(format!(
            "README.md does not state the supported PyTorch, `torch>={claimed}`"
        ));
    }
    out
}

/// `.ci/run` calls `cargo xtask test` on a line that is not a comment.
pub(crate) fn check_ci_script(root: &Path) -> Vec<String> {
    match read(&root.join(".ci/run")) {
        Ok(t)
            if t.lines()
                .any(|l| !l.trim().starts_with('#') && l.contains("cargo xtask test")) =>
        {
            vec![]
        }
        Ok(_) => vec![".ci/run does not call `cargo xtask test`".to_string()],
        Err(e) => vec![e],
    }
}

/// `ARCHITECTURE.md` mentions every workspace crate and stays short.
pub(crate) fn check_architecture(root: &Path) -> Vec<String> {
    let text = match read(&root.join("ARCHITECTURE.md")) {
        Ok(t) => t,
        Err(e) => return vec![e],
    };
    let members = match members(root) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let mut out: Vec<String> = members
        .iter()
        .filter(|m| !text.contains(&m.name))
        .map(|m| format!("ARCHITECTURE.md does not mention the crate `{}`", m.name))
        .collect();
    let words = text.split_whitespace().count();
    if words > ARCHITECTURE_MAX_WORDS {
        out.push(format!(
            "ARCHITECTURE.md has {words} words; keep it a map a newcomer reads in ten minutes \
             (at most {ARCHITECTURE_MAX_WORDS}): move detail into the crates' READMEs and docs"
        ));
    }
    out
}

/// The most words `ARCHITECTURE.md` may have: a map, not an atlas.
const ARCHITECTURE_MAX_WORDS: usize = 1500;

#[cfg(test)]
mod tests;
