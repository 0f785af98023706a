//! Where this process sits in the job, read from the environment its launcher left.
//!
//! [`LaunchInfo::from_env`] understands, in this order of precedence:
//!
//! | launcher | variables |
//! |---|---|
//! | `fhrun` | `FH_RANK`, `FH_SIZE`, `FH_LOCAL_RANK`, `FH_LOCAL_SIZE`, `FH_CROSS_RANK`, `FH_CROSS_SIZE`, `FH_RENDEZVOUS_ADDR`, `FH_JOB_TOKEN` |
//! | OpenMPI `mpirun` | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | MPICH / Hydra (PMI) | `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` |
//! | Slurm `srun` | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` or `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_STEP_TASKS_PER_NODE` or `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`, `SLURM_NODEID`, `SLURM_STEP_NUM_NODES` or `SLURM_NNODES` (only inside a job step, i.e. when `SLURM_STEP_ID` is set: a batch script is one process) |
//! | `torchrun` | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT` |
//! | none | a single process: rank 0 of 1 |
//!
//! Whatever the launcher, `FH_RENDEZVOUS_ADDR` (`host:port` where rank 0 listens) and
//! `FH_JOB_TOKEN` win when set; otherwise the rendezvous is `MASTER_ADDR:MASTER_PORT`. Under
//! `torchrun`, whose agent already holds `MASTER_PORT`, rank 0 listens on `MASTER_PORT + 1`.
//!
//! **The job token.** `FH_JOB_TOKEN` is the job's shared secret: at least [`MIN_TOKEN_LEN`]
//! bytes of printable ASCII with at least [`MIN_TOKEN_DISTINCT`](crate::token::MIN_TOKEN_DISTINCT) distinct characters (`fhrun`
//! makes 64 random hex digits per job); [`check_token`] says what is wrong and how to fix it.
//! A set but empty (or blank) `FH_JOB_TOKEN` is an error, never taken for an unset one — that
//! is what `export FH_JOB_TOKEN=$(openssl rand -hex 32)` leaves on a host without openssl. It is held in a
//! [`JobToken`], whose `Debug` never shows it, and never crosses the network (the TCP backend
//! proves knowledge of it with HMAC-SHA-256 over fresh nonces). Without `FH_JOB_TOKEN` (plain
//! `torchrun`, `srun` or `mpirun`) a token is *derived* from what all ranks share (rendezvous
//! address, world size, job-id variables), so that such jobs still just work: it keeps other
//! jobs and accidents out, but anyone who can read those public facts can compute it, so it
//! authenticates nothing. Rank 0 says so once on stderr, with the fix. `FH_REQUIRE_TOKEN=1`
//! turns that fallback into an error.
//!
//! **Hosts.** The local and cross values a launcher gives are claims: every rank's host is
//! settled from facts at the TCP rendezvous ([`crate::hosts`]; `FH_HOST_ID` names it instead),
//! and a claim that contradicts them stops every rank at start-up. Without local values every
//! rank is first assumed on one host ([`LaunchInfo::local_vars`] is then `None`).
//!
//! **The rendezvous address** must name an address of rank 0's host: a wildcard (`0.0.0.0`,
//! `::`) would make rank 0 listen on every interface and is refused unless
//! `FH_ALLOW_WILDCARD=1`.
//!
//! **The timeout** (`FH_TIMEOUT_SECONDS`, seconds, may be fractional) is at least
//! [`MIN_TIMEOUT`] and at most a year. The heartbeats' settings (`FH_HEARTBEAT_TIMEOUT_SECONDS`,
//! `FH_HEARTBEAT_INTERVAL_MS`) are read here too ([`crate::heartbeat::Settings::from_vars`]).
//!
//! **The launcher's release.** `fhrun` gives every rank its own release in
//! [`FHRUN_VERSION_VAR`]; a rank of another release ([`fh_core::RELEASE`]) stops at start-up
//! with an error naming both (the ranks' Python environment and the `fhrun` that started them
//! come from different installs).
//!
//! Every bad value is a [`JobError::Config`](crate::JobError::Config) naming the variable and what is expected.

use std::fmt;
use std::time::Duration;

use crate::error::config;
use crate::heartbeat::Settings as HeartbeatSettings;
use crate::token::{check_token, JobToken, MIN_TOKEN_LEN};
use crate::{Result, Topology};

/// The variable in which `fhrun` gives its ranks its release (`fh_core::RELEASE`), checked
/// against the rank's own by [`LaunchInfo::from_vars`].
pub const FHRUN_VERSION_VAR: &str = "FH_FHRUN_VERSION";

/// Default for `FH_TIMEOUT_SECONDS`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Shortest `FH_TIMEOUT_SECONDS` accepted: every wait of a job (process start-up, the
/// rendezvous, a handshake, a collective) must be allowed at least this long.
pub const MIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Which launcher started this process (whose variables were read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// FastHorovod's own `fhrun` (the `FH_*` variables).
    Fhrun,
    /// OpenMPI's `mpirun`/`mpiexec`.
    OpenMpi,
    /// MPICH/Hydra or another PMI launcher.
    Mpich,
    /// Slurm's `srun`.
    Slurm,
    /// PyTorch's `torchrun`.
    Torchrun,
    /// No launcher: a single process.
    Single,
}

impl Launcher {
    /// A short human-readable name.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Fhrun => "fhrun",
            Launcher::OpenMpi => "OpenMPI",
            Launcher::Mpich => "MPICH/PMI",
            Launcher::Slurm => "Slurm",
            Launcher::Torchrun => "torchrun",
            Launcher::Single => "single process",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// This process's place in the job and how to reach the others.
#[derive(Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    /// Global rank, `0..size`.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the ranks of this host.
    pub local_rank: usize,
    /// Number of ranks on this host.
    pub local_size: usize,
    /// Index of this host.
    pub cross_rank: usize,
    /// Number of hosts.
    pub cross_size: usize,
    /// `host:port` where rank 0 listens for the rendezvous (`None` for a single process).
    pub rendezvous: Option<String>,
    /// The job token every connection must prove (`None` for a single process).
    pub token: Option<JobToken>,
    /// Whether [`LaunchInfo::token`] was derived from shared job facts rather than given in
    /// `FH_JOB_TOKEN` (then it authenticates nothing; it only keeps other jobs out).
    pub token_derived: bool,
    /// Whether a wildcard rendezvous address (`0.0.0.0`, `::`) is allowed
    /// (`FH_ALLOW_WILDCARD=1`).
    pub allow_wildcard: bool,
    /// Which launcher's variables were used.
    pub launcher: Launcher,
    /// How long to wait for a peer before giving up (`FH_TIMEOUT_SECONDS`).
    pub timeout: Duration,
    /// The heartbeats' interval and tolerated silence (`FH_HEARTBEAT_INTERVAL_MS`,
    /// `FH_HEARTBEAT_TIMEOUT_SECONDS`); `None` when turned off (`fh_transport::liveness`).
    pub liveness: Option<HeartbeatSettings>,
    /// The host identity given in `FH_HOST_ID`, which replaces the one computed from facts
    /// ([`crate::hosts::HostId`]); `None` when unset.
    pub host_id: Option<String>,
    /// The launcher's variables that gave [`LaunchInfo::local_rank`] and
    /// [`LaunchInfo::local_size`] (rank variable, size variable); `None` when the launcher
    /// gave none and the values are only assumed (every rank on one host).
    pub local_vars: Option<(&'static str, &'static str)>,
    /// The launcher's variables that gave [`LaunchInfo::cross_rank`] and
    /// [`LaunchInfo::cross_size`]; `None` when they are only derived.
    pub cross_vars: Option<(&'static str, &'static str)>,
}

impl fmt::Debug for LaunchInfo {
    // The token is a secret: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaunchInfo")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("cross_rank", &self.cross_rank)
            .field("cross_size", &self.cross_size)
            .field("rendezvous", &self.rendezvous)
            .field("token", &self.token)
            .field("token_derived", &self.token_derived)
            .field("allow_wildcard", &self.allow_wildcard)
            .field("launcher", &self.launcher)
            .field("timeout", &self.timeout)
            .field("liveness", &self.liveness)
            .field("host_id", &self.host_id)
            .field("local_vars", &self.local_vars)
            .field("cross_vars", &self.cross_vars)
            .finish()
    }
}

impl LaunchInfo {
    /// A single process: rank 0 of 1, no rendezvous.
    pub fn single() -> Self {
        LaunchInfo {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            cross_rank: 0,
            cross_size: 1,
            rendezvous: None,
            token: None,
            token_derived: false,
            allow_wildcard: false,
            launcher: Launcher::Single,
            timeout: DEFAULT_TIMEOUT,
            liveness: Some(HeartbeatSettings::default()),
            host_id: None,
            local_vars: None,
            cross_vars: None,
        }
    }

    /// The launch of rank `t.rank` as `fhrun` gives it: its whole topology as the launcher's
    /// claims, the rendezvous address and the job token. [`LaunchInfo::to_vars`] writes it.
    pub fn for_rank(t: Topology, rendezvous: impl Into<String>, token: JobToken) -> Self {
        LaunchInfo {
            rank: t.rank,
            size: t.size,
            local_rank: t.local_rank,
            local_size: t.local_size,
            cross_rank: t.cross_rank,
            cross_size: t.cross_size,
            rendezvous: (t.size > 1).then(|| rendezvous.into()),
            token: Some(token),
            launcher: Launcher::Fhrun,
            local_vars: Some(FHRUN_LOCAL_VARS),
            cross_vars: Some(FHRUN_CROSS_VARS),
            ..LaunchInfo::single()
        }
    }

    /// The variables that start a rank with this launch: the writer beside the reader, which
    /// every launcher, bench and test that starts ranks uses. [`LaunchInfo::from_vars`] reads
    /// them back into this same `LaunchInfo` when it is an `fhrun` launch
    /// ([`LaunchInfo::for_rank`], with any timeout, heartbeat settings, host id or wildcard
    /// permission set on it). A derived token is not written: every rank derives it again.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            ("FH_RANK", self.rank.to_string()),
            ("FH_SIZE", self.size.to_string()),
        ];
        if self.local_vars.is_some() {
            out.push((FHRUN_LOCAL_VARS.0, self.local_rank.to_string()));
            out.push((FHRUN_LOCAL_VARS.1, self.local_size.to_string()));
        }
        if self.cross_vars.is_some() {
            out.push((FHRUN_CROSS_VARS.0, self.cross_rank.to_string()));
            out.push((FHRUN_CROSS_VARS.1, self.cross_size.to_string()));
        }
        if let Some(r) = &self.rendezvous {
            out.push(("FH_RENDEZVOUS_ADDR", r.clone()));
        }
        if let Some(t) = self.token.as_ref().filter(|_| !self.token_derived) {
            out.push(("FH_JOB_TOKEN", t.expose().to_owned()));
        }
        if self.timeout != DEFAULT_TIMEOUT {
            out.push(("FH_TIMEOUT_SECONDS", self.timeout.as_secs_f64().to_string()));
        }
        match self.liveness {
            None => out.push((crate::heartbeat::SILENCE_VAR, "0".into())),
            Some(s) if s != HeartbeatSettings::default() => {
                out.push((
                    crate::heartbeat::SILENCE_VAR,
                    s.silence.as_secs_f64().to_string(),
                ));
                out.push((
                    crate::heartbeat::INTERVAL_VAR,
                    s.interval.as_millis().to_string(),
                ));
            }
            Some(_) => {}
        }
        if let Some(h) = &self.host_id {
            out.push((HOST_ID_VAR, h.clone()));
        }
        if self.allow_wildcard {
            out.push(("FH_ALLOW_WILDCARD", "1".into()));
        }
        out
    }

    /// This launch with the topology `t` settled from the facts
    /// ([`crate::hosts::settle`]) in place of the launcher's.
    pub fn with_topology(&self, t: Topology) -> LaunchInfo {
        LaunchInfo {
            local_rank: t.local_rank,
            local_size: t.local_size,
            cross_rank: t.cross_rank,
            cross_size: t.cross_size,
            ..self.clone()
        }
    }

    /// Read the process environment (see the [module documentation](self)).
    pub fn from_env() -> Result<Self> {
        let info = Self::from_vars(|name| std::env::var(name).ok())?;
        if info.token_derived {
            tracing::warn!(launcher = %info.launcher, "{DERIVED_TOKEN_NOTICE}");
            if info.rank == 0 {
                announce_derived_token(info.launcher);
            }
        }
        Ok(info)
    }

    /// Parse from any variable source; `var(name)` returns the value of `name` if set.
    /// Pure: this is what [`LaunchInfo::from_env`] calls with the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        // A set-but-empty token is not a missing one: deriving a public token in its place
        // would let anyone in (`export FH_JOB_TOKEN=$(openssl rand -hex 32)` on a host without
        // openssl sets it empty).
        if let Some(t) = var("FH_JOB_TOKEN") {
            check_token(&t)?;
        }
        // Treat other empty values as unset: launchers and shells often export empty variables.
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        // First: a launcher of another release may set anything else differently.
        check_launcher_release(&get)?;
        let timeout = parse_timeout(&get)?;

        let mut info = if get("FH_RANK").is_some() || get("FH_SIZE").is_some() {
            from_fhrun(&get)?
        } else if get("OMPI_COMM_WORLD_RANK").is_some() || get("OMPI_COMM_WORLD_SIZE").is_some() {
            from_openmpi(&get)?
        } else if get("PMI_RANK").is_some() || get("PMI_SIZE").is_some() {
            from_mpich(&get)?
        } else if get("SLURM_PROCID").is_some()
            && first_set(
                &get,
                &["SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"],
            )
            .is_some()
        {
            from_slurm(&get)?
        } else if get("RANK").is_some() && get("WORLD_SIZE").is_some() {
            from_torchrun(&get)?
        } else {
            LaunchInfo::single()
        };
        info.timeout = timeout;
        info.liveness = crate::heartbeat::Settings::from_vars(get)?;
        info.host_id = parse_host_id(&get)?;
        info.allow_wildcard = parse_flag(&get, "FH_ALLOW_WILDCARD")?;
        let require_token = parse_flag(&get, "FH_REQUIRE_TOKEN")?;
        info.check_topology()?;
        if info.size > 1 {
            info.rendezvous = Some(rendezvous(&get, info.launcher, info.allow_wildcard)?);
            match get("FH_JOB_TOKEN") {
                Some(token) => {
                    check_token(&token)?;
                    info.token = Some(JobToken::new(token.trim().to_owned()));
                }
                None if require_token => {
                    return Err(config(
                        "FH_JOB_TOKEN",
                        format!(
                            "FH_REQUIRE_TOKEN is set but FH_JOB_TOKEN is not (a {} launch): \
                             export a random secret of at least {MIN_TOKEN_LEN} bytes, e.g. \
                             `export FH_JOB_TOKEN=$(openssl rand -hex 32)`, in the environment \
                             every rank inherits (see fh-launch/README.md)",
                            info.launcher
                        ),
                    ));
                }
                None => {
                    info.token = Some(JobToken::new(derive_token(&get, &info)));
                    info.token_derived = true;
                }
            }
        } else if let Some(token) = get("FH_JOB_TOKEN") {
            check_token(&token)?;
            info.token = Some(JobToken::new(token.trim().to_owned()));
        }
        Ok(info)
    }

    /// The topology described by this launch.
    pub fn topology(&self) -> Topology {
        Topology {
            rank: self.rank,
            size: self.size,
            local_rank: self.local_rank,
            local_size: self.local_size,
            cross_rank: self.cross_rank,
            cross_size: self.cross_size,
        }
    }

    fn check_topology(&self) -> Result<()> {
        let (prefix, rank_var, size_var) = match self.launcher {
            Launcher::Fhrun => ("FH_", "FH_RANK", "FH_SIZE"),
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
            ),
            Launcher::Mpich => ("MPI_", "PMI_RANK", "PMI_SIZE"),
            Launcher::Slurm => ("SLURM_", "SLURM_PROCID", "SLURM_NTASKS"),
            Launcher::Torchrun => ("", "RANK", "WORLD_SIZE"),
            Launcher::Single => ("", "rank", "size"),
        };
        if self.size == 0 {
            return Err(config(size_var, "the world size must be at least 1"));
        }
        if self.rank >= self.size {
            return Err(config(
                rank_var,
                format!(
                    "rank {} is not below the world size {} ({size_var}); ranks are 0..{}",
                    self.rank,
                    self.size,
                    self.size - 1
                ),
            ));
        }
        if self.local_size == 0 || self.local_size > self.size {
            return Err(config(
                format!("{prefix}LOCAL_SIZE"),
                format!(
                    "local size {} must be between 1 and the world size {}",
                    self.local_size, self.size
                ),
            ));
        }
        if self.local_rank >= self.local_size {
            return Err(config(
                format!("{prefix}LOCAL_RANK"),
                format!(
                    "local rank {} is not below the local size {}",
                    self.local_rank, self.local_size
                ),
            ));
        }
        if self.cross_size == 0 || self.cross_size > self.size {
            return Err(config(
                format!("{prefix}CROSS_SIZE"),
                format!(
                    "cross size (number of hosts) {} must be between 1 and the world size {}",
                    self.cross_size, self.size
                ),
            ));
        }
        if self.cross_rank >= self.cross_size {
            return Err(config(
                format!("{prefix}CROSS_RANK"),
                format!(
                    "cross rank (host index) {} is not below the cross size {}",
                    self.cross_rank, self.cross_size
                ),
            ));
        }
        Ok(())
    }
}

/// A rank started by an `fhrun` of another release stops here, naming both releases.
fn check_launcher_release(get: &impl Fn(&str) -> Option<String>) -> Result<()> {
    match get(FHRUN_VERSION_VAR) {
        Some(theirs) if theirs.trim() != fh_core::RELEASE => Err(config(
            FHRUN_VERSION_VAR,
            format!(
                "this rank runs FastHorovod {}, but the fhrun that started it is FastHorovod \
                 {}: install the same FastHorovod version on every host and launch with the \
                 fhrun that comes with it (`pip install fasthorovod-….whl` puts it beside the \
                 environment's python)",
                fh_core::RELEASE,
                theirs.trim()
            ),
        )),
        _ => Ok(()),
    }
}

type Get<'a> = dyn Fn(&str) -> Option<String> + 'a;

fn parse_usize(get: &Get<'_>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| config(name, format!("expected a non-negative integer, got {v:?}"))),
    }
}

fn require_usize(get: &Get<'_>, name: &str, launcher: Launcher, other: &str) -> Result<usize> {
    parse_usize(get, name)?.ok_or_else(|| {
        config(
            name,
            format!("{other} is set (a {launcher} launch) but {name} is missing"),
        )
    })
}

fn parse_timeout(get: &Get<'_>) -> Result<Duration> {
    match get("FH_TIMEOUT_SECONDS") {
        None => Ok(DEFAULT_TIMEOUT),
        Some(v) => parse_timeout_value(&v),
    }
}

/// Parse a value of `FH_TIMEOUT_SECONDS`: a number of seconds (may be fractional) from
/// [`MIN_TIMEOUT`] to a year; anything else is an error naming the variable and the fix.
pub fn parse_timeout_value(v: &str) -> Result<Duration> {
    let secs: f64 = v.trim().parse().map_err(|_| {
        config(
            "FH_TIMEOUT_SECONDS",
            format!("expected a positive number of seconds, got {v:?}"),
        )
    })?;
    if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0 * 365.0) {
        return Err(config(
            "FH_TIMEOUT_SECONDS",
            format!("expected a positive number of seconds (at most a year), got {v:?}"),
        ));
    }
    if secs < MIN_TIMEOUT.as_secs_f64() {
        return Err(config(
            "FH_TIMEOUT_SECONDS",
            format!(
                "{v:?} is too short: every wait of a job (start-up, the rendezvous, a \
                 handshake, a collective) needs at least {} s; set FH_TIMEOUT_SECONDS to {} or \
                 more (the default is {} s)",
                MIN_TIMEOUT.as_secs_f64(),
                MIN_TIMEOUT.as_secs_f64(),
                DEFAULT_TIMEOUT.as_secs()
            ),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Fill in what a launcher left out: without local information every rank is assumed on one
/// host; without cross information hosts are assumed to hold `local_size` consecutive ranks.
fn derive_rest(
    launcher: Launcher,
    rank: usize,
    size: usize,
    local: Option<(usize, usize)>,
    cross: (Option<usize>, Option<usize>),
    vars: Vars,
) -> LaunchInfo {
    let local_vars = local.and(vars.local);
    let cross_vars = match cross {
        (Some(_), Some(_)) => vars.cross,
        _ => None,
    };
    let (local_rank, local_size) = local.unwrap_or((rank, size));
    let ls = local_size.max(1);
    let cross_rank = cross.0.unwrap_or(rank / ls);
    let cross_size = cross.1.unwrap_or(size.div_ceil(ls));
    LaunchInfo {
        rank,
        size,
        local_rank,
        local_size,
        cross_rank,
        cross_size,
        rendezvous: None,
        token: None,
        token_derived: false,
        allow_wildcard: false,
        launcher,
        timeout: DEFAULT_TIMEOUT,
        liveness: Some(HeartbeatSettings::default()),
        host_id: None,
        local_vars,
        cross_vars,
    }
}

/// The variables a launcher's local and cross values come from (when it sets them).
#[derive(Default)]
struct Vars {
    local: Option<(&'static str, &'static str)>,
    cross: Option<(&'static str, &'static str)>,
}

/// `n` distinct ports on 127.0.0.1 that were free a moment ago (held together while probed,
/// so that they differ): where a launcher on one machine, a bench or a test puts a rendezvous
/// (and a store). Another process may take one before it is used; callers that start ranks
/// on it see that as the rendezvous' own clear error.
pub fn free_local_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// One port on 127.0.0.1 that was free a moment ago ([`free_local_ports`]).
pub fn free_local_port() -> std::io::Result<u16> {
    Ok(free_local_ports(1)?[0])
}

/// The variable that names this rank's host, replacing the identity computed from facts
/// ([`crate::hosts::HostId`]).
pub const HOST_ID_VAR: &str = "FH_HOST_ID";

/// Longest host name `FH_HOST_ID` may give, in bytes.
pub const MAX_NAMED_HOST_LEN: usize = 255;

fn parse_host_id(get: &Get<'_>) -> Result<Option<String>> {
    let Some(v) = get("FH_HOST_ID") else {
        return Ok(None);
    };
    let v = v.trim();
    if v.len() > MAX_NAMED_HOST_LEN || !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(config(
            "FH_HOST_ID",
            format!(
                "expected a name of at most {MAX_NAMED_HOST_LEN} printable ASCII characters without \
                 spaces, shared by exactly the ranks of one host (e.g. the host name), got {v:?}"
            ),
        ));
    }
    Ok(Some(v.to_owned()))
}

fn local_pair(get: &Get<'_>, rank_var: &str, size_var: &str) -> Result<Option<(usize, usize)>> {
    match (parse_usize(get, rank_var)?, parse_usize(get, size_var)?) {
        (Some(r), Some(s)) => Ok(Some((r, s))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(config(
            size_var,
            format!("{rank_var} is set but {size_var} is missing; set both or neither"),
        )),
        (None, Some(_)) => Err(config(
            rank_var,
            format!("{size_var} is set but {rank_var} is missing; set both or neither"),
        )),
    }
}

/// fhrun's variables of the local rank and size.
const FHRUN_LOCAL_VARS: (&str, &str) = ("FH_LOCAL_RANK", "FH_LOCAL_SIZE");
/// fhrun's variables of the host index and host count.
const FHRUN_CROSS_VARS: (&str, &str) = ("FH_CROSS_RANK", "FH_CROSS_SIZE");

fn from_fhrun(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Fhrun;
    let rank = require_usize(get, "FH_RANK", l, "FH_SIZE")?;
    let size = require_usize(get, "FH_SIZE", l, "FH_RANK")?;
    let local = local_pair(get, "FH_LOCAL_RANK", "FH_LOCAL_SIZE")?;
    let cross = (
        parse_usize(get, "FH_CROSS_RANK")?,
        parse_usize(get, "FH_CROSS_SIZE")?,
    );
    let vars = Vars {
        local: Some(FHRUN_LOCAL_VARS),
        cross: Some(FHRUN_CROSS_VARS),
    };
    Ok(derive_rest(l, rank, size, local, cross, vars))
}

fn from_openmpi(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::OpenMpi;
    let rank = require_usize(get, "OMPI_COMM_WORLD_RANK", l, "OMPI_COMM_WORLD_SIZE")?;
    let size = require_usize(get, "OMPI_COMM_WORLD_SIZE", l, "OMPI_COMM_WORLD_RANK")?;
    let local = local_pair(
        get,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )?;
    let vars = Vars {
        local: Some(("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
        cross: None,
    };
    Ok(derive_rest(l, rank, size, local, (None, None), vars))
}

fn from_mpich(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Mpich;
    let rank = require_usize(get, "PMI_RANK", l, "PMI_SIZE")?;
    let size = require_usize(get, "PMI_SIZE", l, "PMI_RANK")?;
    let local = local_pair(get, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
    let vars = Vars {
        local: Some(("MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
        cross: None,
    };
    Ok(derive_rest(l, rank, size, local, (None, None), vars))
}

/// Parse Slurm's `SLURM_TASKS_PER_NODE` (`"2(x3),1"`) and return the count of node `node`.
/// A plain number (`SLURM_NTASKS_PER_NODE=2`) applies to every node.
fn slurm_tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    if let Ok(n) = spec.trim().parse::<usize>() {
        return Some(n);
    }
    let mut seen = 0usize;
    for part in spec.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((c, rest)) => (c.parse().ok()?, rest.strip_suffix(')')?.parse().ok()?),
            None => (part.parse().ok()?, 1usize),
        };
        seen = seen.checked_add(repeat)?;
        if node < seen {
            return Some(count);
        }
    }
    None
}

/// The first of `names` that is set, with its name.
fn first_set(get: &Get<'_>, names: &[&'static str]) -> Option<(&'static str, String)> {
    names.iter().find_map(|&n| get(n).map(|v| (n, v)))
}

fn from_slurm(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Slurm;
    let rank = require_usize(get, "SLURM_PROCID", l, "SLURM_PROCID")?;
    // A job step may use fewer tasks and nodes than the allocation: prefer the step's view.
    let size = match first_set(
        get,
        &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"],
    ) {
        Some((name, _)) => require_usize(get, name, l, "SLURM_PROCID")?,
        None => {
            return Err(config(
                "SLURM_NTASKS",
                "SLURM_PROCID is set (a Slurm job step) but none of SLURM_STEP_NUM_TASKS, \
                 SLURM_NTASKS and SLURM_NPROCS is",
            ))
        }
    };
    let node = parse_usize(get, "SLURM_NODEID")?;
    let local_rank = parse_usize(get, "SLURM_LOCALID")?;
    let spec = first_set(
        get,
        &[
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
        ],
    );
    let local_size_var = spec.as_ref().map(|(name, _)| *name);
    let local_size = match spec {
        None => None,
        Some((name, spec)) => {
            let node = node.unwrap_or(0);
            Some(slurm_tasks_on_node(&spec, node).ok_or_else(|| {
                config(
                    name,
                    format!(
                        "expected a task count or a list like \"2(x3),1\" covering node {node}, \
                         got {spec:?}"
                    ),
                )
            })?)
        }
    };
    let local = match (local_rank, local_size) {
        (Some(r), Some(s)) => Some((r, s)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(config(
                "SLURM_TASKS_PER_NODE",
                "SLURM_LOCALID is set but none of SLURM_STEP_TASKS_PER_NODE, \
                 SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE is",
            ))
        }
        (None, Some(_)) => {
            return Err(config(
                "SLURM_LOCALID",
                "the tasks per node are set but SLURM_LOCALID is missing",
            ))
        }
    };
    let nodes_var = first_set(get, &["SLURM_STEP_NUM_NODES", "SLURM_NNODES"]).map(|(n, _)| n);
    let nodes = match nodes_var {
        Some(name) => parse_usize(get, name)?,
        None => None,
    };
    let vars = Vars {
        local: local_size_var.map(|s| ("SLURM_LOCALID", s)),
        cross: nodes_var.map(|n| ("SLURM_NODEID", n)),
    };
    Ok(derive_rest(l, rank, size, local, (node, nodes), vars))
}

fn from_torchrun(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Torchrun;
    let rank = require_usize(get, "RANK", l, "WORLD_SIZE")?;
    let size = require_usize(get, "WORLD_SIZE", l, "RANK")?;
    let local = local_pair(get, "LOCAL_RANK", "LOCAL_WORLD_SIZE")?;
    let cross = (
        parse_usize(get, "GROUP_RANK")?,
        parse_usize(get, "GROUP_WORLD_SIZE")?,
    );
    let vars = Vars {
        local: Some(("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
        cross: Some(("GROUP_RANK", "GROUP_WORLD_SIZE")),
    };
    Ok(derive_rest(l, rank, size, local, cross, vars))
}

fn check_addr(var: &str, addr: &str) -> Result<()> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(config(
            var,
            format!("expected host:port (e.g. 10.0.0.1:29400), got {addr:?}"),
        ));
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(config(
            var,
            format!("the host part of {addr:?} is empty; expected host:port"),
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(config(
            var,
            format!("the port of {addr:?} must be an integer in 1..=65535"),
        )),
    }
}

/// Whether `host` (without brackets) is a wildcard address: listening there means every
/// interface.
pub fn is_wildcard_host(host: &str) -> bool {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
}

fn check_not_wildcard(var: &str, addr: &str, allow: bool) -> Result<()> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    if !allow && is_wildcard_host(host) {
        return Err(config(
            var,
            format!(
                "{addr:?} is a wildcard address: rank 0 would listen on every interface of its \
                 host. Give an address of rank 0's host that the other ranks can reach (e.g. \
                 127.0.0.1 for one host, or the cluster network's address), or set \
                 FH_ALLOW_WILDCARD=1 if listening everywhere is really intended"
            ),
        ));
    }
    Ok(())
}

fn parse_flag(get: &Get<'_>, name: &str) -> Result<bool> {
    match get(name).as_deref().map(str::trim) {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) if v.eq_ignore_ascii_case("false") || v.eq_ignore_ascii_case("no") => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("yes") => Ok(true),
        Some(v) => Err(config(
            name,
            format!("expected 1 (on) or 0 (off), got {v:?}"),
        )),
    }
}

fn rendezvous(get: &Get<'_>, launcher: Launcher, allow_wildcard: bool) -> Result<String> {
    if let Some(addr) = get("FH_RENDEZVOUS_ADDR") {
        let addr = addr.trim().to_owned();
        check_addr("FH_RENDEZVOUS_ADDR", &addr)?;
        check_not_wildcard("FH_RENDEZVOUS_ADDR", &addr, allow_wildcard)?;
        return Ok(addr);
    }
    match (get("MASTER_ADDR"), get("MASTER_PORT")) {
        (Some(host), Some(port)) => {
            let mut port: u16 = port.trim().parse().ok().filter(|&p| p > 0).ok_or_else(|| {
                config(
                    "MASTER_PORT",
                    format!("expected a port number in 1..=65535, got {port:?}"),
                )
            })?;
            // torchrun's agent serves its own store on MASTER_PORT; use the next port.
            if launcher == Launcher::Torchrun
                && get("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"))
            {
                port = port.checked_add(1).ok_or_else(|| {
                    config(
                        "MASTER_PORT",
                        "the torchrun agent holds MASTER_PORT and MASTER_PORT + 1 overflows; \
                         set FH_RENDEZVOUS_ADDR",
                    )
                })?;
            }
            let host = host.trim();
            let addr = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            check_addr("MASTER_ADDR", &addr)?;
            check_not_wildcard("MASTER_ADDR", &addr, allow_wildcard)?;
            Ok(addr)
        }
        (Some(_), None) => Err(config(
            "MASTER_PORT",
            "MASTER_ADDR is set but MASTER_PORT is missing",
        )),
        (None, Some(_)) => Err(config(
            "MASTER_ADDR",
            "MASTER_PORT is set but MASTER_ADDR is missing",
        )),
        (None, None) => Err(config(
            "FH_RENDEZVOUS_ADDR",
            format!(
                "this is a job of several ranks (started by {launcher}) but no rendezvous address \
                 is set: launch with fhrun, or set FH_RENDEZVOUS_ADDR=host:port (where rank 0 will \
                 listen), or MASTER_ADDR and MASTER_PORT, in every rank's environment"
            ),
        )),
    }
}

/// What rank 0 says when the token is derived.
const DERIVED_TOKEN_NOTICE: &str = "FH_JOB_TOKEN is not set, so the job token is derived from \
     the rendezvous address, the world size and the launcher's job id. That keeps other jobs and \
     accidents out, but anyone who can see those facts can compute it: it authenticates nothing. \
     To fix, export a random secret in the environment every rank inherits, e.g. \
     `export FH_JOB_TOKEN=$(openssl rand -hex 32)` before torchrun/srun/mpirun (mpirun: add \
     `-x FH_JOB_TOKEN`), or launch with fhrun; set FH_REQUIRE_TOKEN=1 to refuse to start without \
     one.";

/// Say once per process, on stderr, that the token is derived. This is the one place where
/// this library writes to stderr itself: a warning that only a `tracing` subscriber could show
/// would go unseen in exactly the jobs it is about.
fn announce_derived_token(launcher: Launcher) {
    use std::io::Write as _;
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID: AtomicBool = AtomicBool::new(false);
    if SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let mut err = std::io::stderr().lock();
    // Nothing to do if stderr is closed.
    let _ = writeln!(
        err,
        "fasthorovod (rank 0, {launcher}): warning: {DERIVED_TOKEN_NOTICE}"
    );
}

/// 64-bit FNV-1a, for deriving a stable (not secret) token.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn derive_token(get: &Get<'_>, info: &LaunchInfo) -> String {
    let job_id = [
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "OMPI_MCA_ess_base_jobid",
        "OMPI_MCA_orte_ess_jobid",
        "PMI_JOBID",
        "PMIX_NAMESPACE",
        "TORCHELASTIC_RUN_ID",
    ]
    .iter()
    .map(|v| format!("{v}={};", get(v).unwrap_or_default()))
    .collect::<String>();
    let facts = format!(
        "fasthorovod-derived-token;{};size={};{job_id}",
        info.rendezvous.as_deref().unwrap_or(""),
        info.size
    );
    let a = fnv1a(0xcbf2_9ce4_8422_2325, facts.as_bytes());
    let b = fnv1a(0x6c62_272e_07bb_0142, facts.as_bytes());
    format!("derived-{a:016x}{b:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// What the writer writes, the reader reads back: any fhrun launch, with any timeout,
        /// heartbeat settings, host id and wildcard permission.
        #[test]
        fn the_writer_and_the_reader_agree(
            hosts in 1usize..5,
            per_host in 1usize..5,
            pick in 0usize..1000,
            port in 1024u16..65535,
            timeout_ms in 1000u64..100_000,
            beats in proptest::option::of((40u64..500, 3u64..40)),
            host_id in proptest::option::of("[a-z][a-z0-9-]{0,20}"),
            wildcard: bool,
        ) {
            let size = hosts * per_host;
            let rank = pick % size;
            let t = Topology {
                rank,
                size,
                local_rank: rank % per_host,
                local_size: per_host,
                cross_rank: rank / per_host,
                cross_size: hosts,
            };
            let addr = if wildcard { "0.0.0.0" } else { "127.0.0.1" };
            let mut info = LaunchInfo::for_rank(
                t,
                format!("{addr}:{port}"),
                JobToken::new("0123456789abcdef0123456789abcdef"),
            );
            info.timeout = Duration::from_millis(timeout_ms);
            info.liveness = beats.map(|(interval, times)| HeartbeatSettings {
                interval: Duration::from_millis(interval),
                silence: Duration::from_millis(interval * times),
            });
            info.host_id = host_id;
            info.allow_wildcard = wildcard;
            let vars: std::collections::HashMap<&str, String> = info.to_vars().into_iter().collect();
            let back = LaunchInfo::from_vars(|n| vars.get(n).cloned()).unwrap();
            proptest::prop_assert_eq!(back, info);
        }
    }

    #[test]
    fn tasks_per_node_syntax() {
        assert_eq!(slurm_tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
        assert_eq!(slurm_tasks_on_node("4", 3), Some(4));
        assert_eq!(slurm_tasks_on_node("x", 0), None);
    }
}
