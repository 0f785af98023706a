//! fhrun's side: taking a part's file lines out of its output and writing each file whole
//! into fhrun's job directory.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;

use super::{travel_name, MAX_FILE};

/// fhrun's side: where a part's files go.
#[derive(Debug, Clone)]
pub struct Gather {
    /// The marker of the part's file lines.
    pub marker: String,
    /// fhrun's own directories, by the name files travel under (`flight`, `timeline`).
    pub dirs: Vec<(String, PathBuf)>,
}

/// A file being received.
struct Incoming {
    /// Its name as it travels (`NAME`, `SUB/NAME`) and the directory's (`flight`, ...).
    name: String,
    dir: String,
    tmp: PathBuf,
    target: PathBuf,
    file: std::fs::File,
    size: u64,
    got: u64,
}

/// What fhrun does with a part's file lines.
struct Receiver<'a> {
    gather: &'a Gather,
    /// Who sent them, for warnings.
    who: &'a str,
    current: Option<Incoming>,
    /// The flight records received since the last `sent` line (names as they travel).
    records: Vec<String>,
}

impl Receiver<'_> {
    /// Takes one file line (after the marker and its space).
    fn line(&mut self, rest: &str) {
        let mut words = rest.split(' ');
        match words.next() {
            Some("begin") => {
                self.abandon();
                let (Some(dir), Some(name), Some(size), None) =
                    (words.next(), words.next(), words.next(), words.next())
                else {
                    return self.warn(format!("a malformed file line {rest:?}"));
                };
                self.begin(dir, name, size);
            }
            Some("data") => {
                let Some(inc) = self.current.as_mut() else {
                    return;
                };
                let data = match B64.decode(words.next().unwrap_or("")) {
                    Ok(d) => d,
                    Err(e) => return self.fail(format!("bad base64 ({e})")),
                };
                inc.got += data.len() as u64;
                if inc.got > inc.size {
                    return self.fail("more bytes than announced".into());
                }
                if let Err(e) = inc.file.write_all(&data) {
                    let why = format!("cannot write {}: {e}", inc.tmp.display());
                    self.fail(why);
                }
            }
            Some("end") => {
                if let Some(inc) = self.current.take() {
                    if inc.got != inc.size {
                        let _ = std::fs::remove_file(&inc.tmp);
                        return self.warn(format!(
                            "{} short of its size ({} of {} bytes)",
                            inc.target.display(),
                            inc.got,
                            inc.size
                        ));
                    }
                    if inc.dir == "flight" {
                        self.records.push(inc.name.clone());
                    }
                    finish(inc);
                }
            }
            Some("sent") => self.say_where(),
            _ => self.warn(format!("a malformed file line {rest:?}")),
        }
    }

    fn begin(&mut self, dir: &str, name: &str, size: &str) {
        let Some((_, into)) = self.gather.dirs.iter().find(|(d, _)| d == dir) else {
            return self.warn(format!("a file for an unknown directory {dir:?}"));
        };
        if !travel_name(name) {
            return self.warn(format!("a file of a refused name {name:?}"));
        }
        let size = match size.parse::<u64>() {
            Ok(s) if s <= MAX_FILE => s,
            _ => return self.warn(format!("{name} of a refused size {size:?}")),
        };
        // The directory (or its subdirectory, for SUB/NAME), made (0700) if no rank of this
        // host wrote there.
        let (into, file_name) = match name.rsplit_once('/') {
            Some((sub, file)) => (into.join(sub), file),
            None => (into.clone(), name),
        };
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&into);
        if let Err(e) = made {
            return self.warn(format!(
                "{name}, but {} cannot be made: {e}",
                into.display()
            ));
        }
        let made = crate::sys::random_hex(6).and_then(|tag| {
            let tmp = into.join(format!(".{file_name}.{tag}.gather"));
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            Ok((tmp, file))
        });
        match made {
            Ok((tmp, file)) => {
                self.current = Some(Incoming {
                    name: name.to_string(),
                    dir: dir.to_string(),
                    tmp,
                    target: into.join(file_name),
                    file,
                    size,
                    got: 0,
                })
            }
            Err(e) => self.warn(format!("cannot write {name} into {}: {e}", into.display())),
        }
    }

    /// The part sent the flight records its ranks wrote while the job runs (on `SIGUSR1`):
    /// say where they are now, as the ranks of fhrun's own host do.
    fn say_where(&mut self) {
        let names = std::mem::take(&mut self.records);
        let Some((_, flight)) = self.gather.dirs.iter().find(|(d, _)| d == "flight") else {
            return;
        };
        // By subdirectory: (SUB, the ranks or names of its files).
        let mut by_dir: Vec<(&str, Vec<String>)> = Vec::new();
        for n in &names {
            let (sub, file) = n.rsplit_once('/').unwrap_or(("", n));
            let what = match file
                .strip_prefix("rank-")
                .and_then(|f| f.strip_suffix(".json"))
            {
                Some(r) if r.parse::<usize>().is_ok() => r.to_string(),
                _ => file.to_string(),
            };
            match by_dir.iter_mut().find(|(s, _)| *s == sub) {
                Some((_, v)) => v.push(what),
                None => by_dir.push((sub, vec![what])),
            }
        }
        for (sub, what) in by_dir {
            let at = match sub {
                "" => flight.clone(),
                sub => flight.join(sub),
            };
            let whose = match what.len() {
                1 => format!("rank {}", what[0]),
                _ => format!("ranks {}", what.join(", ")),
            };
            eprintln!(
                "fhrun: {} sent the flight records of {whose}: they are in {}; `fhrun \
                 --explain {}` names the first divergence",
                self.who,
                at.display(),
                flight.display()
            );
        }
    }

    fn warn(&self, what: String) {
        eprintln!("fhrun: warning: {} sent {what}; it is not kept", self.who);
    }

    /// The file being received is dropped, saying why.
    fn fail(&mut self, why: String) {
        if let Some(inc) = self.current.take() {
            let _ = std::fs::remove_file(&inc.tmp);
            self.warn(format!("{} with {why}", inc.target.display()));
        }
    }

    /// The file being received is dropped (its stream ended or another began).
    fn abandon(&mut self) {
        if let Some(inc) = self.current.take() {
            let _ = std::fs::remove_file(&inc.tmp);
            self.warn(format!("{} cut short", inc.target.display()));
        }
    }
}

/// A received file takes its place: renamed over the target, unless the target is already
/// the same file (a part on this very machine whose ranks wrote into fhrun's directory).
fn finish(inc: Incoming) {
    drop(inc.file);
    let same = std::fs::symlink_metadata(&inc.target).is_ok_and(|m| m.is_file())
        && match (std::fs::read(&inc.target), std::fs::read(&inc.tmp)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
    if same {
        let _ = std::fs::remove_file(&inc.tmp);
    } else if let Err(e) = std::fs::rename(&inc.tmp, &inc.target) {
        let _ = std::fs::remove_file(&inc.tmp);
        eprintln!(
            "fhrun: warning: cannot put a gathered file at {}: {e}",
            inc.target.display()
        );
    }
}

/// Copies a remote part's stdout to `out`, taking out and keeping the files it sends under
/// `gather`'s marker (see the module's documentation). `who` names the part in warnings.
pub(crate) fn relay(input: impl Read, mut out: impl Write, gather: &Gather, who: &str) {
    let mut rx = Relay::new(gather, who);
    let mut r = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        // Bounded lines, as fhrun's other relays: a longer one is passed on in pieces.
        match (&mut r).take(64 * 1024).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        rx.line(&line, &mut out);
    }
}

/// [`relay`] a line at a time, for a relay that takes other lines out too (an elastic part's
/// exit reports); a file cut short by the end of the stream is dropped with the relay.
pub(crate) struct Relay<'a> {
    rx: Receiver<'a>,
}

impl<'a> Relay<'a> {
    /// Files under `gather`'s marker, from the part `who`.
    pub(crate) fn new(gather: &'a Gather, who: &'a str) -> Self {
        Relay {
            rx: Receiver {
                gather,
                who,
                current: None,
                records: Vec::new(),
            },
        }
    }

    /// Takes one line of the part's stdout: its output goes to `out`, a file line is kept.
    pub(crate) fn line(&mut self, line: &[u8], out: &mut impl Write) {
        let marker = self.rx.gather.marker.as_str();
        // A file line may follow a rank's last output that did not end its line.
        let at = find(line, marker.as_bytes());
        let (text, file_line) = match at {
            Some(i) => (&line[..i], Some(&line[i..])),
            None => (line, None),
        };
        if !text.is_empty() {
            let _ = out.write_all(text);
            if file_line.is_some() {
                let _ = out.write_all(b"\n");
            }
            let _ = out.flush();
        }
        if let Some(l) = file_line {
            let l = String::from_utf8_lossy(l);
            let l = l.trim_end_matches('\n');
            if let Some(rest) = l.strip_prefix(marker).and_then(|r| r.strip_prefix(' ')) {
                self.rx.line(rest);
            }
        }
    }
}

impl Drop for Relay<'_> {
    fn drop(&mut self) {
        self.rx.abandon();
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}
