//! One frame (an 8-byte header and its payload) on its way through a nonblocking socket:
//! the send and receive halves of a transfer in progress, each resuming where the last
//! system call left off. A payload may come from, or go to, several slices: they travel as
//! one frame (scatter-gather I/O).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::RawFd;

use super::sys;

/// The send half of a transfer in progress.
pub(super) struct SendState<'a> {
    pub(super) peer: usize,
    pub(super) header: [u8; 8],
    /// The payload, in order (one slice, or several sent as one frame).
    pub(super) data: &'a [&'a [u8]],
    /// Payload bytes in all.
    pub(super) len: usize,
    pub(super) done: usize,
}

impl SendState<'_> {
    pub(super) fn total(&self) -> usize {
        8 + self.len
    }
    pub(super) fn finished(&self) -> bool {
        self.done == self.total()
    }

    /// Send what is left without blocking.
    pub(super) fn step(&self, fd: RawFd) -> io::Result<usize> {
        if let [d] = self.data {
            return if self.done < 8 {
                sys::send2(fd, &self.header[self.done..], d)
            } else {
                sys::send2(fd, &[], &d[self.done - 8..])
            };
        }
        let mut iov = Vec::with_capacity(self.data.len().min(MAX_IOV) + 1);
        let mut skip = self.done;
        for s in std::iter::once(&self.header[..]).chain(self.data.iter().copied()) {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            iov.push(IoSlice::new(&s[skip..]));
            skip = 0;
            if iov.len() == MAX_IOV {
                break;
            }
        }
        sys::sendv(fd, &iov)
    }
}

/// The receive half of a transfer in progress.
pub(super) struct RecvState<'a, 'b> {
    pub(super) peer: usize,
    pub(super) header: [u8; 8],
    /// Where the payload goes, in order (one slice, or several filled from one frame).
    pub(super) bufs: &'a mut [&'b mut [u8]],
    /// Payload bytes in all.
    pub(super) len: usize,
    pub(super) done: usize,
    pub(super) checked: bool,
}

impl RecvState<'_, '_> {
    pub(super) fn finished(&self) -> bool {
        self.checked && self.done == 8 + self.len
    }

    /// Receive what is there without blocking (0: the peer closed).
    pub(super) fn step(&mut self, fd: RawFd) -> io::Result<usize> {
        let done = self.done;
        if let [b] = &mut *self.bufs {
            return if done < 8 {
                sys::recv2(fd, &mut self.header[done..], b)
            } else {
                sys::recv2(fd, &mut [], &mut b[done - 8..])
            };
        }
        let mut iov = Vec::with_capacity(self.bufs.len().min(MAX_IOV) + 1);
        let mut skip = done;
        let parts =
            std::iter::once(&mut self.header[..]).chain(self.bufs.iter_mut().map(|b| &mut **b));
        for s in parts {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            iov.push(IoSliceMut::new(&mut s[skip..]));
            skip = 0;
            if iov.len() == MAX_IOV {
                break;
            }
        }
        sys::recvv(fd, &mut iov)
    }
}

/// Most slices handed to one `sendmsg`/`recvmsg` (the rest go in the next call; Linux allows
/// 1024).
const MAX_IOV: usize = 64;
