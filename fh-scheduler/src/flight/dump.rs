//! A rank's flight record on disk: one JSON file per rank, `rank-R.json`, in the flight
//! directory; a process set's engine writes its own in a subdirectory named by the set's
//! members ([`set_dir_name`]: `set-0.2.3/rank-2.json`). Written whole to a temporary name and
//! renamed, so a reader never sees half a record; read back (every rank's) by [`read_dir`],
//! and with every process set's by [`read_all`], for [`super::explain`].

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The `format` field of every dump this version writes.
pub const FORMAT: &str = "fasthorovod-flight-1";

/// One rank's flight record.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Dump {
    /// [`FORMAT`].
    pub format: String,
    /// The rank that wrote it (its world rank).
    pub rank: usize,
    /// Ranks in the world.
    pub size: usize,
    /// Why it was written: `stall: ...`, `engine stopped: ...`, `SIGUSR1`, ...
    pub reason: String,
    /// When, in microseconds since the Unix epoch (the rank's wall clock).
    pub written_unix_us: i64,
    /// Operations the recorder keeps.
    pub capacity: usize,
    /// Operations recorded since the engine started (the oldest fell out of the ring).
    pub recorded: u64,
    /// The last stall report, if a stall was found: each rank that lacks names, and which.
    pub stall: Option<StallDump>,
    /// Why the engine stopped, if it has.
    pub stopped: Option<String>,
    /// The operations, oldest first.
    pub ops: Vec<OpRecord>,
    /// For a process set's engine, the set's members (world ranks, ascending); `size` is then
    /// the set's size. `None`: the world's engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members: Option<Vec<usize>>,
}

/// A stall report as written in a dump.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct StallDump {
    /// Each rank that lacks stalled names (world ranks), with those names.
    pub lacking: Vec<(usize, Vec<String>)>,
    /// How long the oldest stalled name had waited, in milliseconds.
    pub waited_ms: u64,
}

/// One operation of a flight record. Times are microseconds since the Unix epoch on the
/// rank's wall clock.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct OpRecord {
    /// Its sequence number on this rank (from 1).
    pub seq: u64,
    /// The tensor's name.
    pub name: String,
    /// The collective (`allreduce`, `allgather`, ...).
    pub kind: String,
    /// The element type (`f32`, ...).
    pub dtype: String,
    /// The shape (at most [`super::MAX_DIMS`] dimensions; `ndim` says how many there were).
    pub shape: Vec<u64>,
    /// The number of dimensions.
    pub ndim: usize,
    /// Bytes of the tensor.
    pub bytes: u64,
    /// When this rank submitted it.
    pub submitted_us: i64,
    /// When every rank was agreed to have it (negotiated), if it was.
    pub negotiated_us: Option<i64>,
    /// The negotiation round that agreed it (the same number on every rank).
    pub round: Option<u64>,
    /// When its (first) fused group started on a channel.
    pub started_us: Option<i64>,
    /// When it ended.
    pub done_us: Option<i64>,
    /// The channel its (first) group ran on.
    pub channel: Option<u16>,
    /// The ranks a stall found lacking it while it waited for them.
    pub waiting_on: Vec<usize>,
    /// `pending`, `ok` or `error`.
    pub outcome: String,
    /// The error, for `error`.
    pub error: Option<String>,
    /// The rank the error blames as lost, if any.
    pub lost_rank: Option<usize>,
}

/// The file a rank's dump goes to in a flight directory.
pub fn file_name(rank: usize) -> String {
    format!("rank-{rank}.json")
}

/// The subdirectory of a flight directory where a process set's engine writes: `set-` and its
/// members joined by dots (`set-0.2.3`), or, for a set of more than 32 members, its size, first
/// and last member and a hash of them all (`set-n64-0-127-1f2e3d4c5b6a7988`): the same name on
/// every member, with no agreement needed.
pub fn set_dir_name(members: &[usize]) -> String {
    if members.len() <= 32 {
        let parts: Vec<String> = members.iter().map(usize::to_string).collect();
        return format!("set-{}", parts.join("."));
    }
    // Over the members' little-endian bytes: stable across builds and hosts.
    let bytes: Vec<u8> = members
        .iter()
        .flat_map(|m| (*m as u64).to_le_bytes())
        .collect();
    let h = fh_core::hash::fnv1a(fh_core::hash::FNV_OFFSET, &bytes);
    format!(
        "set-n{}-{}-{}-{h:016x}",
        members.len(),
        members.first().copied().unwrap_or(0),
        members.last().copied().unwrap_or(0)
    )
}

/// The flight directory when neither `FH_FLIGHT_DIR` nor a launcher names one: a directory
/// of this user's under the system's temporary directory.
pub fn default_dir() -> PathBuf {
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    std::env::temp_dir().join(format!("fasthorovod-flight-{uid}"))
}

/// Create `dir` (private to this user) if needed. A directory that `private` requires to be
/// this user's own and closed to others (the shared default) is refused otherwise.
fn prepare(dir: &Path, private: bool) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    if private {
        let meta = std::fs::symlink_metadata(dir)?;
        let me = std::fs::metadata("/proc/self")?.uid();
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} is not a directory of this user's closed to others; set FH_FLIGHT_DIR",
                    dir.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Write `dump` as `dir/rank-R.json`, or `dir/set-.../rank-R.json` for a process set's
/// engine (whole: to a temporary name, then renamed). `private`: see [`prepare`] (checked
/// for `dir` itself, then for the set's subdirectory). Returns the file's path.
pub(crate) fn write(dir: &Path, private: bool, dump: &Dump) -> std::io::Result<PathBuf> {
    prepare(dir, private)?;
    let set_dir;
    let dir = match &dump.members {
        Some(m) => {
            set_dir = dir.join(set_dir_name(m));
            prepare(&set_dir, private)?;
            set_dir.as_path()
        }
        None => dir,
    };
    let path = dir.join(file_name(dump.rank));
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        file_name(dump.rank),
        std::process::id()
    ));
    let bytes = serde_json::to_vec(dump).map_err(std::io::Error::other)?;
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_data().ok();
    drop(f);
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Every rank's dump in `dir` (`rank-*.json`), in rank order; an unreadable or malformed
/// file is an error naming it. A rank's dump found twice (impossible by name) keeps the last.
pub fn read_dir(dir: &Path) -> Result<Vec<Dump>, String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the flight directory {}: {e}", dir.display()))?;
    let mut dumps: Vec<Dump> = Vec::new();
    for e in entries {
        let e = e.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let path = e.path();
        let text =
            std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let dump: Dump = serde_json::from_slice(&text)
            .map_err(|e| format!("{} is not a flight record: {e}", path.display()))?;
        if dump.format != FORMAT {
            return Err(format!(
                "{} is a flight record of another format ({:?}; this version reads {FORMAT:?})",
                path.display(),
                dump.format
            ));
        }
        dumps.retain(|d| d.rank != dump.rank);
        dumps.push(dump);
    }
    if dumps.is_empty() {
        return Err(format!(
            "{} holds no flight records (rank-R.json files)",
            dir.display()
        ));
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(dumps)
}

/// The flight records of one engine: the world's (`set: None`) or a process set's.
#[derive(Debug, Clone)]
pub struct Records {
    /// The process set's members (world ranks), or `None` for the world's engine.
    pub set: Option<Vec<usize>>,
    /// Where they are.
    pub dir: PathBuf,
    /// Every rank's dump, in rank order.
    pub dumps: Vec<Dump>,
}

/// The generations' subdirectories of an elastic job's flight directory (`gen-N`, which
/// `FH_FLIGHT_DIR=.../gen-{generation}` makes: [`crate::elastic::GENERATION_PLACEHOLDER`]),
/// in generation order; empty for any other directory.
pub fn generations(dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut gens: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_prefix("gen-")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    gens.sort();
    gens
}

/// The world's records in `dir` (if any) and each process set's in its `set-*`
/// subdirectory, the world's first, then the sets in name order. An error when there are
/// none at all, or when a file cannot be read.
pub fn read_all(dir: &Path) -> Result<Vec<Records>, String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the flight directory {}: {e}", dir.display()))?;
    let mut world = false;
    let mut sets: Vec<PathBuf> = Vec::new();
    for e in entries {
        let e = e.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && name.starts_with("set-") {
            sets.push(e.path());
        } else if !is_dir && name.starts_with("rank-") && name.ends_with(".json") {
            world = true;
        }
    }
    sets.sort();
    let mut all = Vec::new();
    if world {
        all.push(Records {
            set: None,
            dir: dir.to_path_buf(),
            dumps: read_dir(dir)?,
        });
    }
    for path in sets {
        let dumps = match read_dir(&path) {
            Ok(d) => d,
            // An empty set directory (a dump being written, or removed): nothing to say.
            Err(_) if std::fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none()) => continue,
            Err(e) => return Err(e),
        };
        let set = dumps.iter().find_map(|d| d.members.clone());
        all.push(Records {
            set: Some(set.unwrap_or_default()),
            dir: path,
            dumps,
        });
    }
    if all.is_empty() {
        return Err(format!(
            "{} holds no flight records (rank-R.json files, or set-*/rank-R.json for process \
             sets)",
            dir.display()
        ));
    }
    Ok(all)
}
