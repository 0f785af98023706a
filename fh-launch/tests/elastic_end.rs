//! fhrun's elastic driver end to end, how a job ends: a worker's exit 0 ends it (also one
//! started meanwhile, one that never joined, one whose report comes late), every rank
//! failing fails it at once, the reset limit, Ctrl-C. The hosts and the probe are as in
//! `elastic.rs`.

mod common;

use std::process::Command;
use std::time::Duration;

use common::elastic::{
    all_pids, discovery, no_worker_left, probe_pid, set_hosts, start, LIMIT, PROBE,
};
use common::{kill_all, Running, TempDir};

#[test]
fn a_command_that_never_joins_fails_at_once() {
    let dir = TempDir::new("elastic-never");
    let script = discovery(&dir, &["localhost", "127.0.0.2"]);
    // The elastic timeout is far longer than the test's bound: the failure must not wait it.
    let done = Running::start_cmd(Command::new(common::FHRUN).args([
        "--host-discovery-script",
        &script,
        "--min-np",
        "2",
        "--elastic-timeout",
        "600",
        "--kill-grace",
        "1",
        "sh",
        "-c",
        "echo no such module >&2; exit 3",
    ]))
    .wait(LIMIT);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr.contains(
            "fhrun: elastic job failed: every worker ended before the first world formed"
        ) && done.stderr.contains("exited with code 3"),
        "{}",
        done.stderr
    );
}

/// A worker fhrun starts while the job finishes (a host just discovered) must not train
/// again from the start once the job's last workers exited 0: the job ends at its first
/// success, as Horovod's does (its scenario ran 10 epochs instead of 5).
#[test]
fn a_worker_started_while_the_job_finishes_never_trains() {
    let dir = TempDir::new("elastic-late");
    let script = discovery(&dir, &["localhost"]);
    let mut cmd = Command::new(common::FHRUN);
    cmd.args([
        "--host-discovery-script",
        &script,
        "-np",
        "1",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "-x",
        &format!("PROBE_STOP={}/stop", dir.str()),
        "-x",
        "PROBE_LINGER_MS=4000",
        "--kill-grace",
        "1",
        "--timeout",
        "120",
        PROBE,
    ]);
    let mut run = Running::start_cmd(&mut cmd);
    run.wait_for(LIMIT, |out, _| probe_pid(out, 0, "localhost:0").is_some());
    // The last rank agrees to stop and lingers; a second host appears meanwhile.
    std::fs::write(dir.path().join("stop"), "").unwrap();
    run.wait_for(LIMIT, |out, _| out.contains("probe: done in generation 0"));
    set_hosts(&dir, &["localhost", "127.0.0.2"]);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    assert!(!done.stderr.contains("generation 1"), "{}", done.stderr);
    assert!(
        !done.stdout.contains("generation 1 rank"),
        "the late worker trained: {}",
        done.stdout
    );
}

/// `sh -c 'exit 0'` never joins a world: its success ends the job (it was restarted ~36
/// times a second, for ever).
#[test]
fn a_command_that_exits_0_before_joining_ends_the_job() {
    let dir = TempDir::new("elastic-exit0");
    let script = discovery(&dir, &["localhost"]);
    let done = Running::start_cmd(Command::new(common::FHRUN).args([
        "--host-discovery-script",
        &script,
        "-np",
        "1",
        "sh",
        "-c",
        "echo ran; exit 0",
    ]))
    .wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    assert_eq!(done.stdout.matches("ran").count(), 1, "{}", done.stdout);
    assert!(
        done.stderr
            .contains("the job is finishing: worker localhost:0 exited 0"),
        "{}",
        done.stderr
    );
}

/// When every rank of the running world fails, no worker holds the state: the job fails at
/// once, not after --elastic-timeout.
#[test]
fn every_rank_failing_fails_the_job_at_once() {
    let dir = TempDir::new("elastic-allfail");
    let script = discovery(&dir, &["localhost", "127.0.0.2"]);
    let mut run = start(
        &script,
        &dir,
        &["--min-np", "1", "--elastic-timeout", "600"],
    );
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 2 ranks") && all_pids(out).len() == 2
    });
    let pids = all_pids(&run.stdout_now());
    kill_all(&pids);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr.contains(
            "fhrun: elastic job failed: every rank of generation 0 has ended, so no worker holds \
             the training state any more"
        ) && done.stderr.contains("killed by SIGKILL"),
        "{}",
        done.stderr
    );
}

#[test]
fn the_reset_limit_ends_the_job() {
    let dir = TempDir::new("elastic-reset");
    let script = discovery(&dir, &["localhost", "127.0.0.1", "127.0.0.2"]);
    let mut run = start(
        &script,
        &dir,
        &[
            "--min-np",
            "1",
            "--reset-limit",
            "0",
            "--elastic-timeout",
            "30",
        ],
    );
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 3 ranks") && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    let out = run.stdout_now();
    kill_all(&[probe_pid(&out, 0, "127.0.0.2:0").unwrap()]);
    let pids = all_pids(&out);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr
            .contains("elastic job failed: --reset-limit 0 reached")
            && done
                .stderr
                .contains("lost: 127.0.0.2 (rank 2 killed by SIGKILL)"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("generation 1"), "{}", done.stderr);
    no_worker_left(&pids);
}

#[test]
fn ctrl_c_stops_every_worker() {
    let dir = TempDir::new("elastic-int");
    let script = discovery(&dir, &["localhost", "127.0.0.2"]);
    let mut run = start(&script, &dir, &["--min-np", "2"]);
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 2 ranks") && all_pids(out).len() == 2
    });
    let pids = all_pids(&run.stdout_now());
    run.signal(libc::SIGINT);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(130), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr
            .contains("received SIGINT; stopping all workers"),
        "{}",
        done.stderr
    );
    no_worker_left(&pids);
}

/// A worker's last words still on their way when its part ends: fhrun's stdout is read
/// slowly, so the relay of the part's stdout is far behind when the part is reaped. The exit
/// report behind that output must still count (the worker exited 0: the job ends), not make
/// the worker "gone with its part", its host free and the command start again.
#[test]
fn an_exit_report_behind_slow_output_still_ends_the_job() {
    use std::io::Read;
    use std::process::Stdio;

    let dir = TempDir::new("elastic-slow-out");
    let script = discovery(&dir, &["localhost"]);
    // 250 kB of output (more than the pipes between the worker and fhrun hold), then "ran".
    let worker = "i=0; while [ $i -lt 2500 ]; do \
                  echo 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'; \
                  i=$((i+1)); done; echo ran; exit 0";
    let mut child = Command::new(common::FHRUN)
        .args([
            "--host-discovery-script",
            &script,
            "-np",
            "1",
            "--timeout",
            "60",
            "sh",
            "-c",
            worker,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fhrun");
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        // Nothing read for a while (the pipes fill and the worker waits), then slowly for 3 s
        // (the part ends meanwhile, ~2 s of output behind its relay), then at full speed: the
        // report is never more than ~3 s behind its part's end, within fhrun's grace.
        std::thread::sleep(Duration::from_millis(1500));
        let slow_until = std::time::Instant::now() + Duration::from_secs(3);
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if std::time::Instant::now() < slow_until {
                std::thread::sleep(Duration::from_millis(4));
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    let mut err = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fhrun did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = reader.join().unwrap();
    let stderr = err_reader.join().unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_eq!(
        stdout.matches("ran").count(),
        1,
        "the command ran again: {stderr}"
    );
    assert!(
        stderr.contains("the job is finishing: worker localhost:0 exited 0"),
        "{stderr}"
    );
}
