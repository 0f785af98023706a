//! Rank 0's Chrome-trace timeline: a valid JSON array after stop and shutdown, tensor names
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
        .filter(|e| e["cat"] == "negotiate" && e["ph"] == "b" && e["name"] == name)
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
