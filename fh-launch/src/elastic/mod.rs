//! `fhrun --host-discovery-script SCRIPT ...` (or `--min-np N` on fixed hosts): the elastic
//! driver (the design is Horovod elastic's).
//!
//! fhrun runs SCRIPT every second ([`discovery`]: lines `host` or `host:slots`; fixed hosts
//! need no script), keeps the usable hosts — discovered and not blacklisted, in discovery
//! order — and a stamp bumped at every change ([`state`]), and starts each usable host's
//! workers (at most `--max-np` in all) as one *part* ([`workers`]): `fhrun
//! --internal-fhrun-remote` on that host, through the rsh agent for another host and as a plain
//! child process for this one, so every host is handled alike. A worker has no rank of its
//! own: it gets `FH_ELASTIC_ADDR` (the driver's session listener,
//! [`fh_job::elastic::Server`]), `FH_ELASTIC_WORKER=host:slot`, `FH_JOB_TOKEN`,
//! `HOROVOD_HOSTNAME`, `HOROVOD_ELASTIC=1`, horovodrun's `HOROVOD_RANK`... of its slot in the
//! world about to form, the knobs and the `-x` variables, and asks the driver for each world.
//! The driver ([`driver`]) answers all registered workers at once when every worker it expects
//! has registered (each within `--start-timeout`), with ranks from [`generation`]: survivors
//! first by previous rank, then new workers in discovery and slot order; never a world without
//! a survivor. A worker's failure blacklists its host (for good, or for a cooldown that grows
//! with each failure) and stops the host's other workers. The job ends at the first worker
//! that exits 0, as Horovod's; it fails at once when every member of the last world has ended,
//! and when fewer than `--min-np` ranks remain and no host comes within `--elastic-timeout`,
//! naming the lost hosts.
//!
//! fhrun prints one line per generation: `fhrun: generation 3: 2 ranks on h0, h1 (lost h2:
//! rank 2 killed by SIGKILL)`.
//!
//! The session listener is on 127.0.0.1 when every host of the first discovery is this
//! machine (a later remote host is then refused and blacklisted, with the reason); otherwise
//! on this machine's address on the route to the first other host (as the kernel picks the
//! source address; never the wildcard).

mod discovery;
mod driver;
mod generation;
mod state;
mod workers;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};

use fh_job::elastic::{Server, ADDR_VAR};
use fh_job::token::JobToken;

use crate::cli::Cli;
use crate::guardian::Guardian;
use crate::{hosts, launch, mpi, remote, sys, usage, Failure};

pub use discovery::Source;

/// Default `--elastic-timeout`.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Default `--start-timeout` (horovodrun's default too).
pub const DEFAULT_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Where an elastic job's hosts come from, from the flags; `None` for a fixed job.
///
/// A discovery script makes the job elastic (hosts come and go). `--min-np` without one makes
/// it elastic on fixed hosts, as horovodrun's: the hosts of `-H`/`--hostfile`, else `-np` slots
/// of this machine; a lost worker's host is blacklisted and the survivors go on. The other
/// elastic flags without either are refused, naming them.
pub fn source(cli: &Cli, hosts: Option<&[hosts::Host]>) -> Result<Option<Source>, Failure> {
    let e = &cli.elastic;
    if let Some(script) = &e.host_discovery_script {
        return Ok(Some(Source::Script(script.clone())));
    }
    if e.min_np.is_some() {
        let fixed = match (hosts, cli.num_proc) {
            (Some(h), _) => h.to_vec(),
            (None, Some(np)) => vec![hosts::Host {
                name: "localhost".into(),
                slots: np as usize,
            }],
            (None, None) => {
                return Err(usage(
                    "--min-np makes the job elastic, which needs hosts: --host-discovery-script                      SCRIPT (hosts that may change), -H HOST:SLOTS,... or --hostfile FILE (fixed                      hosts), or -np N (N slots of this machine)",
                ))
            }
        };
        let total = hosts::total_slots(&fixed);
        if let Some(np) = cli.num_proc.filter(|&np| np as usize > total) {
            return Err(usage(format!(
                "-np {np} needs {np} slots but the fixed hosts of this elastic job offer only \
                 {total}; add hosts or slots, or lower -np"
            )));
        }
        return Ok(Some(Source::Fixed(fixed)));
    }
    let given: Vec<&str> = [
        (e.max_np.is_some(), "--max-np"),
        (e.slots.is_some(), "--slots"),
        (e.elastic_timeout.is_some(), "--elastic-timeout"),
        (e.start_timeout.is_some(), "--start-timeout"),
        (
            e.blacklist_cooldown_range.is_some(),
            "--blacklist-cooldown-range",
        ),
        (e.reset_limit.is_some(), "--reset-limit"),
    ]
    .into_iter()
    .filter_map(|(g, name)| g.then_some(name))
    .collect();
    if given.is_empty() {
        return Ok(None);
    }
    Err(usage(format!(
        "{} {} only for an elastic job: add --host-discovery-script SCRIPT (a program that \
         prints the usable hosts, one `host` or `host:slots` a line), or --min-np N (fault \
         tolerance on the fixed hosts of -H, --hostfile or -np), or drop {}",
        given.join(", "),
        if given.len() == 1 { "is" } else { "are" },
        if given.len() == 1 { "it" } else { "them" }
    )))
}

/// The address the session listener binds: loopback when every host is this machine, else
/// this machine's address on the route to the first other host (which that host reaches),
/// or failing that an address of this machine's host name that is not loopback.
fn listen_ip(found: &[hosts::Host], hostname: &str) -> Result<(IpAddr, bool), Failure> {
    let Some(remote) = found.iter().find(|h| !hosts::is_local(&h.name, hostname)) else {
        return Ok((IpAddr::V4(Ipv4Addr::LOCALHOST), true));
    };
    if let Ok(ip) = fh_job::elastic::local_ip_towards(&remote.name) {
        if !ip.is_loopback() && !ip.is_unspecified() {
            return Ok((ip, false));
        }
    }
    (hostname, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| !a.ip().is_loopback()))
        .map(|a| (a.ip(), false))
        .ok_or_else(|| {
            (
                1,
                format!(
                    "the discovered hosts include other machines ({}), but fhrun finds no \
                     address of this machine they could reach: no route to {} and this \
                     machine's host name {hostname:?} resolves only to loopback, or not at all; \
                     fix /etc/hosts or DNS",
                    remote.name, remote.name
                ),
            )
        })
}

/// Run an elastic job. `token`: the job token (fhrun's or the one forwarded with `-x`);
/// `env`: what every worker gets besides the elastic variables (token, knobs, `-x`);
/// `gathered`: the job directory's directories other hosts' parts send files back into
/// ([`crate::observe::JobDir::gathered`]).
pub fn run(
    cli: &Cli,
    source: Source,
    token: String,
    env: Vec<(String, String)>,
    gathered: Vec<(String, std::path::PathBuf)>,
) -> Result<i32, Failure> {
    let e = &cli.elastic;
    let scripted = matches!(source, Source::Script(_));
    for (bad, flag) in [
        (scripted && cli.hosts.is_some(), "-H/--hosts"),
        (scripted && cli.hostfile.is_some(), "--hostfile"),
        (cli.mpi, "--mpi"),
        (cli.rendezvous_addr.is_some(), "--rendezvous-addr"),
        (cli.dry_run, "--dry-run"),
    ] {
        if bad {
            return Err(usage(format!(
                "{flag} cannot be used in an elastic job (--host-discovery-script or --min-np): \
                 its hosts come from the script or the fixed host list, and each world's \
                 rendezvous from its rank 0"
            )));
        }
    }
    let min_np = e.min_np.or(cli.num_proc).unwrap_or(1) as usize;
    let max_np = e.max_np.map(|m| m as usize);
    let initial_np = cli.num_proc.map_or(min_np, |n| n as usize);
    if let Some(max) = max_np {
        if max < min_np {
            return Err(usage(format!("--max-np {max} is below --min-np {min_np}")));
        }
        if initial_np > max {
            return Err(usage(format!("-np {initial_np} is above --max-np {max}")));
        }
    }
    if initial_np < min_np {
        return Err(usage(format!(
            "-np {initial_np} is below --min-np {min_np}: -np is how many workers to wait for \
             before the first world"
        )));
    }
    let cooldown = match e.blacklist_cooldown_range.as_deref() {
        None => None,
        Some([lo, hi]) if lo <= hi => Some((*lo, *hi)),
        Some(v) => {
            return Err(usage(format!(
                "--blacklist-cooldown-range MIN MAX wants MIN <= MAX, got {v:?}"
            )))
        }
    };
    let slots = e.slots.unwrap_or(1) as usize;
    let elastic_timeout = e.elastic_timeout.unwrap_or(DEFAULT_TIMEOUT);
    let agent = mpi::split_words(&cli.rsh_agent)
        .map_err(|e| usage(format!("--rsh-agent/FH_RSH_AGENT: {e}")))?;
    if agent.is_empty() {
        return Err(usage("--rsh-agent/FH_RSH_AGENT is empty"));
    }

    // The first discovery decides where the listener binds; a bad script fails here.
    let found = source.first(slots).map_err(|e| (1, e))?;
    let hostname = hosts::this_hostname();
    let (ip, loopback) = listen_ip(&found, &hostname)?;

    // Signals are blocked before any thread starts (the listener's, discovery's).
    sys::block_handled_signals().map_err(|e| (1, format!("cannot set up signal handling: {e}")))?;
    let server = Server::bind(
        SocketAddr::new(ip, 0),
        JobToken::from(token.as_str()),
        elastic_timeout,
    )
    .map_err(|e| (1, format!("cannot start the elastic driver: {e}")))?;
    let exe =
        std::env::current_exe().map_err(|e| (1, format!("cannot find fhrun's own path: {e}")))?;
    let cwd = std::env::current_dir()
        .map_err(|e| (1, format!("cannot read the current directory: {e}")))?;
    let mut worker_env = vec![
        (ADDR_VAR.to_string(), server.local_addr().to_string()),
        ("FH_JOB_TOKEN".to_string(), token),
        ("HOROVOD_ELASTIC".to_string(), "1".to_string()),
    ];
    worker_env.extend(env);
    let marker = sys::random_hex(8).map_err(|e| (1, format!("cannot read /dev/urandom: {e}")))?;
    let ctx = workers::PartContext {
        exe: exe.to_string_lossy().into_owned(),
        agent,
        cwd: cwd.to_string_lossy().into_owned(),
        command: cli.command.clone(),
        env: worker_env,
        forwarded: remote::FORWARDED_VARS
            .iter()
            .filter_map(|&k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect(),
        prefix: !cli.no_prefix,
        kill_grace: cli.kill_grace,
        verbose: cli.verbose,
        marker: format!("fhrun-elastic-exit-{marker}"),
        gather: (!gathered.is_empty()).then(|| crate::gather::Gather {
            marker: format!("fhrun-files-{marker}"),
            dirs: gathered,
        }),
    };
    let settings = driver::Settings {
        min_np,
        max_np,
        initial_np,
        elastic_timeout,
        start_timeout: e.start_timeout.unwrap_or(DEFAULT_START_TIMEOUT),
        reset_limit: e.reset_limit,
        timeout: cli.timeout,
        loopback,
    };
    if cli.verbose {
        eprintln!(
            "fhrun: elastic driver listening on {} (min-np {min_np}, max-np {}, waiting for \
             {initial_np} to start)",
            server.local_addr(),
            max_np.map_or("unlimited".into(), |m| m.to_string())
        );
    }
    let disc = discovery::Discovery::start(source, slots)
        .map_err(|e| (1, format!("cannot start the host discovery thread: {e}")))?;
    if let Err(e) = sys::become_subreaper() {
        if cli.verbose {
            eprintln!("fhrun: cannot become a subreaper ({e}); orphans of the workers go to init");
        }
    }
    let mut guardian = Guardian::start();
    let mut d = driver::Driver::new(settings, ctx, server, cooldown);
    d.discovered(Ok(found));
    let code = d.run(&disc, guardian.as_mut());
    drop(disc);
    launch::stop_orphans(&guardian, cli.kill_grace);
    if let Some(g) = guardian {
        g.dismiss();
    }
    Ok(code)
}
