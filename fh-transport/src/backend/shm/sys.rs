//! The operating-system calls of the shared-memory backend, each wrapped in a small safe
//! function: POSIX shared-memory objects, `mmap`, futexes and process liveness. They go through
//! `rustix` (and `memmap2` for the mappings), which wrap the system calls safely; no raw FFI
//! is left here.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::io::Errno;

/// Directory where Linux exposes POSIX shared-memory objects.
pub(crate) use fh_job::hosts::SHM_DIR;

/// The path of the shared-memory object `name` (`/fh-…`). Opening the path in [`SHM_DIR`]
/// with `O_NOFOLLOW | O_CLOEXEC` is exactly what glibc's `shm_open` does; doing it here keeps
/// `O_NOFOLLOW`, which `rustix::shm::open` does not add.
fn shm_path(name: &str) -> io::Result<String> {
    let base = name.trim_start_matches('/');
    if base.is_empty() || base.contains('/') || base.contains('\0') || base.len() > 255 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad shared-memory object name",
        ));
    }
    Ok(format!("{SHM_DIR}/{base}"))
}

/// An open shared-memory object, closed on drop.
#[derive(Debug)]
pub(crate) struct Fd(OwnedFd);

/// What `fstat` says about a shared-memory object.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stat {
    /// Size in bytes.
    pub(crate) len: u64,
    /// Change time, seconds since the epoch.
    pub(crate) ctime: i64,
    /// Owner.
    pub(crate) uid: u32,
    /// Mode bits (permissions in the low 9 bits).
    pub(crate) mode: u32,
}

/// This process's effective user id.
pub(crate) fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

impl Fd {
    /// Size, change time, owner and mode of the object.
    pub(crate) fn stat(&self) -> io::Result<Stat> {
        let st = rustix::fs::fstat(&self.0)?;
        #[allow(clippy::unnecessary_cast)] // the field types differ between targets
        Ok(Stat {
            len: u64::try_from(st.st_size).unwrap_or(0),
            ctime: st.st_ctime as i64,
            uid: st.st_uid,
            mode: st.st_mode as u32,
        })
    }

    /// Set the object's size (sparse: no memory is used yet).
    pub(crate) fn set_len(&self, len: usize) -> io::Result<()> {
        rustix::fs::ftruncate(&self.0, len as u64)?;
        Ok(())
    }

    /// Reserve the memory of the first `len` bytes so that touching a page later cannot fail
    /// with SIGBUS when `/dev/shm` is full.
    pub(crate) fn reserve(&self, len: usize) -> io::Result<()> {
        match rustix::fs::fallocate(&self.0, FallocateFlags::empty(), 0, len as u64) {
            // A file system that cannot reserve: pages are then allocated when touched.
            Ok(()) | Err(Errno::OPNOTSUPP) | Err(Errno::INVAL) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// `shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600)`.
pub(crate) fn shm_create(name: &str) -> io::Result<Fd> {
    let fd = rustix::fs::open(
        shm_path(name)?,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )?;
    // The mode given at creation is filtered by the umask; make sure it is exactly 0600.
    rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR)?;
    Ok(Fd(fd))
}

/// `shm_open(name, O_RDWR)` (or `O_RDONLY` when `write` is false) of an existing object.
pub(crate) fn shm_open_existing(name: &str, write: bool) -> io::Result<Fd> {
    let access = if write { OFlags::RDWR } else { OFlags::RDONLY };
    let fd = rustix::fs::open(
        shm_path(name)?,
        access | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok(Fd(fd))
}

/// `shm_unlink(name)`; a name that is already gone is not an error.
pub(crate) fn shm_unlink(name: &str) -> io::Result<()> {
    match rustix::fs::unlink(shm_path(name)?) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A shared mapping of the start of a shared-memory object, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    map: memmap2::MmapRaw,
}

impl Mapping {
    /// Map the first `len` bytes of `fd` shared, read-write or read-only. The caller has
    /// checked with [`Fd::stat`] that the object is at least `len` bytes long.
    pub(crate) fn new(fd: &Fd, len: usize, write: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        let mut opts = memmap2::MmapOptions::new();
        opts.len(len);
        let map = if write {
            opts.map_raw(&fd.0)?
        } else {
            opts.map_raw_read_only(&fd.0)?
        };
        Ok(Mapping { map })
    }

    /// Base address (page aligned).
    pub(crate) fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

fn timespec(d: Duration) -> rustix::thread::futex::Timespec {
    rustix::thread::futex::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: d.subsec_nanos() as _,
    }
}

/// Sleep until `word` no longer holds `expected`, a `FUTEX_WAKE` arrives, or `timeout` passes.
/// Spurious returns are allowed; the caller re-checks its condition.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    // A shared (not private) futex: the word lives in a mapping shared between processes.
    // Every error (EAGAIN, ETIMEDOUT, EINTR) means "re-check", so the result is not needed.
    let _ = rustix::thread::futex::wait(
        word,
        rustix::thread::futex::Flags::empty(),
        expected,
        Some(&timespec(timeout)),
    );
}

/// Wake every waiter sleeping on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // How many sleepers woke is not needed; it cannot fail on a valid word.
    let _ =
        rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), i32::MAX as u32);
}

/// This process's id.
pub(crate) fn pid() -> u32 {
    std::process::id()
}

/// Start time of a process (clock ticks since boot, field 22 of `/proc/PID/stat`) and whether
/// it is a zombie; `None` if there is no such process.
fn proc_stat(pid: u32) -> Option<(u64, bool)> {
    proc_state(pid).map(|(start, state)| (start, state == "Z" || state == "X"))
}

/// Start time and state letter of process `pid`, from `/proc/<pid>/stat`.
fn proc_state(pid: u32) -> Option<(u64, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: parse after it.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.to_string(); // field 3
    let start = fields.nth(18)?.parse().ok()?; // field 22
    Some((start, state))
}

/// Whether process `pid`, started at `start` (0 = unknown), is stopped (SIGSTOP, a
/// debugger): alive but never to make progress by itself.
pub(crate) fn process_stopped(pid: u32, start: u64) -> bool {
    proc_state(pid)
        .is_some_and(|(s, state)| (start == 0 || s == start) && (state == "T" || state == "t"))
}

/// Start time of this process, used with the pid to recognise it (pids are reused).
pub(crate) fn self_start_time() -> u64 {
    proc_stat(pid()).map(|(s, _)| s).unwrap_or(0)
}

/// Whether process `pid`, started at `start` (0 = unknown), still runs. Zombies count as dead.
pub(crate) fn process_alive(pid: u32, start: u64) -> bool {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    // Signal 0 only checks for existence and permission; nothing is delivered.
    let rc = rustix::process::test_kill_process(p);
    if rc == Err(Errno::SRCH) {
        return false;
    }
    match proc_stat(pid) {
        Some((s, zombie)) => !zombie && (start == 0 || s == start),
        // No /proc entry although kill() saw it: trust kill().
        None => rc.is_ok(),
    }
}
