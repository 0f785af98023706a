//! The workload replay (headline) and the negotiation-cost measurement, run by every rank
//! through the engine (`fh-scheduler`).

use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_scheduler::{AllreduceOptions, Config, Engine, Preset, Tensor, Wire};
use fh_transport::Transport;
use serde::{Deserialize, Serialize};

use crate::workload::Workload;

/// The `fasthorovod` channel counts the replay compares.
pub const CHANNEL_COUNTS: [usize; 3] = [1, 2, 4];

/// A schedule preset as the replay runs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    /// `horovod` or `fasthorovod`.
    pub preset: String,
    /// Data channels (`fasthorovod` only).
    pub channels: Option<usize>,
    /// `fasthorovod` back-pressure forced on (`true`, `+bp`) or off (`false`, `-bp`); `None`:
    /// as the preset ships (`auto`: on over a network stack and from 64 ranks).
    #[serde(default)]
    pub backpressure: Option<bool>,
    /// The flight recorder turned off (`FH_FLIGHT_RECORDS=0`), to measure what recording
    /// costs (`rec-off`); it is on as shipped.
    #[serde(default)]
    pub flight_off: bool,
}

impl ScheduleSpec {
    /// The presets compared over a transport whose data moves over `wire`, in a world of
    /// `np` ranks: `horovod`, `fasthorovod` with K = 1, 2, 4 ([`CHANNEL_COUNTS`]) as shipped,
    /// and the same with back-pressure the other way from what `auto` ships there (the engine's
    /// own rule, [`Config::backpressure_on`]): `+bp` where it ships off (one host's memory),
    /// `-bp` where it ships on (TCP).
    pub fn all_for(np: usize, wire: Wire) -> Vec<ScheduleSpec> {
        let shipped = Config::preset(Preset::FastHorovod).backpressure_on(np, wire);
        let mut v = vec![ScheduleSpec {
            preset: "horovod".into(),
            channels: None,
            backpressure: None,
            flight_off: false,
        }];
        for bp in [None, Some(!shipped)] {
            for k in CHANNEL_COUNTS {
                v.push(ScheduleSpec {
                    preset: "fasthorovod".into(),
                    channels: Some(k),
                    backpressure: bp,
                    flight_off: false,
                });
            }
        }
        v
    }

    /// The shipped `fasthorovod` (K = 4) with the flight recorder on (as shipped) and off:
    /// what always-on recording costs, replayed side by side (`fh-bench suite --flight-cost`).
    pub fn flight_cost() -> Vec<ScheduleSpec> {
        [false, true]
            .into_iter()
            .map(|off| ScheduleSpec {
                preset: "fasthorovod".into(),
                channels: Some(4),
                backpressure: None,
                flight_off: off,
            })
            .collect()
    }

    /// `horovod`, `fasthorovod K=k`, `fasthorovod K=k +bp` or `… -bp` (the labels the
    /// simulation uses too), and ` rec-off` with the flight recorder off.
    pub fn label(&self) -> String {
        let base = self.base_label();
        if self.flight_off {
            format!("{base} rec-off")
        } else {
            base
        }
    }

    fn base_label(&self) -> String {
        match (self.channels, self.backpressure) {
            (Some(k), None) => format!("{} K={k}", self.preset),
            (Some(k), Some(true)) => format!("{} K={k} +bp", self.preset),
            (Some(k), Some(false)) => format!("{} K={k} -bp", self.preset),
            (None, _) => self.preset.clone(),
        }
    }

    fn config(&self) -> Result<Config, String> {
        let preset: Preset = self.preset.parse().map_err(|e| format!("{e}"))?;
        let c = Config::preset(preset);
        let c = match self.channels {
            Some(k) => c.channels(k),
            None => c,
        };
        let mut c = match preset {
            Preset::FastHorovod => c.backpressure(self.backpressure),
            Preset::Horovod => c,
        };
        if self.flight_off {
            c.flight_records = 0;
        }
        Ok(c)
    }
}

/// One replay configuration, as sent to every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplayJob {
    /// Model name.
    pub model: String,
    /// (name, elements) of each gradient in release order (f32).
    pub tensors: Vec<(String, usize)>,
    /// When each becomes ready after the backward starts, seconds.
    pub deadlines_s: Vec<f64>,
    /// The schedule.
    pub schedule: ScheduleSpec,
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
}

impl ReplayJob {
    /// The job for a workload.
    pub fn new(
        w: &Workload,
        backward: Duration,
        schedule: ScheduleSpec,
        warmup: usize,
        steps: usize,
    ) -> Self {
        ReplayJob {
            model: w.model.clone(),
            tensors: w
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.elements))
                .collect(),
            deadlines_s: w
                .deadlines(backward)
                .iter()
                .map(|d| d.as_secs_f64())
                .collect(),
            schedule,
            warmup,
            steps,
        }
    }
}

/// What one rank measured in a replay.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReplayOutput {
    /// Per timed step, seconds from backward start to the last gradient reduced.
    pub step_seconds: Vec<f64>,
    /// Bytes each data channel carried during the timed steps, in channel order.
    pub channel_bytes: Vec<u64>,
    /// The parallel TCP streams this rank's transport chose to peers on other hosts (`None`
    /// where nothing crosses hosts over TCP).
    #[serde(default)]
    pub tcp_streams: Option<crate::record::TcpStreams>,
    /// CPU time this process (the rank, every thread of it) used over the timed steps,
    /// seconds ([`process_cpu_seconds`]).
    #[serde(default)]
    pub cpu_seconds: f64,
    /// CPU time of the thread that ran the steps (submitted each gradient at its deadline and
    /// waited for the results) over the timed steps, seconds ([`thread_cpu_seconds`]): the
    /// training loop's share of [`ReplayOutput::cpu_seconds`], the rest being the engine's.
    #[serde(default)]
    pub main_thread_cpu_seconds: f64,
}

/// CPU time (user and system, every thread) this process has used so far, seconds
/// (`getrusage(RUSAGE_SELF)`); 0 where it cannot be read.
pub fn process_cpu_seconds() -> f64 {
    rusage_seconds(libc::RUSAGE_SELF)
}

/// CPU time (user and system) the calling thread has used so far, seconds
/// (`getrusage(RUSAGE_THREAD)`); 0 where it cannot be read.
pub fn thread_cpu_seconds() -> f64 {
    rusage_seconds(libc::RUSAGE_THREAD)
}

/// User plus system CPU time of `who` (`RUSAGE_SELF`, `RUSAGE_THREAD`), seconds; 0 where it
/// cannot be read.
fn rusage_seconds(who: libc::c_int) -> f64 {
    // SAFETY: an all-zero `rusage` is a valid value; getrusage only writes into it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a `rusage` for the call's duration.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// CPU time the threads of this process now alive have used so far, seconds, to the
/// nanosecond (the scheduler's own count, `/proc/self/task/*/schedstat`): for spans much
/// shorter than a clock tick, where [`process_cpu_seconds`] is too coarse. Threads that ended
/// are not counted, so only a span whose threads all outlive it may be measured with it;
/// [`process_cpu_seconds`] where `/proc` cannot be read.
pub fn threads_cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return process_cpu_seconds();
    };
    let mut ns = 0u64;
    for t in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        ns += text
            .split_whitespace()
            .next()
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0);
    }
    ns as f64 * 1e-9
}

/// Runs a replay job on this rank.
pub fn run_replay(job: &ReplayJob, transport: Box<dyn Transport>) -> Result<ReplayOutput, String> {
    // Chosen when the transport started (measured there under `auto`), before the engine.
    let tcp_streams = transport.stream_choice().map(Into::into);
    let engine = Engine::start(transport, job.schedule.config()?)
        .map_err(|e| format!("starting the engine ({}): {e}", job.schedule.label()))?;
    let result = replay_steps(&engine, job);
    let stop = engine.shutdown();
    let mut out = result?;
    stop.map_err(|e| format!("engine shutdown: {e}"))?;
    out.tcp_streams = tcp_streams;
    Ok(out)
}

fn replay_steps(engine: &Engine, job: &ReplayJob) -> Result<ReplayOutput, String> {
    let err = |e: fh_scheduler::SchedulerError| e.to_string();
    let mut tensors: Vec<Option<Tensor>> = job
        .tensors
        .iter()
        .map(|(_, n)| Some(Tensor::from_slice(&vec![1.0f32; *n])))
        .collect();
    let mut times = Vec::with_capacity(job.steps);
    let mut channel_start: Vec<u64> = Vec::new();
    let mut cpu_start = 0.0;
    let mut main_cpu_start = 0.0;
    for step in 0..job.warmup + job.steps {
        engine.barrier().map_err(err)?.wait().map_err(err)?;
        if step == job.warmup {
            channel_start = engine.stats().channels.iter().map(|c| c.bytes).collect();
            cpu_start = process_cpu_seconds();
            main_cpu_start = thread_cpu_seconds();
        }
        let t0 = Instant::now();
        let mut handles = Vec::with_capacity(tensors.len());
        for (i, (name, _)) in job.tensors.iter().enumerate() {
            let due = t0 + Duration::from_secs_f64(job.deadlines_s[i]);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let t = tensors[i]
                .take()
                .ok_or_else(|| format!("tensor {name} missing"))?;
            handles.push(
                engine
                    .allreduce(name, t, AllreduceOptions::with_op(ReduceOp::Average))
                    .map_err(err)?,
            );
        }
        for (i, h) in handles.into_iter().enumerate() {
            tensors[i] = Some(h.wait().map_err(err)?);
        }
        let elapsed = t0.elapsed().as_secs_f64();
        if step >= job.warmup {
            times.push(elapsed);
        }
    }
    let cpu_seconds = (process_cpu_seconds() - cpu_start).max(0.0);
    let main_thread_cpu_seconds = (thread_cpu_seconds() - main_cpu_start).max(0.0);
    // The average of ones is one: check the first element of every gradient.
    for (i, t) in tensors.iter().enumerate() {
        let t = t.as_ref().ok_or("tensor missing after the replay")?;
        if t.dtype() != DType::F32 || t.data().len() < 4 || t.data()[..4] != 1.0f32.to_ne_bytes() {
            return Err(format!(
                "wrong result for {}: the average of ones is not one",
                job.tensors[i].0
            ));
        }
    }
    let channel_bytes = engine
        .stats()
        .channels
        .iter()
        .enumerate()
        .map(|(c, ch)| {
            ch.bytes
                .saturating_sub(channel_start.get(c).copied().unwrap_or(0))
        })
        .collect();
    Ok(ReplayOutput {
        step_seconds: times,
        channel_bytes,
        tcp_streams: None,
        cpu_seconds,
        main_thread_cpu_seconds,
    })
}

/// The negotiation mode with riding off (`Config::eager_bytes` 0).
pub const RIDING_OFF: &str = "bit-vector, riding off";

/// The back-to-back measurement with caller rounds off (`Config::caller_rounds`): every round
/// on the negotiation thread, two thread hand-offs per allreduce.
pub const CALLER_ROUNDS_OFF: &str = "bit-vector, caller rounds off";

/// What a back-to-back measurement adds to its mode's name.
pub const BACK_TO_BACK: &str = ", 8 B back to back";

/// One negotiation measurement, as sent to every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NegotiationJob {
    /// `coordinator` (cache capacity 0: the coordinator every round), `bit-vector` (a cache
    /// with room for every name; small cached allreduces ride in the round, as by default) or
    /// [`RIDING_OFF`] (the same without riding: a round, then the collective); back to back
    /// also [`CALLER_ROUNDS_OFF`] (riding, every round on the negotiation thread).
    pub mode: String,
    /// Tensors per step (one f32 each).
    pub tensors: usize,
    /// Untimed steps first (the first one fills the cache).
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// When non-zero, each step is this many 8-byte allreduces of one name, each submitted
    /// when the last completed (a training loop's metric, or the latency of a small named
    /// allreduce), and every figure of the step is per allreduce.
    #[serde(default)]
    pub back_to_back: usize,
}

/// What a rank measured per timed step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NegotiationStep {
    /// Submit all, wait all, seconds.
    pub seconds: f64,
    /// Negotiation rounds during the step.
    pub rounds: u64,
    /// Negotiation bytes this rank sent during the step.
    pub bytes: u64,
    /// Time spent in negotiation rounds during the step, seconds.
    pub negotiation_s: f64,
    /// CPU time this rank's threads used during the step, every thread (user and system),
    /// seconds ([`threads_cpu_seconds`]); per allreduce back to back, like the other figures.
    #[serde(default)]
    pub cpu_s: f64,
}

/// Runs a negotiation job on this rank.
pub fn run_negotiation(
    job: &NegotiationJob,
    transport: Box<dyn Transport>,
) -> Result<Vec<NegotiationStep>, String> {
    let config = Config::preset(Preset::FastHorovod).channels(1);
    // Coordinator: no cache, every round goes through rank 0. Bit-vector: a cache large
    // enough for every name, so that steady-state rounds are bit vectors only.
    let config = if job.mode == "coordinator" {
        config.cache_capacity(0)
    } else {
        let slots = config.cache_capacity.max(job.tensors + 16);
        let config = config.cache_capacity(slots);
        if job.mode.starts_with(RIDING_OFF) {
            config.eager_bytes(0)
        } else if job.mode.starts_with(CALLER_ROUNDS_OFF) {
            config.caller_rounds(false)
        } else {
            config
        }
    };
    let engine =
        Engine::start(transport, config).map_err(|e| format!("starting the engine: {e}"))?;
    let result = negotiation_steps(&engine, job);
    let stop = engine.shutdown();
    let out = result?;
    stop.map_err(|e| format!("engine shutdown: {e}"))?;
    Ok(out)
}

fn negotiation_steps(
    engine: &Engine,
    job: &NegotiationJob,
) -> Result<Vec<NegotiationStep>, String> {
    let err = |e: fh_scheduler::SchedulerError| e.to_string();
    let names: Vec<String> = (0..job.tensors).map(|i| format!("neg.{i}")).collect();
    let mut out = Vec::with_capacity(job.steps);
    let sum = AllreduceOptions::with_op(ReduceOp::Sum);
    for step in 0..job.warmup + job.steps {
        engine.barrier().map_err(err)?.wait().map_err(err)?;
        let s0 = engine.stats();
        let cpu0 = threads_cpu_seconds();
        let t0 = Instant::now();
        if job.back_to_back > 0 {
            for _ in 0..job.back_to_back {
                let x = Tensor::from_slice(&[1.0f32; 2]);
                engine
                    .allreduce("neg.b2b", x, sum)
                    .map_err(err)?
                    .wait()
                    .map_err(err)?;
            }
            if step >= job.warmup {
                let per = |x: f64| x / job.back_to_back as f64;
                let s1 = engine.stats();
                out.push(NegotiationStep {
                    seconds: per(t0.elapsed().as_secs_f64()),
                    rounds: s1.rounds.saturating_sub(s0.rounds) / job.back_to_back as u64,
                    bytes: s1
                        .negotiation_bytes_sent
                        .saturating_sub(s0.negotiation_bytes_sent)
                        / job.back_to_back as u64,
                    negotiation_s: per(s1
                        .negotiation_time
                        .saturating_sub(s0.negotiation_time)
                        .as_secs_f64()),
                    cpu_s: per(threads_cpu_seconds() - cpu0),
                });
            }
            continue;
        }
        let handles = names
            .iter()
            .map(|n| {
                engine.allreduce(
                    n,
                    Tensor::from_slice(&[1.0f32]),
                    AllreduceOptions::with_op(ReduceOp::Sum),
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        for h in handles {
            h.wait().map_err(err)?;
        }
        let seconds = t0.elapsed().as_secs_f64();
        let s1 = engine.stats();
        if step >= job.warmup {
            out.push(NegotiationStep {
                seconds,
                rounds: s1.rounds.saturating_sub(s0.rounds),
                bytes: s1
                    .negotiation_bytes_sent
                    .saturating_sub(s0.negotiation_bytes_sent),
                negotiation_s: s1
                    .negotiation_time
                    .saturating_sub(s0.negotiation_time)
                    .as_secs_f64(),
                cpu_s: threads_cpu_seconds() - cpu0,
            });
        }
    }
    Ok(out)
}
