//! The Python peers of the replay: PyTorch DDP on Gloo, the same DDP on FastHorovod's
//! `torch.distributed` backend (`fasthorovod.torch.distributed`), Horovod and FastHorovod's own
//! PyTorch adapter (`fasthorovod.torch`), replaying the same workload through their own APIs
//! (`peers/torch_replay.py`, written next to the run at bench time and run with
//! `$FH_BENCH_PYTHON`, else `python3`).
//!
//! The `ddp-floor` row is the DDP run with a communication hook that communicates nothing:
//! what DDP itself costs (its bucket copies), the least any backend can expose under DDP.
//!
//! DDP: N Python processes on 127.0.0.1 with the torchrun environment (`RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, ...); on the `fasthorovod` backend also `FH_JOB_TOKEN`,
//! `FH_TRANSPORT` and `FH_RENDEZVOUS_ADDR` (a port of its own, not torchrun's `MASTER_PORT + 1`).
//! Horovod: `horovodrun -np N -H localhost:N` with `--gloo`, or `--mpi` with Open MPI yielding
//! or busy-polling (three rows), under `$FH_BENCH_HOROVOD_PYTHON` when set (`cargo xtask
//! horovod` builds it into `target/hvd-venv`); across hosts `horovodrun -H h0:R,h1:R` with an
//! `ssh` stand-in that goes through the rsh agent.
//! `fasthorovod.torch`: N Python processes with fhrun's environment (`FH_RANK`, `FH_SIZE`,
//! `FH_RENDEZVOUS_ADDR`, `FH_JOB_TOKEN`, `FH_TRANSPORT`, ...), over shared memory or TCP. Rank 0
//! prints one JSON line with the slowest rank's time per step and the CPU time of all ranks over
//! the timed steps; every wait is bounded and every child is killed and reaped on failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fh_job::{JobToken, LaunchInfo, Topology};

use crate::runner::{free_port, random_token, Children};

mod horovod;
mod output;

use horovod::{horovodrun, write_ssh_shim};
pub use output::{parse_output, PeerResult};

/// The adapter's source, embedded so that the binary can write it wherever it runs.
pub const SOURCE: &str = include_str!("../../peers/torch_replay.py");

/// Environment variable naming the Python interpreter of the peers (default `python3`).
pub const PYTHON_ENV: &str = "FH_BENCH_PYTHON";

/// One Python peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Name in the "not measured" list.
    pub what: &'static str,
    /// The `schedule` label of its replay rows.
    pub label: &'static str,
    /// The module that must import.
    pub module: &'static str,
    /// `--mode` of the adapter.
    pub mode: &'static str,
    /// How to install it.
    pub install: &'static str,
    /// The `transport` of its rows; for `fasthorovod` also the `FH_TRANSPORT` of its ranks.
    pub transport: &'static str,
}

/// Horovod's rows: its Gloo controller, then its MPI controller with Open MPI yielding the
/// core while it waits (`mpi_yield_when_idle 1`) and busy-polling (`0`, Open MPI's default when
/// the host is not oversubscribed); the `transport` of the row names the mode.
const HOROVOD: [Peer; 3] = [
    Peer {
        what: "Horovod over Gloo",
        label: "horovod-torch",
        module: "horovod.torch",
        mode: "horovod",
        install: HOROVOD_INSTALL,
        transport: "gloo",
    },
    Peer {
        what: "Horovod over MPI (yielding)",
        label: "horovod-torch",
        module: "horovod.torch",
        mode: "horovod",
        install: HOROVOD_INSTALL,
        transport: "mpi",
    },
    Peer {
        what: "Horovod over MPI (busy-polling)",
        label: "horovod-torch",
        module: "horovod.torch",
        mode: "horovod",
        install: HOROVOD_INSTALL,
        transport: "mpi-busy",
    },
];

/// How to get Horovod: `cargo xtask horovod` builds it into `target/hvd-venv`, which
/// `cargo xtask bench` hands to the Horovod rows ([`HOROVOD_PYTHON_ENV`]).
const HOROVOD_INSTALL: &str =
    "cargo xtask horovod, or pip install horovod[pytorch] and name its interpreter in FH_BENCH_HOROVOD_PYTHON";

/// The peers, in report order.
pub const PEERS: [Peer; 9] = [
    Peer {
        what: "PyTorch DDP (Gloo)",
        label: "ddp-gloo",
        module: "torch",
        mode: "ddp",
        install: "pip install torch",
        transport: "gloo",
    },
    Peer {
        what: "PyTorch DDP on the fasthorovod backend over shared memory",
        label: "ddp-fasthorovod",
        module: "fasthorovod.torch.distributed",
        mode: "ddp-fasthorovod",
        install: "pip install ./fh-torch",
        transport: "shm",
    },
    Peer {
        what: "PyTorch DDP on the fasthorovod backend over TCP",
        label: "ddp-fasthorovod",
        module: "fasthorovod.torch.distributed",
        mode: "ddp-fasthorovod",
        install: "pip install ./fh-torch",
        transport: "tcp",
    },
    HOROVOD[0],
    HOROVOD[1],
    HOROVOD[2],
    Peer {
        what: "fasthorovod.torch over shared memory",
        label: "fasthorovod-torch",
        module: "fasthorovod.torch",
        mode: "fasthorovod",
        install: "pip install ./fh-torch",
        transport: "shm",
    },
    Peer {
        what: "fasthorovod.torch over TCP",
        label: "fasthorovod-torch",
        module: "fasthorovod.torch",
        mode: "fasthorovod",
        install: "pip install ./fh-torch",
        transport: "tcp",
    },
    Peer {
        what: "PyTorch DDP communicating nothing (the floor of the DDP rows)",
        label: "ddp-floor",
        module: "torch",
        mode: "ddp-floor",
        install: "pip install torch",
        transport: "none",
    },
];

/// The peers when the ranks span hosts, in report order: shared memory alone cannot span
/// hosts, so `fasthorovod.torch` runs over `hier` (shared memory within a host, TCP between)
/// and over TCP.
pub const PEERS_ACROSS_HOSTS: [Peer; 6] = [
    PEERS[0],
    HOROVOD[0],
    HOROVOD[1],
    HOROVOD[2],
    Peer {
        what: "fasthorovod.torch over hier",
        label: "fasthorovod-torch",
        module: "fasthorovod.torch",
        mode: "fasthorovod",
        install: "pip install ./fh-torch",
        transport: "hier",
    },
    PEERS[7],
];

/// The `peer` that the adapter prints in each mode.
fn printed_name(mode: &str) -> &'static str {
    match mode {
        "ddp" => "ddp-gloo",
        "ddp-fasthorovod" => "ddp-fasthorovod",
        "ddp-floor" => "ddp-floor",
        "horovod" => "horovod",
        _ => "fasthorovod-torch",
    }
}

impl Peer {
    /// The reason recorded when the module does not import with `python`.
    pub fn not_installed(&self, python: &str) -> String {
        format!(
            "skipped: not installed ({}; `{python} -c \"import {}\"` fails; another \
             interpreter: {PYTHON_ENV})",
            self.install, self.module
        )
    }
}

/// The interpreter: `$FH_BENCH_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var(PYTHON_ENV)
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Environment variable naming the interpreter of the Horovod rows (an environment where
/// `horovod.torch` imports, such as `target/hvd-venv` of `cargo xtask horovod`); default: the
/// other peers' ([`PYTHON_ENV`]).
pub const HOROVOD_PYTHON_ENV: &str = "FH_BENCH_HOROVOD_PYTHON";

/// Environment variable naming the network interfaces Horovod uses across hosts (its
/// `--network-interfaces`; `cargo xtask bench --emulate` sets the emulated hosts' `eth0`).
pub const HOROVOD_NICS_ENV: &str = "FH_BENCH_HOROVOD_NICS";

/// Whether `python -c "import module"` succeeds within `timeout` (killed and reaped if not).
pub fn imports(python: &str, module: &str, timeout: Duration) -> bool {
    let Ok(mut child) = Command::new(python)
        .args(["-c", &format!("import {module}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return false;
    };
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return s.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

/// Where a peer's ranks run when they span hosts: the hosts with their slots (`--hosts
/// h0:2,h1:2`), the rsh agent that starts commands on them (`FH_RSH_AGENT`, else `ssh`) and
/// `fhrun` (which starts `fasthorovod.torch` across them). The first host is rank 0's and this
/// one's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// `(host, slots)`, rank 0's first.
    pub list: Vec<(String, usize)>,
    /// The rsh agent (`agent HOST COMMAND...`).
    pub agent: String,
    /// The `fhrun` executable.
    pub fhrun: PathBuf,
}

impl Hosts {
    /// Parses `h0:2,h1:2` (a host without `:slots` has one slot).
    pub fn parse(list: &str, agent: String, fhrun: PathBuf) -> Result<Hosts, String> {
        let mut v = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (h, n) = match item.rsplit_once(':') {
                Some((h, n)) => (
                    h,
                    n.parse::<usize>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| format!("--hosts: bad slot count in '{item}'"))?,
                ),
                None => (item, 1),
            };
            v.push((h.to_string(), n));
        }
        if v.is_empty() {
            return Err("--hosts: no host given".into());
        }
        Ok(Hosts {
            list: v,
            agent,
            fhrun,
        })
    }

    /// Total slots.
    pub fn slots(&self) -> usize {
        self.list.iter().map(|(_, n)| n).sum()
    }

    /// `(host, local rank, local size)` of each rank: the hosts' slots filled in order.
    pub fn placement(&self) -> Vec<(&str, usize, usize)> {
        self.list
            .iter()
            .flat_map(|(h, n)| (0..*n).map(move |l| (h.as_str(), l, *n)))
            .collect()
    }
}

/// A word for `sh -c`: single-quoted unless plain.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// One replay of `workload` through `peer` on `np` ranks (on this host, or across `hosts`).
pub struct PeerRun<'a> {
    /// The peer.
    pub peer: Peer,
    /// The interpreter.
    pub python: &'a str,
    /// The adapter script (written by [`write_script`]).
    pub script: &'a Path,
    /// The workload file.
    pub workload: &'a Path,
    /// Ranks.
    pub np: usize,
    /// Emulated backward, ms.
    pub backward_ms: f64,
    /// Untimed steps.
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// Where the logs go.
    pub log_dir: &'a Path,
    /// Longest the whole run may take.
    pub timeout: Duration,
    /// The ranks span these hosts (None: all on this one).
    pub hosts: Option<&'a Hosts>,
}

/// Writes the adapter into `dir`.
pub fn write_script(dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let p = dir.join("torch_replay.py");
    std::fs::write(&p, SOURCE).map_err(|e| format!("writing {}: {e}", p.display()))?;
    Ok(p)
}

impl PeerRun<'_> {
    /// Runs the peer; the result is checked against the request.
    pub fn run(&self, name: &str) -> Result<PeerResult, String> {
        std::fs::create_dir_all(self.log_dir)
            .map_err(|e| format!("creating {}: {e}", self.log_dir.display()))?;
        let args = |c: &mut Command| {
            c.arg(self.script)
                .arg("--mode")
                .arg(self.peer.mode)
                .arg("--workload")
                .arg(self.workload)
                .args(["--backward-ms", &self.backward_ms.to_string()])
                .args(["--warmup", &self.warmup.to_string()])
                .args(["--steps", &self.steps.to_string()])
                .args(["--timeout", &self.timeout.as_secs().max(1).to_string()])
                // One compute thread per rank, as the engine's workers, on a shared host.
                .env("OMP_NUM_THREADS", "1")
                .env("PYTHONUNBUFFERED", "1")
                .stdin(Stdio::null());
        };
        let mut children = Children::default();
        let log0 = if let Some(hosts) = self.hosts {
            self.spawn_across(hosts, name, &mut children)?
        } else if self.peer.mode == "ddp-fasthorovod" {
            let (store_port, engine_port) = two_free_ports()?;
            let token = random_token()?;
            for rank in 0..self.np {
                let mut c = Command::new(self.python);
                args(&mut c);
                c.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", self.np.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", self.np.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", store_port.to_string())
                    .env("FH_RENDEZVOUS_ADDR", format!("127.0.0.1:{engine_port}"))
                    .env("FH_JOB_TOKEN", &token)
                    .env("FH_TRANSPORT", self.peer.transport);
                children.spawn(c, self.log_dir, &format!("{name}.rank{rank}"))?;
            }
            self.log_dir.join(format!("{name}.rank0.log"))
        } else if self.peer.mode == "fasthorovod" {
            let port = free_port()?;
            let token = random_token()?;
            for rank in 0..self.np {
                let mut c = Command::new(self.python);
                args(&mut c);
                let launch = LaunchInfo::for_rank(
                    Topology::single_host(rank, self.np),
                    format!("127.0.0.1:{port}"),
                    JobToken::new(token.clone()),
                );
                c.envs(launch.to_vars())
                    .env("FH_TRANSPORT", self.peer.transport);
                children.spawn(c, self.log_dir, &format!("{name}.rank{rank}"))?;
            }
            self.log_dir.join(format!("{name}.rank0.log"))
        } else if self.peer.mode == "horovod" {
            let python = self.peer.python(self.python);
            let mut c = Command::new(horovodrun(&python));
            c.args(
                self.peer
                    .horovodrun_args(self.np, &format!("localhost:{}", self.np), None),
            )
            .envs(MPI_AS_ROOT)
            .arg(&python);
            args(&mut c);
            children.spawn(c, self.log_dir, name)?;
            self.log_dir.join(format!("{name}.log"))
        } else {
            let port = crate::runner::free_port()?;
            for rank in 0..self.np {
                let mut c = Command::new(self.python);
                args(&mut c);
                c.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", self.np.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", self.np.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("GLOO_SOCKET_IFNAME", loopback_interface());
                children.spawn(c, self.log_dir, &format!("{name}.rank{rank}"))?;
            }
            self.log_dir.join(format!("{name}.rank0.log"))
        };
        children.wait_all(self.timeout)?;
        let text = std::fs::read_to_string(&log0)
            .map_err(|e| format!("reading {}: {e}", log0.display()))?;
        let r = parse_output(&text)?;
        if r.peer != printed_name(self.peer.mode) {
            return Err(format!(
                "asked for the {} peer, got a result from '{}'",
                self.peer.mode, r.peer
            ));
        }
        if r.np != self.np || r.steps != self.steps {
            return Err(format!(
                "{} ran np {} × {} steps, asked for np {} × {} steps",
                r.peer, r.np, r.steps, self.np, self.steps
            ));
        }
        Ok(r)
    }
}

impl PeerRun<'_> {
    /// The adapter's arguments (after the interpreter), as words.
    fn adapter_words(&self) -> Vec<String> {
        vec![
            self.script.display().to_string(),
            "--mode".into(),
            self.peer.mode.into(),
            "--workload".into(),
            self.workload.display().to_string(),
            "--backward-ms".into(),
            self.backward_ms.to_string(),
            "--warmup".into(),
            self.warmup.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--timeout".into(),
            self.timeout.as_secs().max(1).to_string(),
        ]
    }

    /// Starts the ranks across `hosts`; returns rank 0's log. `fasthorovod.torch`: `fhrun -H`
    /// with the rsh agent and `--transport` (the token travels on the agent's stdin);
    /// DDP: each rank through the agent with torch's `env://` variables, `MASTER_ADDR` the
    /// first host; Horovod: `horovodrun -H`.
    fn spawn_across(
        &self,
        hosts: &Hosts,
        name: &str,
        children: &mut Children,
    ) -> Result<PathBuf, String> {
        if hosts.slots() != self.np {
            return Err(format!(
                "--hosts has {} slots for --np {}",
                hosts.slots(),
                self.np
            ));
        }
        let host_list: Vec<String> = hosts.list.iter().map(|(h, n)| format!("{h}:{n}")).collect();
        let host_list = host_list.join(",");
        match self.peer.mode {
            "fasthorovod" => {
                let mut c = Command::new(&hosts.fhrun);
                c.args(["-np", &self.np.to_string(), "-H", &host_list])
                    .args(["--rsh-agent", &hosts.agent])
                    .args(["--transport", self.peer.transport])
                    .args(["-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1"])
                    .arg(self.python)
                    .args(self.adapter_words())
                    .stdin(Stdio::null());
                children.spawn(c, self.log_dir, name)?;
                Ok(self.log_dir.join(format!("{name}.log")))
            }
            "horovod" => {
                // Horovod starts its remote ranks with `ssh`: a stand-in first on PATH sends
                // them through the rsh agent (mpirun also reads OMPI_MCA_plm_rsh_agent).
                let shim = write_ssh_shim(&self.log_dir.join(format!("{name}.ssh")), &hosts.agent)?;
                let path = std::env::var_os("PATH").unwrap_or_default();
                let path =
                    std::env::join_paths(std::iter::once(shim).chain(std::env::split_paths(&path)))
                        .map_err(|e| format!("PATH: {e}"))?;
                let nics = std::env::var(HOROVOD_NICS_ENV).ok();
                let python = self.peer.python(self.python);
                let mut c = Command::new(horovodrun(&python));
                c.args(
                    self.peer
                        .horovodrun_args(self.np, &host_list, nics.as_deref()),
                )
                .env("PATH", path)
                .env("OMPI_MCA_plm_rsh_agent", &hosts.agent)
                .envs(MPI_AS_ROOT)
                .env("OMP_NUM_THREADS", "1")
                .env("PYTHONUNBUFFERED", "1")
                .arg(&python)
                .args(self.adapter_words())
                .stdin(Stdio::null());
                children.spawn(c, self.log_dir, name)?;
                Ok(self.log_dir.join(format!("{name}.log")))
            }
            _ => {
                let port = free_port()?;
                let master = &hosts.list[0].0;
                for (rank, (host, local, local_size)) in hosts.placement().into_iter().enumerate() {
                    let mut words = vec!["env".to_string()];
                    for (k, v) in [
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", self.np.to_string()),
                        ("LOCAL_RANK", local.to_string()),
                        ("LOCAL_WORLD_SIZE", local_size.to_string()),
                        ("MASTER_ADDR", master.clone()),
                        ("MASTER_PORT", port.to_string()),
                        ("OMP_NUM_THREADS", "1".into()),
                        ("PYTHONUNBUFFERED", "1".into()),
                    ] {
                        words.push(format!("{k}={v}"));
                    }
                    words.push(self.python.to_string());
                    words.extend(self.adapter_words());
                    let line: Vec<String> = words.iter().map(|w| shell_word(w)).collect();
                    let mut c = Command::new(&hosts.agent);
                    c.arg(host).arg(line.join(" ")).stdin(Stdio::null());
                    children.spawn(c, self.log_dir, &format!("{name}.rank{rank}"))?;
                }
                Ok(self.log_dir.join(format!("{name}.rank0.log")))
            }
        }
    }
}

/// Open MPI refuses to start as root without these (CI runs as root); harmless otherwise.
const MPI_AS_ROOT: [(&str, &str); 2] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
];

/// Two distinct free ports on 127.0.0.1.
fn two_free_ports() -> Result<(u16, u16), String> {
    let p = fh_job::launch::free_local_ports(2)
        .map_err(|e| format!("finding a free port on 127.0.0.1: {e}"))?;
    Ok((p[0], p[1]))
}

/// The loopback interface's name (`lo` on Linux, `lo0` on the BSDs and macOS).
fn loopback_interface() -> &'static str {
    if cfg!(target_os = "linux") {
        "lo"
    } else {
        "lo0"
    }
}

#[cfg(test)]
mod tests;
