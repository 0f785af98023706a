//! A loaded NCCL is never unloaded: NCCL starts threads that outlive the call that started
//! them (`ncclGetUniqueId` leaves its bootstrap root thread waiting for ranks), and unmapping
//! the library under such a thread crashed the process with SIGSEGV (issue 13: the `cuda`
//! tests of fh-transport, about one run in five). No GPU needed.
//!
//! The library is `FH_NCCL_LIBRARY`, else the NCCL wheel of `$VIRTUAL_ENV`, else of the
//! repository's `target/fh-venv` (where `cargo xtask test` installs PyTorch). Skips, saying so,
//! when none holds it. Only [`fh_nccl_sys::find`] is used here (never the process-wide
//! [`fh_nccl_sys::load`], whose cached copy would keep the library mapped on its own).

use std::path::{Path, PathBuf};

mod common;

use fh_nccl_sys::sys::{ncclResult_t, ncclUniqueId};

/// The `libnccl.so.2` to test with, or `None` (after printing why).
fn library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(fh_nccl_sys::LIBRARY_VAR) {
        return Some(PathBuf::from(p));
    }
    if let Some((_, nccl)) = common::nccl_wheels().into_iter().next() {
        return Some(nccl.join("lib/libnccl.so.2"));
    }
    eprintln!(
        "skipped: no libnccl.so.2 ({} unset, no NCCL wheel in $VIRTUAL_ENV or target/fh-venv)",
        fh_nccl_sys::LIBRARY_VAR
    );
    None
}

/// Load NCCL at `lib`, have it start its bootstrap root thread (`ncclGetUniqueId`), drop it.
fn open_start_a_thread_and_drop(lib: &Path) {
    let nccl = fh_nccl_sys::find(Some(lib.to_path_buf())).expect("load libnccl.so.2");
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: `ncclGetUniqueId` writes one `ncclUniqueId` through a valid pointer.
    let r = unsafe { nccl.lib().ncclGetUniqueId(&mut id) };
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", nccl.error_string(r));
    assert!(id.internal.iter().any(|&b| b != 0), "an all-zero id");
    drop(nccl);
}

/// Whether `lib` (compared by its canonical path) is mapped into this process.
fn mapped(lib: &Path) -> bool {
    let want = std::fs::canonicalize(lib).expect("canonical path of libnccl.so.2");
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .any(|p| Path::new(p) == want)
}

/// Deterministic: nothing else in this process holds the library (a thread NCCL started may
/// pin it for a while, so this one starts none), and it stays mapped after the drop.
#[test]
fn dropping_a_loaded_nccl_leaves_it_mapped() {
    let Some(lib) = library() else { return };
    let nccl = fh_nccl_sys::find(Some(lib.clone())).expect("load libnccl.so.2");
    assert!(nccl.version_code().expect("ncclGetVersion") > 0);
    drop(nccl);
    assert!(
        mapped(&lib),
        "{} was unmapped when its Nccl was dropped (threads NCCL started may still run its code)",
        lib.display()
    );
}

/// Many threads loading NCCL, starting its threads and dropping it at once: the process
/// survives (it crashed with SIGSEGV when a drop unmapped the library).
#[test]
fn threads_loading_and_dropping_nccl_at_once_do_not_crash() {
    let Some(lib) = library() else { return };
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..4 {
                    open_start_a_thread_and_drop(&lib);
                }
            });
        }
    });
    // Give NCCL's threads time to run after the last drop (this test asserts no timing: a
    // crash, if any, would end the process here or later in this binary).
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(mapped(&lib));
}
