use super::*;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    let v = normalize_args(
        std::iter::once("fhrun")
            .chain(args.iter().copied())
            .map(String::from),
    );
    Cli::try_parse_from(v)
}

#[test]
fn np_and_command() {
    let c = parse(&["-np", "4", "python", "train.py", "--lr", "0.1"]).unwrap();
    assert_eq!(c.num_proc, Some(4));
    assert_eq!(c.command, ["python", "train.py", "--lr", "0.1"]);
    let c = parse(&["-n", "2", "--", "sh", "-c", "echo hi"]).unwrap();
    assert_eq!(c.num_proc, Some(2));
    assert_eq!(c.command, ["sh", "-c", "echo hi"]);
    // The command's own -np is not touched.
    let c = parse(&["-np", "2", "--", "mpirun", "-np", "3"]).unwrap();
    assert_eq!(c.command, ["mpirun", "-np", "3"]);
}

#[test]
fn missing_pieces_are_errors() {
    assert!(parse(&["-np", "2"]).is_err());
    assert!(parse(&["echo"]).is_err());
    assert!(parse(&["-np", "0", "echo"]).is_err());
    assert!(parse(&["-np", "x", "echo"]).is_err());
}

#[test]
fn knobs_to_env() {
    let c = parse(&[
        "-np",
        "2",
        "--channels",
        "3",
        "--fusion-threshold-mb",
        "32",
        "--partition-mb",
        "8",
        "--cycle-time-ms",
        "2.5",
        "--cache-capacity",
        "0",
        "--schedule",
        "horovod",
        "--priority",
        "forward",
        "--timeline-filename",
        "/tmp/t.json",
        "--no-stall-check",
        "--stall-shutdown-seconds",
        "9",
        "--transport",
        "tcp",
        "--timeout-seconds",
        "7",
        "--log-level",
        "debug",
        "true",
    ])
    .unwrap();
    let env = c.knobs.to_env();
    let get = |k: &str| {
        env.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{k} missing"))
    };
    assert_eq!(get("FH_CHANNELS"), "3");
    assert_eq!(get("FH_FUSION_THRESHOLD"), (32u64 << 20).to_string());
    assert_eq!(get("FH_PARTITION_BYTES"), (8u64 << 20).to_string());
    assert_eq!(get("FH_CYCLE_TIME_MS"), "2.5");
    assert_eq!(get("FH_CACHE_CAPACITY"), "0");
    assert_eq!(get("FH_SCHEDULE"), "horovod");
    assert_eq!(get("FH_PRIORITY"), "forward");
    assert_eq!(get("FH_TIMELINE"), "/tmp/t.json");
    assert_eq!(get("FH_STALL_CHECK_SECONDS"), "0");
    assert_eq!(get("FH_STALL_SHUTDOWN_SECONDS"), "9");
    assert_eq!(get("FH_TRANSPORT"), "tcp");
    assert_eq!(get("FH_TIMEOUT_SECONDS"), "7");
    assert_eq!(get("FH_LOG_LEVEL"), "debug");
    assert_eq!(env.len(), 13);
    // Nothing given, nothing exported: the runtime's defaults apply.
    assert!(parse(&["-np", "1", "true"])
        .unwrap()
        .knobs
        .to_env()
        .is_empty());
    assert_eq!(
        parse(&["-np", "1", "--cycle-time-ms", "1.0", "true"])
            .unwrap()
            .knobs
            .to_env(),
        vec![("FH_CYCLE_TIME_MS".to_string(), "1".to_string())]
    );
}

#[test]
fn bad_knob_values_are_rejected() {
    for bad in [
        &["--channels", "0"][..],
        &["--channels", "two"],
        &["--channels", "65"],
        &["--cycle-time-ms", "-1"],
        &["--cycle-time-ms", "nan"],
        &["--schedule", "fast"],
        &["--priority", "backward"],
        &["--transport", "udp"],
        &["--log-level", "loud"],
        &["--timeout-seconds", "0"],
        &["--partition-mb", "0"],
        &["--fusion-threshold-mb", "1.5"],
        &["--stall-check-seconds", "0"],
        &["--no-stall-check", "--stall-check-seconds", "5"],
        &["-x", "1BAD=2"],
        &["-x", "A-B"],
        &["--timeout", "0"],
        &["--rendezvous-addr", "host"],
        &["--rendezvous-addr", "host:0"],
        &["--mpi-args", "-x"],
        &["-H", "a:1", "--hostfile", "f"],
    ] {
        let mut args = vec!["-np", "2"];
        args.extend_from_slice(bad);
        args.push("true");
        assert!(parse(&args).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn elastic_flags() {
    let c = parse(&[
        "--host-discovery-script",
        "./d.sh",
        "--min-np",
        "2",
        "--max-np",
        "4",
        "--blacklist-cooldown-range",
        "5",
        "10",
        "--elastic-timeout",
        "3",
        "true",
    ])
    .unwrap();
    assert_eq!(c.num_proc, None);
    assert_eq!(c.elastic.min_np, Some(2));
    assert_eq!(c.elastic.blacklist_cooldown_range, Some(vec![5, 10]));
    assert_eq!(c.elastic.elastic_timeout, Some(Duration::from_secs(3)));
    assert_eq!(c.command, ["true"]);
    // Without a discovery script or --min-np, -np is required.
    assert!(parse(&["--max-np", "2", "true"]).is_err());
    assert!(parse(&["--min-np", "2", "true"]).is_ok());
}

#[test]
fn horovodrun_spellings() {
    let c = parse(&[
        "-np",
        "2",
        "--min-num-proc",
        "1",
        "--max-num-proc",
        "4",
        "--slots-per-host",
        "2",
        "--start-timeout",
        "5",
        "--log-level",
        "DEBUG",
        "python",
        "train.py",
        "--lr",
        "0.1",
    ])
    .unwrap();
    assert_eq!(
        (c.elastic.min_np, c.elastic.max_np, c.elastic.slots),
        (Some(1), Some(4), Some(2))
    );
    assert_eq!(c.elastic.start_timeout, Some(Duration::from_secs(5)));
    assert_eq!(c.knobs.log_level, Some(LogLevel::Debug));
    // The command's own options stay the command's.
    assert_eq!(c.command, ["python", "train.py", "--lr", "0.1"]);
    for (given, level) in [
        ("WARNING", LogLevel::Warn),
        ("warn", LogLevel::Warn),
        ("FATAL", LogLevel::Error),
        ("Info", LogLevel::Info),
    ] {
        let c = parse(&["-np", "1", "--log-level", given, "true"]).unwrap();
        assert_eq!(c.knobs.log_level, Some(level), "{given}");
    }
}

#[test]
fn an_unknown_option_is_refused_by_name_not_run() {
    let e = parse(&["-np", "2", "--no-such-option", "python", "x.py"]).unwrap_err();
    assert!(e.to_string().contains("--no-such-option"), "{e}");
    // After `--`, anything is the command.
    let c = parse(&["-np", "2", "--", "--odd-program", "x"]).unwrap();
    assert_eq!(c.command, ["--odd-program", "x"]);
}

#[test]
fn env_pass() {
    let c = parse(&["-np", "1", "-x", "A=1", "-x", "B", "-x", "C=x=y", "true"]).unwrap();
    assert_eq!(
        c.env,
        vec![
            EnvPass {
                name: "A".into(),
                value: Some("1".into())
            },
            EnvPass {
                name: "B".into(),
                value: None
            },
            EnvPass {
                name: "C".into(),
                value: Some("x=y".into())
            },
        ]
    );
}

#[test]
fn explain_stands_alone() {
    let c = parse(&["--explain", "/tmp/flight"]).unwrap();
    assert_eq!(c.explain, Some(PathBuf::from("/tmp/flight")));
    assert!(parse(&["--explain", "/tmp/flight", "-np", "2", "echo"]).is_err());
}
