//! Opening a communicator: the full mesh of connections of each new communicator (several
//! streams to a peer on another host), its formation's waits and failures.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::handshake::connect_handshake;
use super::wire::{self, ConnKind, Hello};
use super::{ensure_descriptors, settings, sys, TcpComm, TcpTransport};
use crate::liveness::Watch;
use crate::{Interrupt, Result, TransportError};

impl TcpTransport {
    /// A full mesh for communicator `seq`, `want[p]` connections to peer `p` (0 to itself).
    pub(super) fn open_mesh(
        &mut self,
        label: &str,
        seq: u64,
        want: &[usize],
    ) -> Result<Vec<Vec<TcpStream>>> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let deadline = Instant::now() + self.opts.timeout;
        let mut peers: Vec<Vec<Option<TcpStream>>> = want
            .iter()
            .map(|&n| (0..n).map(|_| None).collect())
            .collect();
        ensure_descriptors(want.iter().sum(), &format!("communicator '{label}'"))?;
        // Connect to every lower rank, each of its streams in order.
        for (r, slots) in peers.iter_mut().enumerate().take(rank) {
            for (stream, slot) in slots.iter_mut().enumerate() {
                let what = if want[r] > 1 {
                    format!("rank {r} (communicator '{label}', stream {stream})")
                } else {
                    format!("rank {r} (communicator '{label}')")
                };
                let hello = Hello {
                    version: wire::PROTOCOL_VERSION,
                    kind: ConnKind::Data,
                    size: size as u32,
                    rank: rank as u32,
                    seq,
                    port: stream as u16,
                    lost: 0,
                    world: self.world,
                    nonce: [0; wire::NONCE_LEN],
                };
                // Every data listener has been up since the rendezvous: a refused connection
                // means that rank's process is gone, not that it is late.
                let s = connect_handshake(
                    &[self.book[r]],
                    |_| Ok(hello.clone()),
                    &self.key,
                    &what,
                    deadline,
                    self.attempt_timeout(),
                    Some(r),
                    &|| self.verdict_error(),
                )?;
                *slot = Some(s);
            }
        }
        // Accept every higher rank (possibly stashed while an earlier communicator was opened).
        let acceptor = self
            .acceptor
            .as_mut()
            .ok_or_else(|| TransportError::Closed("the TCP transport has no listener".into()))?;
        for (r, slots) in peers.iter_mut().enumerate().skip(rank + 1) {
            for (stream, slot) in slots.iter_mut().enumerate() {
                if let Some(s) = self.stash.remove(&(seq, r, stream)) {
                    *slot = Some(s);
                }
            }
        }
        let watch = self.liveness.as_ref().map(|l| l.watch().clone());
        let lost = || watch.as_ref().is_some_and(|w| w.verdict().is_some());
        while let Some(missing) = (rank + 1..size).find(|&r| peers[r].iter().any(Option::is_none)) {
            let Some((hello, stream, from)) = acceptor.next_unless(deadline, VERDICT_POLL, &lost)
            else {
                if let Some(v) = watch.as_ref().and_then(Watch::verdict) {
                    return Err(v.error());
                }
                return Err(TransportError::Handshake {
                    peer: format!("rank {missing}"),
                    reason: format!(
                        "it did not connect for communicator '{label}' (#{seq}) within {:?}{}",
                        self.opts.timeout,
                        acceptor.refusal_note()
                    ),
                });
            };
            let (r, index) = (hello.rank as usize, hello.port as usize);
            // (A later communicator's connection may name a stream this one does not have:
            // the measurement's communicator holds fewer streams than the next.)
            if hello.seq == seq && index >= want[r] {
                // Streams are agreed at the rendezvous: a rank that opens more is broken.
                return Err(TransportError::Protocol {
                    rank: r,
                    detail: format!(
                        "it opened stream {index} of communicator '{label}' (#{seq}), but the \
                         world agreed on {} stream(s) between these ranks",
                        want[r]
                    ),
                });
            }
            if hello.seq < seq || (hello.seq == seq && peers[r][index].is_some()) {
                tracing::warn!(rank = r, seq = hello.seq, stream = index, %from, "dropping a stale or duplicate connection");
            } else if hello.seq == seq {
                peers[r][index] = Some(stream);
            } else {
                self.stash.insert((hello.seq, r, index), stream);
            }
        }
        let peers: Vec<Vec<TcpStream>> = peers
            .into_iter()
            .map(|slots| slots.into_iter().flatten().collect())
            .collect();
        // Socket buffers asked for (FH_TCP_BUFFERS), to peers on other hosts only.
        let (sndbuf, rcvbuf) = self.opts.streams.buffers.sizes();
        for (p, s) in peers
            .iter()
            .enumerate()
            .flat_map(|(p, streams)| streams.iter().map(move |s| (p, s)))
        {
            s.set_nodelay(true)
                .and_then(|_| s.set_nonblocking(true))
                .and_then(|_| s.set_read_timeout(None))
                .and_then(|_| s.set_write_timeout(None))
                .map_err(|e| TransportError::io("configuring a data connection", e))?;
            // The emulated cap is the network's: connections within a host are not capped
            // (unless every peer counts as remote).
            let other_host = self.layout.topology(p).cross_rank != self.topology.cross_rank;
            if other_host {
                sys::set_buffers(s, sndbuf, rcvbuf).map_err(|e| {
                    TransportError::io(
                        format!(
                            "sizing a data connection's socket buffers ({})",
                            settings::BUFFERS_VAR
                        ),
                        e,
                    )
                })?;
            }
            let remote = other_host || self.opts.streams.every_peer;
            if let (Some(cap), true) = (self.opts.streams.flow_cap, remote) {
                sys::set_max_pacing_rate(s, cap).map_err(|e| {
                    TransportError::io(
                        format!("capping a data connection ({})", settings::FLOW_CAP_VAR),
                        e,
                    )
                })?;
            }
        }
        Ok(peers)
    }
}

/// How often a wait of the world's formation (accepting a peer's connection) looks at the
/// liveness verdict.
const VERDICT_POLL: Duration = Duration::from_millis(50);

impl TcpTransport {
    /// The liveness verdict as an error, if a rank was declared lost.
    fn verdict_error(&self) -> Option<TransportError> {
        self.liveness
            .as_ref()
            .and_then(|l| l.watch().verdict())
            .map(|v| v.error())
    }

    /// How long one handshake attempt with a peer of the world may take: with heartbeats, a
    /// short attempt (retried) so that a verdict on a frozen peer is seen between attempts.
    fn attempt_timeout(&self) -> Duration {
        match self.opts.liveness {
            Some(s) => self
                .opts
                .handshake_timeout
                .min(s.silence.max(Duration::from_secs(1))),
            None => self.opts.handshake_timeout,
        }
    }

    /// This rank could not open communicator `seq` because a peer is lost (`err` names it):
    /// tell every other peer out of band, before this rank drops its connections and its
    /// listener, so that a peer whose half of the communicator is open already blames the rank
    /// really lost, not this one hanging up on it. Returns `err`.
    pub(super) fn tell_formation_failed(&self, err: TransportError, seq: u64) -> TransportError {
        let rank = self.topology.rank;
        let (Some(lost), Some(link)) = (err.blamed_rank(), self.link.as_ref()) else {
            return err;
        };
        if lost == rank || lost >= self.topology.size {
            return err;
        }
        let peers = (0..self.topology.size)
            .filter(|&p| p != rank && p != lost)
            .collect();
        link.send_aborts_to_heard(rank, peers, seq, lost);
        err
    }

    /// Open the next communicator, as [`Transport::open`](crate::Transport::open) does, returning the concrete type.
    pub fn open_tcp(&mut self, label: &str) -> Result<TcpComm> {
        self.open_tcp_with(label, Interrupt::new())
    }

    /// [`TcpTransport::open_tcp`] with the interrupt the communicator is to watch (shared with
    /// a communicator that encloses it).
    pub(crate) fn open_tcp_with(&mut self, label: &str, interrupt: Interrupt) -> Result<TcpComm> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let (rank, size) = (self.topology.rank, self.topology.size);
        let want: Vec<usize> = (0..size)
            .map(|p| if p == rank { 0 } else { self.streams_to(p) })
            .collect();
        let peers = if size == 1 {
            vec![Vec::new()]
        } else {
            self.open_mesh(label, seq, &want)
                .map_err(|e| self.tell_formation_failed(e, seq))?
        };
        tracing::debug!(rank, seq, label, "TCP communicator open");
        Ok(TcpComm::new(
            label.to_owned(),
            seq,
            rank,
            size,
            peers,
            &self.opts,
            self.link.clone(),
            interrupt,
        ))
    }
}
