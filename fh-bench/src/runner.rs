//! Running a job on N ranks: threads over the in-process backend, N worker processes of this
//! binary on 127.0.0.1 (TCP or shared memory), or under an external launcher (`mpirun`,
//! `srun`).
//!
//! Worker processes get the `FH_*` environment (rank, size, local/cross ranks, rendezvous
//! address where rank 0 listens, a random job token), read the job from a JSON file and write
//! their result to `<prefix>.rank<R>.json`. Every wait is bounded; on any failure all children
//! are killed and reaped.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fh_job::{JobToken, LaunchInfo, Topology};
use fh_transport::Transport;
use serde::{Deserialize, Serialize};

use crate::collectives::{self, Case, CaseTimes, StreamTimes};
use crate::replay::{self, NegotiationJob, NegotiationStep, ReplayJob};

/// A unit of work run by every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Job {
    /// Collectives sweep cases.
    Collectives {
        /// Cases, in order.
        cases: Vec<Case>,
        /// Untimed runs per case.
        warmup: usize,
        /// Timed runs per case.
        repeats: usize,
    },
    /// Concurrent allreduces, each on its own communicator (the engine's K channels at once).
    Streams {
        /// Bytes of each allreduce.
        bytes: usize,
        /// How many run at once, one measurement per count.
        streams: Vec<usize>,
        /// Run each as the engine runs a staged fused group, through pieces of this many
        /// bytes ([`collectives::staged_allreduce`]); `None`: plain allreduces.
        #[serde(default)]
        stage: Option<usize>,
        /// Untimed runs per count.
        warmup: usize,
        /// Timed runs per count.
        repeats: usize,
    },
    /// A workload replay through the engine.
    Replay(ReplayJob),
    /// A negotiation-cost measurement through the engine.
    Negotiation(NegotiationJob),
}

/// What one rank returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RankOutput {
    /// Per case timings.
    Collectives(Vec<CaseTimes>),
    /// Per stream count timings.
    Streams(Vec<StreamTimes>),
    /// Per timed replay step, seconds, and the bytes per channel.
    Replay(crate::replay::ReplayOutput),
    /// Per timed negotiation step.
    Negotiation(Vec<NegotiationStep>),
}

/// Runs `job` on this rank's transport.
pub fn execute(job: &Job, mut transport: Box<dyn Transport>) -> Result<RankOutput, String> {
    match job {
        Job::Collectives {
            cases,
            warmup,
            repeats,
        } => {
            let mut comm = transport
                .open("fh-bench collectives")
                .map_err(|e| format!("opening a communicator: {e}"))?;
            let out = collectives::run_cases(comm.as_mut(), cases, *warmup, *repeats, |_| {})?;
            Ok(RankOutput::Collectives(out))
        }
        Job::Streams {
            bytes,
            streams,
            stage,
            warmup,
            repeats,
        } => {
            let most = streams.iter().copied().max().unwrap_or(1).max(1);
            let mut comms = (0..most)
                .map(|i| transport.open(&format!("fh-bench stream {i}")))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("opening a communicator: {e}"))?;
            collectives::run_streams(&mut comms, *bytes, streams, *stage, *warmup, *repeats)
                .map(RankOutput::Streams)
        }
        Job::Replay(j) => replay::run_replay(j, transport).map(RankOutput::Replay),
        Job::Negotiation(j) => replay::run_negotiation(j, transport).map(RankOutput::Negotiation),
    }
}

/// How ranks are started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// One thread per rank in this process, in-process backend (`local`).
    Threads,
    /// N worker processes on 127.0.0.1 with the `FH_*` environment (TCP).
    Local,
    /// `mpirun` (OpenMPI): the workers read `OMPI_COMM_WORLD_*`.
    Mpirun {
        /// `--host` list, if any.
        hosts: Option<String>,
    },
    /// `srun` (Slurm): the workers read `SLURM_*`.
    Srun,
}

impl Launch {
    /// How many hosts the ranks span: the distinct names of `mpirun`'s `--host` list, Slurm's
    /// node count (`SLURM_JOB_NUM_NODES`, else `SLURM_NNODES`) under `srun`, else one.
    pub fn hosts(&self) -> usize {
        match self {
            Launch::Mpirun { hosts: Some(list) } => {
                let mut names: Vec<&str> = list
                    .split(',')
                    .map(|h| h.split(':').next().unwrap_or(h).trim())
                    .filter(|h| !h.is_empty())
                    .collect();
                names.sort_unstable();
                names.dedup();
                names.len().max(1)
            }
            Launch::Srun => ["SLURM_JOB_NUM_NODES", "SLURM_NNODES"]
                .iter()
                .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
                .unwrap_or(1)
                .max(1),
            _ => 1,
        }
    }

    /// Name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Launch::Threads => "threads",
            Launch::Local => "local",
            Launch::Mpirun { .. } => "mpirun",
            Launch::Srun => "srun",
        }
    }
}

/// Starts jobs on `np` ranks.
#[derive(Debug, Clone)]
pub struct Runner {
    /// Ranks.
    pub np: usize,
    /// How.
    pub launch: Launch,
    /// This binary (the workers are `fh-bench worker`).
    pub exe: PathBuf,
    /// Where job files, results and worker logs go.
    pub work_dir: PathBuf,
    /// Longest a job may take.
    pub timeout: Duration,
    /// Rendezvous host for external launchers (rank 0's host).
    pub rendezvous_host: String,
    /// `FH_TRANSPORT` of the worker processes (`tcp`, `shm`, ...).
    pub transport: String,
}

impl Runner {
    /// Runs `job` on every rank and returns the outputs in rank order.
    pub fn run(&self, name: &str, job: &Job) -> Result<Vec<RankOutput>, String> {
        match self.launch {
            Launch::Threads => run_threads(self.np, job, self.timeout),
            _ => self.run_processes(name, job),
        }
    }

    fn run_processes(&self, name: &str, job: &Job) -> Result<Vec<RankOutput>, String> {
        fs::create_dir_all(&self.work_dir)
            .map_err(|e| format!("creating {}: {e}", self.work_dir.display()))?;
        let job_path = self.work_dir.join(format!("{name}.job.json"));
        let prefix = self.work_dir.join(name);
        let text = serde_json::to_string(job).map_err(|e| e.to_string())?;
        fs::write(&job_path, text).map_err(|e| format!("writing {}: {e}", job_path.display()))?;
        for r in 0..self.np {
            let _ = fs::remove_file(result_path(&prefix, r));
        }
        let port = free_port()?;
        let token = random_token()?;
        let (transport, setting) = crate::record::transport_env(&self.transport);
        let worker_args = |c: &mut Command| {
            c.arg("worker")
                .arg("--job")
                .arg(&job_path)
                .arg("--out")
                .arg(&prefix)
                .env("FH_JOB_TOKEN", &token)
                .env("FH_TRANSPORT", transport)
                .stdin(Stdio::null());
            if let Some((var, value)) = setting {
                c.env(var, value);
            }
        };
        let mut children = Children::default();
        match &self.launch {
            Launch::Local => {
                for rank in 0..self.np {
                    let mut c = Command::new(&self.exe);
                    worker_args(&mut c);
                    let info = LaunchInfo::for_rank(
                        Topology::single_host(rank, self.np),
                        format!("127.0.0.1:{port}"),
                        JobToken::new(token.clone()),
                    );
                    c.envs(info.to_vars());
                    children.spawn(c, &self.work_dir, &format!("{name}.rank{rank}"))?;
                }
            }
            Launch::Mpirun { hosts } => {
                let mut c = Command::new("mpirun");
                c.args([
                    "--oversubscribe",
                    "--allow-run-as-root",
                    "--bind-to",
                    "none",
                ])
                .args(["-np", &self.np.to_string()]);
                if let Some(h) = hosts {
                    c.args(["--host", h]);
                }
                for v in [
                    "FH_JOB_TOKEN",
                    "FH_TRANSPORT",
                    "FH_RENDEZVOUS_ADDR",
                    "FH_SIZE",
                ]
                .into_iter()
                .chain(setting.map(|(var, _)| var))
                {
                    c.args(["-x", v]);
                }
                // The TCP stream settings must be the same on every rank (the rendezvous checks
                // them): the caller's go to the ranks on other hosts too.
                for v in [
                    fh_transport::backend::tcp::settings::STREAMS_VAR,
                    fh_transport::backend::tcp::settings::STRIPE_MIN_VAR,
                ] {
                    if std::env::var_os(v).is_some() {
                        c.args(["-x", v]);
                    }
                }
                c.arg(&self.exe);
                worker_args(&mut c);
                c.env(
                    "FH_RENDEZVOUS_ADDR",
                    format!("{}:{port}", self.rendezvous_host),
                );
                children.spawn(c, &self.work_dir, &format!("{name}.mpirun"))?;
            }
            Launch::Srun => {
                let mut c = Command::new("srun");
                c.args(["-n", &self.np.to_string(), "--export=ALL"]);
                c.arg(&self.exe);
                worker_args(&mut c);
                c.env(
                    "FH_RENDEZVOUS_ADDR",
                    format!("{}:{port}", self.rendezvous_host),
                );
                children.spawn(c, &self.work_dir, &format!("{name}.srun"))?;
            }
            Launch::Threads => unreachable!("threads are handled by run()"),
        }
        children.wait_all(self.timeout)?;
        (0..self.np)
            .map(|r| {
                let p = result_path(&prefix, r);
                let text = fs::read_to_string(&p).map_err(|e| {
                    format!("rank {r} exited without a result ({}: {e})", p.display())
                })?;
                serde_json::from_str(&text)
                    .map_err(|e| format!("rank {r}'s result is not valid: {e}"))
            })
            .collect()
    }
}

/// Where rank `r` writes its result.
pub fn result_path(prefix: &Path, r: usize) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(format!(".rank{r}.json"));
    PathBuf::from(s)
}

fn run_threads(np: usize, job: &Job, timeout: Duration) -> Result<Vec<RankOutput>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let world = fh_transport::backend::local::LocalWorld::with_timeout(np, timeout);
    let mut handles = Vec::new();
    for t in world {
        let job = job.clone();
        let tx = tx.clone();
        handles.push(std::thread::spawn(move || {
            let rank = t.rank();
            let res = execute(&job, Box::new(t));
            let _ = tx.send((rank, res));
        }));
    }
    drop(tx);
    let deadline = Instant::now() + timeout;
    let mut out: Vec<Option<RankOutput>> = (0..np).map(|_| None).collect();
    for _ in 0..np {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(o))) => out[rank] = Some(o),
            Ok((rank, Err(e))) => return Err(format!("rank {rank}: {e}")),
            Err(_) => {
                return Err(format!(
                    "the in-process job did not finish within {timeout:?}"
                ))
            }
        }
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(out.into_iter().flatten().collect())
}

/// Child processes, killed and reaped when dropped.
#[derive(Default)]
pub(crate) struct Children {
    procs: Vec<(String, Child, PathBuf)>,
}

impl Children {
    pub(crate) fn spawn(&mut self, mut c: Command, dir: &Path, label: &str) -> Result<(), String> {
        let log = dir.join(format!("{label}.log"));
        let file =
            fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let err = file.try_clone().map_err(|e| e.to_string())?;
        c.stdout(Stdio::from(file)).stderr(Stdio::from(err));
        let child = c
            .spawn()
            .map_err(|e| format!("starting {label} ({:?}): {e}", c.get_program()))?;
        self.procs.push((label.to_string(), child, log));
        Ok(())
    }

    /// Waits for every child to exit successfully, at most `timeout`. On the first failure,
    /// gives the others 2 s, then kills them; the error names the failed process and quotes the
    /// end of its log.
    pub(crate) fn wait_all(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut failed: Option<String> = None;
        let mut done = vec![false; self.procs.len()];
        loop {
            for (i, (label, child, log)) in self.procs.iter_mut().enumerate() {
                if done[i] {
                    continue;
                }
                match child.try_wait() {
                    Ok(Some(status)) => {
                        done[i] = true;
                        if !status.success() && failed.is_none() {
                            failed = Some(format!("{label} failed ({status}): {}", tail(log)));
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        done[i] = true;
                        failed.get_or_insert(format!("waiting for {label}: {e}"));
                    }
                }
            }
            if done.iter().all(|d| *d) {
                return match failed {
                    Some(f) => Err(f),
                    None => Ok(()),
                };
            }
            let now = Instant::now();
            if failed.is_some() {
                let grace = now + Duration::from_secs(2);
                while Instant::now() < grace
                    && self
                        .procs
                        .iter_mut()
                        .any(|(_, c, _)| matches!(c.try_wait(), Ok(None)))
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.kill_all();
                return Err(failed.unwrap_or_default());
            }
            if now >= deadline {
                let running: Vec<&str> = self
                    .procs
                    .iter()
                    .zip(&done)
                    .filter(|(_, d)| !**d)
                    .map(|((l, _, _), _)| l.as_str())
                    .collect();
                let msg = format!(
                    "timed out after {timeout:?}; still running: {} (killed)",
                    running.join(", ")
                );
                self.kill_all();
                return Err(msg);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill_all(&mut self) {
        for (_, c, _) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The last lines of a log file.
fn tail(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = fs::File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(6);
    if lines.is_empty() {
        format!("(no output; log {})", path.display())
    } else {
        format!("{} (log {})", lines[start..].join(" | "), path.display())
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub(crate) fn free_port() -> Result<u16, String> {
    fh_job::launch::free_local_port().map_err(|e| format!("finding a free port on 127.0.0.1: {e}"))
}

/// 128 random bits, hex.
pub(crate) fn random_token() -> Result<String, String> {
    let mut b = [0u8; 16];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| format!("reading /dev/urandom for the job token: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::Collective;

    #[test]
    fn the_hosts_a_launch_spans() {
        let mpirun = |h: &str| Launch::Mpirun {
            hosts: Some(h.into()),
        };
        assert_eq!(mpirun("h0:2,h1:2").hosts(), 2);
        assert_eq!(mpirun("h0:2, h0:1,h1").hosts(), 2);
        assert_eq!(mpirun("node1").hosts(), 1);
        assert_eq!(Launch::Mpirun { hosts: None }.hosts(), 1);
        assert_eq!(Launch::Local.hosts(), 1);
        assert_eq!(Launch::Threads.hosts(), 1);
        // The schedules "the other way" follow: back-pressure forced off across hosts, on
        // within one.
        use crate::replay::ScheduleSpec;
        let labels = |hosts| {
            let wire = fh_scheduler::Wire::of(fh_transport::wire_of_choice("hier"), hosts);
            ScheduleSpec::all_for(4, wire)
                .iter()
                .map(ScheduleSpec::label)
                .collect::<Vec<_>>()
        };
        assert!(labels(2).contains(&"fasthorovod K=2 -bp".to_string()));
        assert!(labels(1).contains(&"fasthorovod K=2 +bp".to_string()));
    }

    #[test]
    fn threads_run_a_job() {
        let job = Job::Collectives {
            cases: vec![Case {
                collective: Collective::Allreduce,
                bytes: 64,
            }],
            warmup: 1,
            repeats: 3,
        };
        let out = run_threads(2, &job, Duration::from_secs(30)).unwrap();
        assert_eq!(out.len(), 2);
        let RankOutput::Collectives(c) = &out[1] else {
            panic!("not a collectives result");
        };
        assert_eq!(c[0].seconds.len(), 3);
    }

    #[test]
    fn failing_children_are_reported_and_reaped() {
        let dir = std::env::temp_dir().join(format!("fh-bench-runner-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut ch = Children::default();
        let mut ok = Command::new("sh");
        ok.args(["-c", "sleep 30"]);
        ch.spawn(ok, &dir, "sleeper").unwrap();
        let mut bad = Command::new("sh");
        bad.args(["-c", "echo boom >&2; exit 3"]);
        ch.spawn(bad, &dir, "crasher").unwrap();
        let e = ch.wait_all(Duration::from_secs(20)).unwrap_err();
        assert!(e.contains("crasher failed") && e.contains("boom"), "{e}");
        assert!(ch
            .procs
            .iter_mut()
            .all(|(_, c, _)| c.try_wait().unwrap().is_some()));
        let mut hang = Children::default();
        let mut s = Command::new("sh");
        s.args(["-c", "sleep 30"]);
        hang.spawn(s, &dir, "hanger").unwrap();
        let e = hang.wait_all(Duration::from_millis(200)).unwrap_err();
        assert!(e.contains("timed out") && e.contains("hanger"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
