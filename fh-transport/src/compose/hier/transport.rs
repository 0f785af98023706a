//! The hierarchical world: whether a hierarchy helps, setting it up over a TCP world (the
//! hosts' shared-memory worlds, collectively decided), and opening its communicators.

use std::sync::Arc;
use std::time::Duration;

use fh_job::hosts::Layout;
use fh_job::launch::LaunchInfo;
use fh_job::JobToken;

use super::{HierComm, STAGED_VAR};
use crate::backend::shm::{ShmOptions, ShmTransport};
use crate::backend::tcp::{TcpOptions, TcpTransport};
use crate::{Communicator, Interrupt, Result, Topology, Transport, TransportError};

/// Whether a hierarchy helps: several hosts, and some host with several ranks.
fn worth_it(layout: &Layout) -> bool {
    layout.hosts().len() > 1 && layout.hosts().iter().any(|h| h.len() > 1)
}

/// The token of host `host`'s shared-memory world: derived from the job token
/// ([`JobToken::derive`]), so the hosts' segments are named and keyed apart.
pub fn host_token(job: &JobToken, host: usize) -> JobToken {
    job.derive(&format!("hier host {host}"))
}

/// Whether the hierarchical backend is worth considering for this launch as its launcher
/// describes it: several ranks on several hosts. (`FH_TRANSPORT=auto` decides from the hosts
/// settled at the rendezvous instead, [`fh_job::hosts::choose`]; the final choice is made
/// collectively by [`connect_auto`].)
pub fn suits(info: &LaunchInfo) -> bool {
    info.size > 1 && info.cross_size > 1
}

/// Connect the world for `FH_TRANSPORT=auto` on several hosts: the hierarchical backend when
/// the layout is consistent, some host runs several ranks and every host has room in
/// `/dev/shm`; plain TCP otherwise. Every rank reaches the same decision (it is taken from one
/// allgather).
pub fn connect_auto(info: &LaunchInfo) -> Result<Box<dyn Transport>> {
    let tcp = TcpTransport::connect(info, TcpOptions::from_info(info))?;
    connect_auto_over(tcp, info)
}

/// [`connect_auto`] over a world whose rendezvous is done (every rank passes its own).
pub(crate) fn connect_auto_over(
    tcp: TcpTransport,
    info: &LaunchInfo,
) -> Result<Box<dyn Transport>> {
    match HierTransport::setup(tcp, info, false)? {
        Setup::Hier(t) => Ok(t),
        Setup::Tcp(t, why) => {
            tracing::info!(reason = %why, "FH_TRANSPORT=auto: using plain TCP between all ranks");
            Ok(t)
        }
    }
}

enum Setup {
    Hier(Box<HierTransport>),
    Tcp(Box<TcpTransport>, String),
}

/// One rank's handle on a hierarchical world (see the [module documentation](super)).
#[derive(Debug)]
pub struct HierTransport {
    tcp: TcpTransport,
    shm: ShmTransport,
    layout: Arc<Layout>,
    topology: Topology,
    timeout: Duration,
    /// [`STAGED_VAR`].
    staged: bool,
}

impl HierTransport {
    /// Connect the world described by a launch (`FH_TRANSPORT=hier`): the full-world TCP
    /// rendezvous, a check of the host layout on every rank, and this host's shared-memory
    /// world. Fails with [`TransportError::Config`] when the ranks' `FH_CROSS_*`/`FH_LOCAL_*`
    /// do not describe a consistent layout.
    pub fn connect(info: &LaunchInfo) -> Result<HierTransport> {
        let tcp = TcpTransport::connect(info, TcpOptions::from_info(info))?;
        match Self::setup(tcp, info, true)? {
            Setup::Hier(t) => Ok(*t),
            Setup::Tcp(_, why) => Err(TransportError::Config {
                var: "FH_TRANSPORT".into(),
                reason: format!("'hier' cannot be used: {why}; use 'tcp' or 'auto'"),
            }),
        }
    }

    fn setup(tcp: TcpTransport, info: &LaunchInfo, explicit: bool) -> Result<Setup> {
        // Where the ranks sit is what the rendezvous settled from facts (`fh_job::hosts`).
        let info = &info.with_topology(tcp.topology());
        let layout = tcp.layout().clone();
        // Every rank's place says how much room its /dev/shm had at the rendezvous: the same
        // list, hence the same answer, on every rank.
        let room = |r: usize| {
            let on_host = layout.hosts()[layout.topology(r).cross_rank].len();
            tcp.places()[r].shm_free >= crate::backend::shm::room_needed(on_host)
        };
        if let Some(r) = (0..info.size).find(|&r| !room(r)) {
            let why = format!("rank {r} has too little room in /dev/shm for shared memory");
            return Ok(Setup::Tcp(Box::new(tcp), why));
        }
        // Asked for explicitly, a degenerate hierarchy (one host, or one rank per host) still
        // works; only `auto` skips it.
        if !explicit && !worth_it(&layout) {
            let why = format!(
                "{} ranks on {} hosts: no host runs several ranks",
                info.size,
                layout.hosts().len()
            );
            return Ok(Setup::Tcp(Box::new(tcp), why));
        }
        let host_token = match &info.token {
            Some(t) => host_token(t, info.cross_rank).expose().to_owned(),
            None => format!("hier-single-{}", std::process::id()),
        };
        // Sizes from the environment (`FH_SHM_SLOT_BYTES`), the launch's timeout.
        let opts = ShmOptions {
            timeout: info.timeout,
            ..ShmOptions::from_env()?
        };
        let shm = ShmTransport::join_world(
            &host_token,
            tcp.world_id(),
            info.local_rank,
            info.local_size,
            opts,
        )?;
        let topology = Topology {
            rank: info.rank,
            size: info.size,
            local_rank: info.local_rank,
            local_size: info.local_size,
            cross_rank: info.cross_rank,
            cross_size: layout.hosts().len(),
        };
        tracing::debug!(rank = info.rank, hosts = ?layout.hosts(), "hierarchical world ready");
        Ok(Setup::Hier(Box::new(HierTransport {
            tcp,
            shm,
            layout: Arc::new(layout),
            topology,
            timeout: info.timeout,
            staged: std::env::var(STAGED_VAR).is_ok_and(|v| v == "1"),
        })))
    }

    /// Open the next communicator, as [`Transport::open`] does, returning the concrete type.
    pub fn open_hier(&mut self, label: &str) -> Result<HierComm> {
        // One interrupt for both halves: an engine that stops ends a wait on either side,
        // naming a global rank; both halves watch the world's heartbeats.
        let interrupt = Interrupt::new();
        // Interrupted while opening (a rank lost as the world forms): the cause names the
        // global rank.
        let global = |e: TransportError| interrupt.cause().map_or(e, |c| c.error());
        let tcp = self
            .tcp
            .open_tcp_with(label, interrupt.clone())
            .map_err(global)?;
        let host = self.layout.hosts()[self.topology.cross_rank].clone();
        let watch = self.tcp.liveness();
        let mut shm = self
            .shm
            .open_shm_with(label, interrupt.clone(), Some(host), watch)
            .map_err(global)?;
        // A local peer waiting across hosts fails within its TCP wait's bound and then
        // publishes whom it blames: a rank waiting for it in shared memory waits that long once.
        shm.set_outside_grace(tcp.longest_stall());
        let t = self.topology;
        let hosts = self.layout.hosts();
        let homogeneous = hosts.windows(2).all(|w| w[0].len() == w[1].len());
        let group = if homogeneous {
            hosts.iter().map(|h| h[t.local_rank]).collect()
        } else if t.local_rank == 0 {
            hosts.iter().map(|h| h[0]).collect()
        } else {
            Vec::new()
        };
        Ok(HierComm {
            label: label.to_owned(),
            tcp,
            layout: Arc::clone(&self.layout),
            topology: t,
            homogeneous,
            group_rank: t.cross_rank,
            group,
            leaders: hosts.iter().map(|h| h[0]).collect(),
            host_of: (0..t.size)
                .map(|r| self.layout.topology(r).cross_rank)
                .collect(),
            all: (0..t.size).collect(),
            staging: Vec::new(),
            staged: self.staged,
            broken: None,
            timeout: self.timeout,
            interrupt,
            outside: shm.outside_word(),
            pipeline_chunk: self.tcp.stream_settings().pipeline_chunk,
            shm,
        })
    }
}

impl Transport for HierTransport {
    fn backend(&self) -> &'static str {
        "hier"
    }

    fn wire(&self) -> crate::WireKind {
        crate::WireKind::Network
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.open_hier(label)?))
    }

    fn liveness(&self) -> Option<crate::liveness::Watch> {
        self.tcp.liveness()
    }

    fn stream_choice(&self) -> Option<crate::backend::tcp::StreamChoice> {
        self.tcp.stream_choice()
    }
}
