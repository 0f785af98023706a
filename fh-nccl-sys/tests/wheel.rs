//! The loader finds the `libnccl.so.2` of NVIDIA's NCCL wheel (installed with PyTorch) in the
//! active Python environment, loads it and calls `ncclGetVersion`. No GPU needed.
//!
//! The environment is `$VIRTUAL_ENV`, else the repository's `target/fh-venv` (where
//! `cargo xtask test` installs PyTorch). Skips, saying so, when neither holds the wheel.

use std::path::{Path, PathBuf};

mod common;

/// The venv holding the wheel, its `site-packages/nvidia/nccl` and the wheel's version.
fn wheel() -> Option<(PathBuf, PathBuf, String)> {
    for (venv, nccl) in common::nccl_wheels() {
        let Some(site) = nccl.parent().and_then(Path::parent).map(Path::to_path_buf) else {
            continue;
        };
        let version = std::fs::read_dir(&site)
            .ok()?
            .flatten()
            .filter_map(|d| {
                let name = d.file_name().to_string_lossy().into_owned();
                let rest = name.strip_prefix("nvidia_nccl_cu")?;
                let rest = rest.strip_suffix(".dist-info")?;
                Some(rest.split_once('-')?.1.to_string())
            })
            .next()?;
        return Some((venv, nccl, version));
    }
    None
}

#[test]
fn loader_finds_the_wheels_nccl_and_calls_get_version() {
    let Some((venv, nccl_dir, wheel_version)) = wheel() else {
        eprintln!(
            "skipped: no NVIDIA NCCL wheel (site-packages/nvidia/nccl/lib/libnccl.so.2) in \
             $VIRTUAL_ENV or target/fh-venv; `pip install torch` (or nvidia-nccl-cu12) there"
        );
        return;
    };
    let lib = nccl_dir.join("lib/libnccl.so.2");

    // First (before anything has loaded NCCL into this process), without FH_NCCL_LIBRARY: the
    // search must reach the Python environment's wheel, unless a system NCCL on the loader's
    // path answers first.
    // (Edition 2021: `set_var` is safe; this test binary runs this one test, so nothing else
    // reads the environment concurrently.)
    std::env::set_var("VIRTUAL_ENV", &venv);
    std::env::remove_var(fh_nccl_sys::LIBRARY_VAR);
    let found = fh_nccl_sys::load().expect("the loader finds libnccl.so.2");
    let v = found.version_code().expect("ncclGetVersion");
    assert!(v > 0);
    eprintln!(
        "loaded {} (NCCL version code {v}); wheel {wheel_version}",
        found.path()
    );
    if found.path().starts_with('/') {
        assert_eq!(
            Path::new(found.path()),
            lib,
            "found through the Python environment"
        );
    } else {
        eprintln!("(a system libnccl.so.2 on the loader's path answered first)");
        assert!(fh_nccl_sys::python_site_packages()
            .iter()
            .any(|s| s.join("nvidia/nccl/lib/libnccl.so.2") == lib));
    }

    // The explicit path works and reports the wheel's version.
    let explicit = fh_nccl_sys::find(Some(lib.clone())).expect("load the wheel's libnccl.so.2");
    let (major, minor, patch) = explicit.version().expect("ncclGetVersion");
    let ours = format!("{major}.{minor}.{patch}");
    assert!(
        wheel_version.starts_with(&ours),
        "wheel {wheel_version} but ncclGetVersion says {ours}"
    );
}
