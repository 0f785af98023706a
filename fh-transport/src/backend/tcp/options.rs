//! The TCP backend's tunables ([`TcpOptions`]) and their defaults.

use std::time::Duration;

use fh_job::launch::LaunchInfo;

use super::liveness;
use super::StreamSettings;

/// Default largest message the backend sends or accepts (16 GiB).
pub const DEFAULT_MAX_FRAME: usize = 16 << 30;
/// Default time a connecting stranger has to complete its whole handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The default [`TcpOptions::spin`]: on this project's 2-core, 4-rank loopback measurement
/// an 8-byte named allreduce took about a quarter less with 40 µs than with none.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(40);

/// Tunables of the TCP backend.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Longest wait without progress for a peer (`FH_TIMEOUT_SECONDS`): connecting, the
    /// rendezvous, opening a communicator, and every send/receive.
    pub timeout: Duration,
    /// How long one handshake may take in all (a stranger's, or one attempt of this rank's;
    /// this rank retries failed attempts until [`TcpOptions::timeout`]).
    pub handshake_timeout: Duration,
    /// Largest single message, in bytes.
    pub max_frame: usize,
    /// The heartbeats ([`crate::liveness`]) the world runs from the end of its rendezvous;
    /// `None`: none.
    pub liveness: Option<liveness::Settings>,
    /// Parallel streams to peers on other hosts ([`super::streams`]); the same on every rank.
    pub streams: StreamSettings,
    /// How long a wait for a small message (at most [`super::SPIN_MAX_BYTES`] each way) keeps
    /// trying its sockets, yielding the core between tries, before it sleeps in poll(2); a
    /// peer that answers meanwhile costs no sleep and wake-up. Zero sleeps at once. Local:
    /// it changes no result and need not match across ranks.
    pub spin: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: fh_job::launch::DEFAULT_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_frame: DEFAULT_MAX_FRAME,
            liveness: Some(liveness::Settings::default()),
            streams: StreamSettings::default(),
            spin: DEFAULT_SPIN,
        }
    }
}

impl TcpOptions {
    /// Options with the launch's timeout, the stream settings of the environment
    /// ([`StreamSettings::from_env`]) and default everything else.
    pub fn from_info(info: &LaunchInfo) -> Self {
        TcpOptions {
            timeout: info.timeout,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT.min(info.timeout),
            liveness: info.liveness,
            streams: StreamSettings::from_env(),
            ..TcpOptions::default()
        }
    }
}
