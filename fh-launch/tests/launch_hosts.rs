//! fhrun end to end across hosts: hosts and slots through the rsh agent, and the local dry
//! run. (The `--mpi` command: `launch_mpi.rs`; other hosts' records: `far_host_records.rs`.)

mod common;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn remote_hosts_go_through_the_rsh_agent_and_slots_are_checked() {
    // An agent that cannot be started: a clear error naming the ranks, the host and the agent.
    let out = fhrun(
        &[
            "-np",
            "2",
            "-H",
            "fh-remote-node-7:2",
            "--rsh-agent",
            "/nonexistent/fh-agent",
            "true",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(1), "{out:?}");
    assert!(
        out.stderr.contains("ranks 0-1 on fh-remote-node-7")
            && out.stderr.contains("/nonexistent/fh-agent"),
        "{}",
        out.stderr
    );

    // The plan: local ranks with their variables (the token redacted), the remote ranks through
    // the agent, whose command line holds only the host, fhrun's path and the remote flag.
    let out = fhrun(
        &[
            "-np",
            "3",
            "-H",
            "localhost:1,fh-remote-node-7:2",
            "--rsh-agent",
            "ssh -p 2222",
            "--dry-run",
            "true",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", out.stdout);
    assert!(lines[0].starts_with("rank 0: env "), "{}", lines[0]);
    for want in [
        "FH_RANK=0",
        "FH_SIZE=3",
        "FH_LOCAL_SIZE=1",
        "FH_CROSS_RANK=0",
        "FH_CROSS_SIZE=2",
        "FH_JOB_TOKEN=<redacted>",
    ] {
        assert!(lines[0].contains(want), "{want}: {}", lines[0]);
    }
    let remote: Vec<&str> = lines[1].split(' ').collect();
    assert_eq!(
        remote[..7],
        [
            "ranks",
            "1-2",
            "on",
            "fh-remote-node-7:",
            "ssh",
            "-p",
            "2222"
        ]
    );
    assert_eq!(remote[7], "fh-remote-node-7");
    assert!(remote[8].ends_with("fhrun"), "{}", lines[1]);
    assert_eq!(remote[9..], ["--internal-fhrun-remote"]);

    // With --mpi the agent is mpirun's business: one set in the environment is no error.
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args(["-np", "2", "-H", "a:1,b:1", "--mpi", "--dry-run", "true"])
            .env("FH_RSH_AGENT", "ssh -p 2222"),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains("mpirun "), "{}", out.stdout);

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
