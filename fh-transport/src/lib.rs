//! # fh-transport
//!
//! How bytes move between ranks. A [`Transport`] is a *world*: it knows its rank, the world
//! size and the host topology, and it opens independent [`Communicator`]s (each with its own
//! connections), so that a scheduler can run several collectives at once — one per channel —
//! without interference.
//!
//! A backend implements only point-to-point messaging ([`Communicator::send`],
//! [`Communicator::recv`], [`Communicator::send_recv`]); every collective (allreduce,
//! allgather(v), broadcast, alltoall(v), reduce-scatter, barrier) is written once, in
//! [`algorithms`], against that interface. Backends with faster native collectives override the
//! trait's default methods.
//!
//! A launched process joins its job with [`from_env`]: [`fh_job::LaunchInfo`] reads where it
//! sits from whichever launcher started it (`fhrun`, `mpirun`, `srun`, `torchrun`), and
//! `FH_TRANSPORT` picks the backend — by default `auto`: [`shm`] when every rank is on one
//! host, [`hier`] (shared memory within hosts, TCP between them) on several hosts, else [`tcp`],
//! which meets the other ranks at rank 0's rendezvous address and authenticates every
//! connection with the job token. Which ranks share a host is settled from facts exchanged at
//! that rendezvous ([`hosts`]), not taken from the launcher's word.
//!
//! ```no_run
//! use fh_core::ReduceOp;
//! use fh_transport::CollectivesExt;
//!
//! let mut world = fh_transport::from_env()?;
//! let mut comm = world.open("data")?;
//! let mut grads = vec![world.rank() as f32; 1024];
//! comm.allreduce_typed(&mut grads, ReduceOp::Average)?;
//! # Ok::<(), fh_transport::TransportError>(())
//! ```
//!
//! **Invariant:** this is the only crate that talks to sockets, MPI or NCCL. It knows nothing of
//! tensor names, fusion, scheduling or Python.
#![deny(missing_docs)]

pub mod algorithms;
pub mod backend;
pub mod comm;
pub mod compose;
pub mod error;
pub mod interrupt;
pub mod liveness;
pub mod metrics;

use fh_job::{elastic, hosts};

#[cfg(target_os = "linux")]
use backend::shm;
use backend::{local, mpi, tcp};
#[cfg(target_os = "linux")]
use compose::hier;
use compose::split;

pub use comm::{CollectivesExt, Communicator, Role, Topology, Transport, WireKind};
pub use error::TransportError;
pub use interrupt::Interrupt;

/// Result type of this crate.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// Whether this build includes the MPI backend (feature `mpi`).
pub const MPI_BUILT: bool = cfg!(feature = "mpi");

/// The environment variables this crate reads: the backend choice, where a rank sits in its
/// job (set by `fhrun` or derived from `mpirun`, `srun` and `torchrun`), the job token and
/// the backends' own settings. Upper layers use it to flag `FH_*` names nobody reads (a typo
/// would otherwise be ignored without a word).
pub const ENV_VARIABLES: &[&str] = &[
    "FH_TRANSPORT",
    "FH_RANK",
    "FH_SIZE",
    "FH_LOCAL_RANK",
    "FH_LOCAL_SIZE",
    "FH_CROSS_RANK",
    "FH_CROSS_SIZE",
    "FH_RENDEZVOUS_ADDR",
    "FH_JOB_TOKEN",
    "FH_REQUIRE_TOKEN",
    "FH_ALLOW_WILDCARD",
    "FH_TIMEOUT_SECONDS",
    "FH_HEARTBEAT_TIMEOUT_SECONDS",
    "FH_HEARTBEAT_INTERVAL_MS",
    "FH_HOST_ID",
    "FH_SHM_SLOT_BYTES",
    backend::tcp::settings::STREAMS_VAR,
    backend::tcp::settings::STRIPE_MIN_VAR,
    backend::tcp::settings::STRIPE_LOCAL_VAR,
    backend::tcp::settings::FLOW_CAP_VAR,
    "FH_MPI_THREAD_LEVEL",
    "FH_NCCL_LIBRARY",
    "FH_ELASTIC_ADDR",
    "FH_ELASTIC_WORKER",
    "FH_ELASTIC_TIMEOUT",
    fh_job::launch::FHRUN_VERSION_VAR,
];

/// How the data of a world built for the `FH_TRANSPORT` value `choice` moves on one host (for
/// models and benches that have the choice but no world; a live world says it with
/// [`Transport::wire`]): a choice of two (`CONTROL+DATA`) goes by its data backend.
pub fn wire_of_choice(choice: &str) -> WireKind {
    let data = choice.rsplit('+').next().unwrap_or(choice).trim();
    match data.to_ascii_lowercase().as_str() {
        "tcp" | "hier" => WireKind::Network,
        _ => WireKind::Memory,
    }
}

/// The accepted values of `FH_TRANSPORT`, for error messages.
pub const TRANSPORT_CHOICES: &str =
    "auto, tcp, shm, hier, mpi, local, or CONTROL+DATA to mix two (e.g. mpi+tcp)";

/// Build the world this process was launched into: read [`fh_job::LaunchInfo::from_env`]
/// and the backend chosen by `FH_TRANSPORT` (`auto` — the default — or `tcp`, `shm`, `hier`,
/// `mpi`, `local`), and connect.
///
/// Every backend but `mpi` and `local` starts with the TCP rendezvous through rank 0, where
/// the ranks exchange their host identities ([`hosts`]): the host layout is settled from those
/// facts on every rank alike, and a launcher whose local ranks or sizes contradict them stops
/// every rank with the same [`TransportError::Config`]. `auto` then picks shared memory when
/// every rank is on one host and `/dev/shm` has room on every rank; on several hosts, the
/// hierarchical backend — shared memory within each host, TCP between hosts — when some host
/// runs several ranks and every host has room ([`hier::connect_auto`] decides on every rank
/// alike); TCP otherwise. `hier` asks for the hierarchical backend explicitly (Linux).
/// `local` is only valid for a single process. `shm` needs every rank on one host (Linux).
/// `mpi` needs the `mpi` Cargo feature (else [`TransportError::BackendUnavailable`] says how to
/// build it) and ranks started by `mpirun`. `CONTROL+DATA` (e.g. `mpi+tcp`) opens control
/// communicators on the first backend and data communicators on the second
/// ([`split::SplitTransport`]).
///
/// Each call is a new *incarnation* of the process's world (a script that calls `shutdown()`
/// and `init()` again): the `n`-th world of a process authenticates with the job token's key
/// for incarnation `n` ([`fh_job::JobToken::for_incarnation`]). Every rank builds its worlds
/// in the same order, so the ranks of one incarnation share a key, and anything left of an
/// earlier one — a late connection, an abort notice or a liveness probe, a shared-memory
/// segment under the earlier names — fails authentication or is never found: it cannot
/// reach the new world.
///
/// An elastic worker (`FH_ELASTIC_ADDR` set) is refused: its worlds come from the driver,
/// through [`elastic::Client`], not from rank variables.
pub fn from_env() -> Result<Box<dyn Transport>> {
    from_env_keyed().map(|(world, _)| world)
}

/// [`from_env`], also returning the token this world authenticates with (its incarnation's,
/// `None` for a single process or MPI), from which a caller derives the keys of worlds it
/// forms later among some of these ranks ([`fh_job::JobToken::derive`]).
pub fn from_env_keyed() -> Result<(Box<dyn Transport>, Option<fh_job::JobToken>)> {
    refuse_elastic(|n| std::env::var(n).ok())?;
    let choice = std::env::var("FH_TRANSPORT").ok();
    // MPI learns its world from the MPI runtime (plain `mpirun -np N` sets no rendezvous
    // variables), so it needs nothing from the launch environment.
    if choice
        .as_deref()
        .is_some_and(|c| c.trim().eq_ignore_ascii_case("mpi"))
    {
        return Ok((mpi::world()?, None));
    }
    let mut info = fh_job::LaunchInfo::from_env()?;
    let incarnation = WORLDS_BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    info.token = info.token.map(|t| t.for_incarnation(incarnation));
    let world = world_for(&info, choice.as_deref())?;
    Ok((world, info.token))
}

/// An error when `var` says this process is an elastic worker.
fn refuse_elastic(var: impl Fn(&str) -> Option<String>) -> Result<()> {
    match var(elastic::ADDR_VAR).filter(|v| !v.trim().is_empty()) {
        None => Ok(()),
        Some(_) => Err(TransportError::Config {
            var: elastic::ADDR_VAR.into(),
            reason: format!(
                "this process is a worker of an elastic job ({} is set): its worlds come from \
                 the elastic driver (fh_job::elastic::Client, or fh-scheduler's \
                 elastic::Elastic), not from fh_transport::from_env",
                elastic::ADDR_VAR
            ),
        }),
    }
}

/// Worlds [`from_env`] has started building in this process: the next one's incarnation.
static WORLDS_BUILT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Build the world for `info` with the backend named `choice` (the value of `FH_TRANSPORT`;
/// `None` means `auto`). This is [`from_env`] without reading the environment.
pub fn world_for(info: &fh_job::LaunchInfo, choice: Option<&str>) -> Result<Box<dyn Transport>> {
    let choice = choice
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .unwrap_or("auto");
    if let Some((control, data)) = choice.split_once('+') {
        // Built in this order on every rank: both constructions are collective.
        let control = world_for(info, Some(control))?;
        let data = world_for(info, Some(data))?;
        return Ok(Box::new(split::SplitTransport::new(control, data)?));
    }
    match choice.to_ascii_lowercase().as_str() {
        #[cfg(target_os = "linux")]
        "auto" if info.size > 1 => connect_auto(info),
        "auto" | "tcp" => {
            let opts = tcp::TcpOptions::from_info(info);
            Ok(Box::new(tcp::TcpTransport::connect(info, opts)?))
        }
        "local" => {
            if info.size != 1 {
                return Err(TransportError::Config {
                    var: "FH_TRANSPORT".into(),
                    reason: format!(
                        "'local' runs everything in one process, but this job has {} ranks \
                         (from {}); use 'tcp' or 'auto'",
                        info.size, info.launcher
                    ),
                });
            }
            let world = local::LocalWorld::with_timeout(1, info.timeout);
            world
                .into_iter()
                .next()
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .ok_or_else(|| TransportError::Closed("empty in-process world".into()))
        }
        #[cfg(target_os = "linux")]
        "shm" => connect_shm(info),
        #[cfg(target_os = "linux")]
        "hier" => Ok(Box::new(hier::HierTransport::connect(info)?)),
        #[cfg(not(target_os = "linux"))]
        "hier" => Err(TransportError::BackendUnavailable {
            backend: "hier",
            reason: "the hierarchical backend needs Linux; use FH_TRANSPORT=tcp (or auto)".into(),
        }),
        #[cfg(not(target_os = "linux"))]
        "shm" => Err(TransportError::BackendUnavailable {
            backend: "shm",
            reason: "the shared-memory backend needs Linux; use FH_TRANSPORT=tcp (or auto)".into(),
        }),
        // The MPI world comes from the MPI runtime; `info` is not needed (see `mpi::world`).
        "mpi" => mpi::world(),
        other => Err(TransportError::Config {
            var: "FH_TRANSPORT".into(),
            reason: format!("unknown transport {other:?}; expected one of: {TRANSPORT_CHOICES}"),
        }),
    }
}

/// `FH_TRANSPORT=auto` for several ranks: the rendezvous settles the hosts, and
/// [`hosts::choose`] picks the backend from them, the same on every rank.
#[cfg(target_os = "linux")]
fn connect_auto(info: &fh_job::LaunchInfo) -> Result<Box<dyn Transport>> {
    let tcp = tcp::TcpTransport::connect(info, tcp::TcpOptions::from_info(info))?;
    match hosts::choose(tcp.layout(), tcp.places(), shm::room_needed) {
        hosts::Choice::Shm => {
            let settled = info.with_topology(tcp.topology());
            let world = tcp.world_id();
            let mut tcp = tcp;
            let beats = tcp.take_liveness();
            drop(tcp);
            let mut shm = shm::ShmTransport::from_info_in(&settled, Some(world))?;
            shm.set_liveness(beats);
            Ok(Box::new(shm))
        }
        hosts::Choice::Hier => hier::connect_auto_over(tcp, info),
        hosts::Choice::Tcp(why) => {
            tracing::info!(reason = %why, "FH_TRANSPORT=auto: using plain TCP between all ranks");
            Ok(Box::new(tcp))
        }
    }
}

/// `FH_TRANSPORT=shm`: a launcher that spreads the ranks over several hosts is refused at
/// once; otherwise the rendezvous checks the facts, which must put every rank on one host.
#[cfg(target_os = "linux")]
fn connect_shm(info: &fh_job::LaunchInfo) -> Result<Box<dyn Transport>> {
    shm::check_one_host(info)?;
    if info.size == 1 {
        return Ok(Box::new(shm::ShmTransport::from_info(info)?));
    }
    let tcp = tcp::TcpTransport::connect(info, tcp::TcpOptions::from_info(info))?;
    let hosts = tcp.layout().hosts();
    if hosts.len() != 1 {
        let listed: Vec<String> = hosts
            .iter()
            .take(4)
            .map(|h| format!("{:?}", tcp.places()[h[0]].host.as_str()))
            .collect();
        return Err(TransportError::Config {
            var: "FH_TRANSPORT".into(),
            reason: format!(
                "'shm' needs every rank on one host, but the ranks run on {} hosts ({}{}); use \
                 'auto' or 'tcp' (or set FH_HOST_ID if the ranks really share a host)",
                hosts.len(),
                listed.join(", "),
                if hosts.len() > 4 { ", ..." } else { "" }
            ),
        });
    }
    let settled = info.with_topology(tcp.topology());
    let world = tcp.world_id();
    let mut tcp = tcp;
    let beats = tcp.take_liveness();
    drop(tcp);
    let mut shm = shm::ShmTransport::from_info_in(&settled, Some(world))?;
    shm.set_liveness(beats);
    Ok(Box::new(shm))
}

#[cfg(test)]
mod tests {
    use fh_job::elastic::ADDR_VAR;

    use crate::WireKind;

    #[test]
    fn a_choice_of_two_goes_by_its_data_backend() {
        assert_eq!(super::wire_of_choice("mpi+tcp"), WireKind::Network);
        assert_eq!(super::wire_of_choice("tcp+mpi"), WireKind::Memory);
        assert_eq!(super::wire_of_choice("hier"), WireKind::Network);
        assert_eq!(super::wire_of_choice("shm"), WireKind::Memory);
    }

    #[test]
    fn from_env_refuses_an_elastic_worker() {
        // Checked through the pure helper: the variable's presence is what matters.
        let err = super::refuse_elastic(|n| (n == ADDR_VAR).then(|| "127.0.0.1:1".to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains(ADDR_VAR) && err.contains("elastic"), "{err}");
        assert!(super::refuse_elastic(|_| None).is_ok());
    }
}
