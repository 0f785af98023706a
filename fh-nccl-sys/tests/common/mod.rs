//! Where the tests look for NVIDIA's NCCL wheel: the active virtual environment
//! (`$VIRTUAL_ENV`), then the repository's `target/fh-venv` (which `cargo xtask test` creates).

use std::path::{Path, PathBuf};

/// Every `(venv, site-packages/nvidia/nccl)` that holds the wheel's `lib/libnccl.so.2`, in
/// search order.
pub fn nccl_wheels() -> Vec<(PathBuf, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venvs = std::env::var_os("VIRTUAL_ENV")
        .map(PathBuf::from)
        .into_iter()
        .chain([root.join("target/fh-venv")]);
    let mut found = Vec::new();
    for venv in venvs {
        let Ok(entries) = std::fs::read_dir(venv.join("lib")) else {
            continue;
        };
        for e in entries.flatten() {
            let nccl = e.path().join("site-packages/nvidia/nccl");
            if nccl.join("lib/libnccl.so.2").is_file() {
                found.push((venv.clone(), nccl));
            }
        }
    }
    found
}
