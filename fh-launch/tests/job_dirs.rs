//! The job directory of the jobs fhrun does not start rank by rank: under `--mpi` (mpirun runs
//! as fhrun's child, the ranks get the flight directory and the timeline pattern through `-x`,
//! fhrun merges and keeps what they wrote) and for elastic jobs (a subdirectory per generation).

mod common;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

/// The `work of rank R` spans of a merged timeline, by track.
fn works(file: &Path) -> BTreeSet<(u64, String)> {
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    events
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
        .collect()
}

/// A shell rank: writes its flight record (a copy of `$TEMPLATES/record-R.json`) and its
/// timeline where fhrun's variables say, R being `$RANK_VAR`'s value; `fail`: rank 1 then
/// exits 3.
const RANK_SCRIPT: &str = "set -e\n\
    r=$(printenv \"$RANK_VAR\")\n\
    tl=$(printf %s \"$FH_TIMELINE\" | sed \"s/{rank}/$r/\")\n\
    mkdir -p \"$FH_FLIGHT_DIR\" \"$(dirname \"$tl\")\"\n\
    cp \"$TEMPLATES/record-$r.json\" \"$FH_FLIGHT_DIR/rank-$r.json\"\n\
    printf '[{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%s,\"tid\":0,\"args\":{\"name\":\"rank %s\",\"rank\":%s,\"origin_unix_us\":1000}},\\n{\"name\":\"work of rank %s\",\"ph\":\"X\",\"ts\":1,\"dur\":1,\"pid\":0,\"tid\":0}]' \"$r\" \"$r\" \"$r\" \"$r\" > \"$tl\"\n\
    if [ \"$1\" = fail ] && [ \"$r\" = 1 ]; then exit 3; fi\n";

fn templates(dir: &TempDir, size: usize) -> String {
    let t = dir.path().join("templates");
    std::fs::create_dir_all(&t).unwrap();
    for rank in 0..size {
        std::fs::write(
            t.join(format!("record-{rank}.json")),
            flight_record(rank, size),
        )
        .unwrap();
    }
    t.to_str().unwrap().to_string()
}

#[test]
fn an_mpi_job_merges_every_ranks_timeline_and_keeps_its_flight_records() {
    if !mpirun_on_path() {
        eprintln!("skipped: mpirun is not on PATH (Debian: apt-get install openmpi-bin)");
        return;
    }
    let dir = TempDir::new("mpi-jobdir");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out_file = dir.path().join("timeline.json");
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "--mpi",
                "--timeline-filename",
                out_file.to_str().unwrap(),
                "-x",
                "RANK_VAR=OMPI_COMM_WORLD_RANK",
                "-x",
                &format!("TEMPLATES={}", templates(&dir, 2)),
                "sh",
                "-c",
                RANK_SCRIPT,
                "rank",
                "fail",
            ])
            .env("TMPDIR", &tmp),
    )
    .wait(LIMIT);
    // mpirun's status is fhrun's: rank 1's.
    assert_eq!(out.code(), Some(3), "{out:?}");
    assert!(out.stderr.contains("timeline of 2 ranks"), "{}", out.stderr);
    assert_eq!(
        works(&out_file),
        BTreeSet::from([(0, "work of rank 0".into()), (1, "work of rank 1".into())])
    );
    // The job failed: its records are kept, named, and explained.
    assert!(
        out.stderr
            .contains("flight records of 2 ranks (0, 1) are in"),
        "{}",
        out.stderr
    );
    let job = only_job_dir(&tmp);
    let flight = job.join("flight");
    for rank in 0..2 {
        assert!(flight.join(format!("rank-{rank}.json")).is_file());
    }
    assert!(
        out.stderr
            .contains(&format!("fhrun --explain {}", flight.display())),
        "{}",
        out.stderr
    );
}

#[test]
fn an_elastic_job_keeps_every_generations_records_apart() {
    use common::elastic::{all_pids, discovery, no_worker_left, probe_pid, PROBE};
    let dir = TempDir::new("elastic-jobdir");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out_file = dir.path().join("tl.json");
    let script = discovery(&dir, &["localhost", "127.0.0.1", "127.0.0.2"]);
    let mut run = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "--host-discovery-script",
                &script,
                "-np",
                "3",
                "--min-np",
                "2",
                "--elastic-timeout",
                "2",
                "--kill-grace",
                "1",
                "--timeout",
                "120",
                "--timeline-filename",
                out_file.to_str().unwrap(),
                PROBE,
            ])
            .env("TMPDIR", &tmp),
    );
    // Generation 0 loses its rank 2; generation 1 (renumbered: ranks 0 and 1 again) loses its
    // rank 1, and too few remain: the job fails.
    run.wait_for(LIMIT, |out, _| probe_pid(out, 0, "127.0.0.2:0").is_some());
    kill_all(&[probe_pid(&run.stdout_now(), 0, "127.0.0.2:0").unwrap()]);
    run.wait_for(LIMIT, |out, _| probe_pid(out, 1, "127.0.0.1:0").is_some());
    let out = run.stdout_now();
    kill_all(&[probe_pid(&out, 1, "127.0.0.1:0").unwrap()]);
    let pids = all_pids(&out);
    let done = run.wait(LIMIT);
    no_worker_left(&pids);
    assert_eq!(done.code(), Some(1), "{}\n{}", done.stdout, done.stderr);

    // Each generation's survivors wrote their records in its own directory: rank 0 of both
    // generations, neither overwriting the other.
    let job = only_job_dir(&tmp);
    let flight = job.join("flight");
    let size_of = |path: &Path| -> u64 {
        let v = read_json(path);
        v["size"].as_u64().unwrap()
    };
    assert_eq!(size_of(&flight.join("gen-0/rank-0.json")), 3);
    assert_eq!(size_of(&flight.join("gen-0/rank-1.json")), 3);
    assert_eq!(size_of(&flight.join("gen-1/rank-0.json")), 2);
    let err = &done.stderr;
    for want in [
        "generation 0: flight records of 2 ranks (0, 1) are in",
        "generation 1: flight records of 1 ranks (0) are in",
        // The failed job's last generation is explained.
        "generation 1: first divergence: rank 1 was lost",
        "generation 0: timeline of 3 ranks",
        "generation 1: timeline of 2 ranks",
    ] {
        assert!(err.contains(want), "{want:?} not in\n{err}");
    }
    for g in 0..2 {
        assert!(dir.path().join(format!("tl.gen-{g}.json")).is_file());
    }
    // `--explain` reads every generation, each under its name.
    let explained = fhrun(&["--explain", flight.to_str().unwrap()], LIMIT);
    assert_eq!(explained.code(), Some(0), "{explained:?}");
    let gen0 = explained.stdout.find("generation 0 (").unwrap();
    let gen1 = explained.stdout.find("generation 1 (").unwrap();
    assert!(gen0 < gen1, "{}", explained.stdout);
    assert!(
        explained.stdout[gen0..gen1].contains("rank 2 was lost"),
        "{}",
        explained.stdout
    );
}

#[test]
fn an_elastic_workers_records_come_back_from_another_host() {
    use common::elastic::{all_pids, no_worker_left, probe_pid, PROBE};
    let dir = TempDir::new("elastic-far");
    let Some((agent, near)) = far_host_agent(&dir) else {
        return;
    };
    // The far host: this machine's own address that is not loopback (fhrun then starts its
    // worker through the agent, and its session listener binds there).
    let far = match fh_job::elastic::local_ip_towards("192.0.2.1") {
        Ok(ip) if !ip.is_loopback() && ip.is_ipv4() => ip.to_string(),
        _ => {
            eprintln!("skipped: this machine has no address but loopback");
            return;
        }
    };
    let stop = dir.path().join("stop");
    let hosts = format!("localhost:1,{far}:1");
    let mut run = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "--min-np",
                "1",
                "-H",
                &hosts,
                "--rsh-agent",
                agent.to_str().unwrap(),
                "--kill-grace",
                "1",
                "--timeout",
                "120",
                "-x",
                &format!("PROBE_STOP={}", stop.display()),
                PROBE,
            ])
            .env("TMPDIR", &near),
    );
    // This machine's worker (rank 0) is lost: the far one, rank 1 of generation 0, writes its
    // record on its host; it goes on alone as rank 0 of generation 1 and ends well.
    let far_worker = format!("{far}:0");
    run.wait_for(LIMIT, |out, _| {
        probe_pid(out, 0, "localhost:0").is_some() && probe_pid(out, 0, &far_worker).is_some()
    });
    kill_all(&[probe_pid(&run.stdout_now(), 0, "localhost:0").unwrap()]);
    run.wait_for(LIMIT, |out, _| probe_pid(out, 1, &far_worker).is_some());
    let pids = all_pids(&run.stdout_now());
    std::fs::write(&stop, "").unwrap();
    let done = run.wait(LIMIT);
    no_worker_left(&pids);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
    // The lost generation's record came back from the far host, and is kept and explained
    // although the job went on and succeeded.
    let job = only_job_dir(&near);
    let record = job.join("flight/gen-0/rank-1.json");
    assert!(record.is_file(), "{}", done.stderr);
    assert!(
        done.stderr
            .contains("generation 0: flight records of 1 ranks (1) are in")
            && done
                .stderr
                .contains("generation 0: first divergence: rank 0 was lost"),
        "{}",
        done.stderr
    );
    // The far part removed its own directory.
    let far_dir = dir.path().join("far");
    assert!(
        std::fs::read_dir(&far_dir).unwrap().next().is_none(),
        "{far_dir:?}"
    );
}

#[test]
fn sigusr1_to_an_elastic_job_brings_every_workers_record_while_it_runs() {
    use common::elastic::{all_pids, no_worker_left, probe_pid, PROBE};
    let dir = TempDir::new("elastic-usr1");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let stop = dir.path().join("stop");
    let mut run = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "--min-np",
                "2",
                "-H",
                "localhost:1,127.0.0.2:1",
                "--kill-grace",
                "1",
                "--timeout",
                "120",
                "-x",
                &format!("PROBE_STOP={}", stop.display()),
                PROBE,
            ])
            .env("TMPDIR", &tmp),
    );
    run.wait_for(LIMIT, |out, _| {
        probe_pid(out, 0, "localhost:0").is_some() && probe_pid(out, 0, "127.0.0.2:0").is_some()
    });
    let pids = all_pids(&run.stdout_now());
    run.signal(libc::SIGUSR1);
    // Both workers write their record while the job goes on.
    run.wait_for(LIMIT, |out, err| {
        out.matches("probe: flight record written to").count() == 2
            && err.contains("received SIGUSR1")
    });
    let job = only_job_dir(&tmp);
    let flight = job.join("flight/gen-0");
    for rank in 0..2 {
        let path = flight.join(format!("rank-{rank}.json"));
        let v = read_json(&path);
        assert_eq!(v["reason"], "SIGUSR1", "{}", path.display());
    }
    std::fs::write(&stop, "").unwrap();
    let done = run.wait(LIMIT);
    no_worker_left(&pids);
    assert_eq!(done.code(), Some(0), "{}\n{}", done.stdout, done.stderr);
}

#[test]
fn an_elastic_jobs_timeout_asks_for_the_records_before_it_stops_the_workers() {
    use common::elastic::{all_pids, no_worker_left, PROBE};
    let dir = TempDir::new("elastic-timeout");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let run = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .args([
                "-np",
                "2",
                "--min-np",
                "2",
                "-H",
                "localhost:1,127.0.0.2:1",
                "--kill-grace",
                "1",
                "--timeout",
                "10",
                PROBE,
            ])
            .env("TMPDIR", &tmp),
    );
    let done = run.wait(LIMIT);
    no_worker_left(&all_pids(&done.stdout));
    assert_eq!(done.code(), Some(124), "{}\n{}", done.stdout, done.stderr);
    assert_eq!(
        done.stdout
            .matches("probe: flight record written to")
            .count(),
        2,
        "{}\n{}",
        done.stdout,
        done.stderr
    );
    let job = only_job_dir(&tmp);
    for rank in 0..2 {
        let path = job.join(format!("flight/gen-0/rank-{rank}.json"));
        let v = read_json(&path);
        assert_eq!(v["reason"], "SIGUSR1", "{}", path.display());
    }
}
