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

/// The systems compared, in the order each round runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum System {
    /// `fasthorovod.torch` under fhrun.
    FastHorovod,
    /// Horovod (`horovod.torch`) over MPI, under mpirun.
    HorovodMpi,
    /// Horovod (`horovod.torch`) over Gloo, under `horovodrun --gloo`.
    HorovodGloo,
    /// PyTorch DistributedDataParallel on Gloo.
    DdpGloo,
}

impl System {
    const ALL: [System; 4] = [
        System::FastHorovod,
        System::HorovodMpi,
        System::HorovodGloo,
        System::DdpGloo,
    ];

    fn name(self) -> &'static str {
        match self {
            System::FastHorovod => "fasthorovod.torch (fhrun)",
            System::HorovodMpi => "Horovod, MPI (mpirun)",
            System::HorovodGloo => "Horovod, Gloo (horovodrun)",
            System::DdpGloo => "DDP, Gloo",
        }
    }

    fn key(self) -> &'static str {
        match self {
            System::FastHorovod => "fasthorovod",
            System::HorovodMpi => "horovod-mpi",
            System::HorovodGloo => "horovod-gloo",
            System::DdpGloo => "ddp",
        }
    }
}

/// The experiment's options (after `synthetic`).
#[derive(Debug, PartialEq)]
pub(crate) struct Options {
    /// `--model`: `vgg16` or `resnet-like`.
    pub model: String,
    /// `--batch-size`, per rank.
    pub batch_size: usize,
    /// `--image-size`.
    pub image_size: usize,
    /// `--iters`: timed iterations per run.
    pub iters: usize,
    /// `--batches-per-iter`.
    pub batches_per_iter: usize,
    /// `--warmup`: batches before the timed ones.
    pub warmup: usize,
    /// `--rounds`.
    pub rounds: usize,
    /// `--systems`: which, in this order.
    pub systems: Vec<System>,
    /// `--timeout`: the limit of one run, in seconds.
    pub timeout: u64,
}

/// Usage of the subcommand.
pub(crate) const USAGE: &str = "cargo xtask bench --emulate HxR [--link RATE [--flow RATE]] \
     [--rtt TIME] synthetic [--model vgg16|resnet-like] [--batch-size N] [--image-size PX] \
     [--iters N] [--batches-per-iter N] [--warmup N] [--rounds R] \
     [--systems fasthorovod,horovod-mpi,horovod-gloo,ddp] [--timeout SECONDS]";

/// Parses the options after `synthetic`.
pub(crate) fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        model: "vgg16".into(),
        batch_size: 2,
        image_size: 224,
        iters: 5,
        batches_per_iter: 2,
        warmup: 2,
        rounds: 3,
        systems: System::ALL.to_vec(),
        timeout: 1800,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or(format!("{a} wants a value\nusage: {USAGE}"))
        };
        let mut number = |min: usize| -> Result<usize, String> {
            let v = value()?;
            v.parse::<usize>()
                .ok()
                .filter(|&n| n >= min)
                .ok_or(format!("{a} {v}: expected a whole number >= {min}"))
        };
        match a.as_str() {
            "--model" => {
                let v = value()?;
                if v != "vgg16" && v != "resnet-like" {
                    return Err(format!("--model {v}: expected vgg16 or resnet-like"));
                }
                o.model = v.clone();
            }
            "--batch-size" => o.batch_size = number(1)?,
            "--image-size" => o.image_size = number(1)?,
            "--iters" => o.iters = number(1)?,
            "--batches-per-iter" => o.batches_per_iter = number(1)?,
            "--warmup" => o.warmup = number(0)?,
            "--rounds" => o.rounds = number(1)?,
            "--timeout" => o.timeout = number(1)? as u64,
            "--systems" => {
                let v = value()?;
                o.systems = v
                    .split(',')
                    .map(|s| {
                        System::ALL
                            .into_iter()
                            .find(|x| x.key() == s.trim())
                            .ok_or(format!(
                                "--systems: unknown `{s}` (fasthorovod, horovod-mpi, horovod-gloo, ddp)"
                            ))
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unexpected argument `{other}`\nusage: {USAGE}")),
        }
    }
    if o.model == "vgg16" && o.image_size < 32 {
        return Err("--image-size must be at least 32 for VGG-16".into());
    }
    Ok(o)
}

/// The script's arguments for `o`.
fn script_args(o: &Options) -> Vec<String> {
    let mut a = vec!["--model".to_string(), o.model.clone()];
    if o.model == "resnet-like" {
        a.extend(["--model-size".into(), "medium".into()]);
    }
    for (k, v) in [
        ("--batch-size", o.batch_size),
        ("--image-size", o.image_size),
        ("--num-iters", o.iters),
        ("--num-batches-per-iter", o.batches_per_iter),
        ("--num-warmup-batches", o.warmup),
    ] {
        a.push(k.into());
        a.push(v.to_string());
    }
    a
}

/// The total img/s of rank 0's JSON summary in `output` (its last `{"benchmark"` line; a
/// launcher's tag before it is ignored) and the number of ranks it counts.
pub(crate) fn summary(output: &str) -> Option<(f64, usize)> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.find("{\"benchmark\"").map(|at| &l[at..]))?;
    let ranks = number_after(line, "\"ranks\":")?;
    Some((number_after(line, "\"img_sec_total\":")?, ranks as usize))
}

/// The number after `key` in `line`.
fn number_after(line: &str, key: &str) -> Option<f64> {
    let at = line.find(key)? + key.len();
    let num: String = line[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
        .collect();
    num.parse().ok()
}

/// The median of `xs` (the mean of the middle two for an even count), `None` when empty.
pub(crate) fn median(xs: &[f64]) -> Option<f64> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// How one system fared: its runs' img/s, or why it was skipped.
pub(crate) struct Row {
    pub name: String,
    pub runs: Vec<Result<f64, String>>,
    pub skipped: Option<String>,
}

/// The table: per system the median total img/s over its successful runs, the range, and how
/// many of the rounds succeeded.
pub(crate) fn table(rows: &[Row], rounds: usize) -> String {
    let mut t =
        String::from("| system | img/s (median) | min-max | runs ok |\n|---|---|---|---|\n");
    for r in rows {
        if let Some(why) = &r.skipped {
            t += &format!("| {} | skipped: {why} | | |\n", r.name);
            continue;
        }
        let ok: Vec<f64> = r
            .runs
            .iter()
            .filter_map(|x| x.as_ref().ok().copied())
            .collect();
        let (lo, hi) = ok
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| {
                (l.min(x), h.max(x))
            });
        match median(&ok) {
            Some(m) => {
                t += &format!(
                    "| {} | {m:.2} | {lo:.2}-{hi:.2} | {}/{rounds} |\n",
                    r.name,
                    ok.len()
                )
            }
            None => t += &format!("| {} | failed | | 0/{rounds} |\n", r.name),
        }
    }
    t
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_are_parsed_and_checked() {
        let o = parse(&args(&[
            "--model",
            "vgg16",
            "--batch-size",
            "1",
            "--image-size",
            "32",
            "--iters",
            "2",
            "--rounds",
            "1",
            "--systems",
            "ddp,fasthorovod",
        ]))
        .unwrap();
        assert_eq!(
            (o.batch_size, o.image_size, o.iters, o.rounds),
            (1, 32, 2, 1)
        );
        assert_eq!(o.systems, [System::DdpGloo, System::FastHorovod]);
        assert_eq!(parse(&[]).unwrap().systems, System::ALL);
        assert!(script_args(&o)
            .join(" ")
            .contains("--image-size 32 --num-iters 2"));
        for (bad, want) in [
            (&["--model", "vgg19"][..], "vgg16 or resnet-like"),
            (&["--iters", "0"][..], ">= 1"),
            (&["--image-size", "16"][..], "at least 32"),
            (&["--systems", "nccl"][..], "unknown `nccl`"),
            (&["--rounds"][..], "wants a value"),
            (&["--fast"][..], "unexpected argument"),
        ] {
            let err = parse(&args(bad)).err().unwrap();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
    }

    #[test]
    fn rank_zeros_summary_is_read_behind_a_tag() {
        let out = "Iter #0: 3.0 img/sec per rank\n\
                   [0]<stdout>:{\"benchmark\": \"pytorch_synthetic\", \"img_sec_total\": 12.5, \
                   \"img_sec_total_conf\": 1.0}\n";
        assert_eq!(summary(out), None, "no rank count");
        let out = out.replace("\"img_sec_total\"", "\"ranks\": 4, \"img_sec_total\"");
        assert_eq!(summary(&out), Some((12.5, 4)));
        assert_eq!(
            summary("{\"benchmark\": 1, \"ranks\": 1, \"img_sec_total\": 3e-1}"),
            Some((0.3, 1))
        );
        assert_eq!(summary("Total img/sec on 4 rank(s): 9.0"), None);
    }

    #[test]
    fn the_table_gives_median_and_range() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        let rows = [
            Row {
                name: "a".into(),
                runs: vec![Ok(10.0), Ok(30.0), Ok(20.0), Err("x".into())],
                skipped: None,
            },
            Row {
                name: "b".into(),
                runs: vec![],
                skipped: Some("no Horovod".into()),
            },
            Row {
                name: "c".into(),
                runs: vec![Err("y".into())],
                skipped: None,
            },
        ];
        let t = table(&rows, 4);
        assert!(t.contains("| a | 20.00 | 10.00-30.00 | 3/4 |"), "{t}");
        assert!(t.contains("| b | skipped: no Horovod |"), "{t}");
        assert!(t.contains("| c | failed | | 0/4 |"), "{t}");
    }
}
