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

mod receive;
mod send;

pub(crate) use receive::{relay, Gather, Relay};
pub(crate) use send::{send_on_request, PartDir};

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

/// Whether `name` may travel: plain names joined by `/`, at most [`DEPTH`] subdirectories.
pub(crate) fn travel_name(name: &str) -> bool {
    name.split('/').count() <= DEPTH + 1 && name.split('/').all(plain_name)
}

#[cfg(test)]
mod tests;
