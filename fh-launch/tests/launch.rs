//! fhrun end to end with shell ranks: output prefixes, exit codes, timeouts, a missing command,
//! bad flags. The environment, signals and hosts/mpirun have files of their own
//! (`launch_env.rs`, `launch_signals.rs`, `launch_hosts.rs`).

mod common;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

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
