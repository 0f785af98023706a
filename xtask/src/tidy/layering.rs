//! Which crate may depend on which (DESIGN.md's "must not know" column as per-crate
//! allow-lists), and the CUDA binding's build features.

use std::path::Path;

use super::{dependencies, members, read, strip_comment};

/// Crates that do I/O, spawn threads or bind system libraries: not for `fh-core`.
const IO_CRATES: &[&str] = &[
    "libc",
    "nix",
    "rustix",
    "mio",
    "tokio",
    "async-std",
    "socket2",
    "mpi",
    "mpi-sys",
    "cudarc",
    "nccl*",
    "pyo3*",
    "numpy",
    "memmap2",
    "shared_memory",
    "rayon",
    "crossbeam*",
    "threadpool",
];

/// What the scheduler must not reach directly: sockets, system calls, MPI, CUDA, Python.
const SCHEDULER_FORBIDDEN: &[&str] = &[
    "libc",
    "nix",
    "rustix",
    "mio",
    "tokio",
    "async-std",
    "socket2",
    "mpi",
    "mpi-sys",
    "cudarc",
    "nccl*",
    "pyo3*",
    "numpy",
    "memmap2",
    "shared_memory",
];

/// What joining a job must not reach: the data plane's libraries (MPI, CUDA, NCCL, shared
/// memory maps), Python.
const JOB_FORBIDDEN: &[&str] = &[
    "mpi",
    "mpi-sys",
    "cudarc",
    "nccl*",
    "pyo3*",
    "numpy",
    "memmap2",
    "shared_memory",
];

/// Python bindings: only `fh-torch` may know Python.
const PYTHON_CRATES: &[&str] = &["pyo3*", "numpy"];

/// CUDA and NCCL bindings: only the crates in [`GPU_ALLOWED`] may depend on them ("only
/// fh-transport talks to NCCL").
const GPU_CRATES: &[&str] = &["cudarc", "fh-nccl-sys", "nccl*", "cuda*"];

/// The crates that may depend on [`GPU_CRATES`].
const GPU_ALLOWED: &[&str] = &["fh-transport"];

/// One crate's layering rule.
pub(crate) struct Rule {
    /// The crate (a workspace member's package name).
    pub krate: &'static str,
    /// Workspace crates it may depend on; `None` = any.
    pub internal_allowed: Option<&'static [&'static str]>,
    /// External crates it must not depend on (`name` or `prefix*`).
    pub forbidden: &'static [&'static str],
}

/// DESIGN.md's "must not know" column, as dependency rules. A crate without a rule gets only
/// the global one: nothing but `fh-torch` depends on Python bindings.
pub(crate) const RULES: &[Rule] = &[
    Rule {
        krate: "fh-core",
        internal_allowed: Some(&[]),
        forbidden: IO_CRATES,
    },
    Rule {
        krate: "fh-job",
        internal_allowed: Some(&["fh-core"]),
        forbidden: JOB_FORBIDDEN,
    },
    Rule {
        krate: "fh-transport",
        internal_allowed: Some(&["fh-core", "fh-job", "fh-nccl-sys"]),
        forbidden: PYTHON_CRATES,
    },
    Rule {
        krate: "fh-nccl-sys",
        internal_allowed: Some(&[]),
        forbidden: PYTHON_CRATES,
    },
    Rule {
        krate: "fh-scheduler",
        internal_allowed: Some(&["fh-core", "fh-job", "fh-transport"]),
        forbidden: SCHEDULER_FORBIDDEN,
    },
    Rule {
        krate: "fh-launch",
        internal_allowed: Some(&["fh-core", "fh-job", "fh-transport", "fh-scheduler"]),
        forbidden: PYTHON_CRATES,
    },
    Rule {
        krate: "fh-torch",
        internal_allowed: Some(&["fh-core", "fh-job", "fh-transport", "fh-scheduler"]),
        forbidden: &[],
    },
];
fn matches_pattern(name: &str, pattern: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

/// The layering violations of one crate, given its dependencies and the workspace's crates.
pub(crate) fn layering_violations(
    krate: &str,
    deps: &[String],
    internal: &[String],
) -> Vec<String> {
    let mut out = Vec::new();
    let rule = RULES.iter().find(|r| r.krate == krate);
    for d in deps {
        if krate != "fh-torch" && PYTHON_CRATES.iter().any(|p| matches_pattern(d, p)) {
            out.push(format!(
                "{krate} depends on `{d}`, but only fh-torch may know Python (DESIGN.md, Crates)"
            ));
            continue;
        }
        if !GPU_ALLOWED.contains(&krate) && GPU_CRATES.iter().any(|p| matches_pattern(d, p)) {
            out.push(format!(
                "{krate} depends on `{d}`, but only {} may talk to CUDA or NCCL \
                 (ARCHITECTURE.md, Invariants)",
                GPU_ALLOWED.join(", ")
            ));
            continue;
        }
        let Some(rule) = rule else { continue };
        if internal.contains(d) {
            if let Some(allowed) = rule.internal_allowed {
                if !allowed.contains(&d.as_str()) {
                    out.push(format!(
                        "{krate} depends on `{d}`, which its layer must not know (allowed workspace crates: {})",
                        if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
                    ));
                }
            }
        } else if let Some(p) = rule.forbidden.iter().find(|p| matches_pattern(d, p)) {
            out.push(format!(
                "{krate} depends on `{d}` (matches `{p}`), which its layer must not know \
                 (DESIGN.md's \"must not know\" column; the rule is in xtask/src/tidy.rs)"
            ));
        }
    }
    out
}

/// Checks every crate's direct dependencies against [`RULES`].
pub(crate) fn check_layering(root: &Path) -> Vec<String> {
    let members = match members(root) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let internal: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
    members
        .iter()
        .flat_map(|m| layering_violations(&m.name, &dependencies(&m.manifest), &internal))
        .collect()
}

/// The `cudarc` dependency (root `Cargo.toml`) loads CUDA at run time with a fixed version
/// feature, so that `--features cuda` builds without a CUDA toolkit.
pub(crate) fn check_cudarc_features(root: &Path) -> Vec<String> {
    match read(&root.join("Cargo.toml")) {
        Ok(t) => cudarc_feature_problems(&t),
        Err(e) => vec![e],
    }
}

/// What is wrong with the `cudarc = ...` line of a root manifest (nothing if there is none).
pub(crate) fn cudarc_feature_problems(manifest: &str) -> Vec<String> {
    let Some(line) = manifest
        .lines()
        .map(strip_comment)
        .find(|l| l.trim_start().starts_with("cudarc"))
    else {
        return vec![];
    };
    let mut out = Vec::new();
    if !line.contains("\"dynamic-loading\"") {
        out.push("cudarc must use the `dynamic-loading` feature (build without CUDA)".into());
    }
    if !line.contains("\"cuda-1") {
        out.push("cudarc needs an explicit `cuda-*` version feature (no nvcc at build)".into());
    }
    for bad in [
        "cuda-version-from-build-system",
        "dynamic-linking",
        "static-linking",
    ] {
        if line.contains(bad) {
            out.push(format!(
                "cudarc must not use `{bad}` (it needs a CUDA toolkit to build)"
            ));
        }
    }
    if !line.contains("default-features = false") {
        out.push(
            "cudarc must set `default-features = false` (its defaults link cuBLAS etc.)".into(),
        );
    }
    out
}
