//! Elastic jobs: the session between a worker and its driver (`fhrun
//! --host-discovery-script ...`).
//!
//! Every worker of an elastic job holds one authenticated TCP session to the driver, at
//! [`ADDR_VAR`] (`FH_ELASTIC_ADDR`), under its id [`WORKER_VAR`] (`FH_ELASTIC_WORKER`,
//! `host:slot`). Both sides prove the job token (`FH_JOB_TOKEN`) with HMAC-SHA-256 over fresh
//! nonces (the token never crosses the wire; see [`wire`]). Over the session the worker asks
//! for its next world with [`Client::next_world`] — the driver answers every registered worker
//! at once, when every worker it expects has registered — and for host-set changes with
//! [`Client::host_updates`]. The driver learns that a worker is gone when its session ends.
//!
//! A generation's world is an ordinary world: [`Assignment::launch_info`] gives the
//! [`LaunchInfo`] that `fh_transport::world_for` connects, authenticated with the job token's key
//! for incarnation [`ELASTIC_INCARNATION_BASE`] + generation, so no world of one generation
//! (or of a non-elastic re-`init`) can reach another's. The local and cross values of the
//! assignment are the driver's view from the host names; like any launcher's they are not
//! claimed to the rendezvous, which settles the hosts from facts ([`crate::hosts`]), so two
//! discovery names of one machine make one host.
//!
//! [`Server`] is the driver's side.

mod client;
mod server;
pub mod wire;

#[cfg(test)]
mod tests;

pub use client::Client;
pub use server::{Event, Server};

use crate::launch::{LaunchInfo, Launcher};
use crate::{JobError, Result, Topology};

/// The driver's session address (`ip:port`), set for every worker of an elastic job.
pub const ADDR_VAR: &str = "FH_ELASTIC_ADDR";
/// The worker's id, `host:slot` (the host as the discovery script names it).
pub const WORKER_VAR: &str = "FH_ELASTIC_WORKER";
/// Overrides the elastic timeout the driver sends (seconds), which bounds a Register's wait.
pub const TIMEOUT_VAR: &str = "FH_ELASTIC_TIMEOUT";
/// Generation `g`'s world authenticates with the key of incarnation
/// `ELASTIC_INCARNATION_BASE + g`, apart from every incarnation of a non-elastic re-`init`.
pub const ELASTIC_INCARNATION_BASE: u64 = 1 << 32;

/// Whether this process is a worker of an elastic job (`FH_ELASTIC_ADDR` is set).
pub fn enabled() -> bool {
    std::env::var_os(ADDR_VAR).is_some_and(|v| !v.is_empty())
}

/// One generation's world as the driver assigns it to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The generation (0 for the first world of the job).
    pub generation: u64,
    /// This worker's rank, the world size and the local/cross values from the hosts.
    pub topology: Topology,
    /// `ip:port` where rank 0 listens for the rendezvous (rank 0's candidate).
    pub rendezvous: String,
    /// The driver's host-set stamp when the world was formed ([`HostUpdate::stamp`]).
    pub hosts_stamp: u64,
}

impl Assignment {
    /// The `LaunchInfo` of this generation: `base` (from [`base_info`]: timeout, token, host
    /// id...) with the topology, the rendezvous and the token for incarnation
    /// [`ELASTIC_INCARNATION_BASE`] + generation. The local and cross values are not claimed
    /// (the rendezvous settles them from facts).
    pub fn launch_info(&self, base: &LaunchInfo) -> LaunchInfo {
        let t = self.topology;
        LaunchInfo {
            rank: t.rank,
            size: t.size,
            local_rank: t.local_rank,
            local_size: t.local_size,
            cross_rank: t.cross_rank,
            cross_size: t.cross_size,
            rendezvous: Some(self.rendezvous.clone()),
            token: base.token.as_ref().map(|k| {
                k.for_incarnation(ELASTIC_INCARNATION_BASE.saturating_add(self.generation))
            }),
            launcher: Launcher::Fhrun,
            local_vars: None,
            cross_vars: None,
            ..base.clone()
        }
    }
}

/// The driver's answer to a Register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// This worker is in the new world.
    Member(Assignment),
    /// This worker is not in the new world (its host was removed or blacklisted, or it is
    /// above `--max-np`); the driver stops it.
    Removed(String),
    /// The job cannot go on (e.g. fewer than `--min-np` ranks remain); the reason names the
    /// lost hosts and why they were lost.
    Failed(String),
}

/// Changes of the driver's usable host set after a stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostUpdate {
    /// The driver's current host-set stamp.
    pub stamp: u64,
    /// Whether hosts were added since the stamp asked about.
    pub added: bool,
    /// Whether hosts were removed (or blacklisted) since the stamp asked about.
    pub removed: bool,
}

/// This machine's address on the route to `host` (the source address the kernel would use to
/// reach it; no packet is sent): where a driver listens so that `host` can reach it.
pub fn local_ip_towards(host: &str) -> Result<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs, UdpSocket};
    let io = |e: std::io::Error| JobError::io(format!("finding the route to {host}"), e);
    let target = (host, 9)
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| {
            JobError::io(
                format!("resolving {host}"),
                std::io::Error::other("no address"),
            )
        })?;
    let any = match target {
        std::net::SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        std::net::SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = UdpSocket::bind((any, 0)).map_err(io)?;
    socket.connect(target).map_err(io)?;
    Ok(socket.local_addr().map_err(io)?.ip())
}

/// The variables an elastic worker's base `LaunchInfo` is read from: no rank variable of any
/// launcher (a driver run inside `srun` or `mpirun` leaves theirs in the environment).
const BASE_VARS: &[&str] = &[
    "FH_JOB_TOKEN",
    "FH_TIMEOUT_SECONDS",
    "FH_HOST_ID",
    "FH_ALLOW_WILDCARD",
    "FH_REQUIRE_TOKEN",
];

/// The base `LaunchInfo` of an elastic worker (timeout, token, host id; no rank variables):
/// [`Assignment::launch_info`] completes it per generation. Errors when `FH_JOB_TOKEN` is
/// missing: an elastic world cannot be authenticated without it.
pub fn base_info() -> Result<LaunchInfo> {
    base_info_from(|name| std::env::var(name).ok())
}

/// [`base_info`] from any variable source.
pub fn base_info_from(var: impl Fn(&str) -> Option<String>) -> Result<LaunchInfo> {
    let info = LaunchInfo::from_vars(|name| {
        if BASE_VARS.contains(&name) {
            var(name)
        } else {
            None
        }
    })?;
    if info.token.is_none() {
        return Err(JobError::Config {
            var: "FH_JOB_TOKEN".into(),
            reason: format!(
                "{ADDR_VAR} is set (an elastic worker) but FH_JOB_TOKEN is not: start elastic \
                 workers with fhrun --host-discovery-script, which gives them both"
            ),
        });
    }
    Ok(LaunchInfo {
        launcher: Launcher::Fhrun,
        ..info
    })
}
