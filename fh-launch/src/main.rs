//! `fhrun`: the FastHorovod launcher.
//!
//! Starts N ranks of a command with the `FH_*` environment the runtime reads (rank, size, local
//! and cross rank/size, the rendezvous address where rank 0 listens, a fresh job token, and the
//! runtime knobs given as flags). Local jobs are run by fhrun itself, which prefixes their
//! output, forwards signals and fails fast; jobs spanning hosts go through `mpirun` (`--mpi`).

mod cli;
mod guardian;
mod hosts;
mod launch;
mod mpi;
mod notice;
mod output;
mod sys;

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::Command;

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

fn free_local_port() -> Result<u16, Failure> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| {
            (
                1,
                format!("cannot find a free port for the rendezvous: {e}"),
            )
        })
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
    let np = cli.num_proc as usize;
    let hosts = read_hosts(&cli)?;
    let hostname = hosts::this_hostname();
    let remote: Vec<&Host> = hosts
        .iter()
        .flatten()
        .filter(|h| !hosts::is_local(&h.name, &hostname))
        .collect();
    if let Some(hosts) = &hosts {
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
    if !remote.is_empty() && !cli.mpi {
        let names: Vec<&str> = remote.iter().map(|h| h.name.as_str()).collect();
        return Err(usage(format!(
            "{} {} not this machine, and fhrun starts ranks on other hosts only through mpirun: \
             add --mpi (or launch with mpirun or srun directly; see fh-launch/README.md)",
            names.join(", "),
            if names.len() == 1 { "is" } else { "are" }
        )));
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
            if let Err(e) = fh_transport::bootstrap::check_token(&v) {
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
    let knobs = cli.knobs.to_env();

    if cli.mpi {
        let host_list = hosts.clone().unwrap_or_default();
        let rendezvous = match &cli.rendezvous_addr {
            Some(a) => a.clone(),
            None => format!(
                "{}:{}",
                hosts::rendezvous_host(&host_list, &hostname),
                free_local_port()?
            ),
        };
        let mut env = vec![
            ("FH_RENDEZVOUS_ADDR".to_string(), rendezvous),
            ("FH_JOB_TOKEN".to_string(), token),
        ];
        env.extend(knobs);
        env.extend(user_env);
        let extra_args = match &cli.mpi_args {
            Some(a) => mpi::split_words(a).map_err(usage)?,
            None => Vec::new(),
        };
        let cmd = mpi::build(&mpi::MpiJob {
            np: cli.num_proc,
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
        let err = Command::new(&mpirun)
            .args(&cmd.argv[1..])
            .envs(cmd.env.iter().map(|(k, v)| (k, v)))
            .exec();
        return Err((126, format!("cannot run {}: {err}", mpirun.display())));
    }

    let rendezvous = match &cli.rendezvous_addr {
        Some(a) => a.clone(),
        None => format!("127.0.0.1:{}", free_local_port()?),
    };
    let ranks: Vec<launch::RankSpec> = (0..np)
        .map(|rank| {
            let mut env: Vec<(String, String)> = [
                ("FH_RANK", rank.to_string()),
                ("FH_SIZE", np.to_string()),
                ("FH_LOCAL_RANK", rank.to_string()),
                ("FH_LOCAL_SIZE", np.to_string()),
                ("FH_CROSS_RANK", "0".to_string()),
                ("FH_CROSS_SIZE", "1".to_string()),
                ("FH_RENDEZVOUS_ADDR", rendezvous.clone()),
                ("FH_JOB_TOKEN", token.clone()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            env.extend(knobs.iter().cloned());
            env.extend(user_env.iter().cloned());
            launch::RankSpec { rank, env }
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

    Ok(launch::run(&launch::LocalJob {
        command: cli.command.clone(),
        ranks,
        prefix: !cli.no_prefix,
        kill_grace: cli.kill_grace,
        timeout: cli.timeout,
        verbose: cli.verbose,
    }))
}
