//! Point-to-point messages of the shared-memory communicator: one single-producer
//! single-consumer ring per directed pair, each message framed by its 8-byte length. Every
//! counter read from shared memory is checked against the ring's capacity.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use super::{get, put, ShmComm};
use crate::{Result, TransportError};

/// Progress of one framed outgoing message.
struct Outgoing<'a> {
    header: [u8; 8],
    data: &'a [u8],
    done: usize,
}

impl<'a> Outgoing<'a> {
    fn new(data: &'a [u8]) -> Self {
        Outgoing {
            header: (data.len() as u64).to_le_bytes(),
            data,
            done: 0,
        }
    }
    fn total(&self) -> usize {
        8 + self.data.len()
    }
    fn finished(&self) -> bool {
        self.done == self.total()
    }
}

/// Progress of one framed incoming message.
struct Incoming<'a> {
    header: [u8; 8],
    data: &'a mut [u8],
    done: usize,
}

impl<'a> Incoming<'a> {
    fn new(data: &'a mut [u8]) -> Self {
        Incoming {
            header: [0; 8],
            data,
            done: 0,
        }
    }
    fn finished(&self) -> bool {
        self.done == 8 + self.data.len()
    }
}

impl ShmComm {
    /// A ring's counters, read from shared memory, claim `used` bytes in a ring of `cap`:
    /// more than `cap` means the peer that writes `whose` counter corrupted it.
    fn ring_used(&self, peer: usize, used: u32, cap: usize, whose: &str) -> Result<usize> {
        let used = used as usize;
        if used > cap {
            return Err(TransportError::Protocol {
                rank: peer,
                detail: format!(
                    "the shared-memory ring between ranks {} and {peer} holds {used} bytes by its \
                     counters, more than its capacity of {cap}: rank {peer} corrupted the {whose} \
                     counter (communicator '{}')",
                    self.rank, self.label
                ),
            });
        }
        Ok(used)
    }

    /// Push as much of `msg` into ring `self -> to` as fits. Returns whether anything moved.
    fn push(&self, to: usize, msg: &mut Outgoing<'_>) -> Result<bool> {
        let ctl = self.seg.ring_ctl(self.rank, to);
        let cap = self.seg.layout.ring_bytes;
        let head = ctl.head.word.load(Relaxed);
        let tail = ctl.tail.word.load(Acquire);
        let free = cap - self.ring_used(to, head.wrapping_sub(tail), cap, "tail")?;
        let n = free.min(msg.total() - msg.done);
        if n == 0 {
            return Ok(false);
        }
        let base = self.seg.ring_data(self.rank, to);
        let mut pos = head as usize % cap;
        let mut left = n;
        while left > 0 {
            let run = left.min(cap - pos);
            let src: &[u8] = if msg.done < 8 {
                let m = (8 - msg.done).min(run);
                &msg.header[msg.done..msg.done + m]
            } else {
                let d = msg.done - 8;
                &msg.data[d..d + run]
            };
            // SAFETY: `pos + src.len() <= cap`, inside ring (self -> to); the bytes between
            // head and tail + cap belong to the producer (us) until head is published.
            unsafe { put(base.add(pos), src) };
            msg.done += src.len();
            left -= src.len();
            pos = (pos + src.len()) % cap;
        }
        ctl.head.word.store(head.wrapping_add(n as u32), Release);
        self.notify(to);
        Ok(true)
    }

    /// Pull what is available of `msg` from ring `from -> self`. Returns whether anything
    /// moved, or a protocol error if the framed length differs from the expected one.
    fn pull(&self, from: usize, msg: &mut Incoming<'_>) -> Result<bool> {
        let ctl = self.seg.ring_ctl(from, self.rank);
        let cap = self.seg.layout.ring_bytes;
        let tail = ctl.tail.word.load(Relaxed);
        let head = ctl.head.word.load(Acquire);
        let avail = self.ring_used(from, head.wrapping_sub(tail), cap, "head")?;
        let n = avail.min(8 + msg.data.len() - msg.done);
        if n == 0 {
            return Ok(false);
        }
        let base = self.seg.ring_data(from, self.rank);
        let mut pos = tail as usize % cap;
        let mut left = n;
        while left > 0 {
            let run = left.min(cap - pos);
            let got = if msg.done < 8 {
                let m = (8 - msg.done).min(run);
                // SAFETY: `pos + m <= cap`; bytes between tail and head are published by the
                // producer and not rewritten until we advance tail.
                unsafe { get(&mut msg.header[msg.done..msg.done + m], base.add(pos)) };
                if msg.done + m == 8 {
                    let len = u64::from_le_bytes(msg.header);
                    if len != msg.data.len() as u64 {
                        return Err(TransportError::Protocol {
                            rank: from,
                            detail: format!(
                                "expected a message of {} bytes, received {len} on shared-memory \
                                 communicator '{}'",
                                msg.data.len(),
                                self.label
                            ),
                        });
                    }
                }
                m
            } else {
                let d = msg.done - 8;
                // SAFETY: as above.
                unsafe { get(&mut msg.data[d..d + run], base.add(pos)) };
                run
            };
            msg.done += got;
            left -= got;
            pos = (pos + got) % cap;
        }
        ctl.tail.word.store(tail.wrapping_add(n as u32), Release);
        self.notify(from);
        Ok(true)
    }

    fn ring_has_space(&self, to: usize) -> bool {
        let ctl = self.seg.ring_ctl(self.rank, to);
        let used = ctl
            .head
            .word
            .load(Relaxed)
            .wrapping_sub(ctl.tail.word.load(Acquire));
        // A corrupted counter (used > capacity) counts as space, so that `push` reports it.
        (used as usize) != self.seg.layout.ring_bytes
    }

    fn ring_has_data(&self, from: usize) -> bool {
        let ctl = self.seg.ring_ctl(from, self.rank);
        ctl.head.word.load(Acquire) != ctl.tail.word.load(Relaxed)
    }

    pub(super) fn send_inner(&mut self, to: usize, data: &[u8]) -> Result<()> {
        let mut out = Outgoing::new(data);
        while !out.finished() {
            if !self.push(to, &mut out)? {
                self.wait("send", || Ok((!self.ring_has_space(to)).then_some(to)))?;
            }
        }
        Ok(())
    }

    pub(super) fn recv_inner(&mut self, from: usize, buf: &mut [u8]) -> Result<()> {
        let mut inc = Incoming::new(buf);
        while !inc.finished() {
            if !self.pull(from, &mut inc)? {
                self.wait("recv", || Ok((!self.ring_has_data(from)).then_some(from)))?;
            }
        }
        Ok(())
    }

    pub(super) fn send_recv_inner(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
    ) -> Result<()> {
        let mut out = Outgoing::new(send);
        let mut inc = Incoming::new(recv);
        while !(out.finished() && inc.finished()) {
            let mut moved = false;
            if !out.finished() {
                moved |= self.push(to, &mut out)?;
            }
            if !inc.finished() {
                moved |= self.pull(from, &mut inc)?;
            }
            if !moved {
                let (sf, rf) = (out.finished(), inc.finished());
                self.wait("send_recv", || {
                    let can_send = !sf && self.ring_has_space(to);
                    let can_recv = !rf && self.ring_has_data(from);
                    Ok(if can_send || can_recv {
                        None
                    } else if !rf {
                        Some(from)
                    } else {
                        Some(to)
                    })
                })?;
            }
        }
        Ok(())
    }
}
