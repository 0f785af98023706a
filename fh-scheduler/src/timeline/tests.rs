use super::*;
use serde_json::{json, Value};

fn temp(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fh-tl-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("t.json")
}

fn parse(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    v.as_array().expect("an array").clone()
}

/// Waits (bounded) until the file parses with `n` events or more.
fn wait_for_events(path: &Path, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Ok(Value::Array(a)) = serde_json::from_str::<Value>(&text) {
            if a.len() >= n {
                return a;
            }
        }
        assert!(Instant::now() < deadline, "never got {n} events: {text}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn file_is_valid_json_while_written_and_after_finish() {
    let path = temp("valid");
    let t = Timeline::create(&path, 2).unwrap();
    // Metadata: the process and three lanes.
    assert_eq!(wait_for_events(&path, 4).len(), 4);
    let now = Instant::now();
    t.span(1, "pack", now, now + Duration::from_micros(5));
    // Flushed by the writer on its own while the timeline runs: valid in between.
    let events = wait_for_events(&path, 5);
    assert_eq!(events[4]["name"], "pack");
    assert_eq!(events[4]["dur"], 5.0);
    let odd = "a \"quoted\" \\ name\n\t\u{1}é";
    t.group(
        2,
        CollectiveKind::Allreduce,
        vec![odd.to_string(), "b,c".into()],
        64,
        now,
        now,
    );
    t.round(true, 2, now, now);
    assert!(t.finish(STOP_WAIT));
    assert!(t.finish(STOP_WAIT), "idempotent");
    t.span(0, "late", now, now); // after finish: ignored
    let events = parse(&path);
    assert_eq!(events.len(), 7);
    assert_eq!(events[5]["args"]["names"], json!([odd, "b,c"]));
    assert_eq!(events[5]["name"], "allreduce x2");
    assert_eq!(events[6]["name"], "negotiate (coordinator)");
    assert_eq!(events[6]["args"]["ready"], 2);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

#[test]
fn negotiation_span_names_every_ranks_ready_time_and_the_last() {
    let path = temp("neg");
    let t = Timeline::create(&path, 1).unwrap();
    let learned = Instant::now() + Duration::from_millis(50);
    let at = |ms| {
        Some(ReadyAt {
            learned,
            age: Duration::from_millis(ms),
        })
    };
    // Rank 1 became ready last (the smallest age); rank 2 is unknown (e.g. joined).
    t.negotiated("w".into(), vec![at(30), at(2), None], learned);
    assert!(t.finish(STOP_WAIT));
    let events = parse(&path);
    let b = events.iter().find(|e| e["ph"] == "b").unwrap();
    let e = events.iter().find(|e| e["ph"] == "e").unwrap();
    assert_eq!(
        (b["name"].as_str(), b["cat"].as_str()),
        (Some("w (waits on rank 1)"), Some("negotiate"))
    );
    assert_eq!(b["args"]["tensor"], "w");
    assert_eq!(b["id"], e["id"]);
    assert_eq!(b["args"]["last_ready_rank"], 1);
    let ready = b["args"]["ready_us"].as_object().unwrap();
    assert_eq!(ready.len(), 2, "{ready:?}");
    let (r0, r1) = (ready["0"].as_f64().unwrap(), ready["1"].as_f64().unwrap());
    assert!((r1 - r0 - 28_000.0).abs() < 1.0, "{r0} {r1}");
    assert_eq!(
        b["ts"].as_f64().unwrap(),
        r0,
        "the span starts at the first ready time"
    );
    assert!(e["ts"].as_f64().unwrap() >= r1);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// A writer that cannot keep up makes the engine's threads drop events, never wait.
#[test]
fn a_full_queue_drops_instead_of_blocking() {
    let path = temp("full");
    let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(0);
    let t = Arc::new(Timeline::open(&path, 1, 4, Some(gate_rx), Identity::default()).unwrap());
    // The writer is held at its gate: the queue fills after 4 events. The emitting thread
    // must finish all 100 calls without the writer ever running.
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let t2 = Arc::clone(&t);
    std::thread::spawn(move || {
        let now = Instant::now();
        for _ in 0..100 {
            t2.span(1, "pack", now, now);
        }
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("emitting blocked on a full queue");
    assert_eq!(t.dropped(), 96);
    drop(gate_tx);
    assert!(t.finish(STOP_WAIT));
    let events = parse(&path);
    assert_eq!(events.iter().filter(|e| e["name"] == "pack").count(), 4);
    let notice = events.last().unwrap();
    assert_eq!(notice["args"]["dropped"], 96, "{notice}");
    assert!(notice["name"]
        .as_str()
        .unwrap()
        .contains("96 events dropped"));
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// A file that cannot be written ends the timeline: events are refused from then on.
#[cfg(target_os = "linux")]
#[test]
fn a_write_error_ends_the_timeline() {
    let Ok(t) = Timeline::create(Path::new("/dev/full"), 1) else {
        return; // no /dev/full here: nothing to test
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.is_live() {
        assert!(
            Instant::now() < deadline,
            "a write error did not end the timeline"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(t.shared.dead.load(Ordering::Relaxed));
    assert!(t.finish(STOP_WAIT));
}

#[test]
fn a_rank_timeline_carries_its_clock_and_a_python_lane() {
    let path = temp("rank");
    let who = Identity {
        rank: 3,
        offset_us: -250,
    };
    let t = Timeline::create_for(&path, 2, who).unwrap();
    let now = Instant::now();
    t.framework(
        "submit".into(),
        "allreduce.w".into(),
        now,
        now + Duration::from_micros(7),
    );
    t.group(
        1,
        CollectiveKind::Allreduce,
        vec!["w".into()],
        2_000_000,
        now,
        now + Duration::from_millis(1),
    );
    assert!(t.finish(STOP_WAIT));
    let events = parse(&path);
    let p = &events[0];
    assert_eq!(p["name"], "process_name");
    assert_eq!(p["args"]["name"], "fasthorovod rank 3");
    assert_eq!(
        (p["args"]["rank"].as_u64(), p["args"]["offset_us"].as_i64()),
        (Some(3), Some(-250))
    );
    assert!(p["args"]["origin_unix_us"].as_i64().unwrap() > 1_600_000_000_000_000);
    // The Python lane comes after the two channels, named on its first span.
    let lane = events
        .iter()
        .find(|e| e["name"] == "thread_name" && e["args"]["name"] == "python")
        .unwrap();
    assert_eq!(lane["tid"], 3);
    let submit = events.iter().find(|e| e["name"] == "submit").unwrap();
    assert_eq!(
        (submit["tid"].as_u64(), submit["dur"].as_f64()),
        (Some(3), Some(7.0))
    );
    assert_eq!(submit["args"]["detail"], "allreduce.w");
    // 2 MB in 1 ms: 2 GB/s.
    let group = events.iter().find(|e| e["name"] == "allreduce x1").unwrap();
    assert_eq!(group["args"]["gb_per_s"], 2.0);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

#[test]
fn a_path_with_rank_names_a_file_per_rank() {
    let p = Path::new("/tmp/tl-{rank}.json");
    assert_eq!(path_for(p, 2), Some(PathBuf::from("/tmp/tl-2.json")));
    let p = Path::new("/tmp/tl.json");
    assert_eq!(path_for(p, 0), Some(PathBuf::from("/tmp/tl.json")));
    assert_eq!(path_for(p, 1), None);
}
