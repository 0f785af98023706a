//! fhrun and its ranks say which FastHorovod they are, and a job mixing releases stops with an
//! error naming both: a rank of another release than its fhrun (`FH_FHRUN_VERSION`), and a
//! remote part whose fhrun is of another release than the launching one.

mod common;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;

const SELFTEST: &str = env!("CARGO_BIN_EXE_fh-selftest");
const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn fhrun_says_its_release_and_wire_protocol() {
    for flag in ["--version", "-V"] {
        let out = fhrun(&[flag], LIMIT);
        assert_eq!(out.code(), Some(0), "{out:?}");
        assert_eq!(
            out.stdout.trim(),
            format!(
                "fhrun {} (FastHorovod wire protocol {})",
                fh_core::RELEASE,
                fh_transport::backend::tcp::wire::PROTOCOL_VERSION
            )
        );
    }
}

#[test]
fn every_rank_is_told_fhruns_release() {
    let out = fhrun(&["-np", "2", "sh", "-c", "echo $FH_FHRUN_VERSION"], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines = prefixed(&out.stdout, "stdout");
    assert_eq!(lines.len(), 2, "{out:?}");
    for (_, line) in lines {
        assert_eq!(line, fh_core::RELEASE);
    }
}

#[test]
fn ranks_of_another_release_than_their_fhrun_stop_naming_both() {
    // As if the ranks' environment held another FastHorovod than the one fhrun came with.
    let out = fhrun(
        &["-np", "2", "-x", "FH_FHRUN_VERSION=0.0.1-other", SELFTEST],
        LIMIT,
    );
    assert_ne!(out.code(), Some(0), "{out:?}");
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(
        all.contains("the fhrun that started it is FastHorovod 0.0.1-other"),
        "{all}"
    );
    assert!(
        all.contains(&format!("this rank runs FastHorovod {}", fh_core::RELEASE)),
        "{all}"
    );
}

#[test]
fn a_remote_part_of_another_release_refuses_the_job_naming_both() {
    // An rsh agent that runs the remote part here, after rewriting the first line of the job
    // (the sending fhrun's release), as if the far host had another FastHorovod; like ssh, it
    // ends when the remote part does.
    let dir = TempDir::new("versions");
    let agent = dir.path().join("agent.sh");
    std::fs::write(
        &agent,
        "#!/bin/bash\nshift\nexec sh -c \"$*\" < <(sed -u '1s/^version .*/version 0.0.1-other/')\n",
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = fhrun(
        &[
            "-np",
            "2",
            "-H",
            "localhost:1,fh-far-host:1",
            "--rsh-agent",
            agent.to_str().unwrap(),
            "sleep",
            "30",
        ],
        LIMIT,
    );
    assert_ne!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stderr.contains(&format!(
            "this host's fhrun is FastHorovod {}",
            fh_core::RELEASE
        )),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("the fhrun that sent the job is FastHorovod 0.0.1-other"),
        "{}",
        out.stderr
    );
}
