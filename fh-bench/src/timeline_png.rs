//! A picture of a merged timeline (`fhrun --timeline-filename`): one band per rank, a row per
//! lane (negotiation, each channel, the Python side), each complete span (`X` event) drawn as
//! a box over a time window. What the README shows; Perfetto shows the same file in full.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

/// A span to draw: rank, lane, start and end (µs), name.
#[derive(Debug, Clone, PartialEq)]
struct Span {
    rank: u64,
    lane: u64,
    start: f64,
    end: f64,
    name: String,
}

/// The lanes of each rank with their names, and the spans.
#[derive(Debug, Default)]
struct Trace {
    lanes: BTreeMap<(u64, u64), String>,
    spans: Vec<Span>,
}

fn read(path: &Path) -> Result<Trace, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let events: Vec<Value> = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a JSON trace: {e}", path.display()))?;
    let mut t = Trace::default();
    for e in &events {
        let (Some(pid), Some(tid)) = (e["pid"].as_u64(), e["tid"].as_u64()) else {
            continue;
        };
        let name = e["name"].as_str().unwrap_or("");
        match e["ph"].as_str() {
            Some("M") if name == "thread_name" => {
                let label = e["args"]["name"].as_str().unwrap_or("").to_string();
                t.lanes.insert((pid, tid), label);
            }
            Some("X") => {
                let (Some(ts), Some(dur)) = (e["ts"].as_f64(), e["dur"].as_f64()) else {
                    continue;
                };
                t.spans.push(Span {
                    rank: pid,
                    lane: tid,
                    start: ts,
                    end: ts + dur,
                    name: name.to_string(),
                });
            }
            _ => {}
        }
    }
    if t.spans.is_empty() {
        return Err(format!("{} holds no spans", path.display()));
    }
    Ok(t)
}

/// The window: `from_ms`/`len_ms` after the trace's first span, or by default the second to
/// last `optimizer.step`-free stretch: the middle `len_ms` (default 400 ms) of the trace.
fn window(t: &Trace, from_ms: Option<f64>, len_ms: f64) -> (f64, f64) {
    let first = t
        .spans
        .iter()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let last = t
        .spans
        .iter()
        .map(|s| s.end)
        .fold(f64::NEG_INFINITY, f64::max);
    let len = len_ms * 1e3;
    let start = match from_ms {
        Some(ms) => first + ms * 1e3,
        None => (first + last) / 2.0 - len / 2.0,
    };
    (start, start + len)
}

/// The colour of a span, by what it is.
fn colour(s: &Span, lane_name: &str) -> RGBColor {
    if lane_name == "python" {
        match s.name.as_str() {
            "submit" => RGBColor(120, 160, 230),
            "synchronize" => RGBColor(230, 120, 90),
            _ => RGBColor(140, 200, 140),
        }
    } else if lane_name == "negotiation" {
        if s.name.contains("coordinator") {
            RGBColor(200, 80, 200)
        } else {
            RGBColor(170, 170, 170)
        }
    } else {
        match s.name.as_str() {
            "pack" | "unpack" => RGBColor(240, 190, 80),
            _ => RGBColor(90, 170, 220),
        }
    }
}

/// Draw `input`'s spans in the window to `output` (PNG).
pub fn render(
    input: &Path,
    output: &Path,
    from_ms: Option<f64>,
    len_ms: f64,
) -> Result<(), String> {
    crate::plots::ensure_font()?;
    let t = read(input)?;
    let (w0, w1) = window(&t, from_ms, len_ms);
    // Rows: every (rank, lane) with a name, in order.
    let rows: Vec<((u64, u64), String)> = t.lanes.iter().map(|(k, v)| (*k, v.clone())).collect();
    let row_of: BTreeMap<(u64, u64), usize> =
        rows.iter().enumerate().map(|(i, (k, _))| (*k, i)).collect();
    let (width, row_h, left, top) = (1600u32, 22u32, 190i32, 44i32);
    let height = top as u32 + row_h * rows.len() as u32 + 40;
    let root = BitMapBackend::new(output, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x = |us: f64| left + ((us - w0) / (w1 - w0) * f64::from(width - left as u32 - 10)) as i32;
    let font = ("sans-serif", 14).into_font();
    let title = format!(
        "{} ranks, {:.0} ms of {} (boxes: negotiation rounds, fused groups per channel, the \
         Python side)",
        rows.iter()
            .map(|((r, _), _)| r)
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        len_ms,
        input
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned())
    );
    root.draw(&Text::new(title, (10, 4), font.clone()))
        .map_err(|e| e.to_string())?;
    // The legend, on the title's second line.
    let legend = [
        ("negotiation round", RGBColor(170, 170, 170)),
        ("coordinator round", RGBColor(200, 80, 200)),
        ("fused group", RGBColor(90, 170, 220)),
        ("pack / unpack", RGBColor(240, 190, 80)),
        ("submit", RGBColor(120, 160, 230)),
        ("synchronize (waiting)", RGBColor(230, 120, 90)),
        ("optimizer.step", RGBColor(140, 200, 140)),
    ];
    let mut lx = 10;
    for (label, c) in legend {
        root.draw(&Rectangle::new([(lx, 22), (lx + 12, 32)], c.filled()))
            .map_err(|e| e.to_string())?;
        root.draw(&Text::new(label, (lx + 16, 20), font.clone()))
            .map_err(|e| e.to_string())?;
        lx += 30 + 8 * label.len() as i32;
    }
    let mut last_rank = None;
    for (i, ((rank, _), name)) in rows.iter().enumerate() {
        let y = top + (i as u32 * row_h) as i32;
        if last_rank != Some(*rank) {
            last_rank = Some(*rank);
            root.draw(&PathElement::new(
                vec![(0, y), (width as i32, y)],
                RGBColor(120, 120, 120),
            ))
            .map_err(|e| e.to_string())?;
        }
        let label = format!("rank {rank} {name}");
        root.draw(&Text::new(label, (8, y + 4), font.clone()))
            .map_err(|e| e.to_string())?;
    }
    // Fused groups first, their packing and unpacking over them (a group's `collective`
    // phase is the group itself, not drawn twice).
    let phase = |s: &&Span| matches!(s.name.as_str(), "pack" | "unpack" | "collective");
    let order = t.spans.iter().filter(|s| !phase(s)).chain(
        t.spans
            .iter()
            .filter(|s| phase(s) && s.name != "collective"),
    );
    for s in order {
        if s.end < w0 || s.start > w1 {
            continue;
        }
        let Some(&row) = row_of.get(&(s.rank, s.lane)) else {
            continue;
        };
        let lane_name = &rows[row].1;
        let y = top + (row as u32 * row_h) as i32;
        let (a, b) = (
            x(s.start.max(w0)),
            x(s.end.min(w1)).max(x(s.start.max(w0)) + 1),
        );
        let c = colour(s, lane_name);
        root.draw(&Rectangle::new(
            [(a, y + 3), (b, y + row_h as i32 - 3)],
            c.filled(),
        ))
        .map_err(|e| e.to_string())?;
    }
    // A time axis: ticks every tenth of the window.
    let y = top + (rows.len() as u32 * row_h) as i32 + 5;
    for k in 0..=10 {
        let us = w0 + (w1 - w0) * f64::from(k) / 10.0;
        root.draw(&Text::new(
            format!("{:.0} ms", (us - w0) / 1e3),
            (x(us), y),
            font.clone(),
        ))
        .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lanes_and_spans_and_draws_them() {
        let dir = std::env::temp_dir().join(format!("fh-tlpng-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("t.json");
        std::fs::write(
            &input,
            r#"[{"name":"thread_name","ph":"M","pid":0,"tid":0,"args":{"name":"negotiation"}},
                {"name":"thread_name","ph":"M","pid":1,"tid":3,"args":{"name":"python"}},
                {"name":"negotiate","ph":"X","pid":0,"tid":0,"ts":10,"dur":5},
                {"name":"submit","ph":"X","pid":1,"tid":3,"ts":12,"dur":2}]"#,
        )
        .unwrap();
        let t = read(&input).unwrap();
        assert_eq!(t.lanes.len(), 2);
        assert_eq!(t.spans[1].name, "submit");
        assert_eq!(window(&t, Some(0.0), 1.0), (10.0, 1010.0));
        if crate::plots::ensure_font().is_ok() {
            let out = dir.join("t.png");
            render(&input, &out, Some(0.0), 0.01).unwrap();
            assert!(std::fs::metadata(&out).unwrap().len() > 1000);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
