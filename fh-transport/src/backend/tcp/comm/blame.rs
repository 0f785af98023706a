//! How a TCP communicator fails: it tells its peers whom to blame and shuts its connections,
//! and a peer's closed connection is blamed on the rank that peer names in its abort notice,
//! or on the peer itself when none comes (at once when its listener refuses: its process is
//! gone).

use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::super::{sys, wire};
use super::TcpComm;
use crate::TransportError;

/// How long a rank that sees a peer's connection close waits for that peer's out-of-band
/// abort notice (which names the rank really lost) before blaming the peer itself.
const BLAME_GRACE: Duration = Duration::from_millis(500);

/// After a closed peer's listener refused a connection (its process is gone), how long a
/// notice already on its way may take to be posted.
const NOTICE_SETTLE: Duration = Duration::from_millis(20);

/// How often a closed peer's listener is tried again during the blame grace.
const LOOK_AGAIN: Duration = Duration::from_millis(25);

impl TcpComm {
    /// Record a failure: tell every other peer which rank is to blame (unless a frame to it is
    /// half sent, where a notice would corrupt the stream), and shut the connections down so
    /// that peers blocked on us are released. The error is returned for the caller.
    pub(super) fn fail(
        &mut self,
        err: TransportError,
        half_sent_to: Option<usize>,
    ) -> TransportError {
        let blamed = err.blamed_rank();
        let lost = blamed.unwrap_or(self.rank);
        let notice = wire::abort_header(lost as u32);
        // Peers that must be told out of band, all at once below (a partition must not cost
        // a timeout per peer).
        let mut out_of_band = Vec::new();
        for (p, streams) in self.peers.iter().enumerate() {
            if streams.is_empty() || Some(p) == blamed {
                continue;
            }
            if Some(p) == half_sent_to {
                // A notice now would be read as payload: deliver it out of band.
                out_of_band.push(p);
                continue;
            }
            // In band on every stream to the peer (whichever it reads next, the notice is its
            // next header) when the socket buffers have room; otherwise (that peer is not
            // reading from us right now) out of band, so that its view stays right.
            let mut all_sent = true;
            for stream in streams {
                let sent = sys::send2(stream.as_raw_fd(), &notice, &[]).unwrap_or(0);
                all_sent &= sent == notice.len();
            }
            if !all_sent {
                out_of_band.push(p);
            }
        }
        // Before the shutdowns, so that a peer knows whom to blame when it sees the close.
        if let Some(link) = &self.link {
            link.send_aborts_to_heard(self.rank, out_of_band, self.seq, lost);
        }
        for stream in self.peers.iter().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        tracing::error!(
            communicator = %self.label,
            rank = self.rank,
            error = %err,
            "TCP communicator failed; peers were told"
        );
        self.failed = Some((blamed, err.to_string()));
        err
    }

    /// Give up on this communicator because of `cause`, found outside it (e.g. by a
    /// shared-memory communicator it works with): tell every peer which rank to blame and shut
    /// the connections down, as after a failure of its own. Call it only between operations
    /// (no frame half sent). Does nothing if the communicator failed already.
    pub(crate) fn give_up(&mut self, cause: &TransportError) {
        if self.failed.is_some() {
            return;
        }
        let err = match cause.blamed_rank() {
            Some(rank) if rank != self.rank && rank < self.size => TransportError::PeerLost {
                rank,
                detail: cause.to_string(),
            },
            _ => TransportError::Closed(cause.to_string()),
        };
        let _ = self.fail(err, None);
    }

    pub(super) fn lost(&self, peer: usize, what: &str, e: Option<io::Error>) -> TransportError {
        // The peer may have hung up on purpose after losing another rank, in the middle of a
        // frame to us; then its notice comes out of band, shortly. Wait for it briefly.
        // Unless its process is gone: then its listener refuses a connection at once, and a
        // notice it sent before it died was delivered before it closed (it tells its peers
        // first): a moment for that one to be posted, and the peer itself is to blame.
        if let Some(link) = &self.link {
            // Looked at again and again: a process being killed may close our connection a
            // moment before its listener, which meanwhile still accepts.
            let mut deadline = Instant::now() + BLAME_GRACE;
            let mut look_at = Instant::now();
            loop {
                if let Some((from, lost)) = link.board.get(self.seq) {
                    return self.abort_error(from, lost as u32);
                }
                // This engine's verdict, or the heartbeats' on this peer, came meanwhile.
                if let Some(cause) = self.interrupt.cause() {
                    return cause.error();
                }
                if let Some(v) = link.watch.as_ref().and_then(|w| w.verdict_on(peer)) {
                    return v.error();
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                if now >= look_at && deadline > now + NOTICE_SETTLE {
                    if link.refuses(peer) {
                        deadline = Instant::now() + NOTICE_SETTLE;
                    } else {
                        look_at = Instant::now() + LOOK_AGAIN;
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        TransportError::PeerLost {
            rank: peer,
            detail: match e {
                Some(e) => format!(
                    "{what} on communicator '{}' failed: {e} (the process probably died)",
                    self.label
                ),
                None => format!(
                    "rank {peer} closed its connection during {what} on communicator '{}' \
                     (the process probably died or gave up)",
                    self.label
                ),
            },
        }
    }

    pub(super) fn abort_error(&self, from: usize, lost: u32) -> TransportError {
        let lost = lost as usize;
        if lost == self.rank || lost == from || lost >= self.size {
            TransportError::PeerLost {
                rank: from,
                detail: format!(
                    "rank {from} gave up on communicator '{}' (it blamed this rank or failed itself)",
                    self.label
                ),
            }
        } else {
            TransportError::PeerLost {
                rank: lost,
                detail: format!(
                    "rank {from} reported that it lost rank {lost} on communicator '{}'",
                    self.label
                ),
            }
        }
    }
}
