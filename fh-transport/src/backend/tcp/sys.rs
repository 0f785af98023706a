//! The few system calls of the TCP backend beyond `std::net`: vectored nonblocking
//! send/receive, peek and poll(2), through `rustix`.
//!
//! The functions take raw descriptors because the data path (`comm.rs`) holds its streams in
//! `self` while it reports failures through `&mut self`; each call borrows the descriptor only
//! for its own duration (the one `unsafe` operation per function, `BorrowedFd::borrow_raw`).

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use rustix::event::{PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendFlags};

/// Borrow `fd` for one call.
///
/// # Safety
/// `fd` must be an open descriptor that stays open until the borrow ends.
unsafe fn borrow(fd: RawFd) -> BorrowedFd<'static> {
    // SAFETY: forwarded to the caller.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn send_flags() -> SendFlags {
    SendFlags::NOSIGNAL | SendFlags::DONTWAIT
}
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn send_flags() -> SendFlags {
    SendFlags::DONTWAIT
}

/// Send from two buffers (header rest, payload rest) without blocking and without SIGPIPE.
/// Returns the number of bytes sent; `WouldBlock` when the socket buffer is full.
/// `fd` must be a connected socket that stays open during the call.
pub fn send2(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    // SAFETY: the callers pass the descriptor of a stream they own, open for this call.
    let sock = unsafe { borrow(fd) };
    let iov = [IoSlice::new(a), IoSlice::new(b)];
    let cnt = if b.is_empty() { 1 } else { 2 };
    loop {
        match rustix::net::sendmsg(
            sock,
            &iov[..cnt],
            &mut SendAncillaryBuffer::default(),
            send_flags(),
        ) {
            Err(Errno::INTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

/// Receive into two buffers (header rest, payload rest) without blocking. Returns the number of
/// bytes received (0 means the peer closed); `WouldBlock` when nothing is there.
/// `fd` must be a connected socket that stays open during the call.
pub fn recv2(fd: RawFd, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the callers pass the descriptor of a stream they own, open for this call.
    let sock = unsafe { borrow(fd) };
    let cnt = if b.is_empty() { 1 } else { 2 };
    let mut iov = [IoSliceMut::new(a), IoSliceMut::new(b)];
    loop {
        match rustix::net::recvmsg(
            sock,
            &mut iov[..cnt],
            &mut RecvAncillaryBuffer::default(),
            RecvFlags::DONTWAIT,
        ) {
            Err(Errno::INTR) => continue,
            r => return r.map(|m| m.bytes).map_err(io::Error::from),
        }
    }
}

/// Send from `iov` in order without blocking and without SIGPIPE (scatter-gather: the slices
/// go out as one byte stream). Returns the number of bytes sent; `WouldBlock` when the socket
/// buffer is full. `fd` must be a connected socket that stays open during the call.
pub fn sendv(fd: RawFd, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: the callers pass the descriptor of a stream they own, open for this call.
    let sock = unsafe { borrow(fd) };
    loop {
        match rustix::net::sendmsg(sock, iov, &mut SendAncillaryBuffer::default(), send_flags()) {
            Err(Errno::INTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

/// Receive into `iov` in order without blocking. Returns the number of bytes received (0 means
/// the peer closed); `WouldBlock` when nothing is there. `fd` must be a connected socket that
/// stays open during the call.
pub fn recvv(fd: RawFd, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    // SAFETY: the callers pass the descriptor of a stream they own, open for this call.
    let sock = unsafe { borrow(fd) };
    loop {
        match rustix::net::recvmsg(
            sock,
            iov,
            &mut RecvAncillaryBuffer::default(),
            RecvFlags::DONTWAIT,
        ) {
            Err(Errno::INTR) => continue,
            r => return r.map(|m| m.bytes).map_err(io::Error::from),
        }
    }
}

/// Look at up to `buf.len()` pending bytes without consuming them (nonblocking).
/// `fd` must be a connected socket that stays open during the call.
pub fn peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the callers pass the descriptor of a stream they own, open for this call.
    let sock = unsafe { borrow(fd) };
    loop {
        match rustix::net::recv(sock, &mut *buf, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Err(Errno::INTR) => continue,
            r => return r.map(|(n, _)| n).map_err(io::Error::from),
        }
    }
}

/// Readable.
pub const POLLIN: i16 = PollFlags::IN.bits() as i16;
/// Writable.
pub const POLLOUT: i16 = PollFlags::OUT.bits() as i16;

/// One descriptor to wait on, and what happened to it.
#[derive(Debug, Clone, Copy)]
pub struct PollFd {
    /// The descriptor (negative: ignored).
    pub fd: RawFd,
    /// What to wait for ([`POLLIN`], [`POLLOUT`]).
    pub events: i16,
    /// What happened.
    pub revents: i16,
}

/// A poll entry for `fd` waiting for `events`.
pub fn pollfd(fd: RawFd, events: i16) -> PollFd {
    PollFd {
        fd,
        events,
        revents: 0,
    }
}

/// Wait until one of `fds` is ready or `timeout` passes; returns how many are ready (0 on
/// timeout). Interrupted waits are reported as 0 ready so that callers re-check their deadline.
/// Every non-negative `fd` must stay open during the call.
pub fn poll(fds: &mut [PollFd], timeout: Duration) -> io::Result<usize> {
    let mut raw: Vec<rustix::event::PollFd<'_>> = fds
        .iter()
        .filter(|p| p.fd >= 0)
        .map(|p| {
            // SAFETY: the callers pass descriptors of streams or listeners they own, open
            // for this call.
            let fd = unsafe { borrow(p.fd) };
            rustix::event::PollFd::from_borrowed_fd(
                fd,
                PollFlags::from_bits_truncate(p.events as u16 as _),
            )
        })
        .collect();
    let ts = Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let n = match rustix::event::poll(&mut raw, Some(&ts)) {
        Ok(n) => n,
        Err(Errno::INTR) => 0,
        Err(e) => return Err(e.into()),
    };
    let mut ready = raw.iter();
    for p in fds.iter_mut().filter(|p| p.fd >= 0) {
        p.revents = ready.next().map_or(0, |r| r.revents().bits() as i16);
    }
    Ok(n)
}

/// Cap the rate at which the kernel sends on `stream` (`SO_MAX_PACING_RATE`, bytes per second;
/// TCP paces itself since Linux 4.13): an emulated per-flow cap of a cloud
/// ([`super::settings::FLOW_CAP_VAR`]).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn set_max_pacing_rate(stream: &std::net::TcpStream, bytes_per_sec: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // The kernel takes 32 bits (and, from Linux 5.x, 64); the emulation needs no more than that.
    let rate: u32 = bytes_per_sec.min(u64::from(u32::MAX - 1)) as u32;
    // SAFETY: a valid socket descriptor (borrowed from `stream` for this call), a pointer to a
    // live u32 and its size.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MAX_PACING_RATE,
            (&rate as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Elsewhere the cap is not emulated.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn set_max_pacing_rate(_stream: &std::net::TcpStream, _bytes_per_sec: u64) -> io::Result<()> {
    Err(io::ErrorKind::Unsupported.into())
}

/// The socket buffers a data connection to another host gets under `FH_TCP_BUFFERS=max`
/// ([`super::settings::BUFFERS_VAR`]): per direction, the largest the kernel lets an unprivileged process set
/// (`net.core.wmem_max`, `rmem_max`; the kernel doubles it) where that exceeds what Linux's
/// autotuning can reach (`net.ipv4.tcp_wmem`, `tcp_rmem`, their third field), so that a long
/// fat link (a cloud's round trip of tens of ms at Gbit/s) is not held back by the autotuned
/// window; `None` where autotuning reaches as far (a fixed size would then only stop it).
pub fn roomier_buffers() -> (Option<usize>, Option<usize>) {
    let read = |path: &str, field: usize| -> Option<usize> {
        std::fs::read_to_string(path)
            .ok()?
            .split_whitespace()
            .nth(field)?
            .parse()
            .ok()
    };
    let pick = |core: &str, tcp: &str| {
        let max = read(core, 0)?;
        let auto = read(tcp, 2)?;
        (max.saturating_mul(2) > auto).then_some(max)
    };
    (
        pick("/proc/sys/net/core/wmem_max", "/proc/sys/net/ipv4/tcp_wmem"),
        pick("/proc/sys/net/core/rmem_max", "/proc/sys/net/ipv4/tcp_rmem"),
    )
}

/// Set `stream`'s send and receive buffers (`SO_SNDBUF`, `SO_RCVBUF`), each where given.
pub fn set_buffers(
    stream: &std::net::TcpStream,
    send: Option<usize>,
    recv: Option<usize>,
) -> io::Result<()> {
    use rustix::net::sockopt;
    if let Some(n) = send {
        sockopt::set_socket_send_buffer_size(stream, n)?;
    }
    if let Some(n) = recv {
        sockopt::set_socket_recv_buffer_size(stream, n)?;
    }
    Ok(())
}
