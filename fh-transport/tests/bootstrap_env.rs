//! The environment parser, for every launcher style and for bad values (pure: no process
//! environment is touched).

use std::collections::HashMap;
use std::time::Duration;

use fh_job::launch::{LaunchInfo, Launcher};
use fh_transport::TransportError;

fn parse(vars: &[(&str, &str)]) -> Result<LaunchInfo, TransportError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LaunchInfo::from_vars(|name| map.get(name).cloned()).map_err(TransportError::from)
}

/// The variable named by a configuration error, and its reason.
fn config_err(vars: &[(&str, &str)]) -> (String, String) {
    match parse(vars) {
        Err(TransportError::Config { var, reason }) => (var, reason),
        other => panic!("expected a configuration error for {vars:?}, got {other:?}"),
    }
}

const FHRUN: &[(&str, &str)] = &[
    ("FH_RANK", "3"),
    ("FH_SIZE", "4"),
    ("FH_LOCAL_RANK", "1"),
    ("FH_LOCAL_SIZE", "2"),
    ("FH_CROSS_RANK", "1"),
    ("FH_CROSS_SIZE", "2"),
    ("FH_RENDEZVOUS_ADDR", "10.0.0.1:29400"),
    ("FH_JOB_TOKEN", "0123456789abcdef0123456789abcdef"),
];

#[test]
fn no_launcher_is_a_single_process() {
    let info = parse(&[]).unwrap();
    assert_eq!(info, LaunchInfo::single());
    assert_eq!(
        (info.rank, info.size, info.launcher),
        (0, 1, Launcher::Single)
    );
    assert_eq!(info.rendezvous, None);
    assert_eq!(info.timeout, Duration::from_secs(30));
}

#[test]
fn fhrun_variables() {
    let info = parse(FHRUN).unwrap();
    assert_eq!(info.launcher, Launcher::Fhrun);
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (3, 4, 1, 2, 1, 2)
    );
    assert_eq!(info.rendezvous.as_deref(), Some("10.0.0.1:29400"));
    assert_eq!(
        info.token.as_ref().map(|t| t.expose()),
        Some("0123456789abcdef0123456789abcdef")
    );
    assert!(!info.token_derived);
    // The token never appears in debug output.
    assert!(!format!("{info:?}").contains("0123456789abcdef"));
}

#[test]
fn a_rank_of_another_release_than_its_fhrun_stops_naming_both() {
    let mine = [FHRUN, &[("FH_FHRUN_VERSION", fh_core::RELEASE)]].concat();
    assert_eq!(parse(&mine).unwrap().rank, 3);
    let theirs = [FHRUN, &[("FH_FHRUN_VERSION", "0.0.1-other")]].concat();
    let (var, reason) = config_err(&theirs);
    assert_eq!(var, "FH_FHRUN_VERSION");
    assert!(
        reason.contains("fhrun that started it is FastHorovod 0.0.1-other"),
        "{reason}"
    );
    assert!(
        reason.contains(&format!("this rank runs FastHorovod {}", fh_core::RELEASE)),
        "{reason}"
    );
    // Checked before anything else the launcher set (which another release may set otherwise).
    let broken = [
        &[("FH_FHRUN_VERSION", "0.0.1-other"), ("FH_RANK", "x")][..],
        &FHRUN[1..],
    ]
    .concat();
    assert_eq!(config_err(&broken).0, "FH_FHRUN_VERSION");
}

#[test]
fn fhrun_wins_over_other_launchers() {
    let mut vars = FHRUN.to_vec();
    vars.extend([
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("SLURM_PROCID", "5"),
        ("SLURM_STEP_ID", "0"),
        ("RANK", "2"),
        ("WORLD_SIZE", "9"),
    ]);
    let info = parse(&vars).unwrap();
    assert_eq!(
        (info.launcher, info.rank, info.size),
        (Launcher::Fhrun, 3, 4)
    );
}

#[test]
fn fhrun_without_local_or_cross_assumes_one_host() {
    let info = parse(&[
        ("FH_RANK", "2"),
        ("FH_SIZE", "3"),
        ("FH_RENDEZVOUS_ADDR", "127.0.0.1:5000"),
        ("FH_JOB_TOKEN", "abcdefghijklmnop"),
    ])
    .unwrap();
    assert_eq!(
        (
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (2, 3, 0, 1)
    );
}

#[test]
fn openmpi_variables() {
    let info = parse(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("FH_RENDEZVOUS_ADDR", "node0:29400"),
        ("OMPI_MCA_ess_base_jobid", "1234"),
    ])
    .unwrap();
    assert_eq!(info.launcher, Launcher::OpenMpi);
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (5, 8, 1, 4, 1, 2)
    );
    assert_eq!(info.rendezvous.as_deref(), Some("node0:29400"));
    // No FH_JOB_TOKEN: derived, flagged, deterministic, and different for another job.
    assert!(info.token_derived);
    let again = parse(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("FH_RENDEZVOUS_ADDR", "node0:29400"),
        ("OMPI_MCA_ess_base_jobid", "1234"),
    ])
    .unwrap();
    assert_eq!(
        info.token, again.token,
        "every rank must derive the same token"
    );
    let other_job = parse(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("FH_RENDEZVOUS_ADDR", "node0:29400"),
        ("OMPI_MCA_ess_base_jobid", "1235"),
    ])
    .unwrap();
    assert_ne!(info.token, other_job.token);
}

#[test]
fn mpich_variables() {
    let info = parse(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "6"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "3"),
        ("MASTER_ADDR", "10.1.1.1"),
        ("MASTER_PORT", "4000"),
    ])
    .unwrap();
    assert_eq!(info.launcher, Launcher::Mpich);
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (3, 6, 0, 3, 1, 2)
    );
    assert_eq!(info.rendezvous.as_deref(), Some("10.1.1.1:4000"));
}

#[test]
fn slurm_variables() {
    let info = parse(&[
        ("SLURM_PROCID", "4"),
        ("SLURM_NTASKS", "5"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_TASKS_PER_NODE", "2(x2),1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_NNODES", "3"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_ID", "777"),
        ("FH_RENDEZVOUS_ADDR", "n1:29400"),
    ])
    .unwrap();
    assert_eq!(info.launcher, Launcher::Slurm);
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (4, 5, 0, 1, 2, 3)
    );
    let with_ntasks_per_node = parse(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NNODES", "2"),
        ("SLURM_STEP_ID", "0"),
        ("FH_RENDEZVOUS_ADDR", "n1:29400"),
    ])
    .unwrap();
    assert_eq!(
        (
            with_ntasks_per_node.local_rank,
            with_ntasks_per_node.local_size
        ),
        (1, 2)
    );
}

#[test]
fn slurm_step_variables_win_over_the_allocation() {
    // `srun -n 3` inside an allocation of 8 tasks on 4 nodes.
    let info = parse(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_NNODES", "4"),
        ("SLURM_TASKS_PER_NODE", "2(x4)"),
        ("SLURM_STEP_ID", "1"),
        ("SLURM_STEP_NUM_TASKS", "3"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2,1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_LOCALID", "0"),
        ("FH_RENDEZVOUS_ADDR", "n1:29400"),
    ])
    .unwrap();
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (2, 3, 0, 1, 1, 2)
    );
}

#[test]
fn slurm_batch_script_is_not_a_job_step() {
    // sbatch sets SLURM_PROCID=0 in the batch script itself; only srun steps are ranks.
    let info = parse(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]).unwrap();
    assert_eq!(info.launcher, Launcher::Single);
}

#[test]
fn torchrun_variables() {
    let info = parse(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "abc"),
    ])
    .unwrap();
    assert_eq!(info.launcher, Launcher::Torchrun);
    assert_eq!(
        (
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size
        ),
        (5, 8, 1, 4, 1, 2)
    );
    assert_eq!(info.rendezvous.as_deref(), Some("10.0.0.7:29500"));
    // When torchrun's agent holds MASTER_PORT, rank 0 listens on the next one.
    let agent = parse(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ])
    .unwrap();
    assert_eq!(agent.rendezvous.as_deref(), Some("10.0.0.7:29501"));
    // FH_RENDEZVOUS_ADDR wins over MASTER_*.
    let explicit = parse(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
        ("FH_RENDEZVOUS_ADDR", "10.0.0.7:31000"),
    ])
    .unwrap();
    assert_eq!(explicit.rendezvous.as_deref(), Some("10.0.0.7:31000"));
}

/// `FHRUN` with `FH_JOB_TOKEN` set to `token`.
fn with_token(token: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut vars: Vec<_> = FHRUN
        .iter()
        .filter(|(k, _)| *k != "FH_JOB_TOKEN")
        .copied()
        .collect();
    vars.push(("FH_JOB_TOKEN", token));
    vars
}

#[test]
fn an_empty_token_is_an_error_with_the_fix_never_a_derived_one() {
    // Set but empty or blank: refused, on a job of several ranks and on a single process alike
    // (never treated as unset, which would derive a public token).
    for token in ["", " ", "\t \n"] {
        let (var, reason) = config_err(&with_token(token));
        assert_eq!(var, "FH_JOB_TOKEN");
        assert!(reason.contains("set but empty"), "{reason}");
        assert!(reason.contains("openssl rand -hex 32"), "{reason}");
        assert!(reason.contains("secrets.token_hex"), "{reason}");
        let (var, _) = config_err(&[("FH_JOB_TOKEN", token)]);
        assert_eq!(var, "FH_JOB_TOKEN");
    }
    // Unset under a launcher without a token is still derived (and said so).
    let vars: Vec<_> = FHRUN
        .iter()
        .filter(|(k, _)| *k != "FH_JOB_TOKEN")
        .copied()
        .collect();
    assert!(parse(&vars).unwrap().token_derived);
}

#[test]
fn tokens_with_too_little_variety_are_refused() {
    for token in [
        "aaaaaaaaaaaaaaaa",
        "0000000000000000000000000000000000000000",
        "abababababababababab",
        "0123401234012340",
    ] {
        let (var, reason) = config_err(&with_token(token));
        assert_eq!(var, "FH_JOB_TOKEN", "{token}");
        assert!(reason.contains("distinct character"), "{token}: {reason}");
        assert!(
            !reason.contains(token),
            "the error shows the token: {reason}"
        );
    }
    // Six distinct characters are enough; so is any real random token.
    for token in ["0123450123450123", "5f1d0c3a9e8b7a6d5c4b3a2918070605"] {
        let info = parse(&with_token(token)).unwrap();
        assert_eq!(info.token.unwrap().expose(), token);
    }
}

#[test]
fn timeouts_below_the_minimum_are_refused() {
    for bad in ["1e-12", "0.000001", "0.5", "0.999"] {
        let mut vars = FHRUN.to_vec();
        vars.push(("FH_TIMEOUT_SECONDS", bad));
        let (var, reason) = config_err(&vars);
        assert_eq!(var, "FH_TIMEOUT_SECONDS", "{bad}");
        assert!(reason.contains("too short"), "{reason}");
        assert!(reason.contains("at least 1 s"), "{reason}");
    }
    let mut vars = FHRUN.to_vec();
    vars.push(("FH_TIMEOUT_SECONDS", "1"));
    assert_eq!(parse(&vars).unwrap().timeout, Duration::from_secs(1));
    // The shared-memory options read the same variable with the same rule.
    let shm = fh_transport::backend::shm::ShmOptions::from_lookup(|v| {
        (v == "FH_TIMEOUT_SECONDS").then(|| "1e-12".to_string())
    });
    assert!(
        matches!(shm, Err(TransportError::Config { ref var, .. }) if var == "FH_TIMEOUT_SECONDS"),
        "{shm:?}"
    );
}

#[test]
fn timeout_variable() {
    let mut vars = FHRUN.to_vec();
    vars.push(("FH_TIMEOUT_SECONDS", "2.5"));
    assert_eq!(parse(&vars).unwrap().timeout, Duration::from_millis(2500));
    for bad in ["abc", "0", "-3", "inf", "NaN"] {
        let mut vars = FHRUN.to_vec();
        vars.push(("FH_TIMEOUT_SECONDS", bad));
        let (var, reason) = config_err(&vars);
        assert_eq!(var, "FH_TIMEOUT_SECONDS", "{bad}");
        assert!(reason.contains("positive number of seconds"), "{reason}");
    }
}

#[test]
fn bad_values_name_the_variable_and_what_is_expected() {
    let with = |over: &[(&'static str, &'static str)]| {
        let mut vars: Vec<(&str, &str)> = FHRUN
            .iter()
            .filter(|(k, _)| !over.iter().any(|(o, _)| o == k))
            .copied()
            .collect();
        vars.extend(over.iter().filter(|(_, v)| !v.is_empty()));
        vars
    };
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case<'_>] = &[
        (&[("FH_RANK", "abc")], "FH_RANK", "non-negative integer"),
        (&[("FH_SIZE", "-1")], "FH_SIZE", "non-negative integer"),
        (&[("FH_RANK", "4")], "FH_RANK", "not below the world size"),
        (
            &[("FH_SIZE", "0"), ("FH_RANK", "0")],
            "FH_SIZE",
            "at least 1",
        ),
        (&[("FH_SIZE", "")], "FH_SIZE", "missing"),
        (
            &[("FH_LOCAL_RANK", "2")],
            "FH_LOCAL_RANK",
            "not below the local size",
        ),
        (
            &[("FH_LOCAL_SIZE", "")],
            "FH_LOCAL_SIZE",
            "set both or neither",
        ),
        (
            &[("FH_CROSS_RANK", "2")],
            "FH_CROSS_RANK",
            "not below the cross size",
        ),
        (
            &[("FH_RENDEZVOUS_ADDR", "10.0.0.1")],
            "FH_RENDEZVOUS_ADDR",
            "host:port",
        ),
        (
            &[("FH_RENDEZVOUS_ADDR", "10.0.0.1:0")],
            "FH_RENDEZVOUS_ADDR",
            "1..=65535",
        ),
        (
            &[("FH_RENDEZVOUS_ADDR", "10.0.0.1:99999")],
            "FH_RENDEZVOUS_ADDR",
            "1..=65535",
        ),
        (
            &[("FH_RENDEZVOUS_ADDR", ":80")],
            "FH_RENDEZVOUS_ADDR",
            "empty",
        ),
        (
            &[("FH_JOB_TOKEN", "has space")],
            "FH_JOB_TOKEN",
            "printable ASCII",
        ),
    ];
    for (over, var, needle) in cases {
        let (got_var, reason) = config_err(&with(over));
        assert_eq!(&got_var, var, "for {over:?}: {reason}");
        assert!(
            reason.contains(needle),
            "for {over:?}: {reason:?} lacks {needle:?}"
        );
    }
    let long = "x".repeat(300);
    let mut vars = FHRUN.to_vec();
    vars.retain(|(k, _)| *k != "FH_JOB_TOKEN");
    vars.push(("FH_JOB_TOKEN", &long));
    assert_eq!(config_err(&vars).0, "FH_JOB_TOKEN");
}

#[test]
fn short_tokens_are_refused_naming_the_variable() {
    let mut vars = FHRUN.to_vec();
    vars.retain(|(k, _)| *k != "FH_JOB_TOKEN");
    vars.push(("FH_JOB_TOKEN", "a"));
    let (var, reason) = config_err(&vars);
    assert_eq!(var, "FH_JOB_TOKEN");
    assert!(reason.contains("at least 16"), "{reason}");
    assert!(
        !reason.contains("\"a\""),
        "the error must not echo the token: {reason}"
    );
    // 15 bytes: refused; 16: fine.
    vars.pop();
    vars.push(("FH_JOB_TOKEN", "0123456789abcde"));
    assert_eq!(config_err(&vars).0, "FH_JOB_TOKEN");
    vars.pop();
    vars.push(("FH_JOB_TOKEN", "0123456789abcdef"));
    assert!(parse(&vars).is_ok());
}

#[test]
fn require_token_refuses_the_derived_fallback() {
    let torchrun = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    // Without FH_REQUIRE_TOKEN: derived, and flagged.
    let info = parse(&torchrun).unwrap();
    assert!(info.token_derived);
    // With it: a clear error naming FH_JOB_TOKEN and how to set it.
    let mut vars = torchrun.to_vec();
    vars.push(("FH_REQUIRE_TOKEN", "1"));
    let (var, reason) = config_err(&vars);
    assert_eq!(var, "FH_JOB_TOKEN");
    assert!(reason.contains("FH_REQUIRE_TOKEN"), "{reason}");
    // A real token satisfies it.
    vars.push(("FH_JOB_TOKEN", "0123456789abcdef0123"));
    let info = parse(&vars).unwrap();
    assert!(!info.token_derived);
    // A bad flag value is an error too.
    let mut vars = torchrun.to_vec();
    vars.push(("FH_REQUIRE_TOKEN", "maybe"));
    assert_eq!(config_err(&vars).0, "FH_REQUIRE_TOKEN");
}

#[test]
fn wildcard_rendezvous_is_refused_unless_allowed() {
    for (var, over) in [
        (
            "FH_RENDEZVOUS_ADDR",
            vec![("FH_RENDEZVOUS_ADDR", "0.0.0.0:29400")],
        ),
        (
            "FH_RENDEZVOUS_ADDR",
            vec![("FH_RENDEZVOUS_ADDR", "[::]:29400")],
        ),
        (
            "MASTER_ADDR",
            vec![("MASTER_ADDR", "0.0.0.0"), ("MASTER_PORT", "29400")],
        ),
        (
            "MASTER_ADDR",
            vec![("MASTER_ADDR", "::"), ("MASTER_PORT", "29400")],
        ),
    ] {
        let mut vars: Vec<(&str, &str)> = vec![("RANK", "1"), ("WORLD_SIZE", "2")];
        vars.extend(over.iter().copied());
        let (got, reason) = config_err(&vars);
        assert_eq!(got, var, "{reason}");
        assert!(
            reason.contains("wildcard") && reason.contains("FH_ALLOW_WILDCARD"),
            "{reason}"
        );
        vars.push(("FH_ALLOW_WILDCARD", "1"));
        let info = parse(&vars).unwrap();
        assert!(info.allow_wildcard);
    }
}

#[test]
fn no_debug_output_shows_the_token() {
    let token = "KNOWN-SECRET-TOKEN-0123456789";
    let mut vars = FHRUN.to_vec();
    vars.retain(|(k, _)| *k != "FH_JOB_TOKEN");
    vars.push(("FH_JOB_TOKEN", token));
    let info = parse(&vars).unwrap();
    assert_eq!(info.token.as_ref().map(|t| t.expose()), Some(token));
    for text in [
        format!("{info:?}"),
        format!("{info:#?}"),
        format!("{:?}", info.token),
    ] {
        assert!(!text.contains(token), "{text}");
        assert!(!text.contains("KNOWN-SECRET"), "{text}");
    }
}

#[test]
fn missing_rendezvous_tells_how_to_launch() {
    let (var, reason) = config_err(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    assert_eq!(var, "FH_RENDEZVOUS_ADDR");
    assert!(reason.contains("fhrun"), "{reason}");
    assert!(reason.contains("MASTER_ADDR"), "{reason}");
    assert!(reason.contains("OpenMPI"), "{reason}");
    let (var, _) = config_err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
    assert_eq!(var, "MASTER_PORT");
    let (var, _) = config_err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "http"),
    ]);
    assert_eq!(var, "MASTER_PORT");
}

#[test]
fn partial_launcher_variables_are_errors() {
    assert_eq!(
        config_err(&[("OMPI_COMM_WORLD_RANK", "0")]).0,
        "OMPI_COMM_WORLD_SIZE"
    );
    assert_eq!(config_err(&[("PMI_SIZE", "4")]).0, "PMI_RANK");
    let (var, _) = config_err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_TASKS_PER_NODE", "two"),
        ("FH_RENDEZVOUS_ADDR", "h:1"),
    ]);
    assert_eq!(var, "SLURM_TASKS_PER_NODE");
    let (var, reason) = config_err(&[
        ("PMI_RANK", "9"),
        ("PMI_SIZE", "4"),
        ("FH_RENDEZVOUS_ADDR", "h:1"),
    ]);
    assert_eq!(var, "PMI_RANK");
    assert!(reason.contains("not below the world size 4"), "{reason}");
}

#[test]
fn transport_choice() {
    let single = LaunchInfo::single();
    for ok in [None, Some("auto"), Some("tcp"), Some("TCP"), Some("local")] {
        let t = fh_transport::world_for(&single, ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        assert_eq!(t.size(), 1);
    }
    let solo_shm = fh_transport::world_for(&single, Some("shm")).unwrap();
    assert_eq!(solo_shm.backend(), "shm");
    #[cfg(target_os = "linux")]
    {
        use fh_core::ReduceOp;
        use fh_transport::CollectivesExt;
        let mut solo_hier = fh_transport::world_for(&single, Some("hier")).unwrap();
        assert_eq!(solo_hier.backend(), "hier");
        let mut c = solo_hier.open("solo").unwrap();
        let mut v = [1.5f32, 2.0];
        c.allreduce_typed(&mut v, ReduceOp::Average).unwrap();
        assert_eq!(v, [1.5, 2.0]);
    }
    // With the `mpi` feature, "mpi" would initialise MPI here: tests/mpi_mpirun.rs covers it.
    if !cfg!(feature = "mpi") {
        match fh_transport::world_for(&single, Some("mpi")) {
            Err(TransportError::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "mpi");
                assert!(reason.contains("FH_TRANSPORT=tcp"), "{reason}");
            }
            other => panic!("mpi: {:?}", other.map(|t| t.backend())),
        }
    }
    match fh_transport::world_for(&single, Some("carrier-pigeon")) {
        Err(TransportError::Config { var, reason }) => {
            assert_eq!(var, "FH_TRANSPORT");
            assert!(
                reason.contains("auto, tcp, shm, hier, mpi, local"),
                "{reason}"
            );
        }
        other => panic!("{:?}", other.map(|t| t.backend())),
    }
    let two = parse(FHRUN).unwrap();
    match fh_transport::world_for(&two, Some("local")) {
        Err(TransportError::Config { var, .. }) => assert_eq!(var, "FH_TRANSPORT"),
        other => panic!("{:?}", other.map(|t| t.backend())),
    }
}

#[test]
fn single_process_tcp_world_works_without_network() {
    use fh_core::ReduceOp;
    use fh_transport::CollectivesExt;
    let mut t = fh_transport::world_for(&LaunchInfo::single(), Some("tcp")).unwrap();
    assert_eq!(t.backend(), "tcp");
    let mut c = t.open("solo").unwrap();
    let mut v = [1.5f32, 2.0];
    c.allreduce_typed(&mut v, ReduceOp::Average).unwrap();
    assert_eq!(v, [1.5, 2.0]);
    c.barrier().unwrap();
}
