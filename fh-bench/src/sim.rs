//! The scale simulation: a discrete-event **model** (not a measurement) of the two schedules,
//! replaying a workload's gradient release times against α–β network costs.
//!
//! Model, per step (one emulated backward pass of `B` seconds, gradient i ready at
//! `B × (share₀ + … + shareᵢ)`):
//!
//! - **Collective cost.** A fused group of `m` bytes is one allreduce on `p` ranks, ring or
//!   recursive doubling as the transport itself picks by size (fh-transport's
//!   [`AllreduceAlgorithm::resolve`], called, not copied). Ring: a latency part
//!   `2(p−1)·α + o` (o: per-collective software overhead) and a bandwidth part of
//!   `2(p−1)/p · m` bytes per rank; recursive doubling: `⌊log₂ p⌋·α + o` (two more steps when
//!   `p` is not a power of two) and `⌊log₂ p⌋·m`. Bandwidth parts in flight at the same time
//!   share the link fairly (processor sharing), each at most `stream_cap` (a single TCP stream
//!   rarely fills a fast link; NVLink-class links have no such cap).
//! - **Negotiation round.** Costs `r + ⌈log₂ p⌉·α` (a small recursive-doubling allreduce of
//!   the bit vector plus the software overhead `r`).
//! - **`horovod`** (one background thread): a loop that starts at most every `cycle` seconds,
//!   negotiates the tensors ready at its start, then executes the fused groups one after
//!   another itself; tensors that become ready meanwhile wait for the next loop.
//! - **`fasthorovod` K**: negotiation wakes when a tensor is ready and never waits for
//!   execution, as implemented; with back-pressure (as shipped, `auto`: on from 64 ranks;
//!   `+bp` rows force it on, `-bp` rows off) a rank defers its next round while every channel
//!   holds unfinished work, at most a bound — the engine's own pacing policy
//!   ([`fh_core::fusion::Pacing`], through [`Schedule::config`]). Each round's fused groups go
//!   to the channels idle (everywhere) when it started, as the engine agrees them. Each round's tensors
//!   are planned by the engine's own planner ([`fh_core::fusion::plan_round_on`], the options the
//!   engine derives from its configuration, the channel load carried from round to round):
//!   the same fusion, partitioning and channel assignment as the engine, not a copy
//!   ([`ModelPlanner`]; a test checks the two agree group for group). The channels execute
//!   concurrently.
//!
//! - **Host copies.** A channel packs a fused group of several parts into its fusion buffer
//!   and unpacks it afterwards, scaling an average as it unpacks (a single tensor or a chunk
//!   is reduced in place and scaled in one pass): those passes run at the host's measured copy
//!   rate on the channel, before and after its transfer ([`Overheads::copy_bps`]).
//!
//! Step time = time the last group completes; exposed communication = step − B; scaling
//! efficiency = (F + B) / (F + step) with a forward pass F = B/2 that is not overlapped.

use fh_core::fusion::{
    plan_round_on, runs_inline, ChannelLoad, FusionKey, Group, Pacing, PlanItem, PlanOptions,
};
use fh_core::message::{CollectiveKind, Device};
use fh_core::{DType, ReduceOp};
use fh_scheduler::{Config, Preset};
use fh_transport::algorithms::AllreduceAlgorithm;
use serde::{Deserialize, Serialize};

use crate::workload::Workload;

/// A network link class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Name (`25 Gb/s`, `NVLink-class`, ...).
    pub name: String,
    /// Per-message latency α, seconds.
    pub alpha_s: f64,
    /// Link bandwidth per rank and direction, bytes per second (1/β).
    pub bandwidth_bps: f64,
    /// Most one stream (one channel) reaches, bytes per second; `None` = the link's.
    pub stream_cap_bps: Option<f64>,
}

impl Link {
    /// The documented default link classes: 25/100/400 Gb/s Ethernet-class (TCP; a single
    /// stream assumed to reach at most 25, 40 and 50 Gb/s) and NVLink-class (300 GB/s, no cap).
    pub fn defaults() -> Vec<Link> {
        let gbit = |g: f64| g * 1e9 / 8.0;
        vec![
            Link {
                name: "25 Gb/s".into(),
                alpha_s: 10e-6,
                bandwidth_bps: gbit(25.0),
                stream_cap_bps: None,
            },
            Link {
                name: "100 Gb/s".into(),
                alpha_s: 8e-6,
                bandwidth_bps: gbit(100.0),
                stream_cap_bps: Some(gbit(40.0)),
            },
            Link {
                name: "400 Gb/s".into(),
                alpha_s: 5e-6,
                bandwidth_bps: gbit(400.0),
                stream_cap_bps: Some(gbit(50.0)),
            },
            Link {
                name: "NVLink-class".into(),
                alpha_s: 2e-6,
                bandwidth_bps: 300e9,
                stream_cap_bps: None,
            },
        ]
    }
}

fn default_inline_bytes() -> u64 {
    Config::default().inline_bytes
}

/// Which schedule is modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Horovod's cycle loop: negotiation and execution on one thread.
    Horovod,
    /// Pipelined negotiation and K channels.
    FastHorovod,
}

/// A schedule's parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// The kind.
    pub kind: ScheduleKind,
    /// Data channels (1 for `horovod`).
    pub channels: usize,
    /// Loop period of `horovod`, seconds.
    pub cycle_s: f64,
    /// Fusion threshold, bytes.
    pub fusion_bytes: usize,
    /// Tensors larger than this are split into chunks across channels (`fasthorovod`).
    pub partition_bytes: usize,
    /// `fasthorovod`: back-pressure (the engine's pacing policy) forced on or off; `None`: as
    /// the preset ships (`auto`, by the rank count).
    #[serde(default)]
    pub back_pressure: Option<bool>,
    /// `fasthorovod`: a round planned as one group of at most this many bytes runs on the
    /// negotiation thread (the engine's `FH_INLINE_BYTES`; 0: never).
    #[serde(default = "default_inline_bytes")]
    pub inline_bytes: u64,
}

impl Schedule {
    /// The `horovod` preset: 1 ms cycle, one thread, 128 MiB fusion (Horovod 0.28's).
    pub fn horovod() -> Self {
        Schedule {
            kind: ScheduleKind::Horovod,
            channels: 1,
            cycle_s: 1e-3,
            fusion_bytes: 128 << 20,
            partition_bytes: usize::MAX,
            back_pressure: Some(false),
            inline_bytes: 0,
        }
    }

    /// The `fasthorovod` preset with `k` channels: 64 MiB fusion, 16 MiB partitions,
    /// back-pressure as shipped (`auto`).
    pub fn fasthorovod(k: usize) -> Self {
        Schedule {
            kind: ScheduleKind::FastHorovod,
            channels: k.max(1),
            cycle_s: 0.0,
            fusion_bytes: 64 << 20,
            partition_bytes: 16 << 20,
            back_pressure: None,
            inline_bytes: default_inline_bytes(),
        }
    }

    /// The same schedule with back-pressure forced on (`+bp`).
    pub fn with_back_pressure(mut self) -> Self {
        self.back_pressure = Some(true);
        self
    }

    /// The same schedule with back-pressure off (`-bp`).
    pub fn without_back_pressure(mut self) -> Self {
        self.back_pressure = Some(false);
        self
    }

    /// The engine configuration this schedule models: the model plans and paces through
    /// this configuration's [`Config::plan_options`] and [`Config::pacing`], as the engine does.
    pub fn config(&self) -> Config {
        let preset = match self.kind {
            ScheduleKind::Horovod => Preset::Horovod,
            ScheduleKind::FastHorovod => Preset::FastHorovod,
        };
        let c = Config::preset(preset)
            .channels(self.channels.max(1))
            .fusion_threshold(self.fusion_bytes as u64)
            .partition_bytes((self.partition_bytes as u64).max(1));
        c.backpressure(self.back_pressure)
            .inline_bytes(self.inline_bytes)
    }

    /// `horovod`, `fasthorovod K=k` (as shipped), `fasthorovod K=k +bp` or `… -bp`
    /// (back-pressure forced on or off); the replay's labels.
    pub fn label(&self) -> String {
        let k = self.channels;
        match (self.kind, self.back_pressure) {
            (ScheduleKind::Horovod, _) => "horovod".into(),
            (ScheduleKind::FastHorovod, None) => format!("fasthorovod K={k}"),
            (ScheduleKind::FastHorovod, Some(true)) => format!("fasthorovod K={k} +bp"),
            (ScheduleKind::FastHorovod, Some(false)) => format!("fasthorovod K={k} -bp"),
        }
    }
}

/// Software costs, seconds (calibrated from measurements when available).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Overheads {
    /// Per negotiation round, besides the network latency.
    pub round_s: f64,
    /// Per collective (launch, bookkeeping), besides the network costs and the copies.
    pub per_collective_s: f64,
    /// Host memory rate of a channel's copies, bytes per second: packing a fused group of
    /// several parts into the fusion buffer and unpacking it with the average's scaling (two
    /// passes), or scaling a tensor reduced in place (one pass), on the channel before and
    /// after its transfer; `None`: free.
    #[serde(default)]
    pub copy_bps: Option<f64>,
}

impl Default for Overheads {
    /// Documented defaults: 30 µs per round, 20 µs per collective, copies free.
    fn default() -> Self {
        Overheads {
            round_s: 30e-6,
            per_collective_s: 20e-6,
            copy_bps: None,
        }
    }
}

impl Overheads {
    /// Seconds of host copying a group of `bytes` in `parts` parts costs on its channel.
    pub fn copy_s(&self, bytes: usize, parts: usize) -> f64 {
        match self.copy_bps {
            Some(r) if r > 0.0 => {
                // Several parts: pack, and unpack with the average's scaling (two passes); a
                // single tensor or chunk is reduced in place and scaled (one pass).
                let passes = if parts > 1 { 2.0 } else { 1.0 };
                passes * bytes as f64 / r
            }
            _ => 0.0,
        }
    }
}

/// Time of one ring allreduce of `bytes` on `p` ranks without contention:
/// `2(p−1)·α + 2(p−1)/p · bytes · β` (0 for one rank). The reference formula the simulator's
/// uncontended transfers must reproduce (checked in the tests).
#[cfg_attr(not(test), allow(dead_code))]
pub fn ring_allreduce_time(bytes: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let pf = p as f64;
    2.0 * (pf - 1.0) * alpha + 2.0 * (pf - 1.0) / pf * bytes * beta
}

/// Message steps of fh-transport's recursive doubling on `p > 1` ranks: `⌊log₂ p⌋`, plus two
/// when `p` is not a power of two (the extra ranks fold in and out).
fn rd_steps(p: usize) -> f64 {
    (p as f64).log2().floor() + if p.is_power_of_two() { 0.0 } else { 2.0 }
}

/// Cost of one negotiation round on `p` ranks.
pub fn round_time(p: usize, link: &Link, o: &Overheads) -> f64 {
    let steps = if p <= 1 {
        0.0
    } else {
        (p as f64).log2().ceil()
    };
    o.round_s + steps * link.alpha_s
}

/// A simulated step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    /// Seconds from backward start to the last gradient reduced.
    pub step_s: f64,
    /// Negotiation rounds.
    pub rounds: usize,
    /// Fused collectives executed.
    pub collectives: usize,
}

struct Transfer {
    latency_end: f64,
    remaining: f64,
    /// The group's payload bytes (queued until the transfer ends, as the engine counts).
    bytes: usize,
}

/// What the replay submits: f32 gradients averaged over the ranks.
const GRADIENT_KEY: FusionKey = FusionKey {
    kind: CollectiveKind::Allreduce,
    dtype: DType::F32,
    op: ReduceOp::Average,
    device: Device::Cpu,
    prescale: 0x3FF0_0000_0000_0000, // 1.0
    postscale: 0x3FF0_0000_0000_0000,
};

/// The engine's planner (fh-core's [`plan_round_on`], with the options the engine derives from
/// its configuration and the channel load carried from round to round), driven by the model.
#[derive(Debug, Clone)]
pub struct ModelPlanner {
    opts: PlanOptions,
    load: ChannelLoad,
}

impl ModelPlanner {
    /// The planner of `sched`'s engine configuration, before the first round.
    pub fn new(sched: &Schedule) -> Self {
        let opts = sched.config().plan_options();
        ModelPlanner {
            load: ChannelLoad::new(opts.channels),
            opts,
        }
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.opts.channels.max(1)
    }

    /// Plan one negotiated round of f32 gradients of `sizes` bytes, in ready order, with the
    /// channels of `idle` idle everywhere when the round started (bit `c` = channel `c`).
    pub fn round(&mut self, sizes: &[u64], idle: u64) -> Vec<Group> {
        let items: Vec<PlanItem> = sizes
            .iter()
            .map(|&bytes| PlanItem {
                key: GRADIENT_KEY,
                bytes,
                elem: 4,
                priority: 0,
                group: None,
            })
            .collect();
        plan_round_on(&items, &self.opts, &mut self.load, idle)
    }
}

/// Simulates one step of `sizes` (bytes, in release order) released at `ready` (seconds).
pub fn simulate_step(
    sizes: &[usize],
    ready: &[f64],
    p: usize,
    link: &Link,
    sched: &Schedule,
    o: &Overheads,
) -> StepModel {
    assert_eq!(sizes.len(), ready.len(), "one ready time per tensor");
    let mut planner = ModelPlanner::new(sched);
    let pacing: Pacing = sched.config().pacing(p);
    let inline_bytes = match sched.kind {
        ScheduleKind::FastHorovod => sched.config().inline_bytes,
        ScheduleKind::Horovod => 0, // its loop runs every group itself anyway
    };
    // The one-byte agreement before a group runs on the negotiation thread: a recursive-doubling
    // allreduce on the negotiation communicator.
    let agreement = if p <= 1 {
        0.0
    } else {
        rd_steps(p) * link.alpha_s
    };
    let mut inline_channel: Option<usize> = None; // negotiation runs this channel's group
    let k = planner.channels();
    let cap = link.stream_cap_bps.unwrap_or(f64::INFINITY);
    // Per group: (latency part, wire bytes) of the algorithm the transport picks for it.
    let cost = |m: usize| -> (f64, f64) {
        if p <= 1 {
            return (o.per_collective_s, 0.0);
        }
        let pf = p as f64;
        match AllreduceAlgorithm::Auto.resolve(m, m / 4, p) {
            AllreduceAlgorithm::Ring => (
                2.0 * (pf - 1.0) * link.alpha_s + o.per_collective_s,
                2.0 * (pf - 1.0) / pf * m as f64,
            ),
            _ => {
                let steps = rd_steps(p);
                (steps * link.alpha_s + o.per_collective_s, steps * m as f64)
            }
        }
    };
    let round = round_time(p, link, o);

    let mut now = 0.0f64;
    let mut next_tensor = 0usize; // next tensor to become ready
    let mut pending: Vec<usize> = Vec::new(); // ready, not yet negotiated
    let mut negotiating: Option<(f64, Vec<usize>, u64)> = None; // (end, tensors, idle channels)
                                                                // Per channel: queued groups as (bytes, seconds of host copies).
    let mut queues: Vec<std::collections::VecDeque<(usize, f64)>> = vec![Default::default(); k];
    let mut queued_bytes = vec![0usize; k];
    let mut active: Vec<Option<Transfer>> = (0..k).map(|_| None).collect();
    let mut loop_start = 0.0f64; // horovod: start of the current loop
    let mut in_loop = false; // horovod: a loop is negotiating or executing
    let mut next_tick = 0.0f64; // horovod: when the next loop may start (then every cycle)
    let cycle = sched.cycle_s.max(1e-12);
    let tick_at = |next_tick: f64, now: f64| {
        let j = ((now - next_tick) / cycle - 1e-9).ceil().max(0.0);
        next_tick + j * cycle
    };
    let mut rounds = 0;
    let mut collectives = 0;
    let mut wanted: Option<f64> = None; // fasthorovod: since when a round waits to start
    let mut done_tensors = 0usize; // tensors whose negotiation finished
    let mut last_completion = 0.0f64;
    let total = sizes.len();

    let mut guard = 0u64;
    loop {
        guard += 1;
        if guard > 50_000_000 {
            debug_assert!(false, "the simulation did not converge");
            break;
        }
        // Admit ready tensors.
        while next_tensor < total && ready[next_tensor] <= now + 1e-15 {
            pending.push(next_tensor);
            next_tensor += 1;
        }
        // Finish a negotiation round whose time has come.
        if let Some((end, _, _)) = &negotiating {
            if *end <= now + 1e-15 {
                let (_, tensors, idle) = negotiating.take().unwrap_or_default();
                done_tensors += tensors.len();
                let round: Vec<u64> = tensors.iter().map(|&t| sizes[t] as u64).collect();
                let groups = planner.round(&round, idle);
                // As the engine does: a round planned as one small group runs on the
                // negotiation thread when its channel is idle, after the one-byte agreement,
                // and the next round waits for it.
                if let ([g], true) = (
                    groups.as_slice(),
                    runs_inline(&groups, inline_bytes, |_| true),
                ) {
                    let (c, b) = (g.channel.min(k - 1), g.bytes() as usize);
                    if active[c].is_none() && queues[c].is_empty() {
                        collectives += 1;
                        let (latency, wire) = cost(b);
                        active[c] = Some(Transfer {
                            latency_end: now + agreement + latency + o.copy_s(b, g.parts.len()),
                            remaining: wire,
                            bytes: b,
                        });
                        inline_channel = Some(c);
                    }
                }
                if inline_channel.is_none() {
                    for g in groups {
                        let (c, b) = (g.channel.min(k - 1), g.bytes() as usize);
                        queues[c].push_back((b, o.copy_s(b, g.parts.len())));
                        queued_bytes[c] += b;
                    }
                }
            }
        }
        // Start transfers on idle channels.
        for c in 0..k {
            if active[c].is_none() {
                if let Some((g, copy)) = queues[c].pop_front() {
                    queued_bytes[c] -= g;
                    collectives += 1;
                    let (latency, wire) = cost(g);
                    active[c] = Some(Transfer {
                        latency_end: now + latency + copy,
                        remaining: wire,
                        bytes: g,
                    });
                }
            }
        }
        let channels_idle =
            active.iter().all(Option::is_none) && queues.iter().all(|q| q.is_empty());
        if in_loop && negotiating.is_none() && channels_idle {
            in_loop = false;
            next_tick = (loop_start + cycle).max(now);
        }
        // Start a negotiation round (not while the negotiation thread runs a group itself).
        if negotiating.is_none() && inline_channel.is_none() && !pending.is_empty() {
            let since = *wanted.get_or_insert(now);
            let may_start = match sched.kind {
                // The engine's pacing: defer while every channel holds unfinished work
                // (queued or in flight), at most the pacing bound.
                ScheduleKind::FastHorovod => {
                    let busy = (0..k)
                        .filter(|&c| active[c].is_some() || !queues[c].is_empty())
                        .count();
                    let unfinished = queued_bytes.iter().sum::<usize>()
                        + active.iter().flatten().map(|t| t.bytes).sum::<usize>();
                    let deferred = std::time::Duration::from_secs_f64((now - since).max(0.0));
                    !pacing.defer(busy, k, unfinished as u64, deferred)
                }
                ScheduleKind::Horovod => !in_loop && tick_at(next_tick, now) <= now + 1e-12,
            };
            if may_start {
                if sched.kind == ScheduleKind::Horovod {
                    loop_start = now;
                    in_loop = true;
                }
                rounds += 1;
                wanted = None;
                // As the engine does: the channels idle when the round starts are agreed in it.
                let idle = (0..k.min(64))
                    .filter(|&c| active[c].is_none() && queues[c].is_empty())
                    .fold(0u64, |m, c| m | 1 << c);
                // The horovod preset runs its groups on the negotiation thread: like the engine,
                // every rank first agrees that it can run them (one byte).
                let agree = match sched.kind {
                    ScheduleKind::Horovod => agreement,
                    ScheduleKind::FastHorovod => 0.0,
                };
                negotiating = Some((now + round + agree, std::mem::take(&mut pending), idle));
            }
        }
        if done_tensors == total && channels_idle && negotiating.is_none() {
            break;
        }
        // Next event.
        let in_bw = active
            .iter()
            .filter(|t| matches!(t, Some(t) if t.latency_end <= now + 1e-15))
            .count();
        let rate = if in_bw == 0 {
            0.0
        } else {
            (link.bandwidth_bps / in_bw as f64).min(cap)
        };
        let mut next = f64::INFINITY;
        if next_tensor < total {
            next = next.min(ready[next_tensor]);
        }
        if let Some((end, _, _)) = &negotiating {
            next = next.min(*end);
        }
        let mut finish = vec![f64::INFINITY; k];
        for (c, t) in active.iter().enumerate() {
            if let Some(t) = t {
                if t.latency_end > now + 1e-15 {
                    next = next.min(t.latency_end);
                } else if rate > 0.0 {
                    finish[c] = now + t.remaining / rate;
                    next = next.min(finish[c]);
                } else {
                    finish[c] = now; // nothing left to send
                    next = now;
                }
            }
        }
        if sched.kind == ScheduleKind::Horovod && !in_loop && !pending.is_empty() {
            next = next.min(tick_at(next_tick, now));
        }
        if let (Some(since), true) = (
            wanted,
            negotiating.is_none() && inline_channel.is_none() && !pending.is_empty(),
        ) {
            // A deferred round starts at the latest when the pacing bound runs out.
            let end = since + pacing.max_defer.as_secs_f64();
            if end > now {
                next = next.min(end);
            }
        }
        if !next.is_finite() {
            break; // nothing left that can happen
        }
        let dt = (next - now).max(0.0);
        // Progress the bandwidth parts; complete the transfers that finish now (decided by
        // their finish time, so that rounding cannot leave a sliver that never ends).
        for (c, slot) in active.iter_mut().enumerate() {
            if let Some(t) = slot {
                if finish[c] <= next + 1e-12 * next.abs().max(1e-9) {
                    *slot = None;
                    last_completion = next;
                    if inline_channel == Some(c) {
                        inline_channel = None;
                    }
                } else if t.latency_end <= now + 1e-15 {
                    t.remaining = (t.remaining - rate * dt).max(0.0);
                }
            }
        }
        now = next;
    }
    StepModel {
        step_s: last_completion.max(ready.last().copied().unwrap_or(0.0)),
        rounds,
        collectives,
    }
}

/// A workload's step under a schedule, link and rank count.
pub fn simulate_workload(
    w: &Workload,
    backward_s: f64,
    p: usize,
    link: &Link,
    sched: &Schedule,
    o: &Overheads,
) -> StepModel {
    let sizes: Vec<usize> = (0..w.tensors.len()).map(|i| w.bytes(i)).collect();
    let ready: Vec<f64> = w
        .deadlines(std::time::Duration::from_secs_f64(backward_s))
        .iter()
        .map(|d| d.as_secs_f64())
        .collect();
    simulate_step(&sizes, &ready, p, link, sched, o)
}

/// Scaling efficiency with a non-overlapped forward pass of half the backward.
pub fn efficiency(backward_s: f64, step_s: f64) -> f64 {
    let f = backward_s / 2.0;
    (f + backward_s) / (f + step_s)
}

/// α and bandwidth of a link fitted to measured allreduce times on `p` ranks, against
/// `t = 2(p−1)α + 2(p−1)/p·m·β`: β from the slope between the two largest sizes (the regime
/// fused groups live in), α from the smallest size less its bandwidth term; with fewer than two
/// sizes or a non-positive slope, `None`.
pub fn calibrate_link(name: &str, p: usize, points: &[(f64, f64)]) -> Option<Link> {
    if p < 2 {
        return None;
    }
    let mut pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|q| q.0.is_finite() && q.1.is_finite() && q.1 > 0.0)
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts.dedup_by(|a, b| a.0 == b.0);
    if pts.len() < 2 {
        return None;
    }
    let pf = p as f64;
    let (hi, lo) = (pts[pts.len() - 1], pts[pts.len() - 2]);
    let slope = (hi.1 - lo.1) / (hi.0 - lo.0);
    let beta = slope / (2.0 * (pf - 1.0) / pf);
    if beta <= 0.0 || !beta.is_finite() {
        return None;
    }
    let small = pts[0];
    let alpha = ((small.1 - slope * small.0) / (2.0 * (pf - 1.0))).max(1e-7);
    Some(Link {
        name: name.to_string(),
        alpha_s: alpha,
        bandwidth_bps: 1.0 / beta,
        stream_cap_bps: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
    }

    fn link(alpha: f64, bw: f64, cap: Option<f64>) -> Link {
        Link {
            name: "test".into(),
            alpha_s: alpha,
            bandwidth_bps: bw,
            stream_cap_bps: cap,
        }
    }

    const NO_OVERHEAD: Overheads = Overheads {
        round_s: 0.0,
        per_collective_s: 0.0,
        copy_bps: None,
    };

    #[test]
    fn ring_allreduce_by_hand() {
        // 2·3·10 µs + 1.5 · 1 MB · 1 ns = 60 µs + 1.5 ms.
        assert!(close(ring_allreduce_time(1e6, 4, 1e-5, 1e-9), 1.56e-3));
        assert!(close(ring_allreduce_time(1e6, 2, 1e-5, 1e-9), 2e-5 + 1e-3));
        assert_eq!(ring_allreduce_time(1e9, 1, 1.0, 1.0), 0.0);
        // 1024 ranks: 2·1023·5 µs + 2·1023/1024 · 100 MB / 50 GB/s.
        let t = ring_allreduce_time(100e6, 1024, 5e-6, 1.0 / 50e9);
        assert!(close(
            t,
            2.0 * 1023.0 * 5e-6 + 2.0 * 1023.0 / 1024.0 * 100e6 / 50e9
        ));
    }

    #[test]
    fn one_tensor_fasthorovod_by_hand() {
        // Ready at 10 ms; round = 30 µs + log2(4)·10 µs = 50 µs; collective = 20 µs + 60 µs
        // + 1.5 ms → step = 10 ms + 50 µs + 1.58 ms.
        let l = link(1e-5, 1e9, None);
        let o = Overheads::default();
        let m = simulate_step(&[1_000_000], &[0.010], 4, &l, &Schedule::fasthorovod(1), &o);
        assert!(close(m.step_s, 0.010 + 50e-6 + 20e-6 + 1.56e-3), "{m:?}");
        assert_eq!((m.rounds, m.collectives), (1, 1));
    }

    #[test]
    fn horovod_waits_for_its_cycle_and_its_own_execution() {
        let l = link(1e-5, 1e9, None);
        let coll = 1.56e-3;
        // Loops tick at 0, 1 ms, 2 ms, ... while idle: the tensor ready at 0.5 ms is negotiated
        // at 1 ms (round: log2(4)·α = 20 µs, then the one-byte can-run agreement, 20 µs), then
        // reduced.
        let h = Schedule::horovod();
        let m = simulate_step(&[1_000_000], &[0.0005], 4, &l, &h, &NO_OVERHEAD);
        assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
        // At 1.0 ms exactly it goes at once.
        let m = simulate_step(&[1_000_000], &[0.001], 4, &l, &h, &NO_OVERHEAD);
        assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
        // Two tensors: the second becomes ready while the first executes; it waits for the
        // loop to finish (execution) and for the next cycle tick 1 ms after the first start.
        let m = simulate_step(
            &[1_000_000, 1_000_000],
            &[0.0, 0.0002],
            4,
            &l,
            &h,
            &NO_OVERHEAD,
        );
        let first_end = 4e-5 + coll; // 1.6 ms > 1 ms cycle: the next loop starts at once
        assert!(close(m.step_s, first_end + 4e-5 + coll), "{m:?}");
        assert_eq!(m.rounds, 2);
        // With fasthorovod K=1 without back-pressure, the second round overlaps the first
        // collective; with it (the preset), the round waits for the channel to drain.
        let two = |s: &Schedule| {
            simulate_step(
                &[1_000_000, 1_000_000],
                &[0.0, 0.0002],
                4,
                &l,
                s,
                &NO_OVERHEAD,
            )
        };
        let m = two(&Schedule::fasthorovod(1).without_back_pressure());
        assert!(close(m.step_s, 2e-5 + coll + coll), "{m:?}");
        // As shipped, back-pressure is off on 4 ranks (auto: on from 64).
        assert_eq!(two(&Schedule::fasthorovod(1)), m);
        let m = two(&Schedule::fasthorovod(1).with_back_pressure());
        assert!(close(m.step_s, 2e-5 + coll + 2e-5 + coll), "{m:?}");
    }

    #[test]
    fn channels_share_bandwidth_and_overlap_latency() {
        // Two 1 MB tensors ready at 0, 2 ranks: one round of α = 10 µs, then per tensor a ring
        // (the transport's pick from 256 KiB up): 2α = 20 µs and 1 MB at 1 GB/s. K=1:
        // 10 + 1020 + 1020 µs. K=2: both latencies together, then 2 MB at 1 GB/s shared:
        // 10 + 20 µs + 2 ms.
        let l = link(1e-5, 1e9, None);
        let sizes = [1_000_000, 1_000_000];
        let mut s1 = Schedule::fasthorovod(1);
        s1.fusion_bytes = 1; // no fusion: one collective per tensor
        let mut s2 = s1.clone();
        s2.channels = 2;
        let m1 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s1, &NO_OVERHEAD);
        let m2 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s2, &NO_OVERHEAD);
        assert!(close(m1.step_s, 1e-5 + 2.0 * (2e-5 + 1e-3)), "{m1:?}");
        assert!(close(m2.step_s, 1e-5 + 2e-5 + 2e-3), "{m2:?}");
        // A stream cap of half the link: one channel reaches only 0.5 GB/s; two fill the link.
        let capped = link(1e-5, 1e9, Some(0.5e9));
        let m1 = simulate_step(&sizes, &[0.0, 0.0], 2, &capped, &s1, &NO_OVERHEAD);
        let m2 = simulate_step(&sizes, &[0.0, 0.0], 2, &capped, &s2, &NO_OVERHEAD);
        assert!(close(m1.step_s, 1e-5 + 2.0 * (2e-5 + 2e-3)), "{m1:?}");
        assert!(close(m2.step_s, 1e-5 + 2e-5 + 2e-3), "{m2:?}");
    }

    #[test]
    fn the_model_uses_the_transports_algorithm_choice() {
        // 200 KiB on 8 ranks: recursive doubling (below the ring threshold): 3 α + 3 × 200 KiB.
        // 256 KiB: ring: 14 α + 2·7/8 × 256 KiB.
        let l = link(1e-5, 1e9, None);
        let f = Schedule::fasthorovod(1);
        let small = 200 << 10;
        let m = simulate_step(&[small], &[0.0], 8, &l, &f, &NO_OVERHEAD);
        assert!(
            close(m.step_s, 3e-5 + 3e-5 + 3.0 * small as f64 / 1e9),
            "{m:?}"
        );
        let big = 256 << 10;
        let m = simulate_step(&[big], &[0.0], 8, &l, &f, &NO_OVERHEAD);
        assert!(
            close(m.step_s, 3e-5 + 14e-5 + 1.75 * big as f64 / 1e9),
            "{m:?}"
        );
        // A world that is not a power of two folds in and out: two more steps.
        let m = simulate_step(&[small], &[0.0], 6, &l, &f, &NO_OVERHEAD);
        assert!(
            close(m.step_s, 3e-5 + 4e-5 + 4.0 * small as f64 / 1e9),
            "{m:?}"
        );
    }

    #[test]
    fn small_messages_use_recursive_doubling_at_scale() {
        // 1 KB on 1024 ranks: ring latency 2·1023·α ≫ recursive doubling 10·(α + 1 KB·β).
        let l = link(1e-5, 1e9, None);
        let m = simulate_step(
            &[1000],
            &[0.0],
            1024,
            &l,
            &Schedule::fasthorovod(1),
            &NO_OVERHEAD,
        );
        // round: 10 α; a small group runs on the negotiation thread after a one-byte
        // agreement (10 α); collective: 10 α + 10 KB at 1 GB/s.
        assert!(
            close(
                m.step_s,
                10.0 * 1e-5 + 10.0 * 1e-5 + 10.0 * 1e-5 + 1e4 / 1e9
            ),
            "{m:?}"
        );
        // Without the inline path, no agreement.
        let mut s = Schedule::fasthorovod(1);
        s.inline_bytes = 0;
        let m = simulate_step(&[1000], &[0.0], 1024, &l, &s, &NO_OVERHEAD);
        assert!(
            close(m.step_s, 10.0 * 1e-5 + 10.0 * 1e-5 + 1e4 / 1e9),
            "{m:?}"
        );
    }

    #[test]
    fn host_copies_cost_packed_groups_two_passes_and_single_tensors_one() {
        // 1 GB/s copies: a fused group of two 500 kB tensors is packed, then unpacked and
        // scaled in one pass (2 passes of 1 MB: 2 ms) around its ring on 2 ranks (2α + 1 MB at
        // 1 GB/s); a single 1 MB tensor is reduced in place and only scaled (1 ms).
        let l = link(1e-5, 1e9, None);
        let o = Overheads {
            copy_bps: Some(1e9),
            ..NO_OVERHEAD
        };
        assert!(close(o.copy_s(1_000_000, 2), 2e-3));
        assert!(close(o.copy_s(1_000_000, 1), 1e-3));
        assert_eq!(NO_OVERHEAD.copy_s(1_000_000, 2), 0.0);
        let mut f = Schedule::fasthorovod(1);
        f.inline_bytes = 0;
        let m = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &f, &o);
        assert!(close(m.step_s, 1e-5 + 2e-3 + 2e-5 + 1e-3), "{m:?}");
        let m = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
        assert!(close(m.step_s, 1e-5 + 1e-3 + 2e-5 + 1e-3), "{m:?}");
    }

    #[test]
    fn a_group_run_on_the_negotiation_thread_holds_the_next_round() {
        // Two 1 KB tensors on 2 ranks, the second ready 1 µs after the first: the first round's
        // single small group runs inline (agreement α, then α + 1 KB), and the second round
        // starts only when it is done. Round = α each.
        let l = link(1e-5, 1e9, None);
        let s = Schedule::fasthorovod(2);
        let m = simulate_step(&[1000, 1000], &[0.0, 1e-6], 2, &l, &s, &NO_OVERHEAD);
        let one = 1e-5 + 1e-5 + (1e-5 + 1e3 / 1e9);
        assert!(close(m.step_s, 2.0 * one), "{m:?}");
        assert_eq!((m.rounds, m.collectives), (2, 2));
    }

    #[test]
    fn back_pressure_fuses_what_becomes_ready_meanwhile() {
        // K=1: the first tensor (5 MB) runs for ~5 ms; the 3 tensors ready meanwhile wait for
        // the busy channel and are negotiated in one round: 2 collectives in all, not 4.
        let l = link(1e-5, 1e9, None);
        let sizes = [5_000_000, 1000, 1000, 1000];
        let ready = [0.0, 1e-4, 2e-4, 3e-4];
        let bp = Schedule::fasthorovod(1).with_back_pressure();
        let m = simulate_step(&sizes, &ready, 2, &l, &bp, &NO_OVERHEAD);
        assert_eq!((m.rounds, m.collectives), (2, 2), "{m:?}");
        // Without back-pressure every small tensor gets its own round and collective.
        let off = Schedule::fasthorovod(1).without_back_pressure();
        let m = simulate_step(&sizes, &ready, 2, &l, &off, &NO_OVERHEAD);
        assert_eq!(m.collectives, 4, "{m:?}");
        // K=2: the second channel is idle, so nothing is deferred.
        let mut two = Schedule::fasthorovod(2).with_back_pressure();
        two.fusion_bytes = 1;
        let m = simulate_step(&sizes, &ready, 2, &l, &two, &NO_OVERHEAD);
        assert_eq!(m.rounds, 4, "{m:?}");
    }

    #[test]
    fn fusion_and_partition_through_the_engines_planner() {
        let bytes = |g: Vec<Group>| g.iter().map(Group::bytes).collect::<Vec<_>>();
        let f = Schedule::fasthorovod(4);
        // 40 MiB splits into 4 chunks of 10 MiB (16 MiB partitions would give 3; a multiple
        // of K), each its own group; small tensors around it fuse with each other.
        let mut p = ModelPlanner::new(&f);
        let g = p.round(&[1 << 20, 40 << 20, 1 << 20, 2 << 20], 0);
        assert_eq!(
            bytes(g.clone()),
            [1 << 20, 10 << 20, 10 << 20, 10 << 20, 10 << 20, 3 << 20]
        );
        // Every channel carries a chunk of the large tensor.
        let mut chans: Vec<usize> = g[1..5].iter().map(|g| g.channel).collect();
        chans.sort();
        assert_eq!(chans, [0, 1, 2, 3]);
        // 100 MiB: ceil(100/16) = 7 chunks, rounded up to 8.
        let g = ModelPlanner::new(&f).round(&[100 << 20], 0);
        assert_eq!(g.len(), 8);
        assert_eq!(g.iter().map(Group::bytes).sum::<u64>(), 100 << 20);
        let h = Schedule::horovod();
        assert_eq!(
            bytes(ModelPlanner::new(&h).round(&[40 << 20, 1 << 20], 0)),
            [41 << 20]
        );
        assert_eq!(
            bytes(ModelPlanner::new(&h).round(&[40 << 20; 4], 0)),
            [120 << 20, 40 << 20]
        );
    }

    /// The model and the engine form the same groups on the same channels for the same
    /// arrival sequence: the engine's rounds (as it logged them) replayed through the model's
    /// planner give the engine's groups, parts and channels, load carried across rounds.
    #[test]
    fn model_and_engine_plan_the_same_groups_and_channels() {
        use fh_scheduler::{AllreduceOptions, Engine, Tensor};
        use fh_transport::local::LocalWorld;
        use std::collections::HashMap;
        use std::time::Duration;

        let mut sched = Schedule::fasthorovod(4);
        sched.fusion_bytes = 16 << 10;
        sched.partition_bytes = 4 << 10;
        // Batches of f32 gradients (element counts); each batch is submitted at once and
        // waited for before the next.
        let batches: Vec<Vec<usize>> = vec![
            vec![10, 3000, 7, 500, 500],
            vec![1],
            vec![2500, 2500, 9, 4000, 1, 1, 1],
            vec![64; 12],
            vec![5000, 3, 1000],
        ];
        let cfg = sched.config().record_groups(true);
        let threads: Vec<_> = LocalWorld::with_timeout(2, Duration::from_secs(30))
            .into_iter()
            .map(|t| {
                let (cfg, batches) = (cfg.clone(), batches.clone());
                std::thread::spawn(move || {
                    let e = Engine::start(Box::new(t), cfg).unwrap();
                    for (b, batch) in batches.iter().enumerate() {
                        let hs: Vec<_> = batch
                            .iter()
                            .enumerate()
                            .map(|(i, &n)| {
                                e.allreduce(
                                    &format!("b{b}.t{i}"),
                                    Tensor::from_slice(&vec![1.0f32; n]),
                                    AllreduceOptions::default(),
                                )
                                .unwrap()
                            })
                            .collect();
                        for mut h in hs {
                            h.wait_timeout(Duration::from_secs(30)).unwrap();
                        }
                    }
                    let log = e.group_log();
                    e.shutdown().unwrap();
                    log
                })
            })
            .collect();
        let logs: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(logs[0], logs[1]);
        let log = &logs[0];
        let size: HashMap<String, u64> = batches
            .iter()
            .enumerate()
            .flat_map(|(b, batch)| {
                batch
                    .iter()
                    .enumerate()
                    .map(move |(i, &n)| (format!("b{b}.t{i}"), n as u64 * 4))
            })
            .collect();
        // The engine's rounds: tensors in planner-input order (first appearance), by round.
        // The engine's rounds: tensors in planner-input order (first appearance), by round, with
        // the channels that round agreed were idle.
        let mut rounds: Vec<(u64, u64, Vec<String>)> = Vec::new();
        for g in log {
            if rounds.last().map(|r| r.0) != Some(g.round) {
                rounds.push((g.round, g.idle_channels, Vec::new()));
            }
            let names = &mut rounds.last_mut().unwrap().2;
            for (name, _, _) in &g.parts {
                if !names.contains(name) {
                    names.push(name.clone());
                }
            }
        }
        let mut model = ModelPlanner::new(&sched);
        let mut planned = Vec::new();
        for (round, idle, names) in &rounds {
            let sizes: Vec<u64> = names.iter().map(|n| size[n]).collect();
            for g in model.round(&sizes, *idle) {
                planned.push(fh_scheduler::GroupRecord {
                    round: *round,
                    idle_channels: *idle,
                    channel: g.channel,
                    parts: g
                        .parts
                        .iter()
                        .map(|p| (names[p.item].clone(), p.offset, p.len))
                        .collect(),
                });
            }
        }
        assert_eq!(&planned, log);
        // The sequence exercised chunking and several channels.
        assert!(log.iter().any(|g| g.parts[0].1 > 0));
        assert!(log.iter().any(|g| g.channel == 3));
    }

    #[test]
    fn calibration_recovers_alpha_and_beta() {
        let (alpha, beta, p) = (20e-6, 1.0 / 2e9, 4usize);
        let points: Vec<(f64, f64)> = [1e3, 1e5, 1e6, 1e7, 6e7]
            .iter()
            .map(|&m| (m, ring_allreduce_time(m, p, alpha, beta)))
            .collect();
        let l = calibrate_link("loopback", p, &points).unwrap();
        assert!(close(l.alpha_s, alpha), "{l:?}");
        assert!(close(l.bandwidth_bps, 2e9), "{l:?}");
        assert!(calibrate_link("x", p, &points[..1]).is_none());
        // Noisy large sizes must not swamp α: 10 % error on the largest point only.
        let mut noisy = points.clone();
        noisy[4].1 *= 1.1;
        let l = calibrate_link("loopback", p, &noisy).unwrap();
        assert!((l.alpha_s - alpha).abs() < 0.1 * alpha, "{l:?}");
    }

    #[test]
    fn efficiency_definition() {
        assert_eq!(efficiency(0.1, 0.1), 1.0);
        assert!(close(efficiency(0.1, 0.2), 0.15 / 0.25));
    }
}
