//! The few raw operating-system calls of the shared-memory backend, each wrapped in a small safe
//! function: POSIX shared-memory objects, `mmap`, futexes and process liveness.

use std::ffi::CString;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Directory where Linux exposes POSIX shared-memory objects.
pub(crate) const SHM_DIR: &str = "/dev/shm";

fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

/// An open file descriptor, closed on drop.
#[derive(Debug)]
pub(crate) struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own this descriptor and close it exactly once.
        if unsafe { libc::close(self.0) } != 0 {
            // Nothing to recover (no data is buffered in a shared-memory descriptor).
            tracing::debug!(error = %io::Error::last_os_error(), "close of a shm descriptor failed");
        }
    }
}

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
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

impl Fd {
    /// Size, change time, owner and mode of the object.
    pub(crate) fn stat(&self) -> io::Result<Stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: `st` points to writable memory of the right type; fstat fills it on success.
        let rc = unsafe { libc::fstat(self.0, st.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstat returned 0, so the structure is initialised.
        let st = unsafe { st.assume_init() };
        Ok(Stat {
            len: st.st_size as u64,
            ctime: st.st_ctime,
            uid: st.st_uid,
            mode: st.st_mode,
        })
    }

    /// Set the object's size (sparse: no memory is used yet).
    pub(crate) fn set_len(&self, len: usize) -> io::Result<()> {
        let len = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::ftruncate(self.0, len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reserve the memory of the first `len` bytes so that touching a page later cannot fail
    /// with SIGBUS when `/dev/shm` is full.
    pub(crate) fn reserve(&self, len: usize) -> io::Result<()> {
        let len = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
        // SAFETY: plain syscall on a descriptor we own; posix_fallocate returns the error
        // number instead of setting errno.
        let rc = unsafe { libc::posix_fallocate(self.0, 0, len) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

/// `shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600)`.
pub(crate) fn shm_create(name: &str) -> io::Result<Fd> {
    let c = cname(name)?;
    // SAFETY: `c` is a valid NUL-terminated string; the flags and mode are plain integers.
    let fd = unsafe {
        libc::shm_open(
            c.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
            0o600 as libc::mode_t,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = Fd(fd);
    // The mode passed to shm_open is filtered by the umask; make sure it is exactly 0600.
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::fchmod(fd.0, 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// `shm_open(name, O_RDWR)` (or `O_RDONLY` when `write` is false) of an existing object.
pub(crate) fn shm_open_existing(name: &str, write: bool) -> io::Result<Fd> {
    let c = cname(name)?;
    let mode = if write { libc::O_RDWR } else { libc::O_RDONLY };
    // SAFETY: `c` is a valid NUL-terminated string.
    let fd = unsafe { libc::shm_open(c.as_ptr(), mode | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Fd(fd))
}

/// `shm_unlink(name)`; a name that is already gone is not an error.
pub(crate) fn shm_unlink(name: &str) -> io::Result<()> {
    let c = cname(name)?;
    // SAFETY: `c` is a valid NUL-terminated string.
    if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(e);
        }
    }
    Ok(())
}

/// A shared mapping of a whole shared-memory object, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory; all concurrent access to it goes through atomics or is
// ordered by them (see the protocol in `comm.rs`).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, read-write or read-only.
    pub(crate) fn new(fd: &Fd, len: usize, write: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping chosen by the kernel (addr = NULL); it aliases no Rust
        // object. The descriptor is valid for the duration of the call.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.0, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { ptr, len })
    }

    /// Base address (page aligned).
    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping we created and unmap exactly once; no
        // reference into it outlives `self` (references are created only for the duration of
        // a copy or reduction by the owner of this mapping).
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "munmap of a shm segment failed");
        }
    }
}

/// Sleep until `word` no longer holds `expected`, a `FUTEX_WAKE` arrives, or `timeout` passes.
/// Spurious returns are allowed; the caller re-checks its condition.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word (in a shared mapping, hence the shared
    // — not private — futex op); `ts` lives across the call. Errors (EAGAIN, ETIMEDOUT, EINTR)
    // all mean "re-check", so the result is deliberately ignored.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wake every waiter sleeping on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit word; FUTEX_WAKE only reads its address. Its
    // result (how many sleepers woke) is not needed, and it cannot fail on a valid word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Bytes available to unprivileged users in the file system holding `path`.
pub(crate) fn available_bytes(path: &str) -> Option<u64> {
    let c = cname(path).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid path and `st` writable memory of the right type.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so the structure is initialised.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// This process's id.
pub(crate) fn pid() -> u32 {
    std::process::id()
}

/// Start time of a process (clock ticks since boot, field 22 of `/proc/PID/stat`) and whether
/// it is a zombie; `None` if there is no such process.
fn proc_stat(pid: u32) -> Option<(u64, bool)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: parse after it.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?; // field 3
    let start = fields.nth(18)?.parse().ok()?; // field 22
    Some((start, state == "Z" || state == "X"))
}

/// Start time of this process, used with the pid to recognise it (pids are reused).
pub(crate) fn self_start_time() -> u64 {
    proc_stat(pid()).map(|(s, _)| s).unwrap_or(0)
}

/// Whether process `pid`, started at `start` (0 = unknown), still runs. Zombies count as dead.
pub(crate) fn process_alive(pid: u32, start: u64) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission; nothing is delivered.
    let rc = unsafe { libc::kill(p, 0) };
    if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    match proc_stat(pid) {
        Some((s, zombie)) => !zombie && (start == 0 || s == start),
        // No /proc entry although kill() saw it: trust kill().
        None => rc == 0,
    }
}
