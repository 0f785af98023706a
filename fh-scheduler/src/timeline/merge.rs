//! One timeline of every rank: the ranks' own Chrome traces merged into one, with a process
//! (track group) per rank and its lanes (negotiation, each channel, the Python side) as
//! threads, on one clock.
//!
//! Each rank's file starts with its `process_name` metadata event, whose arguments hold its
//! rank, the wall-clock time (µs since the Unix epoch) of the file's zero, and the rank's clock
//! offset from rank 0 measured at start-up (zero for ranks on rank 0's host, which share its
//! clock). An event at
//! `ts` in rank r's file happened at `origin_unix_us + ts - offset_us` on rank 0's clock; the
//! merged file's zero is the earliest rank's zero. Asynchronous spans (`b`/`e`, matched by
//! id) get ids of their own per rank.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// What one rank's file says about its clock.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Clock {
    rank: u64,
    origin_unix_us: f64,
    offset_us: f64,
}

fn clock_of(events: &[Value]) -> Option<Clock> {
    events.iter().find_map(|e| {
        if e.get("name")?.as_str()? != "process_name" {
            return None;
        }
        let a = e.get("args")?;
        Some(Clock {
            rank: a.get("rank")?.as_u64()?,
            origin_unix_us: a.get("origin_unix_us")?.as_f64()?,
            offset_us: a.get("offset_us").and_then(Value::as_f64).unwrap_or(0.0),
        })
    })
}

/// A rank's events, from a file that may have been cut short (a rank killed while writing):
/// the writer keeps the file a valid array, but a file cut mid-write is read up to its last
/// complete event.
fn read_events(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the timeline {}: {e}", path.display()))?;
    if let Ok(Value::Array(v)) = serde_json::from_str::<Value>(&text) {
        return Ok(v);
    }
    // Cut short: keep the events before the last complete `,\n` separator.
    let body = text.trim_start().strip_prefix('[').unwrap_or(&text);
    let cut = body.rfind(",\n").map_or("", |i| &body[..i]);
    match serde_json::from_str::<Value>(&format!("[{cut}]")) {
        Ok(Value::Array(v)) => Ok(v),
        _ => Err(format!("{} is not a Chrome trace", path.display())),
    }
}

/// Merge the ranks' timeline files `inputs` into one trace at `output`; returns how many
/// events it holds. A file without a clock event is taken as rank 0's clock, with its rank
/// from its position.
pub fn merge(inputs: &[PathBuf], output: &Path) -> Result<usize, String> {
    let mut ranks: Vec<(Clock, Vec<Value>)> = Vec::new();
    for (i, path) in inputs.iter().enumerate() {
        let events = read_events(path)?;
        let clock = clock_of(&events).unwrap_or(Clock {
            rank: i as u64,
            origin_unix_us: 0.0,
            offset_us: 0.0,
        });
        ranks.push((clock, events));
    }
    ranks.sort_by_key(|(c, _)| c.rank);
    let base = ranks
        .iter()
        .map(|(c, _)| c.origin_unix_us - c.offset_us)
        .fold(f64::INFINITY, f64::min);
    let mut out: Vec<Value> = Vec::new();
    for (clock, events) in ranks {
        let rank = clock.rank;
        let shift = clock.origin_unix_us - clock.offset_us - base;
        out.push(
            json!({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"name": format!("rank {rank}")}}),
        );
        out.push(
            json!({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"sort_index": rank}}),
        );
        for mut e in events {
            let Some(obj) = e.as_object_mut() else {
                continue;
            };
            let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
            if obj.get("ph").and_then(Value::as_str) == Some("M") && name == "process_name" {
                continue;
            }
            obj.insert("pid".into(), json!(rank));
            if let Some(ts) = obj.get("ts").and_then(Value::as_f64) {
                let t = ((ts + shift) * 1e3).round() / 1e3;
                obj.insert("ts".into(), json!(t));
            }
            if let Some(id) = obj.get("id").and_then(Value::as_u64) {
                obj.insert("id".into(), json!((id & ((1 << 53) - 1)) ^ (rank << 53)));
            }
            out.push(e);
        }
    }
    let n = out.len();
    let file = std::fs::File::create(output)
        .map_err(|e| format!("cannot create {}: {e}", output.display()))?;
    let mut w = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut w, &Value::Array(out))
        .map_err(|e| format!("cannot write {}: {e}", output.display()))?;
    std::io::Write::flush(&mut w).map_err(|e| format!("cannot write {}: {e}", output.display()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_become_processes_on_one_clock() {
        let dir = std::env::temp_dir().join(format!("fh-merge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r0 = dir.join("r0.json");
        let r1 = dir.join("r1.json");
        // Rank 1's file starts 1 s after rank 0's and its clock is 200 µs ahead of rank 0's.
        std::fs::write(
            &r0,
            r#"[{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"fasthorovod rank 0","rank":0,"origin_unix_us":1000000,"offset_us":0}},
{"name":"negotiate","ph":"X","pid":0,"tid":0,"ts":10,"dur":5},
{"name":"queued","ph":"b","cat":"tensor","id":7,"pid":0,"tid":0,"ts":11}]"#,
        )
        .unwrap();
        // Cut short while writing (no closing bracket, a half event).
        std::fs::write(
            &r1,
            "[{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":\"fasthorovod rank 1\",\"rank\":1,\"origin_unix_us\":2000200,\"offset_us\":200}},\n{\"name\":\"allreduce x1\",\"ph\":\"X\",\"pid\":0,\"tid\":2,\"ts\":10,\"dur\":3},\n{\"name\":\"queued\",\"ph\":\"b\",\"cat\":\"tensor\",\"id\":7,\"pid\":0,\"tid\":0,\"ts\":4},\n{\"name\":\"half",
        )
        .unwrap();
        let out = dir.join("merged.json");
        let n = merge(&[r1.clone(), r0.clone()], &out).unwrap();
        let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(v.len(), n);
        let find = |pid: u64, name: &str| {
            v.iter()
                .find(|e| e["pid"] == json!(pid) && e["name"] == json!(name))
                .cloned()
                .unwrap_or_else(|| panic!("no {name} on {pid}: {v:?}"))
        };
        assert_eq!(find(0, "negotiate")["ts"], json!(10.0));
        // 1 s later on rank 0's clock, plus its own 10 µs.
        assert_eq!(find(1, "allreduce x1")["ts"], json!(1_000_010.0));
        assert_eq!(find(1, "allreduce x1")["tid"], json!(2));
        assert_eq!(find(1, "process_name")["args"]["name"], json!("rank 1"));
        // The same async id on two ranks becomes two ids.
        assert_ne!(find(0, "queued")["id"], find(1, "queued")["id"]);
        assert_eq!(
            v.iter()
                .filter(|e| e["name"] == json!("process_name"))
                .count(),
            2
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
