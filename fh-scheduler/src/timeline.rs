//! The Chrome-trace timeline (chrome://tracing, Perfetto), written by rank 0.
//!
//! The file is a JSON array of trace events that is valid JSON between any two writes: it
//! starts as `[]`, and each event overwrites the closing `]` with `,\n<event>]`. Lane 0 shows
//! negotiation rounds; lane `c + 1` shows the fused collectives of channel `c`.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

struct Sink {
    file: File,
    /// Offset of the closing `]`.
    end: u64,
    first: bool,
    broken: bool,
}

/// A timeline writer shared by the engine's threads.
pub(crate) struct Timeline {
    sink: Mutex<Sink>,
    start: Instant,
}

/// JSON string escaping.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

impl Timeline {
    /// Create (truncate) the file and name the lanes.
    pub(crate) fn create(path: &Path, channels: usize) -> std::io::Result<Self> {
        let mut file = File::create(path)?;
        file.write_all(b"[]")?;
        let t = Timeline {
            sink: Mutex::new(Sink {
                file,
                end: 1,
                first: true,
                broken: false,
            }),
            start: Instant::now(),
        };
        t.write(r#"{"name":"thread_name","ph":"M","pid":0,"tid":0,"args":{"name":"negotiation"}}"#);
        for c in 0..channels {
            t.write(&format!(
                r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{},"args":{{"name":"channel {c}"}}}}"#,
                c + 1
            ));
        }
        Ok(t)
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * 1e6
    }

    /// A complete span on a lane (0 = negotiation, c + 1 = channel c).
    pub(crate) fn span(
        &self,
        lane: usize,
        name: &str,
        begin: Instant,
        end: Instant,
        args: &[(&str, String)],
    ) {
        let mut a = String::new();
        for (i, (k, v)) in args.iter().enumerate() {
            if i > 0 {
                a.push(',');
            }
            let _ = write!(a, "\"{}\":\"{}\"", escape(k), escape(v));
        }
        let ev = format!(
            r#"{{"name":"{}","ph":"X","pid":0,"tid":{lane},"ts":{:.3},"dur":{:.3},"args":{{{a}}}}}"#,
            escape(name),
            self.us(begin),
            (self.us(end) - self.us(begin)).max(0.0),
        );
        self.write(&ev);
    }

    /// An asynchronous span of one tensor (e.g. its time queued before dispatch), shown as a
    /// track of its own.
    pub(crate) fn tensor_span(
        &self,
        id: u64,
        name: &str,
        phase: &str,
        begin: Instant,
        end: Instant,
    ) {
        let (n, p) = (escape(name), escape(phase));
        self.write(&format!(
            r#"{{"name":"{p}","cat":"tensor","ph":"b","id":{id},"pid":0,"tid":0,"ts":{:.3},"args":{{"tensor":"{n}"}}}}"#,
            self.us(begin)
        ));
        self.write(&format!(
            r#"{{"name":"{p}","cat":"tensor","ph":"e","id":{id},"pid":0,"tid":0,"ts":{:.3}}}"#,
            self.us(end).max(self.us(begin))
        ));
    }

    fn write(&self, event: &str) {
        let mut s = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        if s.broken {
            return;
        }
        let mut chunk = String::with_capacity(event.len() + 3);
        if !s.first {
            chunk.push_str(",\n");
        }
        chunk.push_str(event);
        chunk.push(']');
        let end = s.end;
        let res = s
            .file
            .seek(SeekFrom::Start(end))
            .and_then(|_| s.file.write_all(chunk.as_bytes()));
        match res {
            Ok(()) => {
                s.first = false;
                s.end = end + chunk.len() as u64 - 1;
            }
            Err(e) => {
                s.broken = true;
                tracing::warn!(error = %e, "timeline write failed; the timeline stops here");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_is_a_json_array_after_every_write() {
        let dir = std::env::temp_dir().join(format!("fh-tl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        let t = Timeline::create(&path, 2).unwrap();
        let check = || {
            let s = std::fs::read_to_string(&path).unwrap();
            assert!(s.starts_with('[') && s.ends_with(']'), "{s}");
            // Balanced braces outside strings: a cheap structural check.
            let (mut depth, mut in_str, mut esc) = (0i32, false, false);
            for c in s.chars() {
                if in_str {
                    match (esc, c) {
                        (true, _) => esc = false,
                        (false, '\\') => esc = true,
                        (false, '"') => in_str = false,
                        _ => {}
                    }
                    continue;
                }
                match c {
                    '"' => in_str = true,
                    '{' | '[' => depth += 1,
                    '}' | ']' => depth -= 1,
                    _ => {}
                }
                assert!(depth >= 0);
            }
            assert_eq!(depth, 0, "{s}");
            s
        };
        check();
        let now = Instant::now();
        t.span(1, "allreduce \"x\"", now, now, &[("names", "a,b\n".into())]);
        check();
        t.span(0, "negotiate", now, now, &[]);
        let s = check();
        assert_eq!(s.matches("\"ph\":\"X\"").count(), 2);
        std::fs::remove_dir_all(&dir).ok();
    }
}
