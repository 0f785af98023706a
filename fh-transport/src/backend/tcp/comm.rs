//! A TCP communicator: one nonblocking connection per peer, frames moved with poll(2).

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{RecvState, SendState};
use super::link::{NOTICE_TIMEOUT, PROBE_MARGIN, PROBE_TIMEOUT};
use super::wire::{self, Header};
use super::{sys, Link, TcpOptions};
use crate::{Communicator, Interrupt, Result, TransportError};

mod blame;

/// A communicator of the TCP backend (see [`Transport::open`](crate::Transport::open) on a [`super::TcpTransport`]).
///
/// Every operation waits at most the configured timeout *without progress*: a large transfer
/// that keeps moving is never cut short, a silent peer is reported after the timeout, and a
/// peer whose connection closes or resets is reported at once as
/// [`TransportError::PeerLost`]. After a peer failure the communicator is unusable: it tells
/// the other peers which rank was lost (so that they report the same rank) and every later
/// call fails. Its [`Interrupt`] ends a wait at once from another thread (an engine that stops
/// raises it): the operation fails as if this communicator had lost the rank named; so does a
/// wait for a peer that the world's heartbeats declare lost ([`crate::liveness`]).
#[derive(Debug)]
pub struct TcpComm {
    label: String,
    seq: u64,
    rank: usize,
    size: usize,
    peers: Vec<Option<TcpStream>>,
    loopback: VecDeque<Vec<u8>>,
    timeout: Duration,
    max_frame: usize,
    failed: Option<(Option<usize>, String)>,
    link: Option<Arc<Link>>,
    interrupt: Interrupt,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl TcpComm {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        label: String,
        seq: u64,
        rank: usize,
        size: usize,
        peers: Vec<Option<TcpStream>>,
        opts: &TcpOptions,
        link: Option<Arc<Link>>,
        interrupt: Interrupt,
    ) -> Self {
        TcpComm {
            label,
            seq,
            rank,
            size,
            peers,
            loopback: VecDeque::new(),
            timeout: opts.timeout,
            max_frame: opts.max_frame,
            failed: None,
            link,
            interrupt,
        }
    }

    /// The label given to [`Transport::open`](crate::Transport::open) on a [`super::TcpTransport`].
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The communicator's sequence number (the n-th communicator opened from its transport).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The longest a wait on this communicator lasts without progress before the call returns
    /// its error: the timeout, a liveness probe, one more timeout (with its probe and slack) for
    /// a peer that still answers, and the delivery of abort notices out of band.
    pub(crate) fn longest_stall(&self) -> Duration {
        (self.timeout + PROBE_TIMEOUT) * 2 + PROBE_MARGIN + NOTICE_TIMEOUT
    }

    fn check_usable(&self) -> Result<()> {
        match &self.failed {
            None => Ok(()),
            Some((Some(rank), why)) => Err(TransportError::PeerLost {
                rank: *rank,
                detail: format!("communicator '{}' failed earlier: {why}", self.label),
            }),
            Some((None, why)) => Err(TransportError::Closed(format!(
                "communicator '{}' failed earlier: {why}",
                self.label
            ))),
        }
    }

    fn check_peer(&self, peer: usize, len: usize) -> Result<()> {
        if peer >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "peer {peer} out of range 0..{} on communicator '{}'",
                self.size, self.label
            )));
        }
        if len > self.max_frame {
            return Err(TransportError::InvalidArgument(format!(
                "a message of {len} bytes exceeds the TCP backend's maximum frame of {} bytes",
                self.max_frame
            )));
        }
        Ok(())
    }

    fn fd(&self, peer: usize) -> Result<i32> {
        match &self.peers[peer] {
            Some(s) => Ok(s.as_raw_fd()),
            None => Err(TransportError::Closed(format!(
                "no connection to rank {peer} on communicator '{}'",
                self.label
            ))),
        }
    }

    /// Receive into `bufs`, in order, the message this rank sent itself earlier.
    fn take_own_message(&mut self, op: &'static str, bufs: &mut [&mut [u8]]) -> Result<()> {
        let msg = self.loopback.pop_front().ok_or_else(|| {
            TransportError::InvalidArgument(format!(
                "{op}: receiving from oneself (rank {}) with no message sent to oneself",
                self.rank
            ))
        })?;
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if msg.len() != len {
            return Err(TransportError::InvalidArgument(format!(
                "{op}: this rank sent itself {} bytes but receives {len}",
                msg.len(),
            )));
        }
        let mut at = 0;
        for b in bufs.iter_mut() {
            b.copy_from_slice(&msg[at..at + b.len()]);
            at += b.len();
        }
        Ok(())
    }

    /// What is wrong with a frame header from `peer` when `expected` payload bytes are due:
    /// another length, an abort notice, or an unknown control frame.
    fn frame_problem(
        &self,
        op: &'static str,
        peer: usize,
        header: [u8; 8],
        expected: usize,
    ) -> Option<TransportError> {
        match wire::decode_header(header) {
            Header::Data(len) => {
                wire::check_data_len(len, expected)
                    .err()
                    .map(|detail| TransportError::Protocol {
                        rank: peer,
                        detail: format!("{op} on communicator '{}': {detail}", self.label),
                    })
            }
            Header::Abort { lost } => Some(self.abort_error(peer, lost)),
            Header::Unknown(v) => Some(TransportError::Protocol {
                rank: peer,
                detail: format!("unknown control frame {v:#x}"),
            }),
        }
    }

    /// While only sending to `peer`, its incoming side became readable: fail at once if it
    /// closed or sent an abort notice; returns whether to keep watching (not once ordinary data
    /// for a later receive is waiting).
    fn watch_for_abort(
        &mut self,
        op: &'static str,
        fd: i32,
        peer: usize,
        half: Option<usize>,
    ) -> Result<bool> {
        let mut peekbuf = [0u8; 8];
        match sys::peek(fd, &mut peekbuf) {
            Ok(0) => {
                let err = self.lost(peer, op, None);
                Err(self.fail(err, half))
            }
            Ok(8) => match wire::decode_header(peekbuf) {
                Header::Abort { lost } => {
                    let err = self.abort_error(peer, lost);
                    Err(self.fail(err, half))
                }
                _ => Ok(false),
            },
            Ok(_) => Ok(false),
            Err(e) if would_block(&e) => Ok(true),
            Err(e) => {
                let err = self.lost(peer, op, Some(e));
                Err(self.fail(err, half))
            }
        }
    }

    /// Move one frame to `send.0` and/or one frame from `recv.0`, interleaving both so that
    /// neither direction can block the other. A frame's payload may come from several slices
    /// and go to several (one frame on the wire either way).
    fn transfer(
        &mut self,
        op: &'static str,
        send: Option<(usize, &[&[u8]])>,
        recv: Option<(usize, &mut [&mut [u8]])>,
    ) -> Result<()> {
        self.check_usable()?;
        if let Some(cause) = self.interrupt.cause() {
            return Err(self.fail(cause.error(), None));
        }
        let peers = [send.as_ref().map(|s| s.0), recv.as_ref().map(|r| r.0)];
        let declared = self
            .link
            .as_ref()
            .and_then(|l| l.watch.as_ref())
            .and_then(|w| peers.iter().flatten().find_map(|&p| w.verdict_on(p)));
        if let Some(v) = declared {
            return Err(self.fail(v.error(), None));
        }
        if let Some(why) = self.link.as_ref().and_then(|l| l.board.world_fault()) {
            let err = TransportError::Config {
                var: "FH_JOB_TOKEN".into(),
                reason: why,
            };
            return Err(self.fail(err, None));
        }
        let send = send.map(|(p, d)| (p, d, d.iter().map(|s| s.len()).sum::<usize>()));
        let recv = recv.map(|(p, b)| {
            let len = b.iter().map(|s| s.len()).sum::<usize>();
            (p, b, len)
        });
        if let Some((p, _, len)) = &send {
            self.check_peer(*p, *len)?;
        }
        if let Some((p, _, len)) = &recv {
            self.check_peer(*p, *len)?;
        }
        // Messages to oneself go through an in-memory queue.
        let send = match send {
            Some((p, d, _)) if p == self.rank => {
                self.loopback.push_back(d.concat());
                None
            }
            other => other,
        };
        let recv = match recv {
            Some((p, b, _)) if p == self.rank => {
                if let Some((to, d, _)) = send {
                    // Send to the peer first, then take our own message.
                    self.transfer(op, Some((to, d)), None)?;
                }
                return self.take_own_message(op, b);
            }
            other => other,
        };

        let mut tx = send.map(|(peer, data, len)| SendState {
            peer,
            header: wire::data_header(len as u64),
            data,
            len,
            done: 0,
        });
        let mut rx = recv.map(|(peer, bufs, len)| RecvState {
            peer,
            header: [0; 8],
            bufs,
            len,
            done: 0,
            checked: false,
        });
        let tx_fd = match &tx {
            Some(t) => Some(self.fd(t.peer)?),
            None => None,
        };
        let rx_fd = match &rx {
            Some(r) => Some(self.fd(r.peer)?),
            None => None,
        };
        // While only sending to a peer, watch its incoming side for an abort notice.
        let mut watch_tx_in = match (&tx, &rx) {
            (Some(t), Some(r)) => t.peer != r.peer,
            (Some(_), None) => true,
            _ => false,
        };
        let mut last_progress = Instant::now();
        // Whether this wait was extended once already for a peer that still answers.
        let mut extended = false;
        loop {
            let mut progressed = false;
            if let (Some(t), Some(fd)) = (tx.as_mut(), tx_fd) {
                if !t.finished() {
                    match t.step(fd) {
                        Ok(n) => {
                            t.done += n;
                            progressed |= n > 0;
                        }
                        Err(e) if would_block(&e) => {}
                        Err(e) => {
                            let peer = t.peer;
                            let half = (t.done > 0).then_some(peer);
                            let err = self.lost(peer, op, Some(e));
                            return Err(self.fail(err, half));
                        }
                    }
                }
            }
            if let (Some(r), Some(fd)) = (rx.as_mut(), rx_fd) {
                if !r.finished() {
                    match r.step(fd) {
                        // Nothing left to ask for is never the case here, so 0 means EOF.
                        Ok(0) => {
                            let peer = r.peer;
                            let half = tx.as_ref().filter(|t| t.done > 0).map(|t| t.peer);
                            let err = self.lost(peer, op, None);
                            return Err(self.fail(err, half));
                        }
                        Ok(n) => {
                            r.done += n;
                            progressed |= n > 0;
                        }
                        Err(e) if would_block(&e) => {}
                        Err(e) => {
                            let peer = r.peer;
                            let half = tx.as_ref().filter(|t| t.done > 0).map(|t| t.peer);
                            let err = self.lost(peer, op, Some(e));
                            return Err(self.fail(err, half));
                        }
                    }
                    if r.done >= 8 && !r.checked {
                        if let Some(err) = self.frame_problem(op, r.peer, r.header, r.len) {
                            let half = tx.as_ref().filter(|t| t.done > 0).map(|t| t.peer);
                            return Err(self.fail(err, half));
                        }
                        r.checked = true;
                    }
                }
            }
            let tx_done = tx.as_ref().is_none_or(SendState::finished);
            let rx_done = rx.as_ref().is_none_or(RecvState::finished);
            if tx_done && rx_done {
                return Ok(());
            }
            // Interrupted, or the heartbeats declared lost a peer this transfer waits for.
            let waits_for = [
                tx.as_ref().filter(|t| !t.finished()).map(|t| t.peer),
                rx.as_ref().filter(|r| !r.finished()).map(|r| r.peer),
            ];
            let stop = self.interrupt.cause().map(|c| c.error()).or_else(|| {
                let watch = self.link.as_ref()?.watch.as_ref()?;
                waits_for
                    .iter()
                    .flatten()
                    .find_map(|&p| watch.verdict_on(p))
                    .map(|v| v.error())
            });
            if let Some(err) = stop {
                // A frame half sent to a peer cannot carry a notice in band.
                let half = tx
                    .as_ref()
                    .filter(|t| t.done > 0 && !t.finished())
                    .map(|t| t.peer);
                return Err(self.fail(err, half));
            }
            if progressed {
                last_progress = Instant::now();
                continue;
            }

            let waited = last_progress.elapsed();
            if waited >= self.timeout {
                let peer = match (&rx, &tx) {
                    (Some(r), _) if !rx_done => r.peer,
                    (_, Some(t)) => t.peer,
                    (Some(r), None) => r.peer,
                    (None, None) => self.rank,
                };
                let half = tx
                    .as_ref()
                    .filter(|t| t.done > 0 && !t.finished())
                    .map(|t| t.peer);
                // A peer that gave up first said whom it blames (out of band).
                if let Some((from, lost)) = self.link.as_ref().and_then(|l| l.board.get(self.seq)) {
                    let err = self.abort_error(from, lost as u32);
                    return Err(self.fail(err, half));
                }
                // The peer may itself be waiting for a rank that stopped: when its process
                // still answers, give it one more timeout (and its probe), within which it
                // gives up and tells this rank whom to blame; a peer that does not answer is
                // the one stuck.
                if !extended && peer != self.rank {
                    if let Some(link) = &self.link {
                        if link.probe(self.rank, peer) {
                            tracing::debug!(peer, op, "timed out waiting for a peer that still answers; waiting once more");
                            // Long enough for the peer's own timeout and its probe.
                            extended = true;
                            last_progress = Instant::now() + PROBE_TIMEOUT + PROBE_MARGIN;
                            continue;
                        }
                    }
                }
                let err = TransportError::Timeout {
                    rank: peer,
                    op,
                    after: self.timeout,
                };
                return Err(self.fail(err, half));
            }
            let mut fds = [
                sys::pollfd(-1, 0),
                sys::pollfd(-1, 0),
                sys::pollfd(-1, 0),
                sys::pollfd(-1, 0),
            ];
            let mut n = 0;
            let mut tx_slot = None;
            if let (Some(fd), false) = (tx_fd, tx_done) {
                let mut ev = sys::POLLOUT;
                if watch_tx_in {
                    ev |= sys::POLLIN;
                }
                fds[n] = sys::pollfd(fd, ev);
                tx_slot = Some(n);
                n += 1;
            }
            if let (Some(fd), false) = (rx_fd, rx_done) {
                if tx_slot.is_some() && tx_fd == Some(fd) {
                    fds[0].events |= sys::POLLIN;
                } else {
                    fds[n] = sys::pollfd(fd, sys::POLLIN);
                    n += 1;
                }
            }
            if n == 0 {
                // Only possible when the send is done and we are watching nothing: finished.
                return Ok(());
            }
            // Raised, the interrupt's descriptor ends the wait (looked at above, next turn);
            // so does the heartbeats' verdict, until it came (it may concern another rank).
            if let Some(fd) = self.interrupt.wake_fd() {
                fds[n] = sys::pollfd(fd, sys::POLLIN);
            }
            if let Some(w) = self.link.as_ref().and_then(|l| l.watch.as_ref()) {
                if let (None, Some(fd)) = (w.verdict(), w.wake_fd()) {
                    fds[n + 1] = sys::pollfd(fd, sys::POLLIN);
                }
            }
            let ready = sys::poll(&mut fds[..n + 2], self.timeout - waited).map_err(|e| {
                TransportError::io(format!("poll during {op} on '{}'", self.label), e)
            })?;
            if ready == 0 {
                continue;
            }
            if let (Some(slot), Some(t)) = (tx_slot, tx.as_ref()) {
                let same_fd = rx_fd == tx_fd && !rx_done;
                if watch_tx_in && !same_fd && fds[slot].revents & sys::POLLIN != 0 {
                    let half = (t.done > 0).then_some(t.peer);
                    watch_tx_in = self.watch_for_abort(op, fds[slot].fd, t.peer, half)?;
                }
            }
        }
    }
}

impl Communicator for TcpComm {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.transfer("send", Some((peer, &[data])), None)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.transfer("recv", None, Some((peer, &mut [buf])))
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.transfer("send_recv", Some((to, &[send])), Some((from, &mut [recv])))
    }

    fn vectored_io(&self) -> bool {
        true
    }

    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        self.transfer("send_recv", Some((to, send)), Some((from, recv)))
    }

    fn abort(&mut self, lost: usize) {
        self.give_up(&TransportError::PeerLost {
            rank: lost,
            detail: format!("this rank gave up on communicator '{}'", self.label),
        });
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}
