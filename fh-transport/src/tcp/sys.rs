//! The few raw system calls of the TCP backend: vectored nonblocking send/receive and poll(2).
//! Every `unsafe` block is here.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

#[cfg(any(target_os = "linux", target_os = "android"))]
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const SEND_FLAGS: libc::c_int = libc::MSG_DONTWAIT;

fn iovec(buf: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    }
}

/// Send from two buffers (header rest, payload rest) without blocking and without SIGPIPE.
/// Returns the number of bytes sent; `WouldBlock` when the socket buffer is full.
pub fn send2(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let mut iov = [iovec(a), iovec(b)];
    let cnt = if b.is_empty() { 1 } else { 2 };
    // SAFETY: a zeroed msghdr is a valid "no name, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = cnt as _;
    loop {
        // SAFETY: `msg` points at `cnt` iovecs describing live, readable buffers that outlive
        // the call; sendmsg only reads them.
        let n = unsafe { libc::sendmsg(fd, &msg, SEND_FLAGS) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receive into two buffers (header rest, payload rest) without blocking. Returns the number of
/// bytes received (0 means the peer closed); `WouldBlock` when nothing is there.
pub fn recv2(fd: RawFd, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_mut_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_mut_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    let cnt = if b.is_empty() { 1 } else { 2 };
    // SAFETY: a zeroed msghdr is a valid "no name, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = cnt as _;
    loop {
        // SAFETY: `msg` points at `cnt` iovecs describing live, exclusively borrowed, writable
        // buffers that outlive the call; recvmsg writes at most their lengths.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Look at up to `buf.len()` pending bytes without consuming them (nonblocking).
pub fn peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is a live, exclusively borrowed buffer of `buf.len()` bytes.
        let n = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Readiness bits, re-exported for the callers.
pub const POLLIN: i16 = libc::POLLIN;
/// Writable.
pub const POLLOUT: i16 = libc::POLLOUT;

/// One descriptor to wait on.
pub type PollFd = libc::pollfd;

/// A poll entry for `fd` waiting for `events`.
pub fn pollfd(fd: RawFd, events: i16) -> PollFd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// Wait until one of `fds` is ready or `timeout` passes; returns how many are ready (0 on
/// timeout). Interrupted waits are reported as 0 ready so that callers re-check their deadline.
pub fn poll(fds: &mut [PollFd], timeout: Duration) -> io::Result<usize> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // Round a sub-millisecond remainder up, so that we do not spin.
    let ms = if ms == 0 && !timeout.is_zero() { 1 } else { ms };
    // SAFETY: `fds` is a live, exclusively borrowed slice of initialised pollfd structs.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        Ok(0)
    } else {
        Err(e)
    }
}
