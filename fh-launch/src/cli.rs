//! Command-line interface of `fhrun` (clap derive) and the runtime knobs it exports.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// What `fhrun --version` prints after the name: the FastHorovod release (the same as the
/// `fasthorovod` package's `__version__` when both come from one wheel) and the TCP wire
/// protocol version.
pub fn version_line() -> &'static str {
    static LINE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "{} (FastHorovod wire protocol {})",
            fh_core::RELEASE,
            fh_transport::backend::tcp::wire::PROTOCOL_VERSION
        )
    });
    &LINE
}

/// Launch a FastHorovod job: N ranks of COMMAND, each with the FH_* environment.
///
/// Local jobs (no host list, or only this machine) are started by fhrun itself; on other hosts
/// fhrun starts the ranks through an rsh agent (ssh by default), or hands the whole job to
/// `mpirun` with --mpi.
#[derive(Debug, Parser)]
#[command(
    name = "fhrun",
    version = version_line(),
    allow_negative_numbers = true,
    override_usage = "fhrun -np N [-H HOST:SLOTS,... | --hostfile FILE] [--mpi] [OPTIONS] [--] COMMAND [ARGS]...",
    after_help = "Examples:\n  fhrun -np 4 python train.py\n  fhrun -np 2 --channels 2 --log-level debug -- ./my_job --flag\n  fhrun -np 8 -H node1:4,node2:4 python train.py\n  fhrun -np 8 -H node1:4,node2:4 --mpi python train.py\n\n`-np N` is accepted as a synonym of `-n N` / `--num-proc N`."
)]
pub struct Cli {
    /// Number of ranks to start (elastic jobs: how many to wait for before the first world;
    /// default --min-np).
    #[arg(short = 'n', long = "num-proc", visible_alias = "np", value_name = "N",
          required_unless_present_any = ["host_discovery_script", "min_np"],
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub num_proc: Option<u32>,

    /// Hosts and their slots, e.g. `node1:4,node2:4` (a host without `:N` has one slot).
    #[arg(
        short = 'H',
        long = "hosts",
        value_name = "HOST:SLOTS,...",
        conflicts_with = "hostfile"
    )]
    pub hosts: Option<String>,

    /// A hostfile: one host per line as `host slots=N` or `host:N`; `#` starts a comment.
    #[arg(long = "hostfile", visible_alias = "host-file", value_name = "FILE")]
    pub hostfile: Option<PathBuf>,

    /// Run the job through `mpirun` (as fhrun's child) instead of starting the ranks of other
    /// hosts through the rsh agent; other hosts' flight records and timelines then come back
    /// only where the job directory is on a shared filesystem (TMPDIR).
    #[arg(long)]
    pub mpi: bool,

    /// The command that runs a command on another host, as `AGENT [OPTIONS] HOST COMMAND`
    /// (default `ssh`; e.g. "ssh -p 2222"). fhrun runs itself there, at its own path, and sends
    /// the job — the job token included — on the agent's stdin, never on a command line. Not
    /// used with --mpi (mpirun has its own: `--mca plm_rsh_agent`).
    #[arg(
        long = "rsh-agent",
        value_name = "COMMAND",
        env = "FH_RSH_AGENT",
        default_value = "ssh"
    )]
    pub rsh_agent: String,

    /// Extra arguments appended to the mpirun command line (with --mpi), e.g. "--mca btl ^openib".
    #[arg(
        long = "mpi-args",
        value_name = "ARGS",
        allow_hyphen_values = true,
        requires = "mpi"
    )]
    pub mpi_args: Option<String>,

    /// Print what would be run (environment and command) and exit without running it.
    #[arg(long)]
    pub dry_run: bool,

    /// Print the launch plan (and, with --mpi, the mpirun command) before running it.
    #[arg(short, long)]
    pub verbose: bool,

    /// Do not prefix output lines with the rank; ranks write straight to fhrun's stdout/stderr.
    #[arg(long, conflicts_with = "prefix_output")]
    pub no_prefix: bool,

    /// Prefix every output line with `[RANK]<stdout>:` / `[RANK]<stderr>:` (the default).
    #[arg(long)]
    pub prefix_output: bool,

    /// Export an environment variable to every rank: `NAME=VALUE`, or `NAME` to pass fhrun's
    /// own value. Repeatable.
    #[arg(short = 'x', long = "env", value_name = "NAME[=VALUE]", value_parser = parse_env_pass)]
    pub env: Vec<EnvPass>,

    /// Seconds between SIGTERM and SIGKILL when fhrun stops the ranks.
    #[arg(long, value_name = "SECONDS", default_value = "2", value_parser = parse_duration)]
    pub kill_grace: Duration,

    /// Kill the whole job if it has not finished after this many seconds (exit status 124).
    #[arg(long, value_name = "SECONDS", value_parser = parse_positive_duration)]
    pub timeout: Option<Duration>,

    /// Address where rank 0 listens for the rendezvous (default: 127.0.0.1 and a free port for
    /// local jobs; the first host and a free local port number with --mpi).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_host_port)]
    pub rendezvous_addr: Option<String>,

    /// Print what the flight records in DIR (one file per rank, written on a stall, a failure
    /// or SIGUSR1) show — the first divergence across ranks, the last collective every rank
    /// completed — and exit without starting a job.
    #[arg(long, value_name = "DIR", exclusive = true)]
    pub explain: Option<PathBuf>,

    #[command(flatten)]
    pub elastic: ElasticArgs,

    #[command(flatten)]
    pub knobs: Knobs,

    /// The command each rank runs, and its arguments. Its first word may not begin with `-`
    /// (an option fhrun does not know is refused by name, never run as the command); after
    /// `--` anything goes.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Elastic training (as `horovodrun --host-discovery-script`): given a discovery script, fhrun
/// is an elastic driver (see `crate::elastic`).
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Elastic training")]
pub struct ElasticArgs {
    /// Run an elastic job: this executable prints the usable hosts, one `host` or `host:slots`
    /// a line; fhrun runs it every second.
    #[arg(long, value_name = "SCRIPT")]
    pub host_discovery_script: Option<PathBuf>,

    /// Fewest ranks the job may run on (elastic; default -np, else 1). Given without a
    /// discovery script, it makes the job elastic on fixed hosts (-H, --hostfile, or -np
    /// slots of this machine): fault tolerance without new hosts, as horovodrun's.
    #[arg(long, visible_alias = "min-num-proc", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub min_np: Option<u32>,

    /// Most ranks the job may run on (elastic; default: no limit).
    #[arg(long, visible_alias = "max-num-proc", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_np: Option<u32>,

    /// Slots of a host the discovery script names without `:slots` (elastic; default 1).
    #[arg(long, visible_alias = "slots-per-host", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub slots: Option<u32>,

    /// Seconds to wait for hosts: for -np slots before the first world, and for new hosts when
    /// fewer than --min-np ranks remain (elastic; default 600).
    #[arg(long, value_name = "SECONDS", value_parser = parse_positive_duration)]
    pub elastic_timeout: Option<Duration>,

    /// Seconds a worker has to register with the driver, counted from its start or from the
    /// start of the registration round, whichever is later (a new worker's interpreter start
    /// and imports; a survivor's way to its next collective); --elastic-timeout when that is
    /// longer (elastic; default 30).
    #[arg(long, value_name = "SECONDS", value_parser = parse_positive_duration)]
    pub start_timeout: Option<Duration>,

    /// A failing host is blacklisted for a cooldown, not for good (elastic): MIN·2^n plus a
    /// random share of MIN seconds after its n-th failure, kept within MIN..MAX.
    #[arg(long, num_args = 2, value_names = ["MIN", "MAX"], value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
    pub blacklist_cooldown_range: Option<Vec<u64>>,

    /// Most times the world may be re-formed after the first (elastic; default: no limit).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32))]
    pub reset_limit: Option<u32>,
}

/// The runtime's knobs, each exported to every rank as an `FH_*` variable when given.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Runtime knobs (exported to every rank)")]
pub struct Knobs {
    /// Scheduling preset (FH_SCHEDULE).
    #[arg(long, value_enum)]
    pub schedule: Option<Schedule>,

    /// Number of data channels, 1 = sequential dispatch (FH_CHANNELS; unset: fitted to the
    /// cores, 4, or 2 where a host's ranks have fewer than 2 cores each).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub channels: Option<u32>,

    /// Bytes per fused group, in MiB; 0 disables fusion (FH_FUSION_THRESHOLD, in bytes).
    #[arg(long, value_name = "MB", value_parser = parse_mib)]
    pub fusion_threshold_mb: Option<u64>,

    /// Tensors above this size (MiB) are split across channels (FH_PARTITION_BYTES, in bytes).
    #[arg(long, value_name = "MB", value_parser = parse_positive_mib)]
    pub partition_mb: Option<u64>,

    /// Negotiation cycle in milliseconds; 0 = wake on enqueue (FH_CYCLE_TIME_MS).
    #[arg(long, value_name = "MS", value_parser = parse_cycle_ms)]
    pub cycle_time_ms: Option<String>,

    /// Response-cache slots; 0 = coordinator every round (FH_CACHE_CAPACITY).
    #[arg(long, value_name = "SLOTS", value_parser = clap::value_parser!(u64).range(0..=(1 << 24)))]
    pub cache_capacity: Option<u64>,

    /// Group order: `ready` or `forward` (input layers first) (FH_PRIORITY).
    #[arg(long, value_enum)]
    pub priority: Option<Priority>,

    /// Write one Chrome-trace timeline of every rank to this path: each rank records its own,
    /// other hosts' fhrun send theirs back (with --mpi: where the job directory is shared),
    /// fhrun merges them at the end (a track per rank of every host, one clock; an elastic
    /// job: a file per generation, PATH with .gen-N before its extension). A path holding `{rank}` names a file per rank instead, left
    /// unmerged, on each rank's host (FH_TIMELINE).
    #[arg(long, value_name = "PATH")]
    pub timeline_filename: Option<PathBuf>,

    /// Disable the stall inspector (FH_STALL_CHECK_SECONDS=0).
    #[arg(long, conflicts_with = "stall_check_seconds")]
    pub no_stall_check: bool,

    /// Warn when some ranks wait on a tensor longer than this (FH_STALL_CHECK_SECONDS).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub stall_check_seconds: Option<u64>,

    /// Shut down after a stall this long; 0 = never (FH_STALL_SHUTDOWN_SECONDS).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64))]
    pub stall_shutdown_seconds: Option<u64>,

    /// Transport backend (FH_TRANSPORT).
    #[arg(long, value_enum)]
    pub transport: Option<TransportKind>,

    /// Seconds a rank waits for a peer before reporting it lost (FH_TIMEOUT_SECONDS).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub timeout_seconds: Option<u64>,

    /// Runtime log level (FH_LOG_LEVEL); any case, and horovodrun's `warning` and `fatal`.
    #[arg(long, value_enum, ignore_case = true)]
    pub log_level: Option<LogLevel>,
}

/// `--schedule` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Schedule {
    /// Decentralized negotiation, pipelined, parallel channels (default).
    Fasthorovod,
    /// Classic Horovod: one background thread, fixed cycle, sequential execution.
    Horovod,
}

/// `--priority` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Priority {
    /// In readiness order.
    Ready,
    /// Tensors the next forward pass needs first go first.
    Forward,
}

/// `--transport` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// Shared memory on one host; shared memory within and TCP between hosts otherwise.
    Auto,
    /// TCP sockets.
    Tcp,
    /// Shared memory (one host).
    Shm,
    /// Hierarchical: shared memory within each host, TCP between hosts.
    Hier,
    /// MPI (needs an MPI build and launch).
    Mpi,
    /// In-process (testing).
    Local,
}

/// `--log-level` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    /// Everything.
    Trace,
    /// Debugging detail.
    Debug,
    /// Informational.
    Info,
    /// Warnings and errors.
    #[value(alias = "warning")]
    Warn,
    /// Errors only.
    #[value(alias = "fatal")]
    Error,
}

fn value_name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

impl Knobs {
    /// The `FH_*` variables these knobs set, in a stable order.
    pub fn to_env(&self) -> Vec<(String, String)> {
        const MIB: u64 = 1024 * 1024;
        let mut env = Vec::new();
        let mut put = |k: &str, v: String| env.push((k.to_string(), v));
        if let Some(s) = &self.schedule {
            put("FH_SCHEDULE", value_name(s));
        }
        if let Some(c) = self.channels {
            put("FH_CHANNELS", c.to_string());
        }
        if let Some(mb) = self.fusion_threshold_mb {
            put("FH_FUSION_THRESHOLD", (mb * MIB).to_string());
        }
        if let Some(mb) = self.partition_mb {
            put("FH_PARTITION_BYTES", (mb * MIB).to_string());
        }
        if let Some(ms) = &self.cycle_time_ms {
            put("FH_CYCLE_TIME_MS", ms.clone());
        }
        if let Some(c) = self.cache_capacity {
            put("FH_CACHE_CAPACITY", c.to_string());
        }
        if let Some(p) = &self.priority {
            put("FH_PRIORITY", value_name(p));
        }
        if let Some(t) = &self.timeline_filename {
            put("FH_TIMELINE", t.display().to_string());
        }
        if self.no_stall_check {
            put("FH_STALL_CHECK_SECONDS", "0".into());
        } else if let Some(s) = self.stall_check_seconds {
            put("FH_STALL_CHECK_SECONDS", s.to_string());
        }
        if let Some(s) = self.stall_shutdown_seconds {
            put("FH_STALL_SHUTDOWN_SECONDS", s.to_string());
        }
        if let Some(t) = &self.transport {
            put("FH_TRANSPORT", value_name(t));
        }
        if let Some(t) = self.timeout_seconds {
            put("FH_TIMEOUT_SECONDS", t.to_string());
        }
        if let Some(l) = &self.log_level {
            put("FH_LOG_LEVEL", value_name(l));
        }
        env
    }
}

/// One `-x` item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvPass {
    /// Variable name.
    pub name: String,
    /// Explicit value; `None` passes fhrun's own value.
    pub value: Option<String>,
}

fn parse_env_pass(s: &str) -> Result<EnvPass, String> {
    let (name, value) = match s.split_once('=') {
        Some((n, v)) => (n, Some(v.to_string())),
        None => (s, None),
    };
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(format!(
            "'{name}' is not a valid environment variable name (letters, digits and '_', not starting with a digit)"
        ));
    }
    Ok(EnvPass {
        name: name.to_string(),
        value,
    })
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !v.is_finite() || !(0.0..=1e9).contains(&v) {
        return Err(format!("'{s}' is out of range (0 to 1e9 seconds)"));
    }
    Ok(v)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    Ok(Duration::from_secs_f64(parse_seconds(s)?))
}

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let v = parse_seconds(s)?;
    if v <= 0.0 {
        return Err("must be greater than 0".into());
    }
    Ok(Duration::from_secs_f64(v))
}

fn parse_mib(s: &str) -> Result<u64, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number of MiB"))?;
    if v > 1 << 20 {
        return Err(format!("{v} MiB is too large (at most 1048576 MiB)"));
    }
    Ok(v)
}

fn parse_positive_mib(s: &str) -> Result<u64, String> {
    match parse_mib(s)? {
        0 => Err("must be at least 1 MiB".into()),
        v => Ok(v),
    }
}

/// Accepts a non-negative number of milliseconds and returns it normalized (`"1"`, `"0.5"`).
fn parse_cycle_ms(s: &str) -> Result<String, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of milliseconds"))?;
    if !v.is_finite() || !(0.0..=60_000.0).contains(&v) {
        return Err(format!("'{s}' is out of range (0 to 60000 ms)"));
    }
    Ok(if v.fract() == 0.0 {
        format!("{}", v as u64)
    } else {
        format!("{v}")
    })
}

fn parse_host_port(s: &str) -> Result<String, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("'{s}' is not HOST:PORT"))?;
    if host.is_empty() {
        return Err(format!("'{s}' has an empty host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(s.to_string()),
        _ => Err(format!("'{port}' is not a valid port (1-65535)")),
    }
}

/// Rewrites horovodrun/mpirun-style `-np N` (single dash) into `--num-proc N`. Only the first
/// `-np` before a `--` separator is rewritten, so a command's own `-np` is left alone.
pub fn normalize_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut done = false;
    for a in args {
        if !done && a == "--" {
            done = true;
        }
        if !done && a == "-np" {
            out.push("--num-proc".to_string());
            done = true;
        } else if !done && a.starts_with("-np=") {
            out.push(format!("--num-proc={}", &a[4..]));
            done = true;
        } else {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests;
