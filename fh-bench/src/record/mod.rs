//! The machine-readable record of a run (`run.json`): the configuration, the git revision and
//! every figure with its unit.

use serde::{Deserialize, Serialize};

use crate::sim::{Link, Overheads};
use crate::stats::Quantity;

mod hosts;

pub use hosts::{transport_env, Across, AcrossRow, Route, TcpStreams};

/// Version of the `run.json` layout.
pub const SCHEMA: u32 = 1;

/// Everything one `fh-bench` run measured and modelled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Layout version ([`SCHEMA`]).
    pub schema: u32,
    /// `fh-bench <version>`.
    pub tool: String,
    /// When the run started, UTC (`YYYY-MM-DDTHH:MM:SSZ`).
    pub started_utc: String,
    /// `git describe --always --dirty` of the repository, or `unknown`.
    pub git_revision: String,
    /// The machine.
    pub host: Host,
    /// The configuration.
    pub config: RunConfig,
    /// Collectives sweep.
    #[serde(default)]
    pub collectives: Vec<CollRow>,
    /// Concurrent allreduces (K at once, each on its own communicator), per transport.
    #[serde(default)]
    pub streams: Vec<StreamRow>,
    /// Workload replay (the headline).
    #[serde(default)]
    pub replay: Vec<ReplayRow>,
    /// Allreduces at the sweep's smallest and largest sizes, measured on each replay transport
    /// between the replay's rounds (every round's repeats together): the model's loopback
    /// links and the transports' own bounds come from these where present, since they share
    /// the replay's spells of a busy host (see [`RunRecord::link_rows`]).
    #[serde(default)]
    pub replay_allreduce: Vec<CollRow>,
    /// Negotiation cost.
    #[serde(default)]
    pub negotiation: Vec<NegRow>,
    /// Scale simulation (a model).
    #[serde(default)]
    pub simulation: Option<SimResult>,
    /// The replay across hosts: each row's bytes across a host's link, its link bound and the
    /// model on that link (runs with `--hosts` and `--link-gbps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub across: Option<Across>,
    /// What was not run, and why.
    #[serde(default)]
    pub skipped: Vec<Skipped>,
    /// Wall time of the whole run.
    pub wall: Quantity,
}

impl RunRecord {
    /// The allreduce rows a transport's link is calibrated on at `np` ranks: those measured
    /// between the replay's rounds when they give two sizes or more, else the sweep's; with
    /// whether they are the replay's.
    pub fn link_rows(&self, transport: &str, np: usize) -> (Vec<&CollRow>, bool) {
        fn pick<'r>(rows: &'r [CollRow], transport: &str, np: usize) -> Vec<&'r CollRow> {
            rows.iter()
                .filter(|r| r.transport == transport && r.collective == "allreduce" && r.np == np)
                .collect()
        }
        let between = pick(&self.replay_allreduce, transport, np);
        let mut sizes: Vec<usize> = between.iter().map(|r| r.bytes).collect();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.len() >= 2 {
            (between, true)
        } else {
            (pick(&self.collectives, transport, np), false)
        }
    }
}

/// The machine the run was on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Host {
    /// Host name.
    pub hostname: String,
    /// Logical CPUs.
    pub cpus: usize,
    /// `std::env::consts::OS`/`ARCH`.
    pub os: String,
    /// CPU time stolen by the hypervisor during the run, % of all CPU time (Linux
    /// `/proc/stat`), when known: high steal makes timings unreliable.
    #[serde(default)]
    pub steal_percent: Option<f64>,
    /// The 1-minute load average at the end of the run, when known.
    #[serde(default)]
    pub load_average: Option<f64>,
    /// Host copy rate of one thread, GB/s per pass (the best of a few passes of the engine's
    /// packing and unpacking of fused groups, gradient-sized copies through a 64 MiB fusion
    /// buffer with the average's division, at the start of the run): what packing and
    /// unpacking fused groups costs, for the model.
    #[serde(default)]
    pub copy_gbps: Option<f64>,
    /// Host copy rate of each of `np` threads packing and unpacking at once as the engine does,
    /// GB/s per pass (median of a few passes per thread, sampled at the start and between
    /// the replay's rounds): what
    /// a rank's copies get on this host while every rank of the loopback check copies too,
    /// for the model's check against the replay.
    #[serde(default)]
    pub copy_gbps_shared: Option<f64>,
    /// As [`Host::copy_gbps_shared`], for the engine's staged pattern: a fused group packed
    /// into and unpacked from a piece of its fusion buffer (`Config::stage_bytes`) at a
    /// time, GB/s of group bytes for both passes together.
    #[serde(default)]
    pub copy_gbps_staged: Option<f64>,
}

/// The configuration of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// `--quick`.
    pub quick: bool,
    /// Ranks.
    pub np: usize,
    /// How ranks were started (`local` processes, `threads`, `mpirun`, `srun`).
    pub launcher: String,
    /// Hosts (`--hosts`), if any.
    pub hosts: Option<String>,
    /// The suites run.
    pub suites: Vec<String>,
    /// Collective sizes, bytes.
    pub sizes: Vec<usize>,
    /// Timed repeats per collective case.
    pub repeats: usize,
    /// Emulated backward pass of the replay, ms.
    pub backward_ms: f64,
    /// Measured replay steps (after one warm-up step).
    pub steps: usize,
    /// Runs of each replay configuration (interleaved round-robin).
    #[serde(default = "one")]
    pub replay_repeats: usize,
    /// Workloads directory.
    pub workloads_dir: String,
    /// Workloads replayed.
    pub workloads: Vec<String>,
    /// Tensor counts of the negotiation measurement.
    #[serde(default)]
    pub tensor_counts: Vec<usize>,
}

/// One collectives case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollRow {
    /// Transport (`tcp`, `local`, `openmpi`, ...).
    pub transport: String,
    /// Collective name.
    pub collective: String,
    /// Ranks.
    pub np: usize,
    /// Size in bytes (nccl-tests' definition).
    pub bytes: usize,
    /// Time of one collective (slowest rank per repeat), µs.
    pub time: Quantity,
    /// Algorithm bandwidth, GB/s.
    pub algbw: Quantity,
    /// Bus bandwidth, GB/s.
    pub busbw: Quantity,
}

/// Concurrent allreduces of one size: `streams` of them at once, each on its own
/// communicator, as the engine's channels run them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamRow {
    /// Transport (`tcp`, `shm`, `local`).
    pub transport: String,
    /// Ranks.
    pub np: usize,
    /// Bytes of each allreduce.
    pub bytes: usize,
    /// Allreduces in flight at once.
    pub streams: usize,
    /// Each ran as a staged fused group through pieces of this many bytes (the engine's
    /// pattern on one host: pack a piece, reduce it, unpack it with the average); `None`:
    /// plain allreduces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// From a barrier to the last one finished (slowest rank per repeat), ms.
    pub time: Quantity,
    /// All of them together: `streams × bytes / time`, GB/s.
    pub aggregate_algbw: Quantity,
}

impl StreamRow {
    /// This row's aggregate bandwidth ÷ that of one allreduce alone in the same measurement
    /// (same transport, ranks and size, among `rows`): what the report shows and the model's
    /// concurrency factor. `None` without a finite, positive one-stream figure.
    pub fn vs_one(&self, rows: &[StreamRow]) -> Option<f64> {
        let one = rows
            .iter()
            .find(|y| {
                y.transport == self.transport
                    && y.np == self.np
                    && y.bytes == self.bytes
                    && y.stage == self.stage
                    && y.streams == 1
            })?
            .aggregate_algbw
            .median;
        let r = self.aggregate_algbw.median / one;
        (one.is_finite() && one > 0.0 && r.is_finite()).then_some(r)
    }
}

/// One replay configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayRow {
    /// Workload (model).
    pub workload: String,
    /// Schedule preset or peer (`horovod`, `fasthorovod K=2`, peers `ddp-gloo`,
    /// `ddp-fasthorovod`, `horovod-torch`, `fasthorovod-torch`).
    pub schedule: String,
    /// What carried the bytes: `tcp`, `shm` (the engine's transports, also under
    /// `fasthorovod-torch`), `gloo` (DDP; Horovod's Gloo controller), `mpi` / `mpi-busy` (Horovod's
    /// MPI controller, Open MPI yielding or busy-polling), `horovodrun` (older records); empty in records
    /// written before the replay ran over several transports.
    #[serde(default)]
    pub transport: String,
    /// Timed runs of this configuration (interleaved with the other configurations).
    #[serde(default)]
    pub repeats: usize,
    /// Ranks.
    pub np: usize,
    /// Gradient tensors per step.
    pub tensors: usize,
    /// Gradient bytes per step.
    pub bytes: u64,
    /// Emulated backward pass, ms.
    pub backward: Quantity,
    /// Step time (backward start to last gradient reduced; slowest rank), ms, over every timed
    /// step of every repeat.
    pub step: Quantity,
    /// Exposed communication (step − backward), ms, over every timed step of every repeat.
    pub exposed: Quantity,
    /// Median exposed communication of each repeat, ms, in run order.
    #[serde(default)]
    pub exposed_per_repeat: Vec<f64>,
    /// Steps per second.
    pub throughput: Quantity,
    /// Median step time ÷ the `horovod` preset's (same workload, same transport if it ran
    /// over it, else the first).
    pub step_ratio_to_horovod: Option<f64>,
    /// Median exposed communication ÷ the `horovod` preset's.
    pub exposed_ratio_to_horovod: Option<f64>,
    /// Exposed communication ÷ the `ddp-gloo` peer's, per repeat (the two medians of the same
    /// round of the interleaved run): median [min–max] over the repeats.
    #[serde(default)]
    pub exposed_vs_ddp: Option<Quantity>,
    /// The same against the `horovod-torch` peer.
    #[serde(default)]
    pub exposed_vs_horovod_torch: Option<Quantity>,
    /// The same against the `fasthorovod-torch` peer over the same transport
    /// (`DistributedOptimizer`; the base of the `ddp-fasthorovod` rows).
    #[serde(default)]
    pub exposed_vs_fasthorovod_torch: Option<Quantity>,
    /// Each data channel's share of the bytes over the timed steps (rank 0), in channel
    /// order; empty for peers.
    #[serde(default)]
    pub channel_share: Vec<f64>,
    /// CPU time of all ranks together per timed step, ms (the engine's rows over a transport
    /// of one process per rank, and the peers, whose adapter sums its ranks' process CPU
    /// time; None for in-process ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ms_per_step: Option<f64>,
    /// Of [`ReplayRow::cpu_ms_per_step`], the ranks' main threads: the training loop (the
    /// engine's rows: the thread that submits each gradient at its deadline and waits; the
    /// peers: the Python thread that runs the backward, the framework's hooks and the wait),
    /// all ranks together per timed step, ms. The rest is the communication library's threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_thread_cpu_ms_per_step: Option<f64>,
    /// The parallel TCP streams the runtime chose to each peer on another host, per run (rank
    /// 0's transport, [`fh_transport::Transport::stream_choice`]); empty where nothing crosses
    /// hosts over TCP, and for peers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tcp_streams: Vec<TcpStreams>,
}

impl ReplayRow {
    /// The channel shares as `26/25/24/25 %` (`–` when there are none).
    pub fn channel_share_text(&self) -> String {
        if self.channel_share.is_empty() {
            return "–".into();
        }
        let parts: Vec<String> = self
            .channel_share
            .iter()
            .map(|s| format!("{:.0}", s * 100.0))
            .collect();
        format!("{} %", parts.join("/"))
    }
}

impl ReplayRow {
    /// `schedule (transport)`, or the schedule alone when the transport is not recorded.
    pub fn config_label(&self) -> String {
        if self.transport.is_empty() {
            self.schedule.clone()
        } else {
            format!("{} ({})", self.schedule, self.transport)
        }
    }
}

/// One negotiation configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NegRow {
    /// `coordinator` (cache capacity 0), `bit-vector` (small cached allreduces ride in the
    /// round) or `bit-vector, riding off`; with `, 8 B back to back` added, one 8-byte named
    /// allreduce at a time and every figure per allreduce (then also `bit-vector, caller rounds
    /// off`: every round on the negotiation thread).
    pub mode: String,
    /// Ranks.
    pub np: usize,
    /// Tensors submitted per step.
    pub tensors: usize,
    /// Step latency: submit all tensors (1 element each), wait all, µs.
    pub step_latency: Quantity,
    /// Negotiation rounds per step.
    pub rounds_per_step: Quantity,
    /// Latency per negotiation round, µs.
    pub round_latency: Quantity,
    /// Negotiation bytes sent per round by one rank, B.
    pub bytes_per_round: Quantity,
    /// CPU time per step of every rank's process together (every thread, user and system),
    /// µs: on a machine with fewer cores than busy threads, the latency follows it. `None` in
    /// runs recorded before it was measured.
    #[serde(default)]
    pub cpu_per_step: Option<Quantity>,
}

/// The scale simulation's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimResult {
    /// What the model is and is not.
    pub note: String,
    /// Emulated backward per step, ms.
    pub backward_ms: f64,
    /// Link classes modelled.
    pub links: Vec<Link>,
    /// Software overheads used.
    pub overheads: Overheads,
    /// Where α, β and the overheads came from.
    pub calibration: Vec<String>,
    /// Projections.
    pub rows: Vec<SimRow>,
    /// The model at the measured rank count on the calibrated link, beside the measured replay.
    #[serde(default)]
    pub check: Vec<SimCheck>,
}

/// One projection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimRow {
    /// Workload.
    pub workload: String,
    /// Link class.
    pub link: String,
    /// Schedule.
    pub schedule: String,
    /// Ranks.
    pub ranks: usize,
    /// Simulated step time, ms.
    pub step: Quantity,
    /// Simulated exposed communication, ms.
    pub exposed: Quantity,
    /// Scaling efficiency (ratio).
    pub efficiency: Quantity,
}

/// Model against measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimCheck {
    /// Workload.
    pub workload: String,
    /// Schedule.
    pub schedule: String,
    /// Transport of the measured replay (empty in older records).
    #[serde(default)]
    pub transport: String,
    /// Ranks.
    pub ranks: usize,
    /// Measured median step, ms.
    pub measured_ms: f64,
    /// Simulated step on the calibrated link, ms.
    pub simulated_ms: f64,
    /// Measured median exposed communication (step − backward), ms.
    #[serde(default)]
    pub measured_exposed_ms: Option<f64>,
    /// Simulated exposed communication, ms.
    #[serde(default)]
    pub simulated_exposed_ms: Option<f64>,
}

impl SimCheck {
    /// The model's relative error on the step time, (simulated − measured) ÷ measured.
    pub fn step_error(&self) -> f64 {
        (self.simulated_ms - self.measured_ms) / self.measured_ms
    }
}

/// Something not run, with the reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// Suite.
    pub suite: String,
    /// What was skipped.
    pub what: String,
    /// Why (and how to enable it).
    pub reason: String,
}

impl Skipped {
    /// `what` of `suite` ran and failed with `error`.
    pub fn failed(suite: &str, what: impl Into<String>, error: impl std::fmt::Display) -> Self {
        Skipped {
            suite: suite.into(),
            what: what.into(),
            reason: format!("failed: {error}"),
        }
    }
}

fn one() -> usize {
    1
}
