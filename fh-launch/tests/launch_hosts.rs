//! fhrun end to end: hosts and slots, the `--mpi` command (dry run and a real `mpirun` when Open
//! MPI is installed, signals and the timeout passed on to it), the local dry run, and the flight records and timelines of another host.

mod common;
use std::collections::BTreeSet;
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
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(left.is_empty(), "ranks outlived fhrun: {left:?}");

    // fhrun itself SIGKILLed: mpirun dies with it, and the ranks (which mpirun would leave
    // running) with their guardian.
    let mut run = Running::start(&["-np", "2", "--mpi", "sh", "-c", MPI_SIGNAL_RANK]);
    run.wait_for(LIMIT, |out, _| rank_pids(out).len() == 2);
    let pids = rank_pids(&run.stdout_now());
    // The guardian learns of the ranks' groups within 200 ms of their start.
    std::thread::sleep(Duration::from_millis(500));
    run.signal(libc::SIGKILL);
    drop(run.wait(LIMIT));
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(
        left.is_empty(),
        "ranks outlived a SIGKILLed fhrun: {left:?}"
    );

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
    let left = survivors_after(&pids, Duration::from_secs(10));
    kill_all(&left);
    assert!(left.is_empty(), "ranks outlived fhrun: {left:?}");
}

/// A job of two "hosts": this machine (rank 0) and `fh-far-host` (rank 1), whose part an rsh
/// agent runs here in a mount namespace of its own where fhrun's temporary directory is an
/// empty tmpfs — as on another host, fhrun's job directory is not there — and `TMPDIR` is
/// another directory. Each rank writes the flight record and timeline it finds in `templates`
/// to where its variables say, prints its flight directory, and then, with `fail`, rank 1
/// fails and rank 0 waits to be stopped. `None`: this machine cannot run it (no `unshare -m`).
fn two_hosts(dir: &TempDir, extra: &[&str], fail: bool) -> Option<Finished> {
    let (agent, near) = far_host_agent(dir)?;
    let templates = dir.path().join("templates");
    std::fs::create_dir_all(&templates).unwrap();
    for rank in 0..2 {
        std::fs::write(
            templates.join(format!("record-{rank}.json")),
            flight_record(rank, 2),
        )
        .unwrap();
        let timeline = format!(
            "[{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"tid\":0,\"args\":\
             {{\"name\":\"rank {rank}\",\"rank\":{rank},\"origin_unix_us\":1000}}}},\n\
             {{\"name\":\"work of rank {rank}\",\"ph\":\"X\",\"ts\":1,\"dur\":1,\"pid\":0,\"tid\":0}}]"
        );
        std::fs::write(templates.join(format!("timeline-{rank}.json")), timeline).unwrap();
    }
    let script = "set -e\n\
        tl=$(printf %s \"$FH_TIMELINE\" | sed \"s/{rank}/$FH_RANK/\")\n\
        mkdir -p \"$FH_FLIGHT_DIR\" \"$(dirname \"$tl\")\"\n\
        cp \"$1/record-$FH_RANK.json\" \"$FH_FLIGHT_DIR/rank-$FH_RANK.json\"\n\
        [ -z \"$FH_TIMELINE\" ] || cp \"$1/timeline-$FH_RANK.json\" \"$tl\"\n\
        echo \"flight dir $FH_FLIGHT_DIR\"\n\
        if [ \"$2\" = fail ]; then\n\
          if [ \"$FH_RANK\" = 1 ]; then sleep 1; exit 3; fi\n\
          sleep 30\n\
        fi\n";
    let mut args = vec![
        "-np",
        "2",
        "-H",
        "localhost:1,fh-far-host:1",
        "--rsh-agent",
        agent.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let templates = templates.to_str().unwrap().to_string();
    args.extend([
        "sh",
        "-c",
        script,
        "rank",
        &templates,
        if fail { "fail" } else { "pass" },
    ]);
    Some(
        Running::start_cmd(
            std::process::Command::new(FHRUN)
                .args(&args)
                .env("TMPDIR", &near),
        )
        .wait(LIMIT),
    )
}

/// Every file under `dir` (depth 2).
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        found.push(e.file_name().to_string_lossy().into_owned());
    }
    found
}

#[test]
fn the_timeline_has_a_track_for_every_rank_of_every_host() {
    let dir = TempDir::new("gather-timeline");
    let out_file = dir.path().join("timeline.json");
    let Some(out) = two_hosts(
        &dir,
        &["--timeline-filename", out_file.to_str().unwrap()],
        false,
    ) else {
        return;
    };
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stderr.contains("timeline of 2 ranks")
            && out.stderr.contains(out_file.to_str().unwrap()),
        "{}",
        out.stderr
    );
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    let works: BTreeSet<(u64, String)> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"].as_str().unwrap_or("").starts_with("work of"))
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        works,
        BTreeSet::from([(0, "work of rank 0".into()), (1, "work of rank 1".into())])
    );
    // The far rank wrote into its part's own directory, under the far TMPDIR.
    let far = dir.path().join("far");
    let far_lines = prefixed(&out.stdout, "stdout");
    assert!(
        far_lines
            .iter()
            .any(|(r, l)| *r == 1
                && l.contains(&format!("flight dir {}/fhrun-part-", far.display()))),
        "{}",
        out.stdout
    );
    // Nothing is left behind: neither the part's directory nor fhrun's.
    assert!(files_under(&far).is_empty(), "{:?}", files_under(&far));
    assert!(
        files_under(&dir.path().join("near")).is_empty(),
        "{:?}",
        files_under(&dir.path().join("near"))
    );
}

#[test]
fn a_failed_job_keeps_and_explains_the_flight_records_of_every_host() {
    let dir = TempDir::new("gather-flight");
    let Some(out) = two_hosts(&dir, &[], true) else {
        return;
    };
    assert_eq!(out.code(), Some(3), "{out:?}");
    let said = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("fhrun: flight records of 2 ranks (0, 1) are in "))
        .unwrap_or_else(|| panic!("{}", out.stderr));
    let kept = std::path::PathBuf::from(said.split(';').next().unwrap());
    assert!(
        kept.starts_with(dir.path().join("near")),
        "{}",
        kept.display()
    );
    let mut files = files_under(&kept);
    files.sort();
    assert_eq!(files, ["rank-0.json", "rank-1.json"]);
    for want in [
        "fhrun: flight records of ranks 0 and 1 (of 2 ranks)",
        "fhrun:   written by ranks 0 and 1 for: engine stopped",
        "fhrun: last collective every rank completed: \"allreduce.warmup\"",
    ] {
        assert!(out.stderr.contains(want), "{want}: {}", out.stderr);
    }
    assert!(files_under(&dir.path().join("far")).is_empty());
}

/// SIGUSR1 to fhrun while a job of two "hosts" (as in [`two_hosts`]) runs, its ranks waiting
/// for the test's word to end: each rank writes its flight record on SIGUSR1 (as the runtime
/// does), and the far rank's reaches fhrun's job directory — fhrun saying where — while the
/// job still runs, not only when its part ends; then the job ends well and keeps them.
#[test]
fn sigusr1_brings_the_far_hosts_records_while_the_job_runs() {
    let dir = TempDir::new("gather-usr1");
    let Some((agent, near)) = far_host_agent(&dir) else {
        return;
    };
    let templates = dir.path().join("templates");
    std::fs::create_dir_all(&templates).unwrap();
    for rank in 0..2 {
        let record =
            flight_record(rank, 2).replace("\"engine stopped: a peer was lost\"", "\"SIGUSR1\"");
        assert!(record.contains("\"SIGUSR1\""), "{record}");
        std::fs::write(templates.join(format!("record-{rank}.json")), record).unwrap();
    }
    let stop = dir.path().join("stop");
    // Written whole (a temporary name, renamed), as the runtime does.
    let script = "trap 'cp \"$1/record-$FH_RANK.json\" \"$FH_FLIGHT_DIR/.w\" && \
                  mv \"$FH_FLIGHT_DIR/.w\" \"$FH_FLIGHT_DIR/rank-$FH_RANK.json\"' USR1\n\
        mkdir -p \"$FH_FLIGHT_DIR\"\n\
        echo ready\n\
        while [ ! -e \"$2\" ]; do sleep 0.1; done\n";
    let mut job = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "-H",
                "localhost:1,fh-far-host:1",
                "--rsh-agent",
                agent.to_str().unwrap(),
                "sh",
                "-c",
                script,
                "rank",
                templates.to_str().unwrap(),
                stop.to_str().unwrap(),
            ])
            .env("TMPDIR", &near),
    );
    let ready = |out: &str| {
        prefixed(out, "stdout")
            .iter()
            .filter(|(_, l)| *l == "ready")
            .count()
    };
    job.wait_for(LIMIT, |out, _| ready(out) == 2);
    job.signal(libc::SIGUSR1);
    let said = "fhrun: rank 1 on fh-far-host sent the flight records of rank 1: they are in ";
    job.wait_for(LIMIT, |_, err| err.contains(said));
    // The job still runs (its ranks wait for `stop`), and the far record is in fhrun's job
    // directory, whole, next to the near one.
    assert!(alive(job.pid()));
    let err = job.stderr_now();
    let flight = err
        .lines()
        .find_map(|l| l.strip_prefix(said))
        .and_then(|l| l.split(';').next())
        .map(std::path::PathBuf::from)
        .unwrap();
    assert!(flight.starts_with(&near), "{}", flight.display());
    assert!(
        err.contains(&format!("`fhrun --explain {}`", flight.display())),
        "{err}"
    );
    assert_eq!(
        std::fs::read(flight.join("rank-1.json")).unwrap(),
        std::fs::read(templates.join("record-1.json")).unwrap()
    );
    std::fs::write(&stop, "").unwrap();
    let out = job.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    // Said once: at the end the part sends only what changed since.
    assert_eq!(out.stderr.matches(said).count(), 1, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "fhrun: flight records of 2 ranks (0, 1) are in {}",
            flight.display()
        )),
        "{}",
        out.stderr
    );
    let mut files = files_under(&flight);
    files.sort();
    assert_eq!(files, ["rank-0.json", "rank-1.json"]);
    assert!(files_under(&dir.path().join("far")).is_empty());
}

/// A part cut off while it sends a newer copy of a record it sent while the job ran: the copy
/// is dropped with a warning, and the one fhrun has stays whole (an agent stands for the part:
/// a whole record, `sent`, then a file cut short).
#[test]
fn a_record_cut_short_leaves_the_one_sent_before_whole() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("gather-cut");
    let near = dir.path().join("near");
    std::fs::create_dir_all(&near).unwrap();
    let record = dir.path().join("record.json");
    std::fs::write(
        &record,
        flight_record(1, 2).replace("\"engine stopped: a peer was lost\"", "\"SIGUSR1\""),
    )
    .unwrap();
    let agent = dir.path().join("agent.sh");
    std::fs::write(
        &agent,
        format!(
            "#!/bin/sh\n\
             while read -r k v; do case \"$k\" in gather) m=$v;; go) break;; esac; done\n\
             f='{}'\n\
             echo \"$m begin flight rank-1.json $(wc -c < \"$f\")\"\n\
             echo \"$m data $(base64 -w0 \"$f\")\"\n\
             echo \"$m end\"\n\
             echo \"$m sent\"\n\
             echo \"$m begin flight rank-1.json 400\"\n\
             echo \"$m data eHg=\"\n",
            record.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "-H",
                "localhost:1,fh-far-host:1",
                "--rsh-agent",
                agent.to_str().unwrap(),
                "true",
            ])
            .env("TMPDIR", &near),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let said = "fhrun: rank 1 on fh-far-host sent the flight records of rank 1: they are in ";
    let flight = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix(said))
        .and_then(|l| l.split(';').next())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("{}", out.stderr));
    assert!(
        out.stderr.contains(&format!(
            "fhrun: warning: rank 1 on fh-far-host sent {} cut short; it is not kept",
            flight.join("rank-1.json").display()
        )),
        "{}",
        out.stderr
    );
    // No temporary file is left, and the record is the whole one sent first.
    assert_eq!(files_under(&flight), ["rank-1.json"]);
    assert_eq!(
        std::fs::read(flight.join("rank-1.json")).unwrap(),
        std::fs::read(&record).unwrap()
    );
}
