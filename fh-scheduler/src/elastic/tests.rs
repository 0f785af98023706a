use std::collections::VecDeque;

use fh_job::{launch::LaunchInfo, token::JobToken};
use fh_transport::Topology;

use super::*;

/// Hands out scripted answers, then fails.
struct Script(VecDeque<Membership>);

impl WorldSource for Script {
    fn next_world(&mut self) -> Result<Membership, SchedulerError> {
        self.0.pop_front().ok_or_else(|| SchedulerError::Transport {
            lost_rank: None,
            message: "the driver's session ended".into(),
            source: None,
        })
    }

    fn host_updates(&mut self, since: u64) -> Result<HostUpdate, SchedulerError> {
        Ok(HostUpdate {
            stamp: since + 1,
            added: true,
            removed: false,
        })
    }
}

fn base() -> LaunchInfo {
    LaunchInfo {
        token: Some(JobToken::new("elastic-unit-test-token-0123456789")),
        host_id: Some("h1".into()),
        ..LaunchInfo::single()
    }
}

fn member(generation: u64, rank: usize, size: usize) -> Membership {
    Membership::Member(Assignment {
        generation,
        topology: Topology::single_host(rank, size),
        rendezvous: "127.0.0.1:1".into(),
        hosts_stamp: 7,
    })
}

fn elastic(answers: Vec<Membership>) -> Elastic {
    Elastic::with_source(Box::new(Script(answers.into())), base(), Some("tcp".into()))
}

#[test]
fn launch_info_takes_the_place_rendezvous_and_the_generation_token() {
    let a = Assignment {
        generation: 3,
        topology: Topology {
            rank: 2,
            size: 4,
            local_rank: 0,
            local_size: 2,
            cross_rank: 1,
            cross_size: 2,
        },
        rendezvous: "10.0.0.5:4242".into(),
        hosts_stamp: 9,
    };
    let info = a.launch_info(&base());
    assert_eq!(
        (info.rank, info.size, info.local_rank, info.local_size),
        (2, 4, 0, 2)
    );
    assert_eq!((info.cross_rank, info.cross_size), (1, 2));
    assert_eq!(info.rendezvous.as_deref(), Some("10.0.0.5:4242"));
    let job = JobToken::new("elastic-unit-test-token-0123456789");
    assert_eq!(
        info.token,
        Some(job.for_incarnation(ELASTIC_INCARNATION_BASE + 3))
    );
    assert_ne!(info.token, Some(job.for_incarnation(3)));
    // The rest comes from the base.
    assert_eq!(info.host_id.as_deref(), Some("h1"));
    assert_eq!(info.timeout, base().timeout);
}

#[test]
fn a_world_of_one_starts_and_generations_must_grow() {
    let mut e = elastic(vec![member(1, 0, 1), member(1, 0, 1), member(2, 0, 1)]);
    let ElasticStart::Started { engine, assignment } =
        e.start(Config::default()).expect("generation 1")
    else {
        panic!("removed")
    };
    assert_eq!((engine.rank(), engine.size()), (0, 1));
    assert_eq!(assignment.hosts_stamp, 7);
    engine.shutdown().expect("shutdown");
    // The same generation again would reuse its token: refused, naming the generations.
    let err = e.start(Config::default()).unwrap_err();
    assert!(
        matches!(&err, SchedulerError::InvalidArgument(m) if m.contains("after generation 1")),
        "{err}"
    );
    let ElasticStart::Started { engine, .. } = e.start(Config::default()).expect("generation 2")
    else {
        panic!("removed")
    };
    engine.shutdown().expect("shutdown");
    assert_eq!(
        e.host_updates(7).expect("updates"),
        HostUpdate {
            stamp: 8,
            added: true,
            removed: false
        }
    );
}

#[test]
fn each_generation_writes_its_flight_record_and_timeline_apart() {
    let dir = std::env::temp_dir().join(format!("fh-elastic-gen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Config {
        flight_dir: Some(dir.join("flight").join("gen-{generation}")),
        timeline: Some(dir.join("timeline/gen-{generation}/rank-{rank}.json")),
        ..Config::default()
    };
    let mut e = elastic(vec![member(1, 0, 1), member(4, 0, 1)]);
    for generation in [1, 4] {
        let ElasticStart::Started { engine, .. } = e.start(config.clone()).expect("a world") else {
            panic!("removed")
        };
        engine.write_flight_record("SIGUSR1").expect("record");
        engine.shutdown().expect("shutdown");
        let gen = format!("gen-{generation}");
        assert!(dir.join("flight").join(&gen).join("rank-0.json").is_file());
        assert!(dir
            .join("timeline")
            .join(&gen)
            .join("rank-0.json")
            .is_file());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn removed_failed_and_a_lost_session_are_told_apart() {
    let why = "fewer than --min-np 2 ranks remain (lost: h2 (rank 2 killed by SIGKILL))";
    let mut e = elastic(vec![
        Membership::Removed("host h3 was removed".into()),
        Membership::Failed(why.into()),
    ]);
    match e.start(Config::default()) {
        Ok(ElasticStart::Removed(r)) => assert_eq!(r, "host h3 was removed"),
        other => panic!("expected Removed, got {other:?}"),
    }
    let err = e.start(Config::default()).unwrap_err();
    assert_eq!(err, SchedulerError::ElasticFailed { reason: why.into() });
    assert!(err.to_string().contains(why), "{err}");
    // The source fails (the session ended): the job cannot go on either, and says why.
    let err = e.start(Config::default()).unwrap_err();
    assert!(
        matches!(&err, SchedulerError::ElasticFailed { reason } if reason.contains("session ended")),
        "{err}"
    );
}

#[test]
fn impossible_assignments_are_refused_before_any_connection() {
    let bad = [
        member(1, 3, 3),
        member(1, 0, 0),
        Membership::Member(Assignment {
            generation: 1,
            topology: Topology {
                local_rank: 2,
                local_size: 2,
                ..Topology::single_host(0, 2)
            },
            rendezvous: "127.0.0.1:1".into(),
            hosts_stamp: 0,
        }),
        Membership::Member(Assignment {
            generation: 1,
            topology: Topology::single_host(0, 2),
            rendezvous: " ".into(),
            hosts_stamp: 0,
        }),
        member(u64::MAX, 0, 1),
    ];
    for m in bad {
        let mut e = elastic(vec![m.clone()]);
        let err = e.start(Config::default()).unwrap_err();
        assert!(
            matches!(&err, SchedulerError::InvalidArgument(t) if t.contains("elastic driver")),
            "{m:?}: {err}"
        );
    }
}

#[test]
fn from_env_is_none_outside_an_elastic_job() {
    if std::env::var_os(fh_job::elastic::ADDR_VAR).is_none() {
        assert!(Elastic::from_env().expect("no error").is_none());
    }
}

#[test]
fn an_mpi_backend_is_refused_before_registering() {
    let mut e = Elastic::with_source(
        Box::new(Script(VecDeque::new())),
        LaunchInfo::single(),
        Some("mpi+tcp".into()),
    );
    match e.start(Config::default()) {
        Err(SchedulerError::Config { var, reason }) => {
            assert_eq!(var, "FH_TRANSPORT");
            assert!(reason.contains("fixed by mpirun"), "{reason}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}
