//! A remote part's side: its ranks' directory on its host, and sending their files back
//! while they run (on request) and when they end.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;

use super::{plain_name, CHUNK, DEPTH, MAX_FILE};

/// A remote part's own directory for its ranks' flight records and timelines.
pub(crate) struct PartDir {
    pub(super) path: PathBuf,
    /// The gathered directories (names of [`DIRS`](super::DIRS)) and their paths.
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
    /// subdirectory (0700) for each of `dirs` (names of [`DIRS`](super::DIRS)).
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
