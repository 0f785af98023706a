//! fhrun's elastic driver end to end, with `fh-elastic-probe` as the worker.
//!
//! The "hosts" are names of this machine — `localhost`, `127.0.0.1`, `127.0.0.2`,
//! `127.0.0.3` (every 127.x address is loopback, so fhrun starts their parts directly, as it
//! would start this machine's part in a real job). They are distinct hosts to the driver (its
//! blacklist, its generations, its output prefixes); to the transport they are one machine
//! (the rendezvous settles hosts from facts), which the probe does not care about.

mod common;

use std::process::Command;
use std::time::Duration;

use common::elastic::{
    all_pids, discovery, no_worker_left, probe_pid, set_hosts, start, LIMIT, PROBE,
};
use common::{alive, kill_all, Running, TempDir};

#[test]
fn a_lost_host_shrinks_the_world_and_a_new_host_grows_it() {
    let dir = TempDir::new("elastic-grow");
    let script = discovery(&dir, &["localhost", "127.0.0.1", "127.0.0.2"]);
    let mut run = start(
        &script,
        &dir,
        &["-np", "3", "--min-np", "2", "--elastic-timeout", "30"],
    );
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 3 ranks on localhost, 127.0.0.1, 127.0.0.2")
            && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    let first = run.stdout_now();
    let victim = probe_pid(&first, 0, "127.0.0.2:0").unwrap();
    let keeper = probe_pid(&first, 0, "localhost:0").unwrap();
    kill_all(&[victim]);
    run.wait_for(LIMIT, |_, err| {
        err.contains(
            "generation 1: 2 ranks on localhost, 127.0.0.1 (lost 127.0.0.2: rank 2 killed by \
             SIGKILL)",
        )
    });
    // A fourth host appears: the world grows at the workers' next host-update check.
    set_hosts(&dir, &["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 2: 3 ranks on localhost, 127.0.0.1, 127.0.0.3")
            && probe_pid(out, 2, "127.0.0.3:0").is_some()
            && probe_pid(out, 2, "localhost:0").is_some()
            && probe_pid(out, 2, "127.0.0.1:0").is_some()
    });
    let out = run.stdout_now();
    // The survivors are the same processes, with their ranks kept; the new worker is last.
    assert_eq!(probe_pid(&out, 2, "localhost:0"), Some(keeper));
    assert!(
        out.contains("generation 2 rank 0 size 3 sum 3 worker localhost:0"),
        "{out}"
    );
    assert!(
        out.contains("generation 2 rank 2 size 3 sum 3 worker 127.0.0.3:0"),
        "{out}"
    );
    // The blacklisted host never came back.
    assert_eq!(probe_pid(&out, 2, "127.0.0.2:0"), None);
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let pids = all_pids(&out);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    no_worker_left(&pids);
    assert!(!alive(victim));
}

#[test]
fn losing_rank_0_leaves_the_survivors_running() {
    // Rank 0 is the rendezvous root and the coordinator; its loss is reported by every
    // survivor's engine naming rank 0, which must not stop a survivor (its part has a worker
    // at index 0 too).
    let dir = TempDir::new("elastic-rank0");
    let script = discovery(&dir, &["localhost", "127.0.0.1", "127.0.0.2"]);
    let mut run = start(
        &script,
        &dir,
        &["-np", "3", "--min-np", "2", "--elastic-timeout", "30"],
    );
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 3 ranks on localhost, 127.0.0.1, 127.0.0.2")
            && probe_pid(out, 0, "localhost:0").is_some()
            && probe_pid(out, 0, "127.0.0.1:0").is_some()
            && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    let first = run.stdout_now();
    let victim = probe_pid(&first, 0, "localhost:0").unwrap();
    let keepers = [
        probe_pid(&first, 0, "127.0.0.1:0").unwrap(),
        probe_pid(&first, 0, "127.0.0.2:0").unwrap(),
    ];
    kill_all(&[victim]);
    run.wait_for(LIMIT, |out, _| {
        out.contains("generation 1 rank 0 size 2 sum 2 worker 127.0.0.1:0")
            && out.contains("generation 1 rank 1 size 2 sum 2 worker 127.0.0.2:0")
    });
    let out = run.stdout_now();
    assert_eq!(probe_pid(&out, 1, "127.0.0.1:0"), Some(keepers[0]));
    assert_eq!(probe_pid(&out, 1, "127.0.0.2:0"), Some(keepers[1]));
    // Longer than a part would wait before stopping its workers on another's word (a notice
    // window and the kill grace): the survivors must still train.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        keepers.iter().all(|&p| alive(p)),
        "a survivor was stopped after rank 0's loss:\n{}",
        run.stderr_now()
    );
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr.contains(
            "generation 1: 2 ranks on 127.0.0.1, 127.0.0.2 (lost localhost: rank 0 killed by \
             SIGKILL)"
        ),
        "{}",
        done.stderr
    );
    no_worker_left(&all_pids(&out));
}

#[test]
fn fewer_than_min_np_fails_naming_the_lost_host() {
    let dir = TempDir::new("elastic-min");
    let script = discovery(&dir, &["localhost", "127.0.0.2"]);
    let mut run = start(&script, &dir, &["--min-np", "2", "--elastic-timeout", "2"]);
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 2 ranks") && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    let out = run.stdout_now();
    kill_all(&[probe_pid(&out, 0, "127.0.0.2:0").unwrap()]);
    let pids = all_pids(&out);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr.contains(
            "fhrun: elastic job failed: fewer than --min-np 2 ranks remain (lost: 127.0.0.2 \
             (rank 1 killed by SIGKILL))"
        ),
        "{}",
        done.stderr
    );
    no_worker_left(&pids);
}

#[test]
fn a_bad_discovery_line_is_an_error_naming_it() {
    let dir = TempDir::new("elastic-bad");
    let script = discovery(&dir, &["localhost", "127.0.0.2:zero"]);
    let done = start(&script, &dir, &["--min-np", "1"]).wait(LIMIT);
    assert_eq!(done.code(), Some(1), "{}", done.stderr);
    assert!(
        done.stderr.contains("line 2") && done.stderr.contains("invalid slot count 'zero'"),
        "{}",
        done.stderr
    );
}

#[test]
fn elastic_flags_need_a_discovery_script_or_min_np() {
    let done = common::fhrun(&["-np", "2", "--max-np", "2", "true"], LIMIT);
    assert_eq!(done.code(), Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("--max-np is only for an elastic job")
            && done.stderr.contains("--host-discovery-script")
            && done.stderr.contains("--min-np N"),
        "{}",
        done.stderr
    );
    // --min-np alone makes the job elastic, but it needs hosts.
    let done = common::fhrun(&["--min-np", "2", "true"], LIMIT);
    assert_eq!(done.code(), Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("which needs hosts"), "{}", done.stderr);
    // Fixed hosts offering fewer slots than -np.
    let done = common::fhrun(
        &["-np", "3", "--min-np", "1", "-H", "localhost:2", "true"],
        LIMIT,
    );
    assert_eq!(done.code(), Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("offer only 2"), "{}", done.stderr);
}

/// Horovod's elastic examples run as `horovodrun -np 2 --min-np 1 -H h1:1,h2:1 ...`: fault
/// tolerance on fixed hosts, no discovery script.
#[test]
fn min_np_on_fixed_hosts_survives_a_lost_host() {
    let dir = TempDir::new("elastic-fixed");
    let stop = format!("PROBE_STOP={}/stop", dir.str());
    let mut run = Running::start_cmd(Command::new(common::FHRUN).args([
        "-np",
        "2",
        "--min-num-proc",
        "1",
        "-H",
        "localhost:1,127.0.0.2:1",
        "-x",
        &stop,
        "--kill-grace",
        "1",
        "--timeout",
        "120",
        PROBE,
    ]));
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 2 ranks on localhost, 127.0.0.2")
            && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    kill_all(&[probe_pid(&run.stdout_now(), 0, "127.0.0.2:0").unwrap()]);
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 1: 1 rank on localhost (lost 127.0.0.2: rank 1 killed by SIGKILL)")
            && probe_pid(out, 1, "localhost:0").is_some()
    });
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let pids = all_pids(&run.stdout_now());
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    no_worker_left(&pids);
}

/// A world with none of the last one's members would start training over: refused. The only
/// member freezes (it never registers again) while a new host's worker registers.
#[test]
fn a_world_without_a_member_of_the_last_one_is_refused() {
    let dir = TempDir::new("elastic-nostate");
    let script = discovery(&dir, &["localhost"]);
    let mut run = start(
        &script,
        &dir,
        &[
            "--min-np",
            "1",
            "--start-timeout",
            "2",
            "--elastic-timeout",
            "1",
        ],
    );
    run.wait_for(LIMIT, |out, _| probe_pid(out, 0, "localhost:0").is_some());
    let frozen = probe_pid(&run.stdout_now(), 0, "localhost:0").unwrap();
    // SAFETY: a signal to a process this test started.
    unsafe { libc::kill(frozen, libc::SIGSTOP) };
    set_hosts(&dir, &["localhost", "127.0.0.2"]);
    let done = run.wait(LIMIT);
    kill_all(&[frozen]);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr.contains(
            "elastic job failed: no worker of generation 0 remains to synchronise the training \
             state from, and the new workers (127.0.0.2:0) hold none"
        ) && done.stderr.contains("did not register within 2 s"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("generation 1"), "{}", done.stderr);
}

/// A worker whose interpreter starts slowly is not lost to a short --elastic-timeout (Horovod's
/// tests use 1 s): registration has its own bound, --start-timeout.
#[test]
fn a_slow_starting_worker_joins_despite_a_short_elastic_timeout() {
    let dir = TempDir::new("elastic-slow");
    let script = discovery(&dir, &["localhost", "127.0.0.2"]);
    let slow =
        format!("if [ \"$FH_ELASTIC_WORKER\" = 127.0.0.2:0 ]; then sleep 3; fi; exec {PROBE}");
    let mut run = Running::start_cmd(Command::new(common::FHRUN).args([
        "--host-discovery-script",
        &script,
        "--min-np",
        "1",
        "--elastic-timeout",
        "1",
        "-x",
        &format!("PROBE_STOP={}/stop", dir.str()),
        "--kill-grace",
        "1",
        "--timeout",
        "120",
        "sh",
        "-c",
        &slow,
    ]));
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0") && probe_pid(out, 0, "localhost:0").is_some()
    });
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    assert!(
        done.stderr
            .contains("generation 0: 2 ranks on localhost, 127.0.0.2"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("lost"), "{}", done.stderr);
}

/// Each worker gets horovodrun's launch variables of its slot in the first world, which
/// scripts read before `init()`.
#[test]
fn workers_get_horovods_launch_variables() {
    let dir = TempDir::new("elastic-vars");
    let script = discovery(&dir, &["localhost:2", "127.0.0.2"]);
    let show = format!(
        "echo \"vars $FH_ELASTIC_WORKER $HOROVOD_RANK $HOROVOD_SIZE $HOROVOD_LOCAL_RANK \
         $HOROVOD_LOCAL_SIZE $HOROVOD_CROSS_RANK $HOROVOD_CROSS_SIZE\"; exec {PROBE}"
    );
    let mut run = Running::start_cmd(Command::new(common::FHRUN).args([
        "--host-discovery-script",
        &script,
        "-np",
        "3",
        "-x",
        &format!("PROBE_STOP={}/stop", dir.str()),
        "--kill-grace",
        "1",
        "--timeout",
        "120",
        "sh",
        "-c",
        &show,
    ]));
    run.wait_for(LIMIT, |_, err| err.contains("generation 0: 3 ranks"));
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    for (worker, vars, rank) in [
        ("localhost:0", "0 3 0 2 0 2", 0),
        ("localhost:1", "1 3 1 2 0 2", 1),
        ("127.0.0.2:0", "2 3 0 1 1 2", 2),
    ] {
        assert!(
            done.stdout.contains(&format!("vars {worker} {vars}")),
            "{worker}: {}",
            done.stdout
        );
        // The world that formed is the one the variables announced.
        assert!(
            done.stdout.contains(&format!(
                "generation 0 rank {rank} size 3 sum 3 worker {worker}"
            )),
            "{worker}: {}",
            done.stdout
        );
    }
}

#[test]
fn max_np_caps_the_workers_and_np_waits_for_enough_slots() {
    let dir = TempDir::new("elastic-cap");
    // Two slots offered; -np 3 waits for a third.
    let script = discovery(&dir, &["localhost", "127.0.0.1"]);
    let mut run = start(
        &script,
        &dir,
        &[
            "-np",
            "3",
            "--min-np",
            "1",
            "--max-np",
            "3",
            "--elastic-timeout",
            "30",
        ],
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !run.stderr_now().contains("generation 0"),
        "{}",
        run.stderr_now()
    );
    assert!(
        !run.stdout_now().contains("generation 0"),
        "{}",
        run.stdout_now()
    );
    set_hosts(&dir, &["localhost", "127.0.0.1", "127.0.0.2:2"]);
    run.wait_for(LIMIT, |out, err| {
        err.contains("generation 0: 3 ranks on localhost, 127.0.0.1, 127.0.0.2")
            && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let out = run.stdout_now();
    let pids = all_pids(&out);
    let done = run.wait(LIMIT);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    // --max-np 3: the second slot of 127.0.0.2 never started.
    assert!(!done.stdout.contains("[127.0.0.2:1]"), "{}", done.stdout);
    no_worker_left(&pids);
}
