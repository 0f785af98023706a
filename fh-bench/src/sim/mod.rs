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
//!   rarely fills a fast link; NVLink-class links have no such cap). Together they move the
//!   link's bandwidth times its measured concurrency factor ([`Link::aggregate_factor`]: 1 for
//!   the link classes; on a loopback check, what K allreduces at once measured against one, at
//!   the sizes measured, taken at the mean size of the allreduces in flight: a fused group
//!   staged on one host runs stage-sized pieces, so its pieces' size counts).
//! - **Per-flow cap** (a cloud's TCP, [`Link::flows`]): one allreduce reaches at most
//!   `lanes × stripes` flows of the one-stream rate, never more than the link
//!   ([`Link::transfer_cap`]): stripes = the runtime's S where the frames the transport sends
//!   (the ring's pieces of a block, recursive doubling's whole vector) reach its striping
//!   threshold, else 1; lanes = the connections an allreduce drives across the link at once
//!   (hierarchical allreduce: one per rank of a host). Transfers held below their share by
//!   their cap leave the rest to the others (max-min fair).
//! - **Work within a host** ([`Link::local_passes`]): hierarchical allreduce's shared-memory
//!   reduce-scatter and allgather, charged as passes over the group at the copy rate, one after
//!   another with its transfer.
//! - **Negotiation round.** Costs `r + ⌈log₂ p⌉·α` (a small recursive-doubling allreduce of
//!   the bit vector plus the software overhead `r`).
//! - **`horovod`** (one background thread): a loop that starts at most every `cycle` seconds,
//!   negotiates the tensors ready at its start, then executes the fused groups one after
//!   another itself; tensors that become ready meanwhile wait for the next loop.
//! - **`fasthorovod` K**: negotiation wakes when a tensor is ready and never waits for
//!   execution, as implemented; with back-pressure (as shipped, `auto`: on over a network
//!   stack ([`Link::wire`]) and from 64 ranks; `+bp` rows force it on, `-bp` rows off) a rank defers its next round while every channel
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
//!   rate on the channel, before and after its transfer ([`Overheads::copy_bps`]); where the
//!   engine stages fused groups through a cache-sized piece (one host), at the staged rate
//!   measured for that pattern ([`Overheads::staged_copy_bps`]). Over a transport that
//!   reduces slices where they lie ([`Link::vectored_io`]: TCP, shared memory) `fasthorovod`
//!   reduces a fused group where its tensors lie, as the engine decides it
//!   ([`fh_scheduler::Config::fused_in_place`]):
//!   a group on the ring, fused or not, costs only the ring's finishing pass over this rank's
//!   block ([`Overheads::in_place_copy_s`]). In the projections each
//!   channel copies on a core of its own. In the loopback check every rank shares one small
//!   host ([`Overheads::shared_host`]): the copies in flight on a rank's channels share its copy
//!   rate, and where the link's transfers are themselves the host's memory copies (shared
//!   memory, threads: [`Link::host_bound`]) transfers and copies in flight share the host
//!   equally, times the link's measured concurrency factor. (Measured: replaying BERT-base over
//!   shared memory at np 4 on 2 cores, K = 4 moved 16 % fewer bytes per busy second than K = 1;
//!   without this sharing the model gave K = 4 a step a third shorter than K = 1's.)
//!
//! Step time = time the last group completes; exposed communication = step − B; scaling
//! efficiency = (F + B) / (F + step) with a forward pass F = B/2 that is not overlapped.

use fh_core::fusion::{runs_inline, Pacing};
use fh_transport::algorithms::AllreduceAlgorithm;

use crate::workload::Workload;

mod calibrate;
mod params;
mod planner;
#[cfg(test)]
mod tests;

pub use calibrate::calibrate_link;
pub use params::{round_time, Concurrency, Flows, Link, Overheads, Schedule, ScheduleKind};
pub use planner::ModelPlanner;

/// Message steps of fh-transport's recursive doubling on `p > 1` ranks: `⌊log₂ p⌋`, plus two
/// when `p` is not a power of two (the extra ranks fold in and out).
fn rd_steps(p: usize) -> f64 {
    (p as f64).log2().floor() + if p.is_power_of_two() { 0.0 } else { 2.0 }
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

/// A group on its channel: host copies, then the latency part, then the bandwidth part.
struct Transfer {
    /// Host copying left, in seconds at the full copy rate (packing and unpacking, charged
    /// before the wire).
    copy_left: f64,
    /// The latency part, charged once the copies are done.
    latency: f64,
    /// When the latency part ends; `None` while copying.
    latency_end: Option<f64>,
    /// Wire bytes left.
    remaining: f64,
    /// The group's payload bytes (queued until the transfer ends, as the engine counts).
    bytes: usize,
    /// Bytes of each allreduce the group actually runs: the stage piece for a staged fused
    /// group, else the group (what the concurrency factor is looked up by).
    unit: usize,
    /// A staged fused group (its pieces packed, reduced and unpacked one after another).
    staged: bool,
    /// Most this transfer moves alone, bytes per second ([`Link::transfer_cap`]).
    cap: f64,
}

impl Transfer {
    fn new(
        now: f64,
        copy_s: f64,
        latency: f64,
        wire: f64,
        bytes: usize,
        (unit, staged): (usize, bool),
    ) -> Self {
        Transfer {
            copy_left: copy_s,
            latency,
            latency_end: (copy_s <= 0.0).then_some(now + latency),
            remaining: wire,
            bytes,
            unit,
            staged,
            cap: f64::INFINITY,
        }
    }

    fn capped(mut self, cap: f64) -> Self {
        self.cap = cap;
        self
    }

    fn copying(&self) -> bool {
        self.latency_end.is_none()
    }

    fn on_wire(&self, now: f64) -> bool {
        matches!(self.latency_end, Some(e) if e <= now + 1e-15)
    }
}

/// A group queued on its channel: (bytes, seconds of host copies, (bytes of each allreduce it
/// runs, whether it is staged), seconds of agreement before it).
type Queued = (usize, f64, (usize, bool), f64);

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
    let pacing: Pacing = sched.config().pacing(p, link.wire);
    let inline_bytes = match sched.kind {
        ScheduleKind::FastHorovod => sched.config().inline_bytes,
        ScheduleKind::Horovod => 0, // its loop runs every group itself anyway
    };
    // The agreement that every rank can run a round's groups before they run on the
    // negotiation thread. As the engine does it: a round that is one allreduce group small
    // enough for recursive doubling, over channels that carry the flag in that allreduce's own
    // messages ([`Link::agrees_in_band`]: TCP), costs nothing more; otherwise a one-byte
    // recursive-doubling allreduce on the negotiation communicator comes first.
    let agreement = if p <= 1 {
        0.0
    } else {
        rd_steps(p) * link.alpha_s
    };
    let agreement_for = |groups: &[fh_core::fusion::Group]| match groups {
        [g] if (g.bytes() as usize) < fh_transport::algorithms::ALLREDUCE_RING_THRESHOLD_BYTES
            && link.agrees_in_band =>
        {
            0.0
        }
        _ => agreement,
    };
    let mut inline_channel: Option<usize> = None; // negotiation runs this channel's group
                                                  // Whether fused groups are staged, as the engine decides it on one host (the model is on
                                                  // one host where a staged copy rate is given: the loopback check).
    let staged = o.staged_copy_bps.is_some() && sched.config().effective_stage_bytes(1) > 0;
    // As the engine decides it: over a scatter-gather transport, groups on the ring reduced in
    // place and finished on the own block only.
    let in_place = sched.config().fused_in_place(link.vectored_io);
    // The allreduces a group runs: a staged fused group runs its stage-sized pieces one after
    // another (the engine's `run_fused`), the in-place or whole ones run the group.
    let stage = if staged {
        sched.config().effective_stage_bytes(1) as usize
    } else {
        0
    };
    // (bytes of each allreduce the group runs, whether it is a staged fused group).
    let unit_of = |b: usize, parts: usize| {
        let whole = in_place && o.in_place_copy_s(b, p).is_some();
        if parts > 1 && stage > 0 && !whole {
            (b.min(stage), true)
        } else {
            (b, false)
        }
    };
    // The transport's own passes within a host (hierarchical allreduce), on the channel too.
    // Pipelined (`Link::local_chunk`), one chunk's passes are exposed, the rest overlap the
    // transfer.
    let local_s = |b: usize| match o.copy_bps {
        Some(r) if r > 0.0 && link.local_passes > 0.0 => {
            let exposed = link.local_chunk.map_or(b, |c| b.min(c.max(1)));
            link.local_passes * exposed as f64 / r
        }
        _ => 0.0,
    };
    let group_copy = |b: usize, parts: usize| {
        local_s(b)
            + match in_place.then(|| o.in_place_copy_s(b, p)) {
                Some(Some(s)) => s,
                _ => o.copy_s(b, parts, staged),
            }
    };
    let k = planner.channels();
    let cap = |b: usize| link.transfer_cap(b, p);
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
    let mut queues: Vec<std::collections::VecDeque<Queued>> = vec![Default::default(); k];
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
                        let copy = group_copy(b, g.parts.len());
                        let unit = unit_of(b, g.parts.len());
                        let agree = agreement_for(&groups);
                        active[c] = Some(
                            Transfer::new(now, copy, agree + latency, wire, b, unit).capped(cap(b)),
                        );
                        inline_channel = Some(c);
                    }
                }
                if inline_channel.is_none() {
                    // The horovod preset runs its groups on the negotiation thread: the
                    // agreement comes before the first.
                    let mut agree = match sched.kind {
                        ScheduleKind::Horovod => agreement_for(&groups),
                        ScheduleKind::FastHorovod => 0.0,
                    };
                    for g in groups {
                        let (c, b) = (g.channel.min(k - 1), g.bytes() as usize);
                        let (copy, unit) =
                            (group_copy(b, g.parts.len()), unit_of(b, g.parts.len()));
                        queues[c].push_back((b, copy, unit, std::mem::take(&mut agree)));
                        queued_bytes[c] += b;
                    }
                }
            }
        }
        // Start transfers on idle channels.
        for c in 0..k {
            if active[c].is_none() {
                if let Some((g, copy, unit, agree)) = queues[c].pop_front() {
                    queued_bytes[c] -= g;
                    collectives += 1;
                    let (latency, wire) = cost(g);
                    active[c] = Some(
                        Transfer::new(now, copy, agree + latency, wire, g, unit).capped(cap(g)),
                    );
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
                // (The horovod preset's agreement comes with its groups, once planned.)
                negotiating = Some((now + round, std::mem::take(&mut pending), idle));
            }
        }
        if done_tensors == total && channels_idle && negotiating.is_none() {
            break;
        }
        // Next event. Rates now: the bandwidth parts in flight share the link; copies run at
        // the full copy rate, or where the ranks share a host, share it (with the transfers
        // too, on a link whose transfers are the host's own copies).
        // The concurrency factor is the one measured at the mean size of the allreduces the
        // groups sharing run (a staged group runs stage-sized pieces); staged groups on a host
        // whose transfers are its own copies count at the factor measured for staged groups
        // in flight at once, where it was measured (their copies and hand-offs between pieces
        // share the cores too).
        let host_shared = o.shared_host && link.host_bound;
        let sharing = |t: &&Transfer| t.on_wire(now) || (host_shared && t.copying());
        let by_staged = link.host_bound && !link.staged_concurrency.is_empty();
        let (n_sharing, n_staged, plain_bytes) = active.iter().flatten().filter(sharing).fold(
            (0usize, 0usize, 0usize),
            |(n, s, b), t| match t.staged && by_staged {
                true => (n + 1, s + 1, b),
                false => (n + 1, s, b + t.unit),
            },
        );
        let n_plain = n_sharing - n_staged;
        let plain = link.aggregate_factor(n_sharing, plain_bytes / n_plain.max(1));
        let factor = match link.staged_factor(n_sharing) {
            Some(f) if n_staged > 0 && by_staged => {
                (f * n_staged as f64 + plain * n_plain as f64) / n_sharing as f64
            }
            _ => plain,
        };
        // Each transfer sharing gets its share of the factor (only those on the wire use their
        // rate); one held below its share by its cap ([`Link::transfer_cap`]: a per-flow cap)
        // leaves the rest to the others (max-min fair).
        let share = factor / n_sharing.max(1) as f64;
        let rates = fair_rates(
            &active
                .iter()
                .map(|t| t.as_ref().filter(|t| t.on_wire(now)).map(|t| t.cap))
                .collect::<Vec<_>>(),
            link.bandwidth_bps * share,
        );
        let copy_speed = if host_shared {
            share
        } else if o.shared_host {
            1.0 / active
                .iter()
                .flatten()
                .filter(|t| t.copying())
                .count()
                .max(1) as f64
        } else {
            1.0
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
                match t.latency_end {
                    None => {
                        finish[c] = now + t.copy_left / copy_speed;
                        next = next.min(finish[c]);
                    }
                    Some(e) if e > now + 1e-15 => next = next.min(e),
                    Some(_) if rates[c] > 0.0 => {
                        finish[c] = now + t.remaining / rates[c];
                        next = next.min(finish[c]);
                    }
                    Some(_) => {
                        finish[c] = now; // nothing left to send
                        next = now;
                    }
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
                let ends = finish[c] <= next + 1e-12 * next.abs().max(1e-9);
                if t.copying() {
                    if ends {
                        t.copy_left = 0.0;
                        t.latency_end = Some(next + t.latency);
                    } else {
                        t.copy_left = (t.copy_left - copy_speed * dt).max(0.0);
                    }
                } else if ends {
                    *slot = None;
                    last_completion = next;
                    if inline_channel == Some(c) {
                        inline_channel = None;
                    }
                } else if t.on_wire(now) {
                    t.remaining = (t.remaining - rates[c] * dt).max(0.0);
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

/// Max-min fair rates of the transfers on the wire (`caps[c]`: `Some(cap)` for channel `c`'s
/// transfer on the wire, `None` for none), each of `n` entitled to `per_transfer` (the link's
/// rate shared `n` ways) and at most its cap; what a capped one leaves goes to the others.
pub(crate) fn fair_rates(caps: &[Option<f64>], per_transfer: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..caps.len()).filter(|&c| caps[c].is_some()).collect();
    order.sort_by(|&a, &b| caps[a].unwrap_or(0.0).total_cmp(&caps[b].unwrap_or(0.0)));
    let mut left = per_transfer * order.len() as f64;
    let mut rates = vec![0.0; caps.len()];
    for (i, &c) in order.iter().enumerate() {
        let fair = left / (order.len() - i) as f64;
        rates[c] = caps[c].unwrap_or(0.0).min(fair).max(0.0);
        left -= rates[c];
    }
    rates
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
