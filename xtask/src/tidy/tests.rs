use std::path::PathBuf;

use super::layering::{
    check_cudarc_features, check_layering, cudarc_feature_problems, layering_violations,
};
use super::{
    check_architecture, check_ci_script, check_missing_docs, check_no_print_in_libraries,
    check_one_release, check_readme, check_torch_range, denies_missing_docs, dependencies,
    forbidden_calls, package_name, parse_members, readme_problems, takes_workspace_version,
    torch_range_problems,
};

fn assert_clean(failures: Vec<String>) {
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn root() -> PathBuf {
    crate::project_root()
}

#[test]
fn layering() {
    assert_clean(check_layering(&root()));
}

#[test]
fn library_crates_deny_missing_docs() {
    assert_clean(check_missing_docs(&root()));
}

#[test]
fn no_print_or_exit_in_libraries() {
    assert_clean(check_no_print_in_libraries(&root()));
}

#[test]
fn readme_gives_the_commands() {
    assert_clean(check_readme(&root()));
}

#[test]
fn ci_runs_xtask_test() {
    assert_clean(check_ci_script(&root()));
}

#[test]
fn architecture_mentions_every_crate() {
    assert_clean(check_architecture(&root()));
}

#[test]
fn one_release_and_one_torch_range() {
    assert_clean(check_one_release(&root()));
    assert_clean(check_torch_range(&root()));
}

#[test]
fn release_and_torch_range_detection() {
    assert!(takes_workspace_version(
        "[package]\nname = \"a\"\nversion.workspace = true # one\n"
    ));
    assert!(!takes_workspace_version(
        "[package]\nname = \"a\"\nversion = \"0.2.0\"\n[dependencies]\nversion.workspace = true\n"
    ));
    let pyproject = "dependencies = [\"torch>=2.1\"]\n";
    let compat = "TORCH_MIN = (2, 1)\n";
    assert!(torch_range_problems(pyproject, compat, "PyTorch (`torch>=2.1`)").is_empty());
    assert_eq!(
        torch_range_problems(pyproject, "TORCH_MIN = (2, 0)", "torch>=2.1").len(),
        1
    );
    assert_eq!(
        torch_range_problems(pyproject, compat, "torch 2.1").len(),
        1
    );
    assert_eq!(
        torch_range_problems("dependencies = []", compat, "").len(),
        1
    );
}

// The checkers themselves: they must be able to fail.

const MANIFEST: &str = r#"
[package]
name = "fh-core"   # the core

[dependencies]
bytes.workspace = true
serde = { version = "1", features = [
"derive",
] }
fh-transport = { path = "../fh-transport" }

[dev-dependencies]
tokio = "1"

[target.'cfg(unix)'.dependencies]
libc = "0.2"

[dependencies.pyo3]
version = "0.22"

[features]
default = []
"#;

#[test]
fn parses_package_name_and_dependencies() {
    assert_eq!(package_name(MANIFEST).as_deref(), Some("fh-core"));
    assert_eq!(
        dependencies(MANIFEST),
        ["bytes", "serde", "fh-transport", "libc", "pyo3"]
    );
}

#[test]
fn parses_members() {
    let text = "[workspace]\nmembers = [\n  \"a\", # first\n  \"b\",\n]\n";
    assert_eq!(parse_members(text).unwrap(), ["a", "b"]);
}

#[test]
fn layering_catches_forbidden_dependencies() {
    let internal: Vec<String> = ["fh-core", "fh-transport", "fh-scheduler", "fh-torch"]
        .map(String::from)
        .to_vec();
    let v = layering_violations("fh-core", &dependencies(MANIFEST), &internal);
    assert_eq!(v.len(), 3, "{v:#?}");
    assert!(v[0].contains("`fh-transport`"));
    assert!(v[1].contains("`libc`"));
    assert!(v[2].contains("only fh-torch may know Python"));

    let deps = ["fh-transport", "fh-core", "tokio"].map(String::from);
    let v = layering_violations("fh-scheduler", &deps, &internal);
    assert_eq!(v.len(), 1, "{v:#?}");
    assert!(v[0].contains("`tokio`"));

    let deps = ["fh-scheduler", "crossbeam-channel"].map(String::from);
    let v = layering_violations("fh-transport", &deps, &internal);
    assert_eq!(v.len(), 1, "{v:#?}");
    assert!(v[0].contains("`fh-scheduler`"));

    let deps = ["pyo3", "fh-scheduler"].map(String::from);
    assert!(layering_violations("fh-torch", &deps, &internal).is_empty());
    assert_eq!(
        layering_violations("fh-bench", &["pyo3".to_string()], &internal).len(),
        1
    );
}

#[test]
fn cudarc_builds_without_a_toolkit() {
    assert_clean(check_cudarc_features(&root()));
    let good = r#"cudarc = { version = "0.19", default-features = false, features = ["driver", "dynamic-loading", "cuda-12080"] }"#;
    assert!(cudarc_feature_problems(good).is_empty());
    let bad = r#"cudarc = { version = "0.19", features = ["cuda-version-from-build-system"] }"#;
    assert_eq!(
        cudarc_feature_problems(bad).len(),
        4,
        "{:?}",
        cudarc_feature_problems(bad)
    );
    assert!(cudarc_feature_problems("[workspace]\n").is_empty());
}

#[test]
fn only_fh_transport_may_bind_cuda_or_nccl() {
    let internal: Vec<String> = ["fh-core", "fh-transport", "fh-nccl-sys", "fh-scheduler"]
        .map(String::from)
        .to_vec();
    let gpu = ["cudarc", "fh-nccl-sys", "fh-core"].map(String::from);
    assert!(layering_violations("fh-transport", &gpu, &internal).is_empty());
    for krate in ["fh-scheduler", "fh-torch", "fh-bench", "fh-core"] {
        let v = layering_violations(krate, &gpu[..2], &internal);
        assert_eq!(v.len(), 2, "{krate}: {v:#?}");
        assert!(v
            .iter()
            .all(|m| m.contains("only fh-transport may talk to CUDA or NCCL")));
    }
    let v = layering_violations("fh-nccl-sys", &["fh-core".to_string()], &internal);
    assert_eq!(v.len(), 1, "{v:#?}");
}

#[test]
fn finds_prints_outside_comments_and_tests() {
    let src = "\
//! Docs may say println!(\"x\").
/// eprintln!(\"in a doc comment\")
fn f() {
    println!(\"bad\");
    let s = format!(\"fine\");
    eprint!(\"bad too\");
    std::process::exit(1);
    let _ = writeln!(std::io::stderr(), \"sneaky\");
}
#[cfg(test)]
mod tests {
    fn g() { println!(\"fine in tests\"); }
}
";
    assert_eq!(
        forbidden_calls(src),
        [
            (4, "println!("),
            (6, "eprint!("),
            (7, "process::exit("),
            (8, "io::stderr(")
        ]
    );
}

#[test]
fn missing_docs_and_readme_detection() {
    assert!(denies_missing_docs("//! Crate.\n#![deny(missing_docs)]\n"));
    assert!(!denies_missing_docs("#![warn(missing_docs)]\n"));
    assert!(
        readme_problems("# X\n\ncargo xtask bench --quick\ncargo xtask test\n\n## Install\n")
            .is_empty()
    );
    assert_eq!(
        readme_problems("# X\ncargo xtask test\n## Install\n").len(),
        1
    );
    assert_eq!(
        readme_problems("# X\n\ncargo xtask bench --quick\ncargo xtask test\n").len(),
        1
    );
}
