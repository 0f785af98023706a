//! fhrun end to end: a rank killed, signals to fhrun and to its ranks; nothing outlives the job.

mod common;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// Each rank records its pid and a grandchild's pid (atomically), then waits.
const RECORD_PIDS: &str =
    "sleep 60 & echo $! > $D/g$FH_RANK.tmp && mv $D/g$FH_RANK.tmp $D/g$FH_RANK; \
     echo $$ > $D/p$FH_RANK.tmp && mv $D/p$FH_RANK.tmp $D/p$FH_RANK; wait";

/// As [`RECORD_PIDS`], with a grandchild that ends by itself after 2 s.
const RECORD_PIDS_SHORT: &str =
    "sleep 2 & echo $! > $D/g$FH_RANK.tmp && mv $D/g$FH_RANK.tmp $D/g$FH_RANK; \
     echo $$ > $D/p$FH_RANK.tmp && mv $D/p$FH_RANK.tmp $D/p$FH_RANK; wait";

fn pid_files(np: usize) -> Vec<String> {
    (0..np)
        .flat_map(|r| [format!("p{r}"), format!("g{r}")])
        .collect()
}

#[test]
fn a_rank_killed_by_sigkill_stops_the_job_and_leaves_nothing_behind() {
    let dir = TempDir::new("sigkill");
    let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
        "-np",
        "3",
        "--kill-grace",
        "1",
        "sh",
        "-c",
        RECORD_PIDS,
    ]));
    let pids = read_pids(dir.path(), &pid_files(3), LIMIT);
    let victim = pids[2]; // rank 1's shell
                          // SAFETY: plain kill(2) on a process this test started (through fhrun).
    unsafe {
        libc::kill(victim, libc::SIGKILL);
    }
    let out = job.wait(LIMIT);
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert_eq!(out.code(), Some(128 + 9), "{out:?}");
    let want = format!("fhrun: rank 1 (pid {victim}) was killed by signal 9 (SIGKILL)");
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn sigint_and_sigterm_stop_every_rank_without_blaming_one() {
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let dir = TempDir::new("sigint");
        // Rank 2 ignores SIGINT and SIGTERM: fhrun has to escalate to SIGKILL.
        let script = format!("if [ $FH_RANK = 2 ]; then trap '' INT TERM; fi; {RECORD_PIDS}");
        let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
            "-np",
            "3",
            "--kill-grace",
            "1",
            "sh",
            "-c",
            &script,
        ]));
        let pids = read_pids(dir.path(), &pid_files(3), LIMIT);
        job.signal(sig);
        let out = job.wait(LIMIT);
        let left = survivors_after(&pids, Duration::from_secs(10));
        kill_all(&left);
        assert_eq!(out.code(), Some(code), "{out:?}");
        assert!(out.stderr.contains("stopping all ranks"), "{}", out.stderr);
        assert!(
            !out.stderr.contains("(pid "),
            "no rank is blamed: {}",
            out.stderr
        );
        assert!(left.is_empty(), "processes left behind: {left:?}");
    }
}

#[test]
fn killing_fhrun_itself_takes_the_ranks_down() {
    let dir = TempDir::new("pdeathsig");
    let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
        "-np",
        "2",
        "sh",
        "-c",
        "echo $$ > $D/p$FH_RANK.tmp && mv $D/p$FH_RANK.tmp $D/p$FH_RANK; exec sleep 60",
    ]));
    let pids = read_pids(dir.path(), &["p0".into(), "p1".into()], LIMIT);
    job.signal(libc::SIGKILL);
    let out = job.wait(LIMIT);
    assert_eq!(out.status.code(), None);
    none_left(&pids, "ranks");
}

#[test]
fn killing_fhrun_takes_down_the_ranks_descendants_too() {
    // Each rank is a shell wrapper with a child of its own (`sleep 60 &`): the parent-death
    // signal reaches only the shell; the guardian takes the rest of the rank's group down.
    let dir = TempDir::new("grandchildren");
    let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
        "-np",
        "3",
        "sh",
        "-c",
        RECORD_PIDS,
    ]));
    let pids = read_pids(dir.path(), &pid_files(3), LIMIT);
    job.signal(libc::SIGKILL);
    let out = job.wait(LIMIT);
    assert_eq!(out.status.code(), None);
    none_left(&pids, "processes of the job");
}

#[test]
fn sigquit_is_forwarded_and_stops_the_job() {
    let dir = TempDir::new("sigquit");
    let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
        "-np",
        "2",
        "--kill-grace",
        "5",
        "sh",
        "-c",
        &format!("trap 'echo GOT-QUIT; exit 7' QUIT; {RECORD_PIDS}"),
    ]));
    let pids = read_pids(dir.path(), &pid_files(2), LIMIT);
    job.signal(libc::SIGQUIT);
    let out = job.wait(LIMIT);
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert_eq!(out.code(), Some(128 + libc::SIGQUIT), "{out:?}");
    assert_eq!(out.stdout.matches("GOT-QUIT").count(), 2, "{out:?}");
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn sigtstp_stops_the_ranks_and_sigcont_resumes_them() {
    let dir = TempDir::new("sigtstp");
    let job = Running::start_cmd(std::process::Command::new(FHRUN).env("D", dir.str()).args([
        "-np",
        "2",
        "sh",
        "-c",
        "echo $$ > $D/p$FH_RANK.tmp && mv $D/p$FH_RANK.tmp $D/p$FH_RANK; sleep 2; echo RESUMED",
    ]));
    let pids = read_pids(dir.path(), &["p0".into(), "p1".into()], LIMIT);
    let state = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|t| {
                t[t.rfind(')')? + 1..]
                    .split_whitespace()
                    .next()
                    .map(str::to_string)
            })
            .unwrap_or_default()
    };
    job.signal(libc::SIGTSTP);
    // Every rank, and fhrun itself, stops (bounded wait).
    let deadline = std::time::Instant::now() + LIMIT;
    let all_stopped = || pids.iter().all(|&p| state(p) == "T") && state(job.pid()) == "T";
    while !all_stopped() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = all_stopped();
    job.signal(libc::SIGCONT);
    let out = job.wait(LIMIT);
    assert!(stopped, "ranks {:?} / fhrun not all stopped", pids);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(out.stdout.matches("RESUMED").count(), 2, "{out:?}");
}

/// `nohup fhrun ...`: a hangup neither stops fhrun nor reaches the ranks (they inherit the
/// ignored SIGHUP, as under nohup); the job runs to its end.
#[test]
fn under_nohup_a_hangup_stops_nothing() {
    let dir = TempDir::new("nohup");
    let script = format!("{RECORD_PIDS_SHORT}; echo finished-$FH_RANK");
    let job = Running::start_cmd(
        std::process::Command::new("nohup")
            .env("D", dir.str())
            .args([FHRUN, "-np", "2", "--kill-grace", "1", "sh", "-c", &script]),
    );
    let pids = read_pids(dir.path(), &pid_files(2), LIMIT);
    job.signal(libc::SIGHUP);
    let out = job.wait(LIMIT);
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert_eq!(out.code(), Some(0), "{out:?}");
    for r in 0..2 {
        assert!(out.stdout.contains(&format!("finished-{r}")), "{out:?}");
    }
    assert!(!out.stderr.contains("received SIGHUP"), "{}", out.stderr);
}
