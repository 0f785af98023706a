//! Bringing other hosts' flight records and timelines to fhrun's job directory.
//!
//! A remote part ([`crate::remote`]) gives its ranks a directory of its own on its host for
//! their flight records and timelines ([`PartDir`]: `fhrun-part-PID-RANDOM` under that host's
//! temporary directory, mode 0700, in place of fhrun's, which does not exist there). When its
//! ranks have ended (however: done, failed or stopped) it sends those files back on its stdout,
//! the stream fhrun relays, as lines under a random marker fhrun gave it:
//!
//! ```text
//! MARKER begin DIR NAME SIZE      DIR: `flight` or `timeline`; NAME: a plain file name,
//!                                 or SUB/NAME, SUB/SUB2/NAME for a file of a subdirectory
//!                                 (an elastic job's `gen-N`, a process set's `set-...`)
//! MARKER data BASE64              up to CHUNK bytes of the file each
//! MARKER end
//! ```
//!
//! then removes its directory. While its ranks run, each time it passed `SIGUSR1` on to them
//! (they write their flight records) it also sends, after [`crate::launch::RECORD_WINDOW`]
//! (and twice more, later, for a rank that was slow to write), the flight records that are
//! new or changed since it last sent, on a thread of its own
//! ([`send_on_request`]: the part's loop only tells it), followed by
//!
//! ```text
//! MARKER sent                     the files sent while the job runs end here
//! ```
//!
//! on which fhrun says where they are. Only what is new or changed since it was last sent
//! travels, at the end too. fhrun's relay ([`relay`]) takes those lines out of the output,
//! and writes each file whole (a temporary name, renamed; an identical file already there is
//! left as is; a file cut short — the part killed while it sends — is dropped, named in a
//! warning, and an earlier copy stays whole) into its own job directory, where
//! [`crate::observe::JobDir::finish`] finds every host's files. Only plain names (no `/`, no
//! leading `.`) of regular files, at most [`MAX_FILE`] bytes each, travel, those of the
//! directories and of their subdirectories down to [`DEPTH`] levels (plain names too); a
//! refused file is named in a warning, and what was not sent stays on its host, named.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;

/// The directories a part gathers, by the name they travel under.
pub(crate) const DIRS: [&str; 2] = ["flight", "timeline"];

/// The largest file sent back (a longer timeline stays on its host, named in a warning).
pub(crate) const MAX_FILE: u64 = 256 << 20;

/// How many subdirectories deep files travel (`gen-N/set-0.1/rank-1.json`: an elastic
/// job's generation, then a process set's records).
const DEPTH: usize = 2;

/// Bytes of a file per `data` line: its base64 stays well under the 64 KiB at which fhrun's
/// output relays cut lines.
const CHUNK: usize = 30 * 1024;

/// Whether `name` may be written into a job directory: a plain file name (no `/`, not `.` or
/// `..`, no leading `.`, which temporary files have), of letters, digits, `-`, `_` and `.`.
pub(crate) fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A remote part's own directory for its ranks' flight records and timelines.
pub(crate) struct PartDir {
    path: PathBuf,
    /// The gathered directories (names of [`DIRS`]) and their paths.
    dirs: Vec<(String, PathBuf)>,
    /// The files sent so far, as they were when sent: a file is sent again only when it
    /// changed (the runtime replaces a record by renaming a new file over it).
    sent: HashMap<PathBuf, Stamp>,
}

/// What tells a file changed: its inode, size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp(u64, u64, i64, i64);

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp(m.ino(), m.len(), m.mtime(), m.mtime_nsec())
    }
}

/// After a request, when the part looks for new flight records to send, in windows (a rank
/// slowed down, on a loaded machine, gets two more looks).
const LOOKS: [u32; 3] = [1, 2, 4];

/// The part's side of sending records while its ranks run: each `()` on the returned sender
/// (the part's loop passed `SIGUSR1` on to its ranks) makes a thread of its own wait `window`
/// for the ranks to write (the engine writes on its own thread, within a fraction of a
/// second), then send to stdout under `marker` the flight records in `dir` that are new or
/// changed, then `MARKER sent`; and look again 2 and 4 windows after the request (a request
/// meanwhile starts over). The part's last send takes the directory out of `dir` (the thread
/// then ends). Nothing here blocks the part's loop; a send holds `dir`'s lock, so files never
/// interleave, and stdout's a line at a time, so the ranks' output goes on. `None`: no thread
/// could be started (the records then travel when the ranks end).
pub(crate) fn send_on_request(
    dir: Arc<Mutex<Option<PartDir>>>,
    marker: String,
    who: String,
    window: Duration,
) -> Option<mpsc::Sender<()>> {
    let (tx, rx) = mpsc::channel::<()>();
    let name = who.clone();
    std::thread::Builder::new()
        .name("send-records".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                let mut asked = Instant::now();
                let mut look = 0;
                while let Some(&n) = LOOKS.get(look) {
                    let at = asked + window * n;
                    match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                        Ok(()) => {
                            (asked, look) = (Instant::now(), 0);
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                    }
                    let mut guard = dir.lock().unwrap_or_else(PoisonError::into_inner);
                    let Some(d) = guard.as_mut() else {
                        return;
                    };
                    d.send_while_running(&marker, &mut std::io::stdout(), &who);
                    look += 1;
                }
            }
        })
        .map_err(|e| {
            eprintln!(
                "{name}: warning: cannot start the thread that sends flight records on SIGUSR1 \
                 ({e}); they reach fhrun when the ranks end"
            )
        })
        .ok()?;
    Some(tx)
}

impl PartDir {
    /// A fresh directory (mode 0700) under this host's temporary directory, with a
    /// subdirectory (0700) for each of `dirs` (names of [`DIRS`]).
    pub(crate) fn create(dirs: &[String]) -> std::io::Result<Self> {
        let tag = crate::sys::random_hex(6)?;
        let path = std::env::temp_dir().join(format!("fhrun-part-{}-{tag}", std::process::id()));
        let mkdir = |p: &Path| std::fs::DirBuilder::new().mode(0o700).create(p);
        mkdir(&path)?;
        let mut made = PartDir {
            path,
            dirs: Vec::new(),
            sent: HashMap::new(),
        };
        for d in dirs {
            let sub = made.path.join(d);
            mkdir(&sub)?;
            made.dirs.push((d.clone(), sub));
        }
        Ok(made)
    }

    /// The directory named `name` (`flight`, `timeline`), if gathered.
    pub(crate) fn dir(&self, name: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(d, _)| d == name)
            .map(|(_, p)| p.as_path())
    }

    /// While the ranks run: send the flight records that are new or changed since they were
    /// last sent, then, if any, `MARKER sent` (fhrun says where they are).
    pub(crate) fn send_while_running(&mut self, marker: &str, out: &mut impl Write, who: &str) {
        let (sent, _) = self.send_new(marker, Some("flight"), out, who);
        if sent > 0 {
            let _ = writeln!(out, "{marker} sent").and_then(|_| out.flush());
        }
    }

    /// Send every file that is new or changed since it was last sent to `out` under `marker`,
    /// then remove the directory — unless a file could not be sent (too big, unreadable, or
    /// `out` closed): then it stays, and `who` (the part's name in messages) says where.
    pub(crate) fn send_and_remove(mut self, marker: &str, out: &mut impl Write, who: &str) {
        let (_, keep) = self.send_new(marker, None, out, who);
        if keep {
            eprintln!("{who}: what was not sent stays in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }

    /// Sends the new or changed files of the directory named `only` (of every one: `None`,
    /// the last send, which also names what lies too deep); returns how many it sent and
    /// whether something could not be sent.
    fn send_new(
        &mut self,
        marker: &str,
        only: Option<&str>,
        out: &mut impl Write,
        who: &str,
    ) -> (usize, bool) {
        let mut keep = false;
        let mut count = 0;
        for (dir, path) in &self.dirs {
            if only.is_some_and(|o| o != dir) {
                continue;
            }
            let mut files = Vec::new();
            // (the subdirectory's name under `path`, "" for `path`, and its depth)
            let mut dirs = vec![(String::new(), 0)];
            while let Some((sub, depth)) = dirs.pop() {
                for (name, is_dir) in plain_entries(&path.join(&sub)) {
                    let name = match sub.is_empty() {
                        true => name,
                        false => format!("{sub}/{name}"),
                    };
                    match (is_dir, depth < DEPTH) {
                        (false, _) => files.push(name),
                        (true, true) => dirs.push((name, depth + 1)),
                        (true, false) if only.is_some() => {}
                        (true, false) => {
                            eprintln!(
                                "{who}: {} is too deep to send to fhrun",
                                path.join(&name).display()
                            );
                            keep = true;
                        }
                    }
                }
            }
            files.sort();
            for name in files {
                let file = path.join(&name);
                let now = std::fs::symlink_metadata(&file).map(|m| Stamp::of(&m));
                if now.is_ok_and(|s| self.sent.get(&file) == Some(&s)) {
                    continue;
                }
                match send_file(marker, dir, &name, &file, out) {
                    Ok(stamp) => {
                        count += 1;
                        self.sent.insert(file, stamp);
                    }
                    Err(e) => {
                        eprintln!("{who}: cannot send {} to fhrun: {e}", file.display());
                        keep = true;
                    }
                }
            }
        }
        (count, keep)
    }
}

/// The entries of `dir` of plain names ([`plain_name`]), in name order, and whether each
/// is a directory (not followed through a symlink).
fn plain_entries(dir: &Path) -> Vec<(String, bool)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(String, bool)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            Some((e.file_name().into_string().ok()?, is_dir))
        })
        .filter(|(n, _)| plain_name(n))
        .collect();
    found.sort();
    found
}

/// Whether `name` may travel: plain names joined by `/`, at most [`DEPTH`] subdirectories.
fn travel_name(name: &str) -> bool {
    name.split('/').count() <= DEPTH + 1 && name.split('/').all(plain_name)
}

/// Sends one file (a regular file, not followed through a symlink, at most [`MAX_FILE`]), a
/// line at a time (other output may go between them); returns it as it was sent.
fn send_file(
    marker: &str,
    dir: &str,
    name: &str,
    path: &Path,
    out: &mut impl Write,
) -> std::io::Result<Stamp> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > MAX_FILE {
        return Err(std::io::Error::other(format!(
            "it holds {} MiB, over the {} MiB fhrun gathers from another host",
            meta.len() >> 20,
            MAX_FILE >> 20
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut f).take(MAX_FILE).read_to_end(&mut bytes)?;
    writeln!(out, "{marker} begin {dir} {name} {}", bytes.len())?;
    for chunk in bytes.chunks(CHUNK) {
        writeln!(out, "{marker} data {}", B64.encode(chunk))?;
    }
    writeln!(out, "{marker} end")?;
    out.flush()?;
    Ok(Stamp::of(&meta))
}

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

#[cfg(test)]
mod tests;
