//! Copies a rank's stdout/stderr to fhrun's own, prefixing each line with the rank.

use std::io::{self, Read, Write};

/// A line longer than this is emitted in pieces (each piece gets the prefix and a newline).
const MAX_PENDING: usize = 64 * 1024;

/// Splits a byte stream into prefixed lines. Bytes after the last newline are held until the
/// line completes, the stream ends (then a newline is added) or the line grows past
/// `MAX_PENDING`.
pub struct LinePrefixer {
    prefix: Vec<u8>,
    pending: Vec<u8>,
}

impl LinePrefixer {
    /// A prefixer writing `prefix` before every line.
    pub fn new(prefix: String) -> Self {
        Self {
            prefix: prefix.into_bytes(),
            pending: Vec::new(),
        }
    }

    /// Feeds `data`; returns the bytes to write now (complete, prefixed lines).
    pub fn feed(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = data;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            out.extend_from_slice(&self.prefix);
            out.extend_from_slice(&self.pending);
            out.extend_from_slice(&rest[..=pos]);
            self.pending.clear();
            rest = &rest[pos + 1..];
        }
        self.pending.extend_from_slice(rest);
        while self.pending.len() >= MAX_PENDING {
            let piece: Vec<u8> = self.pending.drain(..MAX_PENDING).collect();
            out.extend_from_slice(&self.prefix);
            out.extend_from_slice(&piece);
            out.push(b'\n');
        }
        out
    }

    /// The end of the stream: the unfinished line, if any, prefixed and terminated.
    pub fn finish(&mut self) -> Vec<u8> {
        if self.pending.is_empty() {
            return Vec::new();
        }
        let mut out = self.prefix.clone();
        out.append(&mut self.pending);
        out.push(b'\n');
        out
    }
}

/// Which of fhrun's streams a rank's stream goes to.
#[derive(Clone, Copy, Debug)]
pub enum Sink {
    /// fhrun's stdout.
    Stdout,
    /// fhrun's stderr.
    Stderr,
}

fn emit(sink: Sink, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // Write errors (a closed terminal or pipe) are ignored: the rank's output must still be
    // drained so that the rank never blocks on a full pipe.
    let _ = match sink {
        Sink::Stdout => {
            let mut o = io::stdout().lock();
            o.write_all(bytes).and_then(|_| o.flush())
        }
        Sink::Stderr => io::stderr().lock().write_all(bytes),
    };
}

/// Copies `src` to `sink` with `prefix` on every line until end of stream.
pub fn pump(mut src: impl Read, sink: Sink, prefix: String) {
    let mut lines = LinePrefixer::new(prefix);
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => emit(sink, &lines.feed(&buf[..n])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    emit(sink, &lines.finish());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> String {
        let mut p = LinePrefixer::new("[1]<stdout>:".into());
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.feed(c));
        }
        out.extend(p.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn whole_and_split_lines() {
        assert_eq!(run(&[b"a\nb\n"]), "[1]<stdout>:a\n[1]<stdout>:b\n");
        assert_eq!(
            run(&[b"he", b"llo\nwor", b"ld\n"]),
            "[1]<stdout>:hello\n[1]<stdout>:world\n"
        );
        assert_eq!(run(&[b"\n\n"]), "[1]<stdout>:\n[1]<stdout>:\n");
        assert_eq!(run(&[]), "");
    }

    #[test]
    fn partial_last_line_is_terminated() {
        assert_eq!(
            run(&[b"a\nno newline"]),
            "[1]<stdout>:a\n[1]<stdout>:no newline\n"
        );
    }

    #[test]
    fn partial_line_is_held_until_complete() {
        let mut p = LinePrefixer::new("[0]:".into());
        assert!(p.feed(b"abc").is_empty());
        assert_eq!(p.feed(b"def\ng"), b"[0]:abcdef\n");
        assert_eq!(p.finish(), b"[0]:g\n");
    }

    #[test]
    fn very_long_lines_are_cut() {
        let long = vec![b'x'; MAX_PENDING + 10];
        let mut p = LinePrefixer::new("P".into());
        let out = p.feed(&long);
        assert_eq!(out.len(), 1 + MAX_PENDING + 1);
        assert_eq!(p.finish().len(), 1 + 10 + 1);
    }
}
