//! `fh_scheduler::elastic::Elastic` without a driver: three workers (threads of this process),
//! each with a scripted `WorldSource`, live through the generations of an elastic job — a
//! world of 3, one worker leaving after a failure (its reason reaches the others) and then
//! removed, a world of 2 with new ranks that ends at a commit because hosts changed, and the
//! job failing with the driver's reason. Collectives are checked in every generation. Over TCP
//! and `auto` (shared memory on one host). Every wait is bounded.

use std::collections::VecDeque;
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use fh_job::{launch::LaunchInfo, token::JobToken};
use fh_scheduler::elastic::{
    Assignment, Elastic, ElasticStart, HostUpdate, Membership, WorldSource,
};
use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, SchedulerError, Tensor};
use fh_transport::Topology;

const WAIT: Duration = Duration::from_secs(30);
const LIMIT: Duration = Duration::from_secs(90);
const FAILED: &str = "fewer than --min-np 2 ranks remain (lost: h0 (rank 1 killed by SIGKILL))";
const LEAVES: &str = "worker 2 lost its host";

/// One worker's side of a scripted driver: the answers to its registrations, and per
/// generation the host update rank 0 gets at the commit.
struct Scripted {
    answers: VecDeque<Membership>,
    generation: u64,
}

impl WorldSource for Scripted {
    fn next_world(&mut self) -> Result<Membership, SchedulerError> {
        let m = self
            .answers
            .pop_front()
            .ok_or_else(|| SchedulerError::InvalidArgument("the script has ended".into()))?;
        if let Membership::Member(a) = &m {
            self.generation = a.generation;
        }
        Ok(m)
    }

    fn host_updates(&mut self, since: u64) -> Result<HostUpdate, SchedulerError> {
        // Generation 1 ends with a host removed (stamp 1 -> 2), generation 2 with one added.
        match (self.generation, since) {
            (1, 1) => Ok(HostUpdate {
                stamp: 2,
                added: false,
                removed: true,
            }),
            (2, 2) => Ok(HostUpdate {
                stamp: 3,
                added: true,
                removed: false,
            }),
            other => Err(SchedulerError::InvalidArgument(format!(
                "unexpected host_updates (generation, since) = {other:?}"
            ))),
        }
    }
}

fn port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port")
}

fn member(generation: u64, rank: usize, size: usize, port: u16) -> Membership {
    Membership::Member(Assignment {
        generation,
        topology: Topology::single_host(rank, size),
        rendezvous: format!("127.0.0.1:{port}"),
        hosts_stamp: generation,
    })
}

/// How a worker's job ended, and the (generation, rank, size) of each world it ran.
#[derive(Debug, PartialEq)]
struct Outcome {
    worlds: Vec<(u64, usize, usize)>,
    end: String,
}

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

/// Collectives with checked results in one generation.
fn collectives(engine: &Engine, g: u64) {
    let (rank, size) = (engine.rank(), engine.size());
    let v = engine
        .allreduce(
            &format!("g{g}-x"),
            Tensor::from_slice(&[rank as f32 + 1.0; 1000]),
            sum(),
        )
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<f32>())
        .expect("allreduce");
    assert_eq!(v, [(size * (size + 1) / 2) as f32; 1000], "generation {g}");
    let a = engine
        .allgather(&format!("g{g}-ranks"), Tensor::from_slice(&[rank as i32]))
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<i32>())
        .expect("allgather");
    assert_eq!(a, (0..size as i32).collect::<Vec<_>>(), "generation {g}");
}

/// The host-update check at a commit: rank 0 asks, every rank gets the answer.
fn hosts_changed(engine: &Engine, elastic: &mut Elastic, seen: u64, g: u64) -> (bool, HostUpdate) {
    let mine = if engine.rank() == 0 {
        let u = elastic.host_updates(seen).expect("host updates");
        [u.stamp as i64, i64::from(u.added), i64::from(u.removed)]
    } else {
        [0; 3]
    };
    let u = engine
        .broadcast(&format!("g{g}-hosts"), Tensor::from_slice(&mine), 0)
        .and_then(|mut h| h.wait_timeout(WAIT))
        .and_then(|t| t.to_vec::<i64>())
        .expect("broadcast");
    let u = HostUpdate {
        stamp: u[0] as u64,
        added: u[1] == 1,
        removed: u[2] == 1,
    };
    (u.stamp > seen, u)
}

fn worker(id: usize, mut elastic: Elastic) -> Outcome {
    let mut worlds = Vec::new();
    loop {
        let (engine, a) = match elastic.start(Config::default().channels(2)) {
            Ok(ElasticStart::Started { engine, assignment }) => (engine, assignment),
            Ok(ElasticStart::Removed(why)) => {
                return Outcome {
                    worlds,
                    end: format!("removed: {why}"),
                }
            }
            Err(e @ SchedulerError::ElasticFailed { .. }) => {
                return Outcome {
                    worlds,
                    end: format!("failed: {e}"),
                }
            }
            Err(e) => panic!("worker {id}: a world failed to form: {e}"),
        };
        let g = a.generation;
        assert_eq!(engine.topology(), a.topology, "worker {id}, generation {g}");
        worlds.push((g, engine.rank(), engine.size()));
        collectives(&engine, g);
        if g == 1 {
            if id == 2 {
                // A worker that fails: its reason reaches the others, whose engines stop.
                engine.close_with_reason(LEAVES).expect("close");
            } else {
                let err = engine
                    .allreduce("g1-after", Tensor::from_slice(&[1.0f32]), sum())
                    .and_then(|mut h| h.wait_timeout(WAIT))
                    .expect_err("worker 2 has left");
                assert!(err.to_string().contains(LEAVES), "worker {id}: {err}");
                let _ = engine.close();
            }
        } else {
            let (changed, u) = hosts_changed(&engine, &mut elastic, a.hosts_stamp, g);
            assert!(changed, "worker {id}, generation {g}: {u:?}");
            assert_eq!(
                u,
                HostUpdate {
                    stamp: 3,
                    added: true,
                    removed: false
                }
            );
            engine.close().expect("close at a commit");
        }
    }
}

fn job(backend: &str) {
    let (p1, p2) = (port(), port());
    let scripts = [
        vec![
            member(1, 0, 3, p1),
            member(2, 1, 2, p2),
            Membership::Failed(FAILED.into()),
        ],
        vec![
            member(1, 1, 3, p1),
            member(2, 0, 2, p2),
            Membership::Failed(FAILED.into()),
        ],
        vec![
            member(1, 2, 3, p1),
            Membership::Removed("host h2 was blacklisted".into()),
        ],
    ];
    let base = LaunchInfo {
        token: Some(JobToken::new(format!(
            "elastic-test-{backend}-{:08x}{p1:05}{p2:05}",
            std::process::id()
        ))),
        timeout: Duration::from_secs(20),
        ..LaunchInfo::single()
    };
    let (tx, rx) = mpsc::channel();
    for (id, answers) in scripts.into_iter().enumerate() {
        let source = Scripted {
            answers: answers.into(),
            generation: 0,
        };
        let elastic = Elastic::with_source(Box::new(source), base.clone(), Some(backend.into()));
        let tx = tx.clone();
        std::thread::spawn(move || {
            let out =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker(id, elastic)));
            let _ = tx.send((
                id,
                out.map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                }),
            ));
        });
    }
    let mut outs: Vec<Option<Outcome>> = vec![None, None, None];
    for _ in 0..3 {
        let (id, out) = rx.recv_timeout(LIMIT).expect("every worker ends in time");
        outs[id] = Some(out.unwrap_or_else(|p| panic!("{backend}: worker {id} panicked: {p}")));
    }
    let failed = format!("failed: the elastic job cannot go on: {FAILED}");
    assert_eq!(
        outs,
        [
            Some(Outcome {
                worlds: vec![(1, 0, 3), (2, 1, 2)],
                end: failed.clone(),
            }),
            Some(Outcome {
                worlds: vec![(1, 1, 3), (2, 0, 2)],
                end: failed,
            }),
            Some(Outcome {
                worlds: vec![(1, 2, 3)],
                end: "removed: host h2 was blacklisted".into(),
            }),
        ],
        "{backend}"
    );
}

#[test]
fn generations_over_tcp() {
    job("tcp");
}

#[test]
fn generations_over_auto_shared_memory() {
    job("auto");
}
