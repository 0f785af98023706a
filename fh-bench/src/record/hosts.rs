//! The record's part on hosts and their links: how a row's transport routes gradients across
//! hosts ([`Route`], from its name, [`transport_env`]), the streams its runtime chose
//! ([`TcpStreams`]), and the across-hosts table ([`Across`]).

use serde::{Deserialize, Serialize};

/// A bench transport with a setting of its own, `NAME@VAR=VALUE` (e.g.
/// `hier@FH_HIER_PIPELINE=0`: the hierarchical backend with its allreduce pipeline off), to
/// compare against `NAME` in one interleaved run; `hier-serial` is short for that one. Returns
/// `FH_TRANSPORT` and the extra variable, if any.
pub fn transport_env(name: &str) -> (&str, Option<(&str, &str)>) {
    if name == "hier-serial" {
        return ("hier", Some(("FH_HIER_PIPELINE", "0")));
    }
    match name
        .split_once('@')
        .and_then(|(t, kv)| Some((t, kv.split_once('=')?)))
    {
        Some((t, (var, value))) => (t, Some((var, value))),
        None => (name, None),
    }
}

/// How a row's gradients cross the hosts' links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Route {
    /// Reduced within each host, then a ring among the hosts.
    Hierarchical,
    /// One ring over every rank, hosts one after the other.
    FlatRing,
}

impl Route {
    /// The route of a row's transport (`hier`, `auto`, `tcp`, `gloo`, `horovodrun`,
    /// each also as `NAME@VAR=VALUE`, and `hier-serial`) on `ranks_per_host` ranks per host.
    pub fn of(transport: &str, ranks_per_host: usize) -> Route {
        match transport_env(transport).0 {
            "hier" => Route::Hierarchical,
            "auto" if ranks_per_host > 1 => Route::Hierarchical,
            _ => Route::FlatRing,
        }
    }

    /// Fraction of the gradients that crosses each host's link per direction per step.
    pub fn fraction(self, hosts: usize, ranks: usize) -> f64 {
        let two_share = |p: usize| 2.0 * (p.max(1) as f64 - 1.0) / p.max(1) as f64;
        match self {
            Route::Hierarchical => two_share(hosts),
            Route::FlatRing => two_share(ranks),
        }
    }

    /// Ranks of the model's ring on the link.
    pub fn model_ranks(self, hosts: usize, ranks: usize) -> usize {
        match self {
            Route::Hierarchical => hosts,
            Route::FlatRing => ranks,
        }
    }

    /// Name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Route::Hierarchical => "hierarchical",
            Route::FlatRing => "flat ring",
        }
    }
}

/// The replay across hosts: layout, link and one line per replay row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Across {
    /// Hosts.
    pub hosts: usize,
    /// Ranks in all.
    pub ranks: usize,
    /// `h0:2,h1:2`.
    pub layout: String,
    /// The rate TCP reaches across a host's link, Gbit/s (measured by the caller: the best
    /// of 1 and many parallel streams).
    pub link_gbps: f64,
    /// One TCP stream's rate across it, Gbit/s (measured by the caller; the per-flow cap where
    /// one binds); `None`: not given.
    #[serde(default)]
    pub flow_gbps: Option<f64>,
    /// The host copy rate the model charged, GB/s per pass per rank with every rank copying.
    #[serde(default)]
    pub copy_gbps: Option<f64>,
    /// One line per replay row.
    pub rows: Vec<AcrossRow>,
}

/// One replay row across hosts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AcrossRow {
    /// Workload.
    pub workload: String,
    /// The replay row's schedule.
    pub schedule: String,
    /// The replay row's transport.
    pub transport: String,
    /// How its gradients cross.
    pub route: Route,
    /// Bytes out of each host per step (and into it).
    pub bytes_across: f64,
    /// Those bytes at the link rate, minus the backward, ms (at least 0).
    pub bound_ms: f64,
    /// The row's measured exposed time (median), ms.
    pub exposed_ms: f64,
    /// The model's exposed time on this link, ms (None: no model of this row).
    pub model_exposed_ms: Option<f64>,
    /// The TCP streams the row's runtime chose, per run ([`ReplayRow::tcp_streams`](super::ReplayRow::tcp_streams)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tcp_streams: Vec<TcpStreams>,
    /// The streams per peer connection the model gave the row under a per-flow cap (`None`:
    /// no per-flow rate measured).
    #[serde(default)]
    pub model_streams: Option<usize>,
    /// Whether [`AcrossRow::model_streams`] is the runtime's reported choice (else the
    /// runtime's rule applied to the probe's rates).
    #[serde(default)]
    pub streams_reported: bool,
}

impl AcrossRow {
    /// Measured exposed ÷ link bound (None when the bound is zero).
    pub fn vs_bound(&self) -> Option<f64> {
        (self.bound_ms > 0.0).then(|| self.exposed_ms / self.bound_ms)
    }

    /// Model ÷ measured exposed (None without a model or a measured exposed time).
    pub fn model_vs_measured(&self) -> Option<f64> {
        let m = self.model_exposed_ms?;
        (self.exposed_ms > 0.0).then(|| m / self.exposed_ms)
    }
}

/// The TCP streams a run's transport used to each peer on another host, and what it chose them
/// from ([`fh_transport::backend::tcp::StreamChoice`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TcpStreams {
    /// Streams to each peer on another host (S).
    pub streams: usize,
    /// The setting (`FH_TCP_STREAMS`): `auto` where the runtime measured, else the count set.
    pub setting: String,
    /// `auto`'s start-up measurement: one stream alone, Gbit/s.
    #[serde(default)]
    pub one_stream_gbps: Option<f64>,
    /// `auto`'s start-up measurement: [`TcpStreams::probe_streams`] at once, Gbit/s.
    #[serde(default)]
    pub many_streams_gbps: Option<f64>,
    /// Streams of that second measurement.
    #[serde(default)]
    pub probe_streams: Option<usize>,
}

impl From<fh_transport::backend::tcp::StreamChoice> for TcpStreams {
    fn from(c: fh_transport::backend::tcp::StreamChoice) -> Self {
        let gbps = |bps: f64| bps * 8.0 / 1e9;
        TcpStreams {
            streams: c.streams,
            setting: c.setting.to_string(),
            one_stream_gbps: c.measured.map(|m| gbps(m.one_stream_bps)),
            many_streams_gbps: c.measured.map(|m| gbps(m.many_streams_bps)),
            probe_streams: c.measured.map(|m| m.probe_streams),
        }
    }
}

impl TcpStreams {
    /// `S=4 auto (1: 0.48, 8: 1.91 Gbit/s)`, or `S=3 set` where the count was set.
    pub fn text(&self) -> String {
        match (
            self.one_stream_gbps,
            self.many_streams_gbps,
            self.probe_streams,
        ) {
            (Some(one), Some(many), Some(n)) => format!(
                "S={} {} (1: {one:.2}, {n}: {many:.2} Gbit/s)",
                self.streams, self.setting
            ),
            _ => format!("S={} set", self.streams),
        }
    }

    /// The runs' choices in a few words: the one choice where every run made the same (with
    /// the first run's rates), else each run's count (`S=4/4/5 auto`).
    pub fn summary(runs: &[TcpStreams]) -> Option<String> {
        let first = runs.first()?;
        if runs.iter().all(|r| r.streams == first.streams) {
            return Some(first.text());
        }
        let counts: Vec<String> = runs.iter().map(|r| r.streams.to_string()).collect();
        Some(format!("S={} {}", counts.join("/"), first.setting))
    }
}
