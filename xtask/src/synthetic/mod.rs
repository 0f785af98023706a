//! `cargo xtask bench --emulate HxR [--link RATE [--flow RATE]] [--rtt TIME] synthetic
//! [OPTIONS]`: the paper's experiment at this machine's scale. `fh-torch/examples/
//! pytorch_synthetic_benchmark.py` (Horovod's synthetic benchmark, only the import changed)
//! on the emulated cluster's H hosts × R ranks, one run of each system per round, the systems
//! in the same order every round (interleaved):
//! - `fasthorovod.torch` under `fhrun -H h0:R,h1:R,...` with its defaults;
//! - Horovod over MPI (`mpirun -H ...` through the cluster's rsh agent, the script with
//!   `--hvd-module horovod.torch`) under `$FH_BENCH_HOROVOD_PYTHON` or `target/hvd-venv`
//!   (`cargo xtask horovod`); skipped, saying so, when that interpreter cannot import
//!   `horovod.torch` or there is no `mpirun`;
//! - Horovod over Gloo (`horovodrun --gloo -H ... --network-interfaces eth0`, its `ssh` a
//!   stand-in that goes through the rsh agent), beside the same interpreter, skipped alike;
//! - PyTorch DDP on Gloo (`--use-ddp`), each rank started in its host with torchrun's
//!   variables, `MASTER_ADDR` h0.
//!
//! Each run's total img/s is rank 0's JSON summary; the table gives per system the median over
//! the rounds and the range; a run whose summary counts fewer ranks than the layout fails. The
//! runs' logs stay in `target/synthetic/<pid>/`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::multihost::bounded;

mod options;
mod table;

use options::script_args;
pub(crate) use options::{parse, Options, System, USAGE};
use table::{summary, table, Row};

/// An interpreter that imports `horovod.torch` (`$FH_BENCH_HOROVOD_PYTHON`, else
/// `target/hvd-venv`), or why there is none.
fn horovod_python(root: &Path) -> Result<PathBuf, String> {
    let py = std::env::var_os("FH_BENCH_HOROVOD_PYTHON")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            root.join("target")
                .join("hvd-venv")
                .join("bin")
                .join("python")
        });
    if !py.is_file() {
        return Err(format!(
            "no Horovod: {} is missing (build it with `cargo xtask horovod`, or name an \
             interpreter that imports horovod.torch in FH_BENCH_HOROVOD_PYTHON)",
            py.display()
        ));
    }
    let import = Command::new("timeout")
        .arg("120")
        .arg(&py)
        .args(["-c", "import horovod.torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !import.is_ok_and(|s| s.success()) {
        return Err(format!(
            "{} cannot import horovod.torch (build it with `cargo xtask horovod`)",
            py.display()
        ));
    }
    Ok(py)
}

/// Whether Horovod under `py` can run `system`: built with its controller, its launcher found.
fn horovod_ready(py: &Path, system: System) -> Result<(), String> {
    let (built, launcher) = match system {
        System::HorovodMpi => ("mpi_built", "mpirun"),
        _ => ("gloo_built", "horovodrun"),
    };
    let ok = Command::new("timeout")
        .arg("120")
        .arg(py)
        .args([
            "-c",
            &format!("import horovod.torch as h, sys; sys.exit(0 if h.{built}() else 3)"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !ok.is_ok_and(|s| s.success()) {
        return Err(format!("Horovod under {} is not {built}", py.display()));
    }
    let found = match system {
        System::HorovodMpi => crate::multihost::which("mpirun").is_some(),
        _ => horovodrun(py).is_file(),
    };
    if !found {
        return Err(format!("no `{launcher}` (for {})", system.name()));
    }
    Ok(())
}

/// `horovodrun` beside interpreter `py`.
fn horovodrun(py: &Path) -> PathBuf {
    py.with_file_name("horovodrun")
}

/// Writes an `ssh` for horovodrun on the emulated hosts into `dir` (its options dropped, the
/// command run on the host through the cluster's rsh `agent`); returns `dir`.
fn ssh_stand_in(dir: &Path, agent: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("ssh");
    let text = format!(
        "#!/bin/sh\n\
         # ssh on emulated hosts for horovodrun: ssh [OPTIONS] HOST COMMAND...\n\
         while [ $# -gt 0 ]; do case \"$1\" in -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac; done\n\
         host=\"$1\"; shift\n\
         while [ $# -gt 0 ]; do case \"$1\" in -o|-p|-i|-l|-F) shift 2 ;; *) break ;; esac; done\n\
         exec '{}' \"$host\" \"$@\"\n",
        agent.display()
    );
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(dir.to_path_buf())
}

/// Runs the experiment on cluster `c` (`hosts` × `ranks`); prints the table.
pub(crate) fn run(
    root: &Path,
    c: &Cluster,
    fhrun: &Path,
    hosts: usize,
    ranks: usize,
    o: &Options,
) -> ExitCode {
    let script = root
        .join("fh-torch")
        .join("examples")
        .join("pytorch_synthetic_benchmark.py");
    let py = match crate::multihost::torch_python(root) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("xtask bench synthetic: {e}");
            return ExitCode::FAILURE;
        }
    };
    let agent = match c.rsh_agent() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("xtask bench synthetic: {e}");
            return ExitCode::FAILURE;
        }
    };
    let np = hosts * ranks;
    let host_list: Vec<String> = (0..hosts).map(|h| format!("h{h}:{ranks}")).collect();
    let host_list = host_list.join(",");
    let args = script_args(o);
    let mut rows: Vec<Row> = o
        .systems
        .iter()
        .map(|s| Row {
            name: s.name().into(),
            runs: Vec::new(),
            skipped: None,
        })
        .collect();
    let horovod = [System::HorovodMpi, System::HorovodGloo];
    let hvd_py = if o.systems.iter().any(|s| horovod.contains(s)) {
        let h = horovod_python(root);
        for (i, &system) in o.systems.iter().enumerate() {
            if !horovod.contains(&system) {
                continue;
            }
            let ready = h
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|py| horovod_ready(py, system));
            if let Err(why) = ready {
                eprintln!("==> {} skipped: {why}", system.name());
                rows[i].skipped = Some(why);
            }
        }
        h.ok()
    } else {
        None
    };
    let limit = Duration::from_secs(o.timeout);
    // The runs' logs outlive the cluster: target/synthetic/<pid>/.
    let logs = root
        .join("target")
        .join("synthetic")
        .join(std::process::id().to_string());
    if let Err(e) = std::fs::create_dir_all(&logs) {
        eprintln!(
            "xtask bench synthetic: cannot create {}: {e}",
            logs.display()
        );
        return ExitCode::FAILURE;
    }
    eprintln!("==> logs in {}", logs.display());
    for round in 0..o.rounds {
        for (i, &system) in o.systems.iter().enumerate() {
            if rows[i].skipped.is_some() {
                continue;
            }
            let log = logs.join(format!("round{round}-{}.log", system.key()));
            let started = Instant::now();
            let result = match system {
                System::FastHorovod => {
                    let mut cmd = c.command(0, fhrun);
                    cmd.args(["-np", &np.to_string(), "-H", &host_list])
                        .args(["-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED"])
                        .arg(&py)
                        .arg(&script)
                        .args(&args)
                        .env("FH_RSH_AGENT", &agent)
                        .env("OMP_NUM_THREADS", "1")
                        .env("PYTHONUNBUFFERED", "1");
                    one_launcher(cmd, &log, limit, np)
                }
                System::HorovodMpi => {
                    let hvd = hvd_py.as_deref().unwrap_or(Path::new("python3"));
                    let mut cmd = c.command(0, "mpirun");
                    cmd.args(["--allow-run-as-root", "--bind-to", "none"])
                        .args(["-np", &np.to_string(), "-H", &host_list])
                        .args(["--mca", "plm_rsh_agent"])
                        .arg(&agent)
                        .args(["-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1"])
                        .arg(hvd)
                        .arg(&script)
                        .args(&args)
                        .args(["--hvd-module", "horovod.torch"]);
                    one_launcher(cmd, &log, limit, np)
                }
                System::HorovodGloo => {
                    let hvd = hvd_py.as_deref().unwrap_or(Path::new("python3"));
                    let path = std::env::var_os("PATH").unwrap_or_default();
                    let path = ssh_stand_in(&logs.join("ssh"), &agent).and_then(|shim| {
                        std::env::join_paths(
                            std::iter::once(shim).chain(std::env::split_paths(&path)),
                        )
                        .map_err(|e| format!("PATH: {e}"))
                    });
                    match path {
                        Err(e) => Err(e),
                        Ok(path) => {
                            let mut cmd = c.command(0, horovodrun(hvd));
                            cmd.args(["-np", &np.to_string(), "-H", &host_list])
                                .args(["--gloo", "--network-interfaces", "eth0"])
                                .arg(hvd)
                                .arg(&script)
                                .args(&args)
                                .args(["--hvd-module", "horovod.torch"])
                                .env("PATH", path)
                                .env("OMP_NUM_THREADS", "1")
                                .env("PYTHONUNBUFFERED", "1");
                            one_launcher(cmd, &log, limit, np)
                        }
                    }
                }
                System::DdpGloo => ddp(c, &py, &script, &args, hosts, ranks, &log, limit),
            };
            let secs = started.elapsed().as_secs_f64();
            match &result {
                Ok(v) => eprintln!(
                    "==> round {}/{}: {}: {v:.2} img/s ({secs:.0} s)",
                    round + 1,
                    o.rounds,
                    system.name()
                ),
                Err(e) => eprintln!(
                    "==> round {}/{}: {}: FAILED ({secs:.0} s): {e}",
                    round + 1,
                    o.rounds,
                    system.name()
                ),
            }
            rows[i].runs.push(result);
        }
    }
    let what = format!(
        "## Synthetic benchmark across {hosts} emulated hosts x {ranks} ranks\n\n\
         pytorch_synthetic_benchmark.py {}; total img/s of the {np} ranks, the median over {} \
         interleaved round(s):\n\n",
        args.join(" "),
        o.rounds
    );
    println!("\n{what}{}", table(&rows, o.rounds));
    let failed = rows
        .iter()
        .any(|r| r.skipped.is_none() && r.runs.iter().any(Result::is_err));
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One launcher (fhrun, mpirun) started on h0: rank 0's img/s, or why none.
fn one_launcher(cmd: Command, log: &Path, limit: Duration, np: usize) -> Result<f64, String> {
    let (status, out) = bounded(cmd, log, limit)?;
    judge(status, &out, log, np)
}

/// Rank 0's img/s when the run succeeded.
fn judge(status: Option<ExitStatus>, out: &str, log: &Path, np: usize) -> Result<f64, String> {
    match status {
        Some(s) if s.success() => match summary(out) {
            Some((v, ranks)) if ranks == np => Ok(v),
            Some((_, ranks)) => Err(format!(
                "the job ran as {ranks} rank(s), not {np} ({})",
                log.display()
            )),
            None => Err(format!("no JSON summary in {}", log.display())),
        },
        other => Err(format!(
            "{} ({}); last lines:\n{}",
            other.map_or("timed out".to_string(), |s| s.to_string()),
            log.display(),
            crate::multihost::last_lines(out, 15)
        )),
    }
}

/// DDP on Gloo: each rank started in its host with torchrun's variables (`MASTER_ADDR` h0);
/// rank 0's img/s.
#[allow(clippy::too_many_arguments)]
fn ddp(
    c: &Cluster,
    py: &Path,
    script: &Path,
    args: &[String],
    hosts: usize,
    ranks: usize,
    log: &Path,
    limit: Duration,
) -> Result<f64, String> {
    let np = hosts * ranks;
    let mut children: Vec<(Child, PathBuf)> = Vec::new();
    let mut spawn = || -> Result<(), String> {
        for rank in 0..np {
            let (h, local) = (rank / ranks, rank % ranks);
            let path = log.with_extension(format!("rank{rank}.log"));
            let f = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let e = f
                .try_clone()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let child = c
                .command(h, py)
                .arg(script)
                .args(args)
                .arg("--use-ddp")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", np.to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("LOCAL_WORLD_SIZE", ranks.to_string())
                .env("MASTER_ADDR", "h0")
                .env("MASTER_PORT", "29500")
                .env("OMP_NUM_THREADS", "1")
                .env("PYTHONUNBUFFERED", "1")
                .stdin(Stdio::null())
                .stdout(f)
                .stderr(e)
                .spawn()
                .map_err(|e| format!("cannot start DDP rank {rank} on h{h}: {e}"))?;
            children.push((child, path));
        }
        Ok(())
    };
    let spawned = spawn();
    let start = Instant::now();
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    while spawned.is_ok() && status.iter().any(Option::is_none) && start.elapsed() < limit {
        for (i, (ch, _)) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = ch.try_wait().ok().flatten();
            }
        }
        // A failed rank ends the run: the others would wait for it.
        if status.iter().flatten().any(|s| !s.success()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (ch, _) in &mut children {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    spawned?;
    let out0 = children
        .first()
        .map(|(_, p)| std::fs::read_to_string(p).unwrap_or_default())
        .unwrap_or_default();
    if let Some(bad) = status
        .iter()
        .position(|s| !matches!(s, Some(s) if s.success()))
    {
        let out = std::fs::read_to_string(&children[bad].1).unwrap_or_default();
        return judge(status[bad], &out, &children[bad].1, np);
    }
    judge(status[0], &out0, &children[0].1, np)
}
