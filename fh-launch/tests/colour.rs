//! Colour only on a terminal, never with `NO_COLOR`: log lines of ranks run through fhrun (and
//! of fh-selftest alone), written to a pipe, carry no escape sequences unless asked for with
//! `FH_LOG_COLOR=always` — and not even then when `NO_COLOR` is set.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SELFTEST: &str = env!("CARGO_BIN_EXE_fh-selftest");
const LIMIT: Duration = Duration::from_secs(60);
const ESC: char = '\u{1b}';

/// fhrun running two fh-selftest ranks at debug level, with `env` added; output to pipes.
fn fhrun_debug(env: &[(&str, &str)]) -> Finished {
    let mut cmd = Command::new(FHRUN);
    cmd.args([
        "-np",
        "2",
        "--log-level",
        "debug",
        "--timeout-seconds",
        "20",
        SELFTEST,
        "--iters",
        "1",
        "--bytes",
        "4096",
    ])
    .env_remove("NO_COLOR")
    .env_remove("FH_LOG_COLOR")
    .envs(env.iter().copied());
    let out = Running::start_cmd(&mut cmd).wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    // The ranks did log (so the check below looks at real log lines).
    assert!(
        prefixed(&out.stderr, "stderr")
            .iter()
            .chain(prefixed(&out.stdout, "stderr").iter())
            .any(|(_, l)| l.contains("DEBUG")),
        "no debug lines: {out:?}"
    );
    out
}

/// fh-selftest as a single process at debug level, with `env`; its stderr through a pipe.
fn selftest_alone(env: &[(&str, &str)]) -> String {
    let child = Command::new(SELFTEST)
        .args(["--iters", "1", "--bytes", "4096"])
        .env_remove("NO_COLOR")
        .env_remove("FH_LOG_COLOR")
        .env("FH_LOG_LEVEL", "debug")
        .env("FH_TIMEOUT_SECONDS", "20")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fh-selftest");
    // Bounded: fh-selftest alone runs for well under a second; a guard thread kills it late.
    let pid = child.id() as i32;
    let start = Instant::now();
    let watchdog = std::thread::spawn(move || {
        while start.elapsed() < LIMIT {
            if !alive(pid) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        kill_all(&[pid]);
    });
    let out = child.wait_with_output().expect("fh-selftest output");
    let _ = watchdog.join();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("DEBUG"), "no debug lines: {err}");
    err
}

#[test]
fn fhrun_output_through_a_pipe_has_no_colour() {
    let out = fhrun_debug(&[]);
    assert!(
        !out.stdout.contains(ESC),
        "escape in stdout: {:?}",
        out.stdout
    );
    assert!(
        !out.stderr.contains(ESC),
        "escape in stderr: {:?}",
        out.stderr
    );
}

#[test]
fn no_color_wins_even_over_fh_log_color_always() {
    let out = fhrun_debug(&[("NO_COLOR", "1"), ("FH_LOG_COLOR", "always")]);
    assert!(
        !out.stdout.contains(ESC) && !out.stderr.contains(ESC),
        "{out:?}"
    );
    let err = selftest_alone(&[("NO_COLOR", "1"), ("FH_LOG_COLOR", "always")]);
    assert!(!err.contains(ESC), "{err:?}");
}

#[test]
fn selftest_colours_only_when_asked() {
    assert!(!selftest_alone(&[]).contains(ESC));
    assert!(!selftest_alone(&[("FH_LOG_COLOR", "never")]).contains(ESC));
    // The check can see colour: asked for, it is there.
    assert!(selftest_alone(&[("FH_LOG_COLOR", "always")]).contains(ESC));
}
