//! fhrun end to end: what the ranks' environment holds (the `FH_*` variables, a fresh job
//! token that is never shown, `-x`) and the warning for a misspelt `FH_*` variable.

mod common;
use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn every_rank_gets_the_fh_environment() {
    for np in [2usize, 4] {
        let nps = np.to_string();
        let out = fhrun(
            &[
                "-np",
                &nps,
                "--channels",
                "3",
                "--schedule",
                "horovod",
                "--fusion-threshold-mb",
                "2",
                "-x",
                "MY_VAR=hello world",
                "--",
                "sh",
                "-c",
                "echo \"$FH_RANK $FH_SIZE $FH_LOCAL_RANK $FH_LOCAL_SIZE $FH_CROSS_RANK \
                 $FH_CROSS_SIZE $FH_RENDEZVOUS_ADDR $FH_JOB_TOKEN $FH_CHANNELS $FH_SCHEDULE \
                 $FH_FUSION_THRESHOLD $MY_VAR\"",
            ],
            LIMIT,
        );
        assert_eq!(out.code(), Some(0), "{out:?}");
        let lines = prefixed(&out.stdout, "stdout");
        assert_eq!(lines.len(), np, "{out:?}");
        let mut ranks = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        let mut tokens = BTreeSet::new();
        for (prefix_rank, line) in lines {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 13, "{line}");
            let rank: usize = f[0].parse().unwrap();
            assert_eq!(rank, prefix_rank, "the prefix names the rank");
            assert_eq!(f[1], nps);
            assert_eq!(f[2], f[0], "one host: local rank = rank");
            assert_eq!(f[3], nps);
            assert_eq!((f[4], f[5]), ("0", "1"));
            let port: u16 = f[6].strip_prefix("127.0.0.1:").unwrap().parse().unwrap();
            assert!(port > 0);
            assert!(f[7].len() >= 32 && f[7].chars().all(|c| c.is_ascii_hexdigit()));
            assert_eq!(f[8], "3");
            assert_eq!(f[9], "horovod");
            assert_eq!(f[10], (2u64 << 20).to_string());
            assert_eq!((f[11], f[12]), ("hello", "world"));
            ranks.insert(rank);
            addrs.insert(f[6].to_string());
            tokens.insert(f[7].to_string());
        }
        assert_eq!(ranks, (0..np).collect());
        assert_eq!(addrs.len(), 1, "one rendezvous address for the job");
        assert_eq!(tokens.len(), 1, "one token for the job");
    }
}

/// The variables horovodrun's launcher gives each rank, which Horovod scripts read before
/// `init()`, and the PMI pair: on one host, rank = local rank, cross rank 0 of 1.
#[test]
fn every_rank_gets_horovods_variables() {
    let host = std::process::Command::new("hostname")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    for np in [2usize, 3] {
        let nps = np.to_string();
        let out = fhrun(
            &[
                "-np",
                &nps,
                "sh",
                "-c",
                "echo \"$HOROVOD_RANK $HOROVOD_SIZE $HOROVOD_LOCAL_RANK $HOROVOD_LOCAL_SIZE \
                 $HOROVOD_CROSS_RANK $HOROVOD_CROSS_SIZE $PMI_RANK $PMI_SIZE $HOROVOD_HOSTNAME\"",
            ],
            LIMIT,
        );
        assert_eq!(out.code(), Some(0), "{out:?}");
        let lines = prefixed(&out.stdout, "stdout");
        assert_eq!(lines.len(), np, "{out:?}");
        let mut seen = BTreeSet::new();
        for (rank, line) in lines {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 9, "np {np} rank {rank}: {line}");
            let r = rank.to_string();
            let want = [
                r.as_str(),
                nps.as_str(),
                r.as_str(),
                nps.as_str(),
                "0",
                "1",
                r.as_str(),
                nps.as_str(),
            ];
            assert_eq!(f[..8], want, "np {np} rank {rank}: {line}");
            assert!(!f[8].is_empty(), "np {np} rank {rank}: no HOROVOD_HOSTNAME");
            if !host.is_empty() {
                assert_eq!(f[8], host, "np {np} rank {rank}: HOROVOD_HOSTNAME");
            }
            seen.insert(rank);
        }
        assert_eq!(seen, (0..np).collect(), "np {np}");
    }
}

/// torch.distributed's `env://` store address: one `MASTER_ADDR:MASTER_PORT` for the job, on
/// the rendezvous host, at a port other than the rendezvous one (which the engine's rank 0
/// takes); with `--rendezvous-addr`, the port after it.
#[test]
fn every_rank_gets_a_torch_store_address_beside_the_rendezvous() {
    let show = "echo \"$MASTER_ADDR $MASTER_PORT $FH_RENDEZVOUS_ADDR\"";
    let out = fhrun(&["-np", "3", "sh", "-c", show], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines: BTreeSet<String> = prefixed(&out.stdout, "stdout")
        .into_iter()
        .map(|(_, l)| l.to_string())
        .collect();
    assert_eq!(lines.len(), 1, "one store address for the job: {lines:?}");
    let line = lines.into_iter().next().unwrap();
    let f: Vec<&str> = line.split(' ').collect();
    assert_eq!(f.len(), 3, "{line}");
    let (host, port) = f[2].rsplit_once(':').unwrap();
    assert_eq!(f[0], host, "the store is on the rendezvous host: {line}");
    let store: u16 = f[1].parse().unwrap();
    assert!(store > 0 && store.to_string() != port, "{line}");
    let given = fhrun(
        &[
            "-np",
            "2",
            "--rendezvous-addr",
            "127.0.0.1:23456",
            "sh",
            "-c",
            show,
        ],
        LIMIT,
    );
    assert_eq!(given.code(), Some(0), "{given:?}");
    for (_, l) in prefixed(&given.stdout, "stdout") {
        assert_eq!(l, "127.0.0.1 23457 127.0.0.1:23456");
    }
}

#[test]
fn each_job_gets_a_fresh_token() {
    let token = || {
        let out = fhrun(&["-np", "1", "sh", "-c", "echo $FH_JOB_TOKEN"], LIMIT);
        assert_eq!(out.code(), Some(0));
        prefixed(&out.stdout, "stdout")[0].1.to_string()
    };
    assert_ne!(token(), token());
}

#[test]
fn verbose_and_dry_run_never_show_the_token() {
    let out = fhrun(
        &["--verbose", "-np", "2", "sh", "-c", "echo $FH_JOB_TOKEN"],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    let token = prefixed(&out.stdout, "stdout")[0].1.to_string();
    assert!(token.len() >= 32, "{out:?}");
    assert!(
        out.stderr.contains("FH_JOB_TOKEN=<redacted>"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains(&token),
        "--verbose leaked the token: {}",
        out.stderr
    );
    let out = fhrun(&["--dry-run", "-np", "2", "true"], LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stdout.contains("FH_JOB_TOKEN=<redacted>"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.lines().any(|l| l
            .split_whitespace()
            .any(|w| w.trim_matches('\'').len() > 40 && w.contains("FH_JOB_TOKEN="))),
        "{}",
        out.stdout
    );
    // A token given on fhrun's own command line works but is warned about; one passed through
    // the environment is not.
    let secret = "0123456789abcdef-my-own-token";
    let out = fhrun(
        &[
            "-np",
            "1",
            "-x",
            &format!("FH_JOB_TOKEN={secret}"),
            "sh",
            "-c",
            "echo $FH_JOB_TOKEN",
        ],
        LIMIT,
    );
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains(secret), "{out:?}");
    assert!(out.stderr.contains("command line"), "{}", out.stderr);
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_JOB_TOKEN", secret)
            .args([
                "-np",
                "1",
                "-x",
                "FH_JOB_TOKEN",
                "sh",
                "-c",
                "echo $FH_JOB_TOKEN",
            ]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains(secret), "{out:?}");
    assert!(!out.stderr.contains("warning"), "{}", out.stderr);
}

#[test]
fn an_empty_or_guessable_forwarded_token_is_refused_with_the_fix() {
    // `FH_JOB_TOKEN= fhrun -x FH_JOB_TOKEN …` (e.g. after `$(openssl rand -hex 32)` failed)
    // would replace fhrun's fresh token with nothing: refused before any rank starts.
    for (value, says) in [
        ("", "set but empty"),
        ("   ", "only whitespace"),
        ("aaaaaaaaaaaaaaaa", "distinct character"),
    ] {
        let out = Running::start_cmd(
            std::process::Command::new(FHRUN)
                .env("FH_JOB_TOKEN", value)
                .args(["-np", "2", "-x", "FH_JOB_TOKEN", "sh", "-c", "echo started"]),
        )
        .wait(LIMIT);
        assert_eq!(out.code(), Some(2), "{value:?}: {out:?}");
        assert!(!out.stdout.contains("started"), "{value:?}: {out:?}");
        assert!(
            out.stderr.contains("FH_JOB_TOKEN")
                && out.stderr.contains(says)
                && out.stderr.contains("openssl rand -hex 32")
                && out.stderr.contains("fresh token"),
            "{value:?}: {}",
            out.stderr
        );
    }
    // The same with the value on the command line.
    let out = fhrun(&["-np", "1", "-x", "FH_JOB_TOKEN=", "true"], LIMIT);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(out.stderr.contains("set but empty"), "{}", out.stderr);
}

#[test]
fn misspelt_fh_variables_are_named_once_with_the_likely_one() {
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_PRESET", "horovod")
            .env("FH_CHANNELS", "2")
            .args(["-np", "2", "-x", "FH_CHANEL=2", "true"]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("warning"))
        .collect();
    assert_eq!(warnings.len(), 2, "{}", out.stderr);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("FH_PRESET") && w.contains("did you mean FH_SCHEDULE?")),
        "{}",
        out.stderr
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("FH_CHANEL ") && w.contains("did you mean FH_CHANNELS?")),
        "{}",
        out.stderr
    );
}

#[test]
fn x_name_passes_fhruns_value_and_refuses_an_unset_one() {
    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env("FH_TEST_PASSED", "from fhrun")
            .env_remove("FH_TEST_UNSET")
            .args([
                "-np",
                "2",
                "-x",
                "FH_TEST_PASSED",
                "sh",
                "-c",
                "echo \"$FH_TEST_PASSED\"",
            ]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lines = prefixed(&out.stdout, "stdout");
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|(_, l)| *l == "from fhrun"), "{out:?}");

    let out = Running::start_cmd(
        std::process::Command::new(FHRUN)
            .env_remove("FH_TEST_UNSET")
            .args(["-np", "1", "-x", "FH_TEST_UNSET", "true"]),
    )
    .wait(LIMIT);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.contains("FH_TEST_UNSET is not set"),
        "{}",
        out.stderr
    );
}
