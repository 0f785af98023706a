//! `cargo xtask nccl-bindings [--check] [--header PATH]`: regenerate `fh-nccl-sys/src/bindings.rs`
//! from the `nccl.h` of NVIDIA's NCCL wheel (`nvidia-nccl-cu12`/`-cu13`, the one PyTorch
//! installs), with bindgen.
//!
//! bindgen (and libclang behind it) is needed only here, so it is an optional dependency of
//! xtask behind the `nccl-bindings` feature: plain `cargo xtask` stays dependency-free, and
//! this task re-runs xtask with the feature (`cargo run -p xtask --features nccl-bindings`).
//!
//! `nccl.h` includes `cuda_runtime.h` and `cuda_fp16.h`; the stubs in `fh-nccl-sys/stub/`
//! declare the one CUDA type it needs (`cudaStream_t`), so no CUDA toolkit is required.
//!
//! Where the header is looked for, first hit wins: `--header PATH`, `FH_NCCL_INCLUDE` (a
//! directory holding `nccl.h`), then `nvidia/nccl/include/nccl.h` under the site-packages of
//! `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `<repo>/target/fh-venv`, and of `python3` on the `PATH`.
//!
//! `--check` compares instead of writing and fails when the committed file differs.

use std::path::Path;
#[cfg(feature = "nccl-bindings")]
use std::path::PathBuf;
use std::process::{Command, ExitCode};

#[cfg(feature = "nccl-bindings")]
/// The committed bindings, relative to the repository root.
pub(crate) const BINDINGS: &str = "fh-nccl-sys/src/bindings.rs";
#[cfg(feature = "nccl-bindings")]
/// The stub CUDA headers, relative to the repository root.
pub(crate) const STUB_DIR: &str = "fh-nccl-sys/stub";

#[cfg(feature = "nccl-bindings")]
/// The NCCL functions the runtime calls (and nothing else, so that the loader needs only these
/// symbols).
pub(crate) const FUNCTIONS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// Entry point of `cargo xtask nccl-bindings`.
pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    #[cfg(feature = "nccl-bindings")]
    {
        match generate::run(root, args) {
            Ok(msg) => {
                eprintln!("nccl-bindings: {msg}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("nccl-bindings: {e}");
                ExitCode::FAILURE
            }
        }
    }
    #[cfg(not(feature = "nccl-bindings"))]
    {
        // Re-run ourselves with bindgen compiled in.
        let status = Command::new(crate::cargo())
            .current_dir(root)
            .args([
                "run",
                "--quiet",
                "--package",
                "xtask",
                "--features",
                "nccl-bindings",
                "--",
                "nccl-bindings",
            ])
            .args(args)
            .status();
        match status {
            Ok(s) if s.success() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("nccl-bindings: cannot run cargo: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

#[cfg(feature = "nccl-bindings")]
/// The `nccl.h` to generate from: `explicit`, else `FH_NCCL_INCLUDE`, else the NCCL wheel of a
/// Python environment. `Err` lists where it looked.
pub(crate) fn find_header(root: &Path, explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--header {}: no such file", p.display()))
        };
    }
    let mut tried = Vec::new();
    if let Some(dir) = std::env::var_os("FH_NCCL_INCLUDE") {
        let p = PathBuf::from(dir).join("nccl.h");
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p);
    }
    for site in site_packages_dirs(root) {
        let p = site.join("nvidia/nccl/include/nccl.h");
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p);
    }
    Err(format!(
        "no nccl.h found (tried: {}); install NVIDIA's wheel (`pip install nvidia-nccl-cu12` or \
         -cu13, which PyTorch pulls in), activate that environment, or pass --header PATH",
        if tried.is_empty() {
            "no Python environment found".to_string()
        } else {
            tried
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    ))
}

#[cfg(feature = "nccl-bindings")]
/// Candidate `site-packages` directories: of `$VIRTUAL_ENV`, `$CONDA_PREFIX`,
/// `<root>/target/fh-venv`, and those `python3` reports.
fn site_packages_dirs(root: &Path) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    prefixes.push(root.join("target/fh-venv"));
    let mut out = Vec::new();
    for prefix in prefixes {
        if let Ok(entries) = std::fs::read_dir(prefix.join("lib")) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("python") {
                    out.push(e.path().join("site-packages"));
                }
            }
        }
    }
    if let Ok(o) = Command::new("python3")
        .args(["-c", "import sys; print('\\n'.join(sys.path))"])
        .output()
    {
        if o.status.success() {
            out.extend(
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(PathBuf::from),
            );
        }
    }
    out
}

#[cfg(feature = "nccl-bindings")]
pub(crate) mod generate {
    //! The generator itself (needs bindgen, hence libclang).

    use std::path::{Path, PathBuf};

    use super::{find_header, BINDINGS, FUNCTIONS, STUB_DIR};

    /// Parses the arguments, generates, and writes or checks the bindings.
    pub(crate) fn run(root: &Path, args: &[String]) -> Result<String, String> {
        let mut check = false;
        let mut header = None;
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--check" => check = true,
                "--header" => {
                    header = Some(PathBuf::from(
                        it.next().ok_or("--header needs a path to nccl.h")?,
                    ))
                }
                other => {
                    return Err(format!(
                        "unknown argument `{other}` (expected --check, --header PATH)"
                    ))
                }
            }
        }
        let header = find_header(root, header.as_deref())?;
        let text = bindings(root, &header)?;
        let target = root.join(BINDINGS);
        if check {
            let committed = std::fs::read_to_string(&target)
                .map_err(|e| format!("cannot read {}: {e}", target.display()))?;
            if committed == text {
                Ok(format!(
                    "{BINDINGS} is up to date with {}",
                    header.display()
                ))
            } else {
                Err(format!(
                    "{BINDINGS} differs from what {} generates; run `cargo xtask nccl-bindings`",
                    header.display()
                ))
            }
        } else {
            std::fs::write(&target, &text)
                .map_err(|e| format!("cannot write {}: {e}", target.display()))?;
            Ok(format!("wrote {BINDINGS} from {}", header.display()))
        }
    }

    /// The bindings text for `header` (deterministic: same header, same text).
    pub(crate) fn bindings(root: &Path, header: &Path) -> Result<String, String> {
        let version = nccl_version(header)?;
        let mut builder = bindgen::Builder::default()
            .header(header.to_string_lossy())
            .clang_arg(format!("-I{}", root.join(STUB_DIR).display()))
            .dynamic_library_name("NcclLib")
            .dynamic_link_require_all(true)
            .newtype_enum("nccl.*_t")
            .allowlist_type("ncclUniqueId")
            .allowlist_type("ncclComm_t")
            .allowlist_type("ncclResult_t")
            .allowlist_type("ncclDataType_t")
            .allowlist_type("ncclRedOp_t")
            .allowlist_var("NCCL_UNIQUE_ID_BYTES")
            .derive_debug(true)
            .derive_default(false)
            .layout_tests(false)
            .wrap_unsafe_ops(true)
            .generate_comments(false)
            .disable_header_comment()
            .raw_line(format!(
                "// Generated by `cargo xtask nccl-bindings` from nccl.h of NCCL {version} \
                 (NVIDIA's nvidia-nccl wheel). Do not edit."
            ));
        for f in FUNCTIONS {
            builder = builder.allowlist_function(*f);
        }
        let generated = builder
            .generate()
            .map_err(|e| format!("bindgen failed on {}: {e}", header.display()))?;
        Ok(generated.to_string())
    }

    /// `MAJOR.MINOR.PATCH` from the header's `#define`s.
    fn nccl_version(header: &Path) -> Result<String, String> {
        let text = std::fs::read_to_string(header)
            .map_err(|e| format!("cannot read {}: {e}", header.display()))?;
        let get = |name: &str| {
            text.lines()
                .find_map(|l| {
                    let mut w = l.split_whitespace();
                    (w.next() == Some("#define") && w.next() == Some(name))
                        .then(|| w.next().map(str::to_string))
                        .flatten()
                })
                .ok_or_else(|| format!("{} has no #define {name}", header.display()))
        };
        Ok(format!(
            "{}.{}.{}",
            get("NCCL_MAJOR")?,
            get("NCCL_MINOR")?,
            get("NCCL_PATCH")?
        ))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Regenerating the bindings from the wheel's header reproduces the committed file.
        #[test]
        fn regenerated_bindings_match_the_committed_file() {
            let root = crate::project_root();
            let header = match find_header(&root, None) {
                Ok(h) => h,
                Err(e) => {
                    eprintln!("skipped: {e}");
                    return;
                }
            };
            let text = match std::panic::catch_unwind(|| bindings(&root, &header)) {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => {
                    eprintln!(
                        "skipped: bindgen could not load libclang (install libclang-dev, or set \
                         LIBCLANG_PATH)"
                    );
                    return;
                }
            };
            let committed =
                std::fs::read_to_string(root.join(BINDINGS)).expect("committed bindings");
            assert!(
                committed == text,
                "{BINDINGS} differs from what {} generates; run `cargo xtask nccl-bindings`",
                header.display()
            );
        }
    }
}
