//! The flight records and timelines of another host: merged, kept and explained when the job
//! ends, brought while it runs on SIGUSR1, and a transfer cut short.

mod common;
use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

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
