//! The notice channel: how a failing rank tells fhrun *why* it fails before it exits.
//!
//! A rank that is about to die of its own failure (an uncaught Python exception: the
//! `sys.excepthook` that `fasthorovod.torch` installs) writes one line, `RANK REASON\n`, to a
//! pipe whose write end every rank inherits; [`NOTICE_VAR`] says which descriptor it is
//! (`FD:INODE`, the inode so that a process that merely inherited the variable, not the
//! descriptor, can tell a reused descriptor number from the pipe). A write of at most
//! `PIPE_BUF` bytes to a pipe is atomic, so lines from several ranks never interleave, and the
//! write end is non-blocking, so a rank never waits on fhrun.
//!
//! fhrun reads the pipe without blocking in its main loop. The first notice decides whom to
//! blame: a rank that failed on its own writes it before its interpreter runs the atexit
//! `hvd.shutdown()` that tells the others, so it comes before any survivor can exit with the
//! error it got from the runtime, and a survivor's Python code (whose error comes from the
//! runtime) writes none. The runtime itself writes one when a rank's engine stops because
//! another rank was lost, naming the lost rank (`fh_job::notice::notify_launcher`),
//! so that a dead or stopped rank is blamed as soon as a survivor sees it, not when the first
//! survivor has finished exiting.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

/// The variable that tells a rank the notice pipe's write end: `FD:INODE`.
pub const NOTICE_VAR: &str = "FH_NOTICE_FD";

/// The longest notice fhrun keeps (a longer line is cut); ranks keep theirs below `PIPE_BUF`.
const MAX_LINE: usize = 4096;

/// One rank's notice that it is failing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The rank that wrote it.
    pub rank: usize,
    /// Why it fails, as the rank says it (`raised ValueError: boom`).
    pub reason: String,
    /// When fhrun read it.
    pub at: Instant,
}

/// fhrun's end of the notice pipe (and, until the ranks are started, the write end they
/// inherit).
pub struct NoticeChannel {
    read: OwnedFd,
    write: Option<OwnedFd>,
    write_ino: u64,
    pending: Vec<u8>,
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

impl NoticeChannel {
    /// A fresh pipe: both ends close-on-exec (the write end is made inheritable in each rank
    /// only, by [`NoticeChannel::inherit_in_child`]) and non-blocking.
    pub fn open() -> io::Result<Self> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the two-element array.
        cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) })?;
        // SAFETY: pipe2 succeeded: both descriptors are open and owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: stat is plain data (zeroed is a valid value); fstat fills it for an open
        // descriptor.
        let st = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            cvt(libc::fstat(write.as_raw_fd(), &mut st))?;
            st
        };
        Ok(Self {
            read,
            write: Some(write),
            write_ino: st.st_ino,
            pending: Vec::new(),
        })
    }

    /// The value of [`NOTICE_VAR`] for the ranks (`FD:INODE`), while the write end is open.
    pub fn env_value(&self) -> Option<String> {
        self.write
            .as_ref()
            .map(|w| format!("{}:{}", w.as_raw_fd(), self.write_ino))
    }

    /// The write end's descriptor, for [`inherit_in_child`](Self::inherit_in_child).
    pub fn write_fd(&self) -> Option<RawFd> {
        self.write.as_ref().map(|w| w.as_raw_fd())
    }

    /// Make `fd` (the write end) survive `exec` in a forked child. Async-signal-safe.
    ///
    /// # Safety
    /// Only call between fork and exec (from `CommandExt::pre_exec`).
    pub unsafe fn inherit_in_child(fd: RawFd) -> io::Result<()> {
        // SAFETY: fcntl on a descriptor the child inherited; no memory is touched.
        cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }).map(|_| ())
    }

    /// Close fhrun's copy of the write end (once every rank is started: only they write).
    pub fn close_write(&mut self) {
        self.write = None;
    }

    /// The notices written since the last call, in the order they were written. Never
    /// blocks. Lines that do not parse (no rank, or a rank `>= size`) are dropped.
    pub fn drain(&mut self, size: usize) -> Vec<Notice> {
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: read into a valid buffer of the given length.
            let n = unsafe {
                libc::read(
                    self.read.as_raw_fd(),
                    buf.as_mut_ptr().cast::<libc::c_void>(),
                    buf.len(),
                )
            };
            if n > 0 {
                self.pending.extend_from_slice(&buf[..n as usize]);
                continue;
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // 0: every write end is closed; < 0: EAGAIN (nothing more now) or an error.
            break;
        }
        let now = Instant::now();
        let mut out = Vec::new();
        while let Some(pos) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=pos).collect();
            if let Some((rank, reason)) = parse_line(&line[..line.len() - 1]) {
                if rank < size {
                    out.push(Notice {
                        rank,
                        reason,
                        at: now,
                    });
                }
            }
        }
        if self.pending.len() > MAX_LINE {
            // A line without an end that long is no notice: drop it.
            self.pending.clear();
        }
        out
    }
}

/// `RANK REASON` → the rank and the reason (one line, cut at [`MAX_LINE`] bytes, control
/// characters replaced). `None` when it does not start with a rank.
pub fn parse_line(line: &[u8]) -> Option<(usize, String)> {
    let text = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
    let (rank, reason) = text.trim_end().split_once(' ')?;
    let rank: usize = rank.parse().ok()?;
    let reason: String = reason
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    Some((rank, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse() {
        assert_eq!(
            parse_line(b"1 raised ValueError: boom"),
            Some((1, "raised ValueError: boom".into()))
        );
        assert_eq!(parse_line(b"12 x\ty  "), Some((12, "x y".into())));
        assert_eq!(parse_line(b"one raised"), None);
        assert_eq!(parse_line(b"3"), None);
        assert_eq!(parse_line(b""), None);
    }

    fn write(fd: RawFd, data: &[u8]) {
        // SAFETY: write from a valid buffer to an open descriptor.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        assert_eq!(n, data.len() as isize);
    }

    #[test]
    fn notices_come_in_order_and_whole() {
        let mut ch = NoticeChannel::open().unwrap();
        let fd = ch.write_fd().unwrap();
        let value = ch.env_value().unwrap();
        assert!(value.starts_with(&format!("{fd}:")), "{value}");
        assert!(ch.drain(4).is_empty());
        write(fd, b"2 raised KeyError: 'x'\n9 out of range\n1 par");
        let got = ch.drain(4);
        assert_eq!(
            got.iter()
                .map(|n| (n.rank, n.reason.as_str()))
                .collect::<Vec<_>>(),
            [(2, "raised KeyError: 'x'")]
        );
        write(fd, b"tial\n");
        let got = ch.drain(4);
        assert_eq!((got[0].rank, got[0].reason.as_str()), (1, "partial"));
        ch.close_write();
        assert!(ch.env_value().is_none());
        assert!(ch.drain(4).is_empty());
    }
}
