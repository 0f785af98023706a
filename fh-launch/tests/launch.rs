//! fhrun end to end with shell ranks: environment, output prefixes, exit codes, failing fast,
//! signals, timeouts, the mpirun command, refusals.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// Lines of `text` that start with `[rank]<stream>:`, as (rank, rest).
fn prefixed<'a>(text: &'a str, stream: &str) -> Vec<(usize, &'a str)> {
    text.lines()
        .filter_map(|l| {
            let l = l.strip_prefix('[')?;
            let (rank, rest) = l.split_once(']')?;
            let rest = rest.strip_prefix(&format!("<{stream}>:"))?;
            Some((rank.parse().ok()?, rest))
        })
        .collect()
}

#[test]
fn every_rank_gets_the_fh_environment() {
    for np in [2usize, 4] {
        let nps = np.to_string();
        let out = fhrun(
            &[
                "-np",
                &nps,
                "--channels",
                "3",
                "--schedule",
                "horovod",
                "--fusion-threshold-mb",
                "2",
                "-x",
                "MY_VAR=hello world",
                "--",
                "sh",
                "-c",
                "echo \"$FH_RANK $FH_SIZE $FH_LOCAL_RANK $FH_LOCAL_SIZE $FH_CROSS_RANK \
                 $FH_CROSS_SIZE $FH_RENDEZVOUS_ADDR $FH_JOB_TOKEN $FH_CHANNELS $FH_SCHEDULE \
                 $FH_FUSION_THRESHOLD $MY_VAR\"",
            ],
            LIMIT,
        );
        assert_eq!(out.code(), Some(0), "{out:?}");
        let lines = prefixed(&out.stdout, "stdout");
        assert_eq!(lines.len(), np, "{out:?}");
        let mut ranks = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        let mut tokens = BTreeSet::new();
        for (prefix_rank, line) in lines {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 13, "{line}");
            let rank: usize = f[0].parse().unwrap();
            assert_eq!(rank, prefix_rank, "the prefix names the rank");
            assert_eq!(f[1], nps);
            assert_eq!(f[2], f[0], "one host: local rank = rank");
            assert_eq!(f[3], nps);
            assert_eq!((f[4], f[5]), ("0", "1"));
            let port: u16 = f[6].strip_prefix("127.0.0.1:").unwrap().parse().unwrap();
            assert!(port > 0);
            assert!(f[7].len() >= 32 && f[7].chars().all(|c| c.is_ascii_hexdigit()));
            assert_eq!(f[8], "3");
            assert_eq!(f[9], "horovod");
            assert_eq!(f[10], (2u64 << 20).to_string());
            assert_eq!((f[11], f[12]), ("hello", "world"));
            ranks.insert(rank);
            addrs.insert(f[6].to_string());
            tokens.insert(f[7].to_string());
        }
        assert_eq!(ranks, (0..np).collect());
        assert_eq!(addrs.len(), 1, "one rendezvous address for the job");
        assert_eq!(tokens.len(), 1, "one token for the job");
    }
}

#[test]
fn each_job_gets_a_fresh_token() {
    let token = || {
        let out = fhrun(&["-np", "1", "sh", "-c", "echo $FH_JOB_TOKEN"], LIMIT);
        assert_eq!(out.code(), Some(0));
        prefixed(&out.stdout, "stdout")[0].1.to_string()
    };
    assert_ne!(token(), token());
}

#[test]
fn verbose_and_dry_run_never_show_the_token() {
    let out = fhrun(
        &["--verbose", "-np", "2", "sh", "-c", "echo $FH_JOB_TOKEN"],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    let token = prefixed(&out.stdout, "stdout")[0].1.to_string();
    assert!(token.len() >= 32, "{out:?}");
    assert!(
        out.stderr.contains("FH_JOB_TOKEN=<redacted>"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains(&token),
        "--verbose leaked the token: {}",
        out.stderr
    );
    let out = fhrun(&["--dry-run", "-np", "2", "true"], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stdout.contains("FH_JOB_TOKEN=<redacted>"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.lines().any(|l| l
            .split_whitespace()
            .any(|w| w.trim_matches('\'').len() > 40 && w.contains("FH_JOB_TOKEN="))),
        "{}",
        out.stdout
    );
    // A token given on fhrun's own command line works but is warned about; one passed through
    // the environment is not.
    let secret = "0123456789abcdef-my-own-token";
    let out = fhrun(
        &[
            "-np",
            "1",
            "-x",
            &format!("FH_JOB_TOKEN={secret}"),
            "sh",
            "-c",
            "echo $FH_JOB_TOKEN",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains(secret), "{out:?}");
    assert!(out.stderr.contains("command line"), "{}", out.stderr);
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_JOB_TOKEN", secret)
            .args([
                "-np",
                "1",
                "-x",
                "FH_JOB_TOKEN",
                "sh",
                "-c",
                "echo $FH_JOB_TOKEN",
            ]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains(secret), "{out:?}");
    assert!(!out.stderr.contains("warning"), "{}", out.stderr);
}

#[test]
fn misspelt_fh_variables_are_named_once_with_the_likely_one() {
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_PRESET", "horovod")
            .env("FH_CHANNELS", "2")
            .args(["-np", "2", "-x", "FH_CHANEL=2", "true"]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("warning"))
        .collect();
    assert_eq!(warnings.len(), 2, "{}", out.stderr);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("FH_PRESET") && w.contains("did you mean FH_SCHEDULE?")),
        "{}",
        out.stderr
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("FH_CHANEL ") && w.contains("did you mean FH_CHANNELS?")),
        "{}",
        out.stderr
    );
}

#[test]
fn output_is_prefixed_per_rank_and_stream() {
    let script = "printf 'out %s\\n' $FH_RANK; printf 'err %s\\n' $FH_RANK >&2; \
                  printf 'part'; sleep 0.1; printf 'ial\\nno newline'";
    let out = fhrun(&["-np", "3", "sh", "-c", script], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    for r in 0..3 {
        let mine = |stream, text: &str| {
            prefixed(
                if stream == "stdout" {
                    &out.stdout
                } else {
                    &out.stderr
                },
                stream,
            )
            .into_iter()
            .filter(|&(rank, _)| rank == r)
            .map(|(_, t)| t.to_string())
            .collect::<Vec<_>>()
                == text.lines().map(String::from).collect::<Vec<_>>()
        };
        assert!(
            mine("stdout", &format!("out {r}\npartial\nno newline")),
            "{out:?}"
        );
        assert!(mine("stderr", &format!("err {r}")), "{out:?}");
    }

    let raw = fhrun(
        &["-np", "2", "--no-prefix", "sh", "-c", "echo plain$FH_RANK"],
        LIMIT,
    );
    assert_eq!(raw.code(), Some(0));
    let mut lines: Vec<&str> = raw.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["plain0", "plain1"]);
}

#[test]
fn success_is_zero_and_a_failing_rank_is_named_with_its_code() {
    let ok = fhrun(&["-np", "3", "true"], LIMIT);
    assert_eq!(ok.code(), Some(0), "{ok:?}");

    // Rank 2 fails while the others would sleep for a minute: fhrun must stop them.
    let out = fhrun(
        &[
            "-np",
            "3",
            "sh",
            "-c",
            "if [ $FH_RANK = 2 ]; then exit 3; fi; exec sleep 60",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(3), "{out:?}");
    assert!(
        out.stderr.contains("fhrun: rank 2 (pid ") && out.stderr.contains("exited with code 3"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("rank 0 (pid") && !out.stderr.contains("rank 1 (pid"),
        "only the failing rank is blamed: {}",
        out.stderr
    );
}

/// Each rank records its pid and a grandchild's pid (atomically), then waits.
const RECORD_PIDS: &str =
    "sleep 60 & echo $! > $D/g$FH_RANK.tmp && mv $D/g$FH_RANK.tmp $D/g$FH_RANK; \
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
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(
        left.is_empty(),
        "ranks outlived a SIGKILLed fhrun: {left:?}"
    );
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
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(
        left.is_empty(),
        "processes of the job outlived a SIGKILLed fhrun: {left:?} of {pids:?}"
    );
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

#[test]
fn timeout_kills_the_job_and_says_so() {
    let out = fhrun(
        &[
            "-np",
            "2",
            "--timeout",
            "0.5",
            "--kill-grace",
            "0.5",
            "sleep",
            "60",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(124), "{out:?}");
    assert!(out.stderr.contains("timed out"), "{}", out.stderr);
}

#[test]
fn a_missing_command_is_reported() {
    let out = fhrun(&["-np", "2", "/nonexistent/fh-no-such-program"], LIMIT);
    assert_eq!(out.code(), Some(127), "{out:?}");
    assert!(
        out.stderr.contains("cannot start rank 0") && out.stderr.contains("fh-no-such-program"),
        "{}",
        out.stderr
    );
}

#[test]
fn bad_flags_are_usage_errors() {
    for (args, needle) in [
        (&["-np", "2", "--channels", "0", "true"][..], "--channels"),
        (&["-np", "2", "--schedule", "fast", "true"], "--schedule"),
        (
            &["-np", "2", "--cycle-time-ms", "-3", "true"],
            "--cycle-time-ms",
        ),
        (&["-np", "2"], "COMMAND"),
    ] {
        let out = fhrun(args, LIMIT);
        assert_eq!(out.code(), Some(2), "{args:?}: {out:?}");
        assert!(out.stderr.contains(needle), "{args:?}: {}", out.stderr);
    }
}

#[test]
fn remote_hosts_need_mpi_and_slots_are_checked() {
    let out = fhrun(&["-np", "2", "-H", "fh-remote-node-7:2", "true"], LIMIT);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.contains("fh-remote-node-7") && out.stderr.contains("add --mpi"),
        "{}",
        out.stderr
    );

    let out = fhrun(&["-np", "3", "-H", "localhost:2", "true"], LIMIT);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.contains("needs 3 slots") && out.stderr.contains("only 2"),
        "{}",
        out.stderr
    );

    // Local hosts (from a hostfile) run locally.
    let dir = TempDir::new("hostfile");
    let hf = dir.path().join("hosts");
    std::fs::write(&hf, "# this machine\nlocalhost slots=1\n127.0.0.1:1\n").unwrap();
    let out = fhrun(
        &[
            "-np",
            "2",
            "--hostfile",
            hf.to_str().unwrap(),
            "sh",
            "-c",
            "echo $FH_SIZE",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(prefixed(&out.stdout, "stdout").len(), 2);

    std::fs::write(&hf, "localhost slots=two\n").unwrap();
    let out = fhrun(
        &["-np", "1", "--hostfile", hf.to_str().unwrap(), "true"],
        LIMIT,
    );
    assert_eq!(out.code(), Some(2));
    assert!(
        out.stderr.contains(":1:") && out.stderr.contains("two"),
        "{}",
        out.stderr
    );
}

#[test]
fn mpi_dry_run_builds_the_mpirun_command() {
    let out = fhrun(
        &[
            "-np",
            "4",
            "-H",
            "fh-node-a:2,fh-node-b:2",
            "--mpi",
            "--dry-run",
            "--channels",
            "2",
            "--mpi-args",
            "--mca btl_tcp_if_include eth0",
            "-x",
            "FOO=bar",
            "-x",
            "HOME",
            "--",
            "python",
            "train.py",
            "--epochs",
            "3",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    let line = out.stdout.trim();
    let (env, cmd) = line.split_once(" mpirun ").expect(line);
    assert!(env.starts_with("env "), "{line}");
    assert!(env.contains("FH_RENDEZVOUS_ADDR=fh-node-a:"), "{line}");
    assert!(
        env.contains("FH_CHANNELS=2") && env.contains("FOO=bar"),
        "{line}"
    );
    // The token is passed through the environment and never shown.
    assert!(env.contains("'FH_JOB_TOKEN=<redacted>'"), "{line}");
    let root = unsafe { libc::geteuid() } == 0;
    let expected = format!(
        "{}-np 4 -H fh-node-a:2,fh-node-b:2 --bind-to none --map-by slot --tag-output \
         -x FH_RENDEZVOUS_ADDR -x FH_JOB_TOKEN -x FH_CHANNELS -x FOO -x HOME \
         --mca btl_tcp_if_include eth0 python train.py --epochs 3",
        if root { "--allow-run-as-root " } else { "" }
    );
    assert_eq!(cmd, expected);

    // On this machine only: oversubscription allowed, rendezvous on loopback.
    let out = fhrun(&["-np", "2", "--mpi", "--dry-run", "true"], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stdout.contains("FH_RENDEZVOUS_ADDR=127.0.0.1:"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains(" --oversubscribe ") && out.stdout.trim_end().ends_with(" true"),
        "{}",
        out.stdout
    );
}

#[test]
fn mpi_without_mpirun_says_how_to_get_it() {
    let dir = TempDir::new("nompi");
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("PATH", dir.str())
            .args(["-np", "2", "--mpi", "true"]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(127), "{out:?}");
    assert!(
        out.stderr.contains("mpirun") && out.stderr.contains("openmpi-bin"),
        "{}",
        out.stderr
    );
}

#[test]
fn local_dry_run_lists_every_rank() {
    let out = fhrun(
        &[
            "-np",
            "3",
            "--dry-run",
            "--log-level",
            "warn",
            "echo",
            "hi there",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3);
    for (r, l) in lines.iter().enumerate() {
        assert!(
            l.starts_with(&format!("rank {r}: env FH_RANK={r} FH_SIZE=3 ")),
            "{l}"
        );
        assert!(
            l.contains("FH_LOG_LEVEL=warn") && l.ends_with("echo 'hi there'"),
            "{l}"
        );
    }
}

fn mpirun_on_path() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false)
}

#[test]
fn mpi_mode_runs_through_a_real_mpirun() {
    if !mpirun_on_path() {
        eprintln!("skipped: mpirun is not on PATH (Debian: apt-get install openmpi-bin)");
        return;
    }
    let out = fhrun(
        &[
            "-np",
            "2",
            "--mpi",
            "--channels",
            "3",
            "-x",
            "MY_VAR=abc",
            "--",
            "sh",
            "-c",
            "echo \"$OMPI_COMM_WORLD_RANK $OMPI_COMM_WORLD_SIZE $FH_RENDEZVOUS_ADDR \
             $FH_JOB_TOKEN $FH_CHANNELS $MY_VAR\"",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    // mpirun --tag-output writes `[jobid,rank]<stdout>:`.
    let mut seen = BTreeSet::new();
    let mut tokens = BTreeSet::new();
    for line in out.stdout.lines() {
        let Some((tag, rest)) = line.split_once("]<stdout>:") else {
            continue;
        };
        let f: Vec<&str> = rest.split(' ').collect();
        assert_eq!(f.len(), 6, "{line}");
        assert!(tag.ends_with(&format!(",{}", f[0])), "{line}");
        assert_eq!(f[1], "2");
        assert!(f[2].starts_with("127.0.0.1:"), "{line}");
        assert!(f[3].len() >= 32, "{line}");
        assert_eq!((f[4], f[5]), ("3", "abc"));
        seen.insert(f[0].to_string());
        tokens.insert(f[3].to_string());
    }
    assert_eq!(seen, ["0", "1"].map(String::from).into(), "{out:?}");
    assert_eq!(tokens.len(), 1);
}

#[test]
fn x_name_passes_fhruns_value_and_refuses_an_unset_one() {
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_TEST_PASSED", "from fhrun")
            .env_remove("FH_TEST_UNSET")
            .args([
                "-np",
                "2",
                "-x",
                "FH_TEST_PASSED",
                "sh",
                "-c",
                "echo \"$FH_TEST_PASSED\"",
            ]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines = prefixed(&out.stdout, "stdout");
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|(_, l)| *l == "from fhrun"), "{out:?}");

    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env_remove("FH_TEST_UNSET")
            .args(["-np", "1", "-x", "FH_TEST_UNSET", "true"]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.contains("FH_TEST_UNSET is not set"),
        "{}",
        out.stderr
    );
}
