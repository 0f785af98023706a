//! fhrun's `--mpi` command: the dry run, the message without mpirun, and a real `mpirun` when
//! Open MPI is installed, with signals and the timeout passed on to it.

mod common;
use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

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
    // torch.distributed's env:// store beside it (see launch_env.rs).
    assert!(env.contains("MASTER_ADDR=fh-node-a "), "{line}");
    assert!(
        env.contains("FH_CHANNELS=2") && env.contains("FOO=bar"),
        "{line}"
    );
    // The token is passed through the environment and never shown.
    assert!(env.contains("'FH_JOB_TOKEN=<redacted>'"), "{line}");
    let root = unsafe { libc::geteuid() } == 0;
    let expected = format!(
        "{}-np 4 -H fh-node-a:2,fh-node-b:2 --bind-to none --map-by slot --tag-output \
         -x FH_RENDEZVOUS_ADDR -x FH_JOB_TOKEN -x MASTER_ADDR -x MASTER_PORT -x FH_CHANNELS \
         -x FH_FHRUN_VERSION -x FOO -x HOME \
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

/// Ranks under mpirun that say so when they get SIGUSR1, print their pid, and otherwise wait
/// 30 s (longer than a test waits for them to go).
const MPI_SIGNAL_RANK: &str = "r=$OMPI_COMM_WORLD_RANK\n\
    trap 'echo usr1 $r' USR1\n\
    echo pid $$\n\
    i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n";

/// The pids the ranks printed.
fn rank_pids(stdout: &str) -> Vec<i32> {
    stdout
        .lines()
        .filter_map(|l| l.split_once("<stdout>:pid ")?.1.trim().parse().ok())
        .collect()
}

#[test]
fn mpi_mode_passes_signals_and_the_timeout_on_to_mpirun() {
    if !mpirun_on_path() {
        eprintln!("skipped: mpirun is not on PATH (Debian: apt-get install openmpi-bin)");
        return;
    }
    // SIGUSR1 reaches every rank (through mpirun); SIGINT stops the job: 130.
    let mut run = Running::start(&["-np", "2", "--mpi", "sh", "-c", MPI_SIGNAL_RANK]);
    run.wait_for(LIMIT, |out, _| rank_pids(out).len() == 2);
    let pids = rank_pids(&run.stdout_now());
    run.signal(libc::SIGUSR1);
    run.wait_for(LIMIT, |out, _| {
        out.contains("usr1 0") && out.contains("usr1 1")
    });
    run.signal(libc::SIGINT);
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(130), "{out:?}");
    assert!(
        out.stderr.contains("received SIGINT; stopping mpirun"),
        "{out:?}"
    );
    none_left(&pids, "ranks");

    // fhrun itself SIGKILLed: mpirun dies with it, and the ranks (which mpirun would leave
    // running) with their guardian.
    let mut run = Running::start(&["-np", "2", "--mpi", "sh", "-c", MPI_SIGNAL_RANK]);
    run.wait_for(LIMIT, |out, _| rank_pids(out).len() == 2);
    let pids = rank_pids(&run.stdout_now());
    // The guardian learns of the ranks' groups within 200 ms of their start.
    std::thread::sleep(Duration::from_millis(500));
    run.signal(libc::SIGKILL);
    drop(run.wait(LIMIT));
    none_left(&pids, "ranks");

    // --timeout: the ranks are asked for their records (SIGUSR1), then stopped: 124. (Long
    // enough for mpirun to start them, and their shells to set their trap, on a busy machine.)
    let out = fhrun(
        &[
            "-np",
            "2",
            "--mpi",
            "--timeout",
            "5",
            "sh",
            "-c",
            MPI_SIGNAL_RANK,
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(124), "{out:?}");
    // (How the ranks end after SIGTERM, and whether mpirun relays what they say then, is
    // mpirun's business.)
    for want in ["usr1 0", "usr1 1"] {
        assert!(out.stdout.contains(want), "{want:?} not in {out:?}");
    }
    let pids = rank_pids(&out.stdout);
    assert_eq!(pids.len(), 2, "{out:?}");
    none_left(&pids, "ranks");
}
