//! The Chrome-trace timeline: a valid JSON array after stop and shutdown, tensor names
//! round-trip whatever they contain, and each tensor's negotiation span names every rank's
//! ready time and the rank that held it back.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, Config, ReduceOp, Tensor};
use serde_json::Value;

/// A name with a quote, a backslash, control characters and non-ASCII text.
const ODD: &str = "late \"q\" \\ back\nslash\t\u{1}\u{1f} é";

/// How long the late rank waits before submitting.
const LATE_BY: Duration = Duration::from_millis(300);

fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fh-tl-it-{}-{tag}.json", std::process::id()))
}

fn parse(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not valid JSON ({e}): {text}"));
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {text}"))
        .clone()
}

/// The begin events of `name`'s negotiation spans, in file order.
fn negotiations<'a>(events: &'a [Value], name: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["cat"] == "negotiate" && e["ph"] == "b" && e["args"]["tensor"] == name)
        .collect()
}

fn allreduce(e: &fh_scheduler::Engine, name: &str, r: usize) -> Vec<f32> {
    e.allreduce(
        name,
        Tensor::from_slice(&[r as f32; 8]),
        AllreduceOptions::with_op(ReduceOp::Sum),
    )
    .unwrap()
    .wait_timeout(LIMIT)
    .unwrap()
    .to_vec::<f32>()
    .unwrap()
}

/// One rank submits a tensor late, twice (through the coordinator, then from the cache): its
/// negotiation span carries every rank's ready time, and the late rank as the last ready.
#[test]
fn the_negotiation_span_names_the_rank_that_held_a_tensor_back() {
    let n = 3;
    for late in [2usize, 0] {
        let path = temp_path(&format!("late{late}"));
        let cfg = Config::default().channels(2).timeline(&path);
        let out = run_world(n, cfg, move |e, r| {
            let mut sums = Vec::new();
            for _ in 0..2 {
                if r == late {
                    std::thread::sleep(LATE_BY);
                }
                sums.push(allreduce(e, ODD, r));
            }
            (sums, e.stats().cache_hits)
        });
        for (sums, hits) in &out {
            assert_eq!(sums, &vec![vec![3.0f32; 8]; 2]);
            assert!(*hits >= 1, "the second time comes from the cache");
        }
        let events = parse(&path);
        std::fs::remove_file(&path).ok();
        let spans = negotiations(&events, ODD);
        assert_eq!(spans.len(), 2, "one span per negotiation: {events:?}");
        for b in spans {
            let args = &b["args"];
            assert_eq!(args["tensor"], ODD);
            assert_eq!(args["last_ready_rank"], late, "{b}");
            let ready = args["ready_us"].as_object().expect("ready_us is an object");
            let keys: Vec<&str> = ready.keys().map(String::as_str).collect();
            assert_eq!(keys, ["0", "1", "2"], "every rank's ready time: {b}");
            let late_at = ready[&late.to_string()].as_f64().unwrap();
            for (rank, t) in ready {
                assert!(
                    t.as_f64().unwrap() <= late_at,
                    "rank {rank} ready after {late}: {b}"
                );
            }
            // The span runs from the first ready time to agreement, and ends.
            let first = ready
                .values()
                .filter_map(Value::as_f64)
                .fold(f64::MAX, f64::min);
            assert_eq!(b["ts"].as_f64(), Some(first));
            let end = events
                .iter()
                .find(|e| e["ph"] == "e" && e["cat"] == "negotiate" && e["id"] == b["id"])
                .expect("the span's end");
            assert!(end["ts"].as_f64().unwrap() >= late_at);
            assert_eq!(args["agreed_us"], end["ts"]);
        }
        // The odd name round-trips in the other events too.
        assert!(events
            .iter()
            .any(|e| e["name"] == "queued" && e["args"]["tensor"] == ODD));
        assert!(events.iter().any(|e| e["args"]["names"]
            .as_array()
            .is_some_and(|names| names.iter().any(|x| x == ODD))));
    }
}

/// `stop_timeline` leaves a valid file at once; a timeline can start again after a stop, and
/// a start while one runs closes the old file.
#[test]
fn stop_leaves_a_valid_file_and_start_after_stop_and_replace_work() {
    let (a, b, c) = (temp_path("a"), temp_path("b"), temp_path("c"));
    let paths = (a.clone(), b.clone(), c.clone());
    run_world(2, Config::default().channels(1), move |e, r| {
        let (a, b, c) = &paths;
        e.start_timeline(a).unwrap();
        allreduce(e, "first", r);
        e.stop_timeline();
        if r == 0 {
            let events = parse(a);
            assert_eq!(negotiations(&events, "first").len(), 1, "{events:?}");
        }
        e.start_timeline(b).unwrap();
        allreduce(e, "second", r);
        e.start_timeline(c).unwrap(); // replaces b, which is closed
        if r == 0 {
            let events = parse(b);
            assert_eq!(negotiations(&events, "second").len(), 1, "{events:?}");
            assert!(negotiations(&events, "first").is_empty());
        }
        allreduce(e, "third", r);
        // No stop: the engine's shutdown closes c.
    });
    let events = parse(&c);
    assert_eq!(negotiations(&events, "third").len(), 1, "{events:?}");
    assert!(negotiations(&events, "second").is_empty());
    for p in [a, b, c] {
        std::fs::remove_file(p).ok();
    }
}

/// A timeline that cannot be created is an error naming the file; the engine runs on.
#[test]
fn a_timeline_that_cannot_be_created_is_an_error_and_collectives_run_on() {
    let bad = std::env::temp_dir()
        .join(format!("fh-tl-missing-dir-{}", std::process::id()))
        .join("t.json");
    let out = run_world(2, Config::default().channels(1), move |e, r| {
        let err = e.start_timeline(&bad).err().map(|x| x.to_string());
        (err, allreduce(e, "after", r))
    });
    let msg = out[0].0.as_deref().expect("rank 0 reports the error");
    assert!(msg.contains("fh-tl-missing-dir"), "{msg}");
    assert_eq!(out[1].0, None, "other ranks do not write");
    for (_, sum) in out {
        assert_eq!(sum, [1.0f32; 8]);
    }
}

/// What a trace viewer (Perfetto, chrome://tracing) needs of a JSON trace, checked on `events`:
/// every event has a phase, a pid and a tid, and a timestamp unless it is metadata; complete
/// (`X`) events on one lane nest (a viewer drops a slice that partly overlaps another on its
/// track); async (`b`/`e`) spans pair up by category, id and name, end no earlier than they
/// begin, and nest within one (category, id).
fn check_viewer_rules(events: &[Value]) -> Result<(), String> {
    const EPS: f64 = 1e-6;
    // Per (pid, tid): complete spans as (start, end, name).
    type Lanes = std::collections::BTreeMap<(u64, u64), Vec<(f64, f64, String)>>;
    // Per (cat, id): async events as (ts, is_begin, name), in file order.
    type Asyncs = std::collections::BTreeMap<(String, u64), Vec<(f64, bool, String)>>;
    let mut lanes = Lanes::new();
    let mut asyncs = Asyncs::new();
    for e in events {
        let ph = e["ph"].as_str().ok_or(format!("no phase: {e}"))?;
        let pid = e["pid"].as_u64().ok_or(format!("no pid: {e}"))?;
        let tid = e["tid"].as_u64().ok_or(format!("no tid: {e}"))?;
        let name = e["name"]
            .as_str()
            .ok_or(format!("no name: {e}"))?
            .to_string();
        if ph == "M" {
            continue;
        }
        let ts = e["ts"].as_f64().ok_or(format!("no timestamp: {e}"))?;
        if ts.is_nan() || ts < 0.0 {
            return Err(format!("negative timestamp: {e}"));
        }
        match ph {
            "X" => {
                let dur = e["dur"]
                    .as_f64()
                    .ok_or(format!("complete event without dur: {e}"))?;
                if dur.is_nan() || dur < 0.0 {
                    return Err(format!("negative duration: {e}"));
                }
                lanes
                    .entry((pid, tid))
                    .or_default()
                    .push((ts, ts + dur, name));
            }
            "b" | "e" => {
                let cat = e["cat"]
                    .as_str()
                    .ok_or(format!("async event without cat: {e}"))?;
                let id = e["id"]
                    .as_u64()
                    .ok_or(format!("async event without id: {e}"))?;
                asyncs
                    .entry((cat.to_string(), id))
                    .or_default()
                    .push((ts, ph == "b", name));
            }
            "i" => {}
            other => return Err(format!("unexpected phase {other}: {e}")),
        }
    }
    for ((pid, tid), mut spans) in lanes {
        // Parents first: by start, then the longer one.
        spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<(f64, f64, String)> = Vec::new();
        for s in spans {
            while open.last().is_some_and(|top| top.1 <= s.0 + EPS) {
                open.pop();
            }
            if let Some(top) = open.last() {
                if s.1 > top.1 + EPS {
                    return Err(format!(
                        "on lane {pid}/{tid}, '{}' [{}, {}] partly overlaps '{}' [{}, {}]",
                        s.2, s.0, s.1, top.2, top.0, top.1
                    ));
                }
            }
            open.push(s);
        }
    }
    for ((cat, id), evs) in asyncs {
        // In file order (a span's begin is written before its end).
        let mut open: Vec<(f64, String)> = Vec::new();
        for (ts, begin, name) in evs {
            if begin {
                if let Some(top) = open.last() {
                    if ts + EPS < top.0 {
                        return Err(format!(
                            "async {cat}/{id}: '{name}' begins before its parent"
                        ));
                    }
                }
                open.push((ts, name));
            } else {
                let (b, bname) = open
                    .pop()
                    .ok_or(format!("async {cat}/{id}: '{name}' ends without a begin"))?;
                if bname != name {
                    return Err(format!("async {cat}/{id}: '{bname}' ends as '{name}'"));
                }
                if ts + EPS < b {
                    return Err(format!("async {cat}/{id}: '{name}' ends before it begins"));
                }
            }
        }
        if let Some((_, name)) = open.pop() {
            return Err(format!("async {cat}/{id}: '{name}' never ends"));
        }
    }
    Ok(())
}

/// The checker catches what it must: a partial overlap on a lane and an unpaired async span.
#[test]
fn the_viewer_rules_catch_overlaps_and_unpaired_spans() {
    let x = |ts: f64, dur: f64, tid: u64| serde_json::json!({"name": "s", "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur});
    let ok = vec![
        x(0.0, 10.0, 1),
        x(0.0, 4.0, 1),
        x(4.0, 6.0, 1),
        x(5.0, 10.0, 2),
    ];
    assert_eq!(check_viewer_rules(&ok), Ok(()));
    let overlap = vec![x(0.0, 10.0, 1), x(5.0, 10.0, 1)];
    assert!(check_viewer_rules(&overlap)
        .unwrap_err()
        .contains("partly overlaps"));
    let b = serde_json::json!({"name": "t", "cat": "c", "id": 1, "ph": "b", "pid": 0, "tid": 0, "ts": 1.0});
    assert!(check_viewer_rules(&[b]).unwrap_err().contains("never ends"));
}

/// A busy run (fused small tensors, a large tensor split over both channels, groups,
/// broadcasts, tensors held back by a late rank) writes a trace that a viewer shows whole.
#[test]
fn a_busy_timeline_follows_the_viewer_rules() {
    let n = 3;
    let path = temp_path("busy");
    let cfg = Config::default()
        .channels(2)
        .partition_bytes(64 << 10)
        .timeline(&path);
    run_world(n, cfg, move |e, r| busy(e, r, n));
    let events = parse(&path);
    std::fs::remove_file(&path).ok();
    assert!(
        events.iter().filter(|e| e["ph"] == "X").count() > 20,
        "a busy trace: {events:?}"
    );
    assert!(events.iter().any(|e| e["cat"] == "negotiate"));
    if let Err(why) = check_viewer_rules(&events) {
        panic!("{why}");
    }
}

/// Four steps of mixed work, a different rank late in each (see the test above).
fn busy(e: &fh_scheduler::Engine, r: usize, n: usize) {
    for step in 0..4 {
        if r == step % n {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut handles = Vec::new();
        for i in 0..12 {
            handles.push(
                e.allreduce(
                    &format!("small.{i}"),
                    Tensor::from_slice(&[1.0f32; 64]),
                    AllreduceOptions::with_op(ReduceOp::Sum),
                )
                .unwrap(),
            );
        }
        handles.push(
            e.allreduce(
                "large",
                Tensor::from_slice(&vec![1.0f32; 256 << 10]),
                AllreduceOptions::with_op(ReduceOp::Average),
            )
            .unwrap(),
        );
        let group: Vec<Tensor> = (0..3)
            .map(|_| Tensor::from_slice(&[1.0f32; 1000]))
            .collect();
        e.grouped_allreduce("group", group, AllreduceOptions::with_op(ReduceOp::Sum))
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        e.broadcast("bcast", Tensor::from_slice(&[r as f32; 16]), 0)
            .unwrap()
            .wait_timeout(LIMIT)
            .unwrap();
        for mut h in handles {
            h.wait_timeout(LIMIT).unwrap();
        }
    }
}

/// Every rank writes its own timeline (`{rank}` in the path); merged, they make one trace with
/// a track per rank (its negotiation, channels and Python lanes), which a viewer shows whole.
#[test]
fn every_rank_timeline_merges_into_one_trace() {
    let n = 3;
    let dir = std::env::temp_dir().join(format!("fh-tl-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = Config::default()
        .channels(2)
        .partition_bytes(64 << 10)
        .timeline(dir.join("rank-{rank}.json"));
    run_world(n, cfg, move |e, r| {
        assert!(e.timeline_on());
        let t0 = std::time::Instant::now();
        busy(e, r, n);
        e.timeline_span("optimizer.step", "4 steps", t0, std::time::Instant::now());
    });
    let files: Vec<PathBuf> = (0..n).map(|r| dir.join(format!("rank-{r}.json"))).collect();
    let out = dir.join("merged.json");
    let count = fh_scheduler::timeline_merge(&files, &out).unwrap();
    let events = parse(&out);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(events.len(), count);
    if let Err(why) = check_viewer_rules(&events) {
        panic!("{why}");
    }
    for r in 0..n as u64 {
        let mine: Vec<&Value> = events.iter().filter(|e| e["pid"] == r).collect();
        let named = |lane: &str| {
            mine.iter()
                .any(|e| e["name"] == "thread_name" && e["args"]["name"] == lane)
        };
        assert!(
            named("negotiation") && named("channel 1") && named("python"),
            "rank {r}"
        );
        assert!(mine
            .iter()
            .any(|e| e["name"] == "process_name" && e["args"]["name"] == format!("rank {r}")));
        // Each rank's own ready time of each tensor (its queued span), and its groups.
        assert!(mine
            .iter()
            .any(|e| e["name"] == "queued" && e["args"]["tensor"] == "large"));
        assert!(mine.iter().any(|e| e["args"]["gb_per_s"].is_number()));
        assert!(mine.iter().any(|e| e["name"] == "optimizer.step"));
    }
    // Rank 0's negotiation spans name the rank each tensor waited on.
    assert!(events.iter().any(|e| e["pid"] == 0
        && e["cat"] == "negotiate"
        && e["name"].as_str().unwrap().contains("(waits on rank ")));
}
