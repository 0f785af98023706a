//! The job directory of the jobs fhrun does not start rank by rank: under `--mpi` (mpirun runs
//! as fhrun's child, the ranks get the flight directory and the timeline pattern through `-x`,
//! fhrun merges and keeps what they wrote) and for elastic jobs (a subdirectory per generation).

mod common;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn mpirun_on_path() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false)
}

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
    let kept: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let flight = kept[0].path().join("flight");
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
