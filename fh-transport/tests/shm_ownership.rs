//! Shared-memory segments belong to the job's user: a segment another user planted under the
//! job's name is refused with a clear error, never attached, and never removed by clean-up.
//! Acting as another user needs root (as in CI); elsewhere the test says it is skipped.
#![cfg(target_os = "linux")]

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use fh_transport::backend::shm::{self, ShmOptions, ShmTransport};
use fh_transport::TransportError;

const NOBODY: u32 = 65534;

/// Plant `/dev/shm/<name>` as uid/gid 65534, world-writable, `len` bytes of zeros.
fn plant_as_nobody(name: &str, len: usize) {
    let path = format!("/dev/shm/{name}");
    let status = Command::new("sh")
        .args([
            "-c",
            &format!("head -c {len} /dev/zero > {path} && chmod 666 {path}"),
        ])
        .uid(NOBODY)
        .gid(NOBODY)
        .status()
        .expect("run sh as nobody");
    assert!(status.success(), "planting {path} as nobody failed");
}

fn owner(name: &str) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/dev/shm/{name}"))
        .ok()
        .map(|m| m.uid())
}

#[test]
fn another_users_planted_segment_is_refused_never_attached() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: acting as another user needs root");
        return;
    }
    let tok = format!("planted-{}-5f1d0c3a9e8b7a6d5c4b", std::process::id());
    let name = shm::segment_name(&tok, None, 0);
    plant_as_nobody(&name, 1 << 20);
    assert_eq!(owner(&name), Some(NOBODY));
    let opts = ShmOptions::with_timeout(Duration::from_secs(20));

    // A rank that would attach refuses at once (not after the timeout), naming the owner.
    let started = Instant::now();
    let mut t1 = ShmTransport::join(&tok, 1, 2, opts.clone()).unwrap();
    let err = t1.open_shm("data").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TransportError::Handshake { .. }), "{text}");
    assert!(text.contains("uid 65534") && text.contains(&name), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "refused only after {:?}",
        started.elapsed()
    );

    // Rank 0 (whose clean-up runs at join) neither removes it nor uses it.
    let mut t0 = ShmTransport::join(&tok, 0, 2, opts).unwrap();
    let err = t0.open_shm("data").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("uid 65534"), "{text}");
    assert_eq!(
        owner(&name),
        Some(NOBODY),
        "the planted segment must be left alone"
    );

    std::fs::remove_file(format!("/dev/shm/{name}")).unwrap();
}
