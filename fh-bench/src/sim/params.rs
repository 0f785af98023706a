//! What the model is given: link classes (α–β), the schedules compared (each one an engine
//! configuration), and the software costs.

use fh_scheduler::{Config, Preset, Wire};
use serde::{Deserialize, Serialize};

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
    /// Measured aggregate bandwidth of transfers in flight at once ÷ that of one alone, by
    /// transfer size and count (on a loopback check the ranks' channels share a few cores, so
    /// more streams may move less, and small ones lose most); empty: the link is shared without
    /// loss.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        rename = "concurrency_by_size"
    )]
    pub concurrency: Vec<Concurrency>,
    /// Measured aggregate bandwidth of staged fused groups in flight at once (each packed,
    /// reduced and unpacked a stage piece at a time, as the engine runs them on one host) ÷
    /// that of one alone, by count; empty: staged groups share by [`Link::concurrency`]. Only
    /// on a [`Link::host_bound`] link, whose transfers and copies share the host alike.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        rename = "staged_concurrency"
    )]
    pub staged_concurrency: Vec<Concurrency>,
    /// The link's transfers are memory copies by the ranks' own cores (a loopback check: shared
    /// memory, threads, the kernel's loopback): where the ranks' copies share the host
    /// ([`Overheads::shared_host`]), transfers and copies in progress share it together.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub host_bound: bool,
    /// How the engine sees the link when it picks its `auto` defaults (back-pressure,
    /// [`Config::backpressure_on`]): a network stack (the Ethernet classes, TCP loopback) or
    /// one host's memory (shared memory, threads, NVLink-class).
    #[serde(default = "network")]
    pub wire: Wire,
    /// The transport reduces slices where they lie (`Communicator::segments_in_place`: TCP's
    /// scatter-gather I/O — the Ethernet classes and TCP loopback — and shared memory), so
    /// `fasthorovod` reduces fused groups where their tensors lie, without packing and
    /// unpacking ([`Config::fused_in_place`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vectored_io: bool,
    /// The channels carry the flag that every rank can run a small allreduce group inside
    /// that allreduce's own messages (TCP's point-to-point allreduce,
    /// `Communicator::agrees_in_band`): a round of one small group run on the negotiation
    /// thread takes no one-byte agreement step of its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub agrees_in_band: bool,
    /// A cloud's per-flow cap and the TCP connections a transfer drives across it (`None`:
    /// one transfer reaches the link's rate, or [`Link::stream_cap_bps`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flows: Option<Flows>,
    /// Passes over a group's bytes at the host's copy rate ([`Overheads::copy_bps`]) that the
    /// transport's work within a host adds to each allreduce, one after another with its
    /// transfer across hosts (hierarchical allreduce: the shared-memory reduce-scatter and
    /// allgather); 0: none (a flat ring, or within-host work taken as free).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_passes: f64,
    /// The transport pipelines that work with the transfer in chunks of this many bytes
    /// (hierarchical allreduce, `FH_HIER_PIPELINE`): only one chunk's passes stay outside the
    /// transfer, the rest overlap it. `None`: one after another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_chunk: Option<usize>,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// How a transfer's bytes cross a link whose every TCP connection is capped (a cloud's
/// per-flow cap): each of `lanes` connections to a peer on another host, its frames of at
/// least `stripe_min` bytes striped over `streams` parallel streams (fh-transport's
/// [`fh_transport::backend::tcp::streams`]), each stream at most `flow_bps`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Flows {
    /// Most one TCP connection moves, bytes per second (the probe's one-stream rate).
    pub flow_bps: f64,
    /// Streams each large frame is striped over (the runtime's S; 1: none).
    pub streams: usize,
    /// Peer connections a transfer drives across the link at once (hierarchical allreduce:
    /// one per lane, i.e. per rank of a host; a flat ring: one).
    pub lanes: usize,
    /// Smallest frame striped, bytes (the transport's `FH_TCP_STRIPE_MIN`).
    pub stripe_min: usize,
}

impl Flows {
    /// Most one transfer moves across a link of `link_bps` when its largest frame is `frame`
    /// bytes: `lanes × stripes` flows of `flow_bps` each, stripes = `streams` for frames of at
    /// least `stripe_min` bytes (else 1), never more than the link.
    pub fn transfer_cap(&self, frame: usize, link_bps: f64) -> f64 {
        let stripes = if self.streams > 1 && frame >= self.stripe_min.max(2) {
            self.streams.min(frame)
        } else {
            1
        };
        let flows = (self.lanes.max(1) * stripes) as f64;
        (flows * self.flow_bps).min(link_bps)
    }
}

fn network() -> Wire {
    Wire::Network
}

/// One measured concurrency factor: `streams` transfers of `bytes` each in flight at once move
/// `factor` times what one moves alone.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Concurrency {
    /// Bytes of each transfer.
    pub bytes: usize,
    /// Transfers in flight at once (2 or more).
    pub streams: usize,
    /// Their aggregate bandwidth ÷ that of one alone.
    pub factor: f64,
}

impl Link {
    /// Aggregate bandwidth of `n` transfers of about `bytes` each in flight ÷ that of one: 1 for
    /// one transfer or an unmeasured link. Per measured size, linear in `n` between measured
    /// counts (from 1 with 1 up to the first) and the last one's beyond them; between measured
    /// sizes linear in log(size), beyond them the nearest size's.
    pub fn aggregate_factor(&self, n: usize, bytes: usize) -> f64 {
        if n <= 1 || self.concurrency.is_empty() {
            return 1.0;
        }
        let mut sizes: Vec<usize> = self.concurrency.iter().map(|c| c.bytes).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let at = |size: usize| -> f64 {
            let mut pts: Vec<(usize, f64)> = self
                .concurrency
                .iter()
                .filter(|c| c.bytes == size && c.streams >= 2)
                .map(|c| (c.streams, c.factor))
                .collect();
            pts.sort_by_key(|p| p.0);
            by_count(&pts, n)
        };
        let lo = sizes.iter().rev().find(|&&s| s <= bytes).copied();
        let hi = sizes.iter().find(|&&s| s >= bytes).copied();
        match (lo, hi) {
            (Some(a), Some(b)) if a < b => {
                let t =
                    ((bytes as f64).ln() - (a as f64).ln()) / ((b as f64).ln() - (a as f64).ln());
                at(a) + (at(b) - at(a)) * t
            }
            (Some(a), _) => at(a),
            (None, Some(b)) => at(b),
            (None, None) => 1.0,
        }
    }

    /// Most one allreduce of `bytes` on `p` ranks moves across this link, bytes per second:
    /// [`Link::stream_cap_bps`] (or the link's rate), and under a per-flow cap ([`Link::flows`])
    /// what its connections reach with the frames the transport sends: each lane's share, the
    /// ring's pieces of at most [`fh_transport::algorithms::RING_CHUNK_BYTES`] of a block of
    /// `1/p` of it, recursive doubling's whole share.
    pub fn transfer_cap(&self, bytes: usize, p: usize) -> f64 {
        use fh_transport::algorithms::{AllreduceAlgorithm, RING_CHUNK_BYTES};
        let cap = self.stream_cap_bps.unwrap_or(f64::INFINITY);
        let Some(f) = &self.flows else {
            return cap;
        };
        let p = p.max(1);
        let lane = bytes / f.lanes.max(1);
        let frame = match AllreduceAlgorithm::Auto.resolve(lane, lane / 4, p) {
            AllreduceAlgorithm::Ring => lane.div_ceil(p).min(RING_CHUNK_BYTES),
            _ => lane,
        };
        f.transfer_cap(frame, self.bandwidth_bps).min(cap)
    }

    /// Aggregate bandwidth of `n` staged fused groups in flight ÷ that of one, from
    /// [`Link::staged_concurrency`] (linear between measured counts, the last one's beyond);
    /// `None` when it was not measured.
    pub fn staged_factor(&self, n: usize) -> Option<f64> {
        if self.staged_concurrency.is_empty() {
            return None;
        }
        let mut pts: Vec<(usize, f64)> = self
            .staged_concurrency
            .iter()
            .filter(|c| c.streams >= 2)
            .map(|c| (c.streams, c.factor))
            .collect();
        pts.sort_by_key(|p| p.0);
        Some(if n <= 1 { 1.0 } else { by_count(&pts, n) })
    }

    /// The documented default link classes: 25/100/400 Gb/s Ethernet-class (TCP, with its
    /// scatter-gather I/O; a single stream assumed to reach at most 25, 40 and 50 Gb/s) and
    /// NVLink-class (300 GB/s, no cap).
    pub fn defaults() -> Vec<Link> {
        let gbit = |g: f64| g * 1e9 / 8.0;
        vec![
            Link {
                name: "25 Gb/s".into(),
                alpha_s: 10e-6,
                bandwidth_bps: gbit(25.0),
                stream_cap_bps: None,
                concurrency: Vec::new(),
                staged_concurrency: Vec::new(),
                host_bound: false,
                wire: Wire::Network,
                vectored_io: true,
                agrees_in_band: true,
                flows: None,
                local_passes: 0.0,
                local_chunk: None,
            },
            Link {
                name: "100 Gb/s".into(),
                alpha_s: 8e-6,
                bandwidth_bps: gbit(100.0),
                stream_cap_bps: Some(gbit(40.0)),
                concurrency: Vec::new(),
                staged_concurrency: Vec::new(),
                host_bound: false,
                wire: Wire::Network,
                vectored_io: true,
                agrees_in_band: true,
                flows: None,
                local_passes: 0.0,
                local_chunk: None,
            },
            Link {
                name: "400 Gb/s".into(),
                alpha_s: 5e-6,
                bandwidth_bps: gbit(400.0),
                stream_cap_bps: Some(gbit(50.0)),
                concurrency: Vec::new(),
                staged_concurrency: Vec::new(),
                host_bound: false,
                wire: Wire::Network,
                vectored_io: true,
                agrees_in_band: true,
                flows: None,
                local_passes: 0.0,
                local_chunk: None,
            },
            Link {
                name: "NVLink-class".into(),
                alpha_s: 2e-6,
                bandwidth_bps: 300e9,
                stream_cap_bps: None,
                concurrency: Vec::new(),
                staged_concurrency: Vec::new(),
                host_bound: false,
                wire: Wire::Memory,
                vectored_io: false,
                agrees_in_band: false,
                flows: None,
                local_passes: 0.0,
                local_chunk: None,
            },
        ]
    }
}

/// The factor for `n` in flight from `(count, factor)` points by increasing count.
fn by_count(pts: &[(usize, f64)], n: usize) -> f64 {
    let Some(&first) = pts.first() else {
        return 1.0;
    };
    if n <= first.0 {
        // From (1, 1) to the first measured count.
        let span = (first.0.max(2) - 1) as f64;
        return 1.0 + (first.1 - 1.0) * (n - 1) as f64 / span;
    }
    for w in pts.windows(2) {
        let ((a, fa), (b, fb)) = (w[0], w[1]);
        if n <= b && b > a {
            return fa + (fb - fa) * (n - a) as f64 / (b - a) as f64;
        }
    }
    pts[pts.len() - 1].1
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
    /// Where the engine stages fused groups through a cache-sized piece of its fusion buffer
    /// (`fasthorovod` with every rank on one host, `Config::effective_stage_bytes`): bytes per
    /// second of packing and unpacking such a group (both passes together); `None`: the
    /// modelled job spans hosts, fused groups go whole at [`Overheads::copy_bps`].
    #[serde(default)]
    pub staged_copy_bps: Option<f64>,
    /// The ranks' channels share a few cores (the loopback check: every rank on one small
    /// host): the copies in progress on a rank's channels share its copy rate (each of `n` at
    /// `1/n` of it), and on a [`Link::host_bound`] link its transfers share the host with them.
    /// `false` (the projections): each channel copies on a core of its own, as on a cluster node.
    #[serde(default)]
    pub shared_host: bool,
}

impl Default for Overheads {
    /// Documented defaults: 30 µs per round, 20 µs per collective, copies free.
    fn default() -> Self {
        Overheads {
            round_s: 30e-6,
            per_collective_s: 20e-6,
            copy_bps: None,
            staged_copy_bps: None,
            shared_host: false,
        }
    }
}

impl Overheads {
    /// Seconds of host copying a group of `bytes` (fused or a lone tensor) costs on its
    /// channel where the engine reduces it in place ([`Config::fused_in_place`]) on `p` ranks:
    /// the ring finishes (the average's division, the postscale) only this rank's block, one
    /// pass over `bytes / p`. `None` for a group small enough for recursive doubling, which
    /// the engine packs and finishes as before ([`Overheads::copy_s`]).
    pub fn in_place_copy_s(&self, bytes: usize, p: usize) -> Option<f64> {
        use fh_transport::algorithms::AllreduceAlgorithm;
        let p = p.max(1);
        if AllreduceAlgorithm::Auto.resolve(bytes, bytes / 4, p) != AllreduceAlgorithm::Ring {
            return None;
        }
        Some(match self.copy_bps {
            Some(r) if r > 0.0 => bytes as f64 / p as f64 / r,
            _ => 0.0,
        })
    }

    /// Seconds of host copying a group of `bytes` in `parts` parts costs on its channel;
    /// `staged`: the engine stages fused groups (see [`Overheads::staged_copy_bps`]).
    pub fn copy_s(&self, bytes: usize, parts: usize, staged: bool) -> f64 {
        if let (true, true, Some(r)) = (staged, parts > 1, self.staged_copy_bps) {
            if r > 0.0 && self.copy_bps.is_some() {
                return bytes as f64 / r;
            }
        }
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

/// Cost of one negotiation round on `p` ranks.
pub fn round_time(p: usize, link: &Link, o: &Overheads) -> f64 {
    let steps = if p <= 1 {
        0.0
    } else {
        (p as f64).log2().ceil()
    };
    o.round_s + steps * link.alpha_s
}
