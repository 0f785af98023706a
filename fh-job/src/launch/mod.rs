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

mod address;
mod derived;
mod launchers;

use address::rendezvous;
pub use address::{free_local_port, free_local_ports, is_wildcard_host};
use derived::{announce_derived_token, derive_token, DERIVED_TOKEN_NOTICE};
use launchers::{
    first_set, from_fhrun, from_mpich, from_openmpi, from_slurm, from_torchrun, FHRUN_CROSS_VARS,
    FHRUN_LOCAL_VARS,
};

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

    /// The launch of rank `rank` of `size` as a launcher that gives only these two numbers
    /// (`FH_RANK`, `FH_SIZE`): no local or cross claims, so every rank is first assumed on one
    /// host and the hosts are settled from facts at the rendezvous. A world of more than one
    /// rank needs [`LaunchInfo::rendezvous`] and [`LaunchInfo::token`] set on it too.
    /// [`LaunchInfo::to_vars`] writes it.
    pub fn bare(rank: usize, size: usize) -> Self {
        LaunchInfo {
            rank,
            size,
            local_rank: rank,
            local_size: size,
            launcher: Launcher::Fhrun,
            ..LaunchInfo::single()
        }
    }

    /// The variables that start a rank with this launch: the writer beside the reader, which
    /// every launcher, bench and test that starts ranks uses. [`LaunchInfo::from_vars`] reads
    /// them back into this same `LaunchInfo` when it is an `fhrun` launch
    /// ([`LaunchInfo::for_rank`] or [`LaunchInfo::bare`], with any timeout, heartbeat
    /// settings, host id or wildcard permission set on it, and without the cross claim
    /// ([`LaunchInfo::cross_vars`] `None`) when the hosts hold `local_size` consecutive ranks
    /// each, as the reader then assumes). A derived token is not written: every rank derives
    /// it again.
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

#[cfg(test)]
mod tests;
