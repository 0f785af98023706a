//! fhrun end to end: a rank that says it is failing (a line on the notice pipe, as
//! `fasthorovod.torch`'s excepthook writes it) is the one blamed, even when another rank exits
//! first, and fhrun stops the job within its report window of the notice.

mod common;
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// A rank's notice, written the way a shell can: through `/proc/self/fd` (the variable is
/// `FD:INODE`).
const NOTICE: &str =
    "echo \"$FH_RANK raised ValueError: boom\" > /proc/self/fd/${FH_NOTICE_FD%%:*}";

#[test]
fn the_rank_that_says_it_fails_is_blamed_not_the_first_to_exit() {
    // Rank 1 fails and is slow to exit; rank 2 exits first with an error (what a survivor
    // does when the runtime tells it that rank 1 is gone); rank 0 would run for a minute.
    let script = format!(
        "case $FH_RANK in 1) {NOTICE}; date +%s.%N > $D/t; sleep 20; exit 1;; \
         2) sleep 0.3; exit 5;; *) exec sleep 60;; esac"
    );
    let dir = TempDir::new("notice");
    let job = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("D", dir.str())
            .args(["-np", "3", "sh", "-c", &script]),
    );
    let out = job.wait(LIMIT);
    let ended = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let noticed: f64 = std::fs::read_to_string(dir.path().join("t"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        out.stderr.contains("fhrun: rank 1 (pid ")
            && out
                .stderr
                .contains(") raised ValueError: boom; stopping the other ranks"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("rank 2 (pid") && !out.stderr.contains("rank 0 (pid"),
        "only the rank that failed first is blamed: {}",
        out.stderr
    );
    // Rank 1 did not end on its own before fhrun stopped it: fhrun's status is 1.
    assert_eq!(out.code(), Some(1), "{out:?}");
    let took = ended - noticed;
    assert!(
        took < 2.0,
        "fhrun ended {took:.2} s after the notice:\n{}",
        out.stderr
    );
}

#[test]
fn a_failing_rank_that_exits_gives_fhrun_its_status() {
    let script = format!("if [ $FH_RANK = 0 ]; then {NOTICE}; exit 7; fi; exec sleep 60");
    let started = Instant::now();
    let out = fhrun(&["-np", "2", "sh", "-c", &script], LIMIT);
    assert_eq!(out.code(), Some(7), "{out:?}");
    assert!(
        out.stderr
            .contains(") raised ValueError: boom; stopping the other ranks")
            && out.stderr.contains("fhrun: rank 0 (pid "),
        "{}",
        out.stderr
    );
    assert!(started.elapsed() < Duration::from_secs(5), "{out:?}");
}

#[test]
fn a_rank_without_the_pipe_sees_no_variable_and_bad_lines_are_ignored() {
    // fhrun's own environment may carry a notice variable (a launcher around it): the ranks
    // get fhrun's, never that one; lines that are no notice change nothing.
    let script = "echo \"fd=$FH_NOTICE_FD\"; echo 'garbage' > /proc/self/fd/${FH_NOTICE_FD%%:*}; \
                  echo '99 out of range' > /proc/self/fd/${FH_NOTICE_FD%%:*}";
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_NOTICE_FD", "1:1")
            .args(["-np", "2", "sh", "-c", script]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    for (_, line) in prefixed(&out.stdout, "stdout") {
        let value = line.strip_prefix("fd=").unwrap();
        assert!(value != "1:1" && value.contains(':'), "{line}");
    }
    assert!(!out.stderr.contains("(pid "), "{}", out.stderr);
}

#[test]
fn a_stopped_rank_ends_with_the_sigterm_not_the_sigkill() {
    // Rank 1 stops itself (SIGSTOP: a hung rank's stand-in); rank 0 then fails. A stopped
    // process acts on SIGTERM only once it runs again: fhrun sends SIGCONT with it, so the job
    // ends after the report window, not after the 10 s kill grace as well.
    let script = "if [ $FH_RANK = 1 ]; then kill -STOP $$; exec sleep 60; fi; sleep 0.3; exit 3";
    let started = Instant::now();
    let out = fhrun(
        &["-np", "2", "--kill-grace", "10", "sh", "-c", script],
        LIMIT,
    );
    assert_eq!(out.code(), Some(3), "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}: {}",
        started.elapsed(),
        out.stderr
    );
}
