//! What a peer's rank 0 prints: its JSON line, behind a launcher's output tag.

use serde::Deserialize;

/// What the adapter's rank 0 prints.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PeerResult {
    /// `ddp-gloo`, `horovod` or `fasthorovod-torch`.
    pub peer: String,
    /// Workload (model).
    pub workload: String,
    /// Ranks.
    pub np: usize,
    /// Emulated backward, ms.
    pub backward_ms: f64,
    /// Timed steps.
    pub steps: usize,
    /// Slowest rank per timed step, seconds.
    pub step_seconds: Vec<f64>,
    /// Gradient tensors per step.
    pub tensors: usize,
    /// Gradient bytes per step.
    pub bytes: u64,
    /// `torch x.y[, horovod z]`.
    pub version: String,
    /// The averages were checked.
    pub checked: bool,
    /// The TCP streams the runtime chose to each peer on another host, as it reports them
    /// (`fasthorovod.torch`'s `tcp_streams()`); `None` where nothing crosses hosts or the peer
    /// does not say.
    #[serde(default)]
    pub tcp_streams: Option<crate::record::TcpStreams>,
    /// CPU time (user and system, every thread of each process) of all ranks together over
    /// the timed steps, seconds; `None` from an adapter that does not say.
    #[serde(default)]
    pub cpu_seconds: Option<f64>,
    /// CPU time of each rank's main thread (the training loop: the backward, the framework's
    /// hooks and submissions, the wait for the results) over the timed steps, all ranks
    /// together, seconds; `None` from an adapter that does not say.
    #[serde(default)]
    pub main_thread_cpu_seconds: Option<f64>,
}

/// A line without a launcher's output tag: `horovodrun`/`mpirun --tag-output` write
/// `[1,0]<stdout>:` (job, rank) before each line, `fhrun` writes `[0]<stdout>:`; the tag may
/// also name `stderr`. Untagged lines are returned as they are (leading blanks removed).
pub fn strip_output_tag(line: &str) -> &str {
    let l = line.trim_start();
    let Some(rest) = l.strip_prefix('[') else {
        return l;
    };
    let Some(close) = rest.find(']') else {
        return l;
    };
    let inside = &rest[..close];
    if inside.is_empty() || !inside.chars().all(|c| c.is_ascii_digit() || c == ',') {
        return l;
    }
    let after = &rest[close + 1..];
    for tag in ["<stdout>:", "<stderr>:"] {
        if let Some(body) = after.strip_prefix(tag) {
            return body.trim_start();
        }
    }
    l
}

/// Finds and checks the adapter's result line in its output (other lines, such as warnings,
/// are ignored; a launcher's output tag before the line is accepted, see [`strip_output_tag`]).
pub fn parse_output(text: &str) -> Result<PeerResult, String> {
    let line = text
        .lines()
        .rev()
        .map(strip_output_tag)
        .find(|l| l.starts_with("{\"peer\""))
        .ok_or_else(|| {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let start = lines.len().saturating_sub(5);
            format!(
                "the peer printed no result line: {}",
                lines[start..].join(" | ")
            )
        })?;
    // The first JSON value of the line: mpirun's tagged output can glue the next line's tag
    // behind it (`{...}[1,0]<stdout>:`) when the child's newline arrives in a later chunk.
    let r: PeerResult = serde_json::Deserializer::from_str(line)
        .into_iter::<PeerResult>()
        .next()
        .unwrap_or_else(|| Err(serde::de::Error::custom("empty line")))
        .map_err(|e| format!("bad result line from the peer '{line}': {e}"))?;
    if !r.checked {
        return Err(format!("{}: the reduced values were not checked", r.peer));
    }
    if r.step_seconds.len() != r.steps || r.steps == 0 {
        return Err(format!(
            "{}: {} step times for {} steps",
            r.peer,
            r.step_seconds.len(),
            r.steps
        ));
    }
    if let Some(bad) = r.step_seconds.iter().find(|s| !s.is_finite() || **s <= 0.0) {
        return Err(format!("{}: impossible step time {bad} s", r.peer));
    }
    if let Some(bad) = r.cpu_seconds.filter(|c| !c.is_finite() || *c < 0.0) {
        return Err(format!("{}: impossible CPU time {bad} s", r.peer));
    }
    if let Some(bad) = r
        .main_thread_cpu_seconds
        .filter(|c| !c.is_finite() || *c < 0.0)
    {
        return Err(format!(
            "{}: impossible main-thread CPU time {bad} s",
            r.peer
        ));
    }
    Ok(r)
}
