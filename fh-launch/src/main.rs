//! `fhrun`: the FastHorovod launcher.
//!
//! Starts N ranks of a command with the `FH_*` environment the runtime reads (rank, size, local
//! and cross rank/size, the rendezvous address where rank 0 listens, a fresh job token, and the
//! runtime knobs given as flags). fhrun runs the job itself, which prefixes their output,
//! forwards signals and fails fast; the ranks of other hosts it starts through an rsh agent
//! (`remote`), or it hands the whole job to `mpirun` (`--mpi`).

mod cli;
mod elastic;
mod gather;
mod guardian;
mod hosts;
mod launch;
mod mpi;
mod notice;
mod observe;
mod output;
mod remote;
mod sys;

use clap::Parser;

use cli::Cli;
use hosts::Host;

/// Exit status for a bad invocation (same as clap's).
const EXIT_USAGE: i32 = 2;

fn main() {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == guardian::GUARDIAN_ARG)
    {
        std::process::exit(guardian::serve());
    }
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == remote::REMOTE_ARG)
    {
        std::process::exit(remote::serve());
    }
    let args = cli::normalize_args(std::env::args_os().map(|a| a.to_string_lossy().into_owned()));
    let cli = Cli::parse_from(args);
    std::process::exit(match run(cli) {
        Ok(code) => code,
        Err((code, msg)) => {
            eprintln!("fhrun: {msg}");
            code
        }
    });
}

type Failure = (i32, String);

fn usage(msg: impl Into<String>) -> Failure {
    (EXIT_USAGE, msg.into())
}

/// Two distinct free ports (the rendezvous' and the torch store's).
fn free_local_ports() -> Result<(u16, u16), Failure> {
    let ports = fh_job::launch::free_local_ports(2).map_err(|e| {
        (
            1,
            format!("cannot find a free port for the rendezvous: {e}"),
        )
    })?;
    Ok((ports[0], ports[1]))
}

/// The rendezvous address (`--rendezvous-addr`, else `host` and a free port) and torchrun's
/// `MASTER_ADDR` and `MASTER_PORT` for the ranks: the same host and another port (a second
/// free one, or the one after a given rendezvous port), where `torch.distributed`'s default
/// `env://` rendezvous puts its store, so that `init_process_group` (with the `fasthorovod`
/// backend of `fasthorovod.torch.distributed`, or any other) works under fhrun as under
/// torchrun.
fn rendezvous_and_store(cli: &Cli, host: &str) -> Result<(String, [(String, String); 2]), Failure> {
    let (addr, store_port) = match &cli.rendezvous_addr {
        Some(a) => {
            let next = a
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .and_then(|p| p.checked_add(1))
                .unwrap_or(29500);
            (a.clone(), next)
        }
        None => {
            let (r, s) = free_local_ports()?;
            (format!("{host}:{r}"), s)
        }
    };
    let master = addr
        .rsplit_once(':')
        .map_or(addr.as_str(), |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Ok((
        addr,
        [
            ("MASTER_ADDR".to_string(), master),
            ("MASTER_PORT".to_string(), store_port.to_string()),
        ],
    ))
}

fn read_hosts(cli: &Cli) -> Result<Option<Vec<Host>>, Failure> {
    if let Some(list) = &cli.hosts {
        return hosts::parse_host_list(list).map(Some).map_err(usage);
    }
    if let Some(path) = &cli.hostfile {
        let text = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("cannot read hostfile {}: {e}", path.display())))?;
        return hosts::parse_hostfile(&text, &path.display().to_string())
            .map(Some)
            .map_err(usage);
    }
    Ok(None)
}

fn run(cli: Cli) -> Result<i32, Failure> {
    if let Some(dir) = &cli.explain {
        return Ok(observe::explain_dir(dir));
    }
    let hosts = read_hosts(&cli)?;
    // An elastic job: hosts from a discovery script, or fixed ones with --min-np.
    let elastic_source = elastic::source(&cli, hosts.as_deref())?;
    let is_elastic = elastic_source.is_some();
    // clap requires -np unless the job is elastic.
    let np = cli.num_proc.unwrap_or(0) as usize;
    let hostname = hosts::this_hostname();
    let remote: Vec<&Host> = hosts
        .iter()
        .flatten()
        .filter(|h| !hosts::is_local(&h.name, &hostname))
        .collect();
    if let (Some(hosts), false) = (&hosts, is_elastic) {
        let total = hosts::total_slots(hosts);
        if np > total {
            let list: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
            return Err(usage(format!(
                "-np {np} needs {np} slots but the hosts offer only {total} ({}); add hosts or \
                 slots, or lower -np",
                list.join(",")
            )));
        }
    }

    let token = sys::random_hex(32).map_err(|e| {
        (
            1,
            format!("cannot read /dev/urandom for the job token: {e}"),
        )
    })?;
    let mut user_env = Vec::new();
    let mut pass_through = Vec::new();
    for x in &cli.env {
        if x.value.is_some() && mpi::SECRET_VARS.contains(&x.name.as_str()) {
            eprintln!(
                "fhrun: warning: -x {0}=… puts the secret on fhrun's command line, where every \
                 user of this host can read it (ps); export {0} and pass -x {0} instead (or let \
                 fhrun make a fresh one)",
                x.name
            );
        }
        match (&x.value, cli.mpi) {
            (Some(v), _) => user_env.push((x.name.clone(), v.clone())),
            (None, true) => pass_through.push(x.name.clone()),
            (None, false) => match std::env::var(&x.name) {
                Ok(v) => user_env.push((x.name.clone(), v)),
                Err(_) => {
                    return Err(usage(format!(
                    "-x {0}: {0} is not set in fhrun's environment (give a value: -x {0}=VALUE)",
                    x.name
                )))
                }
            },
        }
    }
    // A token the user forwards replaces fhrun's fresh one: it must be a real secret. An empty
    // one (`FH_JOB_TOKEN= fhrun -x FH_JOB_TOKEN …`, or a failed `$(openssl …)`) would make the
    // ranks fall back to a public token.
    for name in mpi::SECRET_VARS {
        let value = user_env
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .or_else(|| {
                pass_through
                    .iter()
                    .any(|k| k == name)
                    .then(|| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
                    .flatten()
            });
        if let Some(v) = value {
            if let Err(e) = fh_job::token::check_token(&v) {
                return Err(usage(format!(
                    "-x {name}: {e}; or drop -x {name} and let fhrun draw a fresh token"
                )));
            }
        }
    }
    // A misspelt FH_* variable would reach every rank and change nothing: say so once, here.
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .chain(user_env.iter().map(|(k, _)| k.clone()))
        .chain(pass_through.iter().cloned())
        .collect();
    names.sort();
    names.dedup();
    for u in fh_scheduler::config::unknown_variables(names.iter().map(String::as_str)) {
        eprintln!("fhrun: warning: {u}; it has no effect");
    }
    let mut knobs = cli.knobs.to_env();
    // Every rank checks that it is of fhrun's own release (a rank of another stops, naming
    // both).
    knobs.push((
        fh_job::launch::FHRUN_VERSION_VAR.to_string(),
        fh_core::RELEASE.to_string(),
    ));
    // A directory of the job's own for the ranks' flight records and timelines (not for a
    // dry run).
    let job_dir = if cli.dry_run {
        None
    } else {
        let user_flight_dir = user_env.iter().any(|(k, _)| k == "FH_FLIGHT_DIR")
            || pass_through.iter().any(|k| k == "FH_FLIGHT_DIR")
            || std::env::var_os("FH_FLIGHT_DIR").is_some();
        let timeline = cli.knobs.timeline_filename.as_deref();
        match observe::JobDir::create(user_flight_dir, timeline, is_elastic) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!(
                    "fhrun: warning: cannot make the job's directory under {} ({e}); flight \
                     records go to the runtime's default and the timeline is rank 0's alone",
                    std::env::temp_dir().display()
                );
                None
            }
        }
    };
    for (k, v) in job_dir.iter().flat_map(observe::JobDir::env) {
        knobs.retain(|(n, _)| *n != k);
        knobs.push((k, v));
    }

    if let Some(source) = elastic_source {
        let token = user_env
            .iter()
            .rev()
            .find(|(k, _)| k == "FH_JOB_TOKEN")
            .map_or(token, |(_, v)| v.clone());
        let mut env = knobs;
        env.extend(user_env);
        let gathered = job_dir.iter().flat_map(observe::JobDir::gathered).collect();
        let code = elastic::run(&cli, source, token, env, gathered)?;
        if let Some(d) = job_dir {
            d.finish(code != 0);
        }
        return Ok(code);
    }

    if cli.mpi {
        let host_list = hosts.clone().unwrap_or_default();
        let (rendezvous, store) =
            rendezvous_and_store(&cli, &hosts::rendezvous_host(&host_list, &hostname))?;
        let mut env = vec![
            ("FH_RENDEZVOUS_ADDR".to_string(), rendezvous),
            ("FH_JOB_TOKEN".to_string(), token),
        ];
        env.extend(store);
        env.extend(knobs);
        env.extend(user_env);
        let extra_args = match &cli.mpi_args {
            Some(a) => mpi::split_words(a).map_err(usage)?,
            None => Vec::new(),
        };
        let cmd = mpi::build(&mpi::MpiJob {
            np: np as u32,
            hosts: &host_list,
            local_only: remote.is_empty(),
            tag_output: !cli.no_prefix,
            as_root: sys::is_root(),
            env,
            pass_through,
            extra_args,
            command: &cli.command,
        });
        if cli.dry_run {
            println!("{}", mpi::display(&cmd));
            return Ok(0);
        }
        let Some(mpirun) = mpi::which("mpirun") else {
            return Err((
                127,
                "--mpi needs `mpirun`, which is not on PATH. Install Open MPI (Debian/Ubuntu: \
                 `apt-get install openmpi-bin`; Fedora: `dnf install openmpi` and load its \
                 module), or launch the job with mpirun or srun directly (see fh-launch/README.md)"
                    .into(),
            ));
        };
        if cli.verbose {
            eprintln!("fhrun: running {}", mpi::display(&cmd));
        }
        let code = mpi::run(
            &mpirun,
            &cmd,
            &mpi::Supervision {
                kill_grace: cli.kill_grace,
                timeout: cli.timeout,
                verbose: cli.verbose,
            },
        );
        if let Some(d) = job_dir {
            if !remote.is_empty() {
                d.note_other_hosts(np, code != 0);
            }
            d.finish(code != 0);
        }
        return Ok(code);
    }

    if !remote.is_empty() {
        let host_list = hosts.unwrap_or_default();
        let (rendezvous, store) =
            rendezvous_and_store(&cli, &hosts::rendezvous_host(&host_list, &hostname))?;
        let mut common: Vec<(String, String)> = store.to_vec();
        common.extend(knobs);
        common.extend(user_env);
        let launch = (rendezvous.as_str(), token.as_str());
        let job = across_hosts(
            &cli,
            &host_list,
            &hostname,
            np,
            launch,
            &common,
            job_dir.as_ref(),
        )?;
        if cli.dry_run || cli.verbose {
            show_plan(&job, cli.dry_run);
            if cli.dry_run {
                return Ok(0);
            }
        }
        let code = launch::run(&job);
        if let Some(d) = job_dir {
            d.finish(code != 0);
        }
        return Ok(code);
    }

    let (rendezvous, store) = rendezvous_and_store(&cli, "127.0.0.1")?;
    let ranks: Vec<launch::RankSpec> = (0..np)
        .map(|rank| {
            let info = fh_job::LaunchInfo::for_rank(
                fh_job::Topology::single_host(rank, np),
                rendezvous.clone(),
                fh_job::JobToken::new(token.clone()),
            );
            let mut env: Vec<(String, String)> = info
                .to_vars()
                .into_iter()
                .chain([
                    // What horovodrun's launcher exports, which Horovod scripts read before
                    // `init()` (to pick a device or a log file); and the PMI pair MPI launchers
                    // set. Every rank runs on this host.
                    ("HOROVOD_HOSTNAME", hostname.clone()),
                    ("HOROVOD_RANK", rank.to_string()),
                    ("HOROVOD_SIZE", np.to_string()),
                    ("HOROVOD_LOCAL_RANK", rank.to_string()),
                    ("HOROVOD_LOCAL_SIZE", np.to_string()),
                    ("HOROVOD_CROSS_RANK", "0".to_string()),
                    ("HOROVOD_CROSS_SIZE", "1".to_string()),
                    ("PMI_RANK", rank.to_string()),
                    ("PMI_SIZE", np.to_string()),
                ])
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            env.extend(store.iter().cloned());
            env.extend(knobs.iter().cloned());
            env.extend(user_env.iter().cloned());
            launch::RankSpec {
                rank,
                env,
                tag: None,
            }
        })
        .collect();

    if cli.dry_run || cli.verbose {
        for r in &ranks {
            let mut parts = vec!["env".to_string()];
            parts.extend(
                r.env
                    .iter()
                    .map(|(k, v)| mpi::shell_quote(&mpi::show_var(k, v))),
            );
            parts.extend(cli.command.iter().map(|a| mpi::shell_quote(a)));
            let line = format!("rank {}: {}", r.rank, parts.join(" "));
            if cli.dry_run {
                println!("{line}");
            } else {
                eprintln!("fhrun: {line}");
            }
        }
        if cli.dry_run {
            return Ok(0);
        }
    }

    let code = launch::run(&launch::LocalJob {
        command: cli.command.clone(),
        ranks,
        remotes: Vec::new(),
        prefix: !cli.no_prefix,
        kill_grace: cli.kill_grace,
        timeout: cli.timeout,
        verbose: cli.verbose,
        report_exits: None,
        record_requests: None,
    });
    if let Some(d) = job_dir {
        d.finish(code != 0);
    }
    Ok(code)
}

/// The ranks of a job across hosts, placed host by host in the list's order (each host's slots
/// filled before the next: rank 0 on the first host): this machine's ranks run here, every
/// other host's through the rsh agent as a remote part. Each rank gets its launch variables
/// ([`fh_job::LaunchInfo::to_vars`] of its place, `launch`'s rendezvous address and job
/// token), then `common`, what every rank gets (so that what the user gives with `-x` wins,
/// as in a job on this machine alone). The parts send back into `job_dir` their ranks' flight
/// records and timelines.
fn across_hosts(
    cli: &Cli,
    host_list: &[Host],
    hostname: &str,
    np: usize,
    (rendezvous, token): (&str, &str),
    common: &[(String, String)],
    job_dir: Option<&observe::JobDir>,
) -> Result<launch::LocalJob, Failure> {
    let agent = mpi::split_words(&cli.rsh_agent)
        .map_err(|e| usage(format!("--rsh-agent/FH_RSH_AGENT: {e}")))?;
    if agent.is_empty() {
        return Err(usage(
            "--rsh-agent/FH_RSH_AGENT is empty: name the command that runs a command on \
             another host (default ssh)",
        ));
    }
    let exe = std::env::current_exe().map_err(|e| {
        (
            1,
            format!("cannot find fhrun's own path for the other hosts: {e}"),
        )
    })?;
    let cwd = std::env::current_dir()
        .map_err(|e| (1, format!("cannot read the current directory: {e}")))?;
    // (host, its first rank, its number of ranks)
    let mut placed: Vec<(&Host, usize, usize)> = Vec::new();
    let mut next = 0;
    for h in host_list {
        let n = h.slots.min(np - next);
        if n > 0 {
            placed.push((h, next, n));
            next += n;
        }
    }
    let forwarded: Vec<(String, String)> = remote::FORWARDED_VARS
        .iter()
        .filter_map(|&k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .collect();
    let mut job = launch::LocalJob {
        command: cli.command.clone(),
        ranks: Vec::new(),
        remotes: Vec::new(),
        prefix: !cli.no_prefix,
        kill_grace: cli.kill_grace,
        timeout: cli.timeout,
        verbose: cli.verbose,
        report_exits: None,
        record_requests: None,
    };
    let gather = match job_dir.map(observe::JobDir::gathered) {
        Some(dirs) if !dirs.is_empty() => Some(gather::Gather {
            marker: format!(
                "fhrun-files-{}",
                sys::random_hex(16).map_err(|e| (1, format!("cannot read /dev/urandom: {e}")))?
            ),
            dirs,
        }),
        _ => None,
    };
    let cross_size = placed.len();
    for (cross, &(h, first, n)) in placed.iter().enumerate() {
        // The launch variables of this host's `local`-th rank.
        let launch_vars = |local: usize| {
            let place = fh_job::Topology {
                rank: first + local,
                size: np,
                local_rank: local,
                local_size: n,
                cross_rank: cross,
                cross_size,
            };
            fh_job::LaunchInfo::for_rank(place, rendezvous, fh_job::JobToken::new(token))
                .to_vars()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
        };
        if hosts::is_local(&h.name, hostname) {
            for local in 0..n {
                job.ranks.push(launch::RankSpec {
                    rank: first + local,
                    env: launch_vars(local).chain(common.iter().cloned()).collect(),
                    tag: None,
                });
            }
            continue;
        }
        let mut part_env = forwarded.clone();
        part_env.extend(common.iter().cloned());
        let part = remote::Part {
            cwd: cwd.to_string_lossy().into_owned(),
            command: cli.command.clone(),
            env: part_env,
            ranks: (first..first + n).collect(),
            prefix: !cli.no_prefix,
            kill_grace: cli.kill_grace,
            verbose: cli.verbose,
            workers: Vec::new(),
            own_env: (0..n)
                .flat_map(|local| launch_vars(local).map(move |(k, v)| (local, k, v)))
                .collect(),
            report: None,
            gather: gather.as_ref().map(|g| g.marker.clone()),
            gather_dirs: gather
                .iter()
                .flat_map(|g| &g.dirs)
                .map(|(d, _)| d.clone())
                .collect(),
        };
        let mut argv = agent.clone();
        argv.push(h.name.clone());
        argv.push(mpi::shell_quote(&exe.to_string_lossy()));
        argv.push(remote::REMOTE_ARG.to_string());
        let label = if n == 1 {
            format!("rank {first} on {}", h.name)
        } else {
            format!("ranks {first}-{} on {}", first + n - 1, h.name)
        };
        job.remotes.push(launch::RemoteSpec {
            label,
            argv,
            input: part.encode(),
            gather: gather.clone(),
        });
    }
    Ok(job)
}

/// Prints (`--dry-run`: to stdout) or tells (`--verbose`: to stderr) the plan of a job across
/// hosts, the job token redacted.
fn show_plan(job: &launch::LocalJob, to_stdout: bool) {
    let say = |line: String| {
        if to_stdout {
            println!("{line}");
        } else {
            eprintln!("fhrun: {line}");
        }
    };
    let vars = |env: &[(String, String)]| -> String {
        env.iter()
            .map(|(k, v)| mpi::shell_quote(&mpi::show_var(k, v)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let cmd: Vec<String> = job.command.iter().map(|a| mpi::shell_quote(a)).collect();
    for r in &job.ranks {
        say(format!(
            "rank {}: env {} {}",
            r.rank,
            vars(&r.env),
            cmd.join(" ")
        ));
    }
    for r in &job.remotes {
        say(format!("{}: {}", r.label, r.argv.join(" ")));
    }
}
