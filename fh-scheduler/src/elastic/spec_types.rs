//! TEMPORARY (issue 28, merge): a copy of the types of `fh_transport::elastic` that this module
//! uses, exactly as the shared design (`elastic-spec.md`) fixes them, so that this branch
//! compiles before that module exists. When merging: delete this file and point the imports
//! in `elastic/mod.rs` at `fh_transport::elastic` (`Assignment`, `HostUpdate`, `Membership`,
//! `ELASTIC_INCARNATION_BASE`, `ADDR_VAR`).

use fh_transport::bootstrap::LaunchInfo;
use fh_transport::Topology;

/// The variable that makes a process a worker of an elastic job: the driver's session
/// listener, `ip:port`.
pub const ADDR_VAR: &str = "FH_ELASTIC_ADDR";

/// The first token incarnation of an elastic job's worlds: generation `g` authenticates with
/// the job token's key for incarnation `ELASTIC_INCARNATION_BASE + g`, so no world of a
/// non-elastic re-init shares a key with one of them.
pub const ELASTIC_INCARNATION_BASE: u64 = 1 << 32;

/// This worker's place in one generation of an elastic job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The generation (one world each).
    pub generation: u64,
    /// This worker's rank, size, local and cross values in the generation's world.
    pub topology: Topology,
    /// `ip:port` where the generation's rank 0 listens for the rendezvous.
    pub rendezvous: String,
    /// The driver's host-set stamp when the generation was formed.
    pub hosts_stamp: u64,
}

impl Assignment {
    /// The LaunchInfo of this generation: `base` (from `LaunchInfo::from_vars` without rank
    /// variables — timeout, token, host id...) with the topology, rendezvous and the token for
    /// incarnation ELASTIC_INCARNATION_BASE + generation.
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
            token: base.token.as_ref().map(|tok| {
                tok.for_incarnation(ELASTIC_INCARNATION_BASE.saturating_add(self.generation))
            }),
            ..base.clone()
        }
    }
}

/// The driver's answer to a worker that registers for the next world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// The worker is in the next world.
    Member(Assignment),
    /// The worker is not in the next world (its host was removed or blacklisted, or it is
    /// above `--max-np`); the reason. The driver stops it.
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
    /// Whether hosts were removed since the stamp asked about.
    pub removed: bool,
}
