//! The notice pipe: how a rank tells `fhrun` at once that it fails, and which rank is to blame.

/// The variable through which `fhrun` gives each rank the write end of its notice pipe,
/// `FD:INODE` (see `fh-launch`'s notice channel).
pub const NOTICE_VAR: &str = "FH_NOTICE_FD";

/// Tell the launcher (`fhrun`, through [`NOTICE_VAR`]) that rank `rank` fails or was lost and
/// why, so that it stops the job at once naming that rank, instead of waiting for the first
/// process to exit (a survivor's interpreter may take seconds to finish exiting). Best effort:
/// does nothing without the variable, or when the descriptor is not that pipe (a process that
/// inherited the variable without the descriptor), and never blocks (the pipe is
/// non-blocking) or fails.
pub fn notify_launcher(rank: usize, reason: &str) {
    let Ok(spec) = std::env::var(NOTICE_VAR) else {
        return;
    };
    let Some((fd, ino)) = spec
        .split_once(':')
        .and_then(|(f, i)| Some((f.parse::<i32>().ok()?, i.parse::<u64>().ok()?)))
    else {
        return;
    };
    if fd < 0 {
        return;
    }
    // SAFETY: the descriptor is only borrowed for the two calls below, and only used when it
    // is the FIFO with the inode fhrun named.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match rustix::fs::fstat(fd) {
        Ok(st)
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Fifo
                && st.st_ino == ino => {}
        _ => return,
    }
    let text: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut line = format!("{rank} {text}");
    // One write of at most PIPE_BUF bytes is atomic: lines from several ranks never mix.
    let mut end = line.len().min(4000);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line.truncate(end);
    line.push('\n');
    let _ = rustix::io::write(fd, line.as_bytes());
}
