//! A TCP communicator: nonblocking connections to every peer (several to a peer on another
//! host, [`super::streams`]), frames moved with poll(2).

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{RecvState, SendState};
use super::link::{NOTICE_TIMEOUT, PROBE_MARGIN, PROBE_TIMEOUT};
use super::streams::{split_stripes, stripe_count, stripe_range, stripe_slices};
use super::wire::{self, Header};
use super::{sys, Link, TcpOptions};
use crate::{Interrupt, Result, TransportError};

mod api;
mod blame;

/// A communicator of the TCP backend (see [`Transport::open`](crate::Transport::open) on a [`super::TcpTransport`]).
///
/// It holds one connection to each peer on its host and [`super::streams`]' agreed number to
/// each peer on another host; a large message to such a peer is striped over them, every
/// stripe of a send and of a receive moved by one poll loop. What follows holds on every
/// stream: progress on any of them counts, and a fault on any of them is the peer's.
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
    /// The connections to each peer, in stream order (none to itself; several to a peer on
    /// another host, [`super::streams`]).
    peers: Vec<Vec<TcpStream>>,
    /// Bytes sent on each of them (headers included).
    sent: Vec<Vec<u64>>,
    /// Smallest message striped over a peer's streams.
    stripe_min: usize,
    /// The most streams a message uses (the measurement of `auto` compares 1 with several).
    stripe_cap: usize,
    loopback: VecDeque<Vec<u8>>,
    timeout: Duration,
    /// How long a wait for a small message retries before it sleeps ([`TcpOptions::spin`]).
    spin: Duration,
    max_frame: usize,
    failed: Option<(Option<usize>, String)>,
    link: Option<Arc<Link>>,
    interrupt: Interrupt,
}

/// Transfers of at most this many bytes each way retry for [`TcpOptions::spin`] before they
/// sleep in poll(2); larger ones sleep at once (they are bandwidth-bound, and retrying would
/// only burn the CPU their copies need).
pub const SPIN_MAX_BYTES: usize = 64 * 1024;

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
        peers: Vec<Vec<TcpStream>>,
        opts: &TcpOptions,
        link: Option<Arc<Link>>,
        interrupt: Interrupt,
    ) -> Self {
        TcpComm {
            label,
            seq,
            rank,
            size,
            sent: peers.iter().map(|p| vec![0; p.len()]).collect(),
            stripe_min: opts.streams.stripe_min,
            stripe_cap: usize::MAX,
            peers,
            loopback: VecDeque::new(),
            timeout: opts.timeout,
            spin: opts.spin,
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

    /// The descriptors of the streams to `peer`, in stream order.
    fn fds(&self, peer: usize) -> Result<Vec<i32>> {
        match &self.peers[peer][..] {
            [] => Err(TransportError::Closed(format!(
                "no connection to rank {peer} on communicator '{}'",
                self.label
            ))),
            streams => Ok(streams.iter().map(AsRawFd::as_raw_fd).collect()),
        }
    }

    /// Use at most `cap` streams per message (≥ 1); every rank involved must set the same.
    pub(super) fn set_stripe_cap(&mut self, cap: usize) {
        self.stripe_cap = cap.max(1);
    }

    /// How many streams (connections) this communicator holds to `peer` (0 for itself).
    pub fn streams(&self, peer: usize) -> usize {
        self.peers.get(peer).map_or(0, Vec::len)
    }

    /// The bytes sent to `peer` so far on each of its streams, frame headers included.
    pub fn bytes_sent(&self, peer: usize) -> Vec<u64> {
        self.sent.get(peer).cloned().unwrap_or_default()
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

    /// The rank named by an abort notice waiting unread at the head of one of `fds`, if any.
    fn notice_on(&self, fds: &[i32]) -> Option<u32> {
        fds.iter().find_map(|&fd| {
            let mut head = [0u8; 8];
            match sys::peek(fd, &mut head) {
                Ok(8) => match wire::decode_header(head) {
                    Header::Abort { lost } => Some(lost),
                    _ => None,
                },
                _ => None,
            }
        })
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

    /// Move one message to `send.0` and/or one message from `recv.0`, interleaving both so
    /// that neither direction can block the other. A message's payload may come from several
    /// slices and go to several; to a peer with several streams a message of at least the
    /// stripe threshold travels as one frame per stream ([`super::streams`]), all of them
    /// moved by this one poll loop.
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

        // The stripes of each direction: (stream, descriptor, frame in progress). Every
        // stripe's header carries the whole message's length.
        let tx_parts: Vec<Vec<&[u8]>> = match &send {
            Some((peer, data, len)) => {
                let streams = self.peers[*peer].len().min(self.stripe_cap);
                let n = stripe_count(*len, streams, self.stripe_min);
                (0..n)
                    .map(|i| stripe_slices(data, stripe_range(*len, n, i)))
                    .collect()
            }
            None => Vec::new(),
        };
        let mut tx: Vec<(usize, i32, SendState<'_>)> = Vec::with_capacity(tx_parts.len());
        if let Some((peer, _, len)) = &send {
            let fds = self.fds(*peer)?;
            for (i, part) in tx_parts.iter().enumerate() {
                tx.push((
                    i,
                    fds[i],
                    SendState {
                        peer: *peer,
                        header: wire::data_header(*len as u64),
                        data: part,
                        len: part.iter().map(|s| s.len()).sum(),
                        done: 0,
                    },
                ));
            }
        }
        let (rx_peer, rx_len) = recv.as_ref().map_or((self.rank, 0), |r| (r.0, r.2));
        let mut rx_parts: Vec<Vec<&mut [u8]>> = match recv {
            Some((peer, bufs, len)) => {
                let streams = self.peers[peer].len().min(self.stripe_cap);
                let n = stripe_count(len, streams, self.stripe_min);
                split_stripes(bufs, len, n)
            }
            None => Vec::new(),
        };
        let mut rx: Vec<(usize, i32, RecvState<'_, '_>)> = Vec::with_capacity(rx_parts.len());
        if !rx_parts.is_empty() {
            let fds = self.fds(rx_peer)?;
            let n = rx_parts.len();
            for (i, part) in rx_parts.iter_mut().enumerate() {
                rx.push((
                    i,
                    fds[i],
                    RecvState {
                        peer: rx_peer,
                        header: [0; 8],
                        bufs: part,
                        len: stripe_range(rx_len, n, i).len(),
                        done: 0,
                        checked: false,
                    },
                ));
            }
        }
        // While only sending to a peer (on a stream), watch its incoming side for an abort
        // notice; `false` once ordinary data for a later receive waits there.
        let mut watch_in = vec![true; tx.len()];
        let mut last_progress = Instant::now();
        let small =
            tx.iter().map(|l| l.2.len).sum::<usize>() <= SPIN_MAX_BYTES && rx_len <= SPIN_MAX_BYTES;
        // Whether this wait was extended once already for a peer that still answers.
        let mut extended = false;
        let mut fds: Vec<sys::PollFd> = Vec::with_capacity(tx.len() + rx.len() + 2);
        loop {
            let mut progressed = false;
            let mut broken = None;
            for (stream, fd, t) in tx.iter_mut() {
                if t.finished() {
                    continue;
                }
                match t.step(*fd) {
                    Ok(n) => {
                        t.done += n;
                        self.sent[t.peer][*stream] += n as u64;
                        progressed |= n > 0;
                    }
                    Err(e) if would_block(&e) => {}
                    Err(e) => {
                        broken = Some((t.peer, Some(e)));
                        break;
                    }
                }
            }
            if let Some((peer, e)) = broken {
                let half = half_sent(&tx);
                // A peer that gave up said why in band on every stream to us before it shut
                // them, and what it sent stays readable after a reset: look there first, on
                // every stream not in the middle of a frame from it.
                let quiet: Vec<i32> = tx
                    .iter()
                    .map(|l| l.1)
                    .filter(|&fd| {
                        !rx.iter()
                            .any(|(_, f, r)| *f == fd && r.done > 0 && !r.finished())
                    })
                    .collect();
                let err = match self.notice_on(&quiet) {
                    Some(lost) => self.abort_error(peer, lost),
                    None => self.lost(peer, op, e),
                };
                return Err(self.fail(err, half));
            }
            let mut problem = None;
            for (_, fd, r) in rx.iter_mut() {
                if r.finished() {
                    continue;
                }
                match r.step(*fd) {
                    // Nothing left to ask for is never the case here, so 0 means EOF.
                    Ok(0) => {
                        broken = Some((r.peer, None));
                        break;
                    }
                    Ok(n) => {
                        r.done += n;
                        progressed |= n > 0;
                    }
                    Err(e) if would_block(&e) => {}
                    Err(e) => {
                        broken = Some((r.peer, Some(e)));
                        break;
                    }
                }
                if r.done >= 8 && !r.checked {
                    if let Some(err) = self.frame_problem(op, r.peer, r.header, rx_len) {
                        problem = Some(err);
                        break;
                    }
                    r.checked = true;
                }
            }
            if let Some((peer, e)) = broken {
                let half = half_sent(&tx);
                let err = self.lost(peer, op, e);
                return Err(self.fail(err, half));
            }
            if let Some(err) = problem {
                let half = half_sent(&tx);
                return Err(self.fail(err, half));
            }
            let tx_done = tx.iter().all(|(_, _, t)| t.finished());
            let rx_done = rx.iter().all(|(_, _, r)| r.finished());
            if tx_done && rx_done {
                return Ok(());
            }
            // Interrupted, or the heartbeats declared lost a peer this transfer waits for.
            let waits_for = [
                tx.iter().find(|l| !l.2.finished()).map(|l| l.2.peer),
                rx.iter().find(|l| !l.2.finished()).map(|l| l.2.peer),
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
                let half = half_open(&tx);
                return Err(self.fail(err, half));
            }
            if progressed {
                last_progress = Instant::now();
                continue;
            }
            // A small message's peer is usually about to answer: try again, yielding the
            // core, rather than pay poll(2)'s sleep and wake-up (tens of microseconds on a
            // busy machine) for each of a small collective's exchanges.
            if small && last_progress.elapsed() < self.spin {
                std::thread::yield_now();
                continue;
            }

            let waited = last_progress.elapsed();
            if waited >= self.timeout {
                let peer = match (waits_for, tx.first(), rx.first()) {
                    ([_, Some(r)], _, _) => r,
                    (_, Some(t), _) => t.2.peer,
                    (_, None, Some(r)) => r.2.peer,
                    (_, None, None) => self.rank,
                };
                let half = half_open(&tx);
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
            // Every unfinished stripe, each descriptor once; a stream only sent on is watched
            // for an abort notice too.
            fds.clear();
            let reading = |fd: i32| rx.iter().any(|(_, f, r)| *f == fd && !r.finished());
            for (k, (_, fd, t)) in tx.iter().enumerate() {
                if t.finished() {
                    continue;
                }
                let mut ev = sys::POLLOUT;
                if watch_in[k] || reading(*fd) {
                    ev |= sys::POLLIN;
                }
                fds.push(sys::pollfd(*fd, ev));
            }
            for (_, fd, r) in &rx {
                if !r.finished() && !fds.iter().any(|p| p.fd == *fd) {
                    fds.push(sys::pollfd(*fd, sys::POLLIN));
                }
            }
            let n = fds.len();
            if n == 0 {
                // Only possible when the send is done and we are watching nothing: finished.
                return Ok(());
            }
            // Raised, the interrupt's descriptor ends the wait (looked at above, next turn);
            // so does the heartbeats' verdict, until it came (it may concern another rank).
            fds.push(sys::pollfd(
                self.interrupt.wake_fd().unwrap_or(-1),
                sys::POLLIN,
            ));
            let verdict_fd = self
                .link
                .as_ref()
                .and_then(|l| l.watch.as_ref())
                .and_then(|w| {
                    if w.verdict().is_none() {
                        w.wake_fd()
                    } else {
                        None
                    }
                });
            fds.push(sys::pollfd(verdict_fd.unwrap_or(-1), sys::POLLIN));
            let ready = sys::poll(&mut fds, self.timeout - waited).map_err(|e| {
                TransportError::io(format!("poll during {op} on '{}'", self.label), e)
            })?;
            if ready == 0 {
                continue;
            }
            for k in 0..tx.len() {
                let (_, fd, t) = &tx[k];
                if !watch_in[k] || t.finished() || reading(*fd) {
                    continue;
                }
                let hit = fds[..n]
                    .iter()
                    .any(|p| p.fd == *fd && p.revents & sys::POLLIN != 0);
                if hit {
                    let (fd, peer) = (*fd, t.peer);
                    let half = half_sent(&tx);
                    watch_in[k] = self.watch_for_abort(op, fd, peer, half)?;
                }
            }
        }
    }
}

/// The peer to which a frame of this transfer is (or may be) partly sent: one whose stripe
/// has begun, finished or not (a notice in band is then unsafe or pointless).
fn half_sent(tx: &[(usize, i32, SendState<'_>)]) -> Option<usize> {
    tx.iter().find(|l| l.2.done > 0).map(|l| l.2.peer)
}

/// The peer to which a frame of this transfer is begun but not finished.
fn half_open(tx: &[(usize, i32, SendState<'_>)]) -> Option<usize> {
    tx.iter()
        .find(|l| l.2.done > 0 && !l.2.finished())
        .map(|l| l.2.peer)
}
