//! Communicators over subsets of the world (`fh_transport::compose::subset`) on the in-process, TCP and
//! shared-memory backends: overlapping and disjoint subsets used at the same time, results
//! against a reference, and the member-list errors.

#[cfg(target_os = "linux")]
mod shm_common;

use std::net::TcpListener;
use std::time::Duration;

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::local::LocalWorld;
use fh_transport::backend::tcp::{TcpOptions, TcpTransport};
use fh_transport::compose::subset::open_subset;
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};

/// One rank's results per subset: (allreduce ends, allgather, broadcast), None if outside.
type PerSet = Vec<Option<(Vec<i64>, Vec<i64>, Vec<i64>)>>;

/// The subsets every test opens, in this order (unsorted on purpose: members are sorted).
fn sets(size: usize) -> Vec<Vec<usize>> {
    match size {
        3 => vec![vec![2, 0], vec![1, 2], vec![1]],
        _ => vec![vec![2, 0], vec![1, 2, 3], vec![3, 1], vec![0, 1, 2, 3]],
    }
}

fn labels(prefix: &str) -> Vec<String> {
    vec![format!("{prefix}-control"), format!("{prefix}-data")]
}

/// One rank's body: bad lists fail on every rank without opening anything, then every subset
/// is opened (collectively), and the members of each run a few collectives on their own
/// thread, all subsets at once. Returns, per subset, this rank's results (None if not a member).
fn body(mut world: Box<dyn Transport>) -> PerSet {
    let (rank, size) = (world.rank(), world.size());
    for bad in [vec![], vec![0, size], vec![1, 1]] {
        let e = open_subset(world.as_mut(), &bad, &labels("bad")).expect_err("invalid list");
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
    }
    let mut opened = Vec::new();
    for (i, members) in sets(size).iter().enumerate() {
        let t = open_subset(world.as_mut(), members, &labels(&format!("set{i}"))).expect("open");
        let mut sorted = members.clone();
        sorted.sort_unstable();
        assert_eq!(t.members(), sorted.as_slice());
        assert_eq!(t.is_member(), members.contains(&rank));
        opened.push(t);
    }
    // The world is undisturbed: a world communicator still works.
    let mut w = world.open("after").expect("world open");
    let mut x = [1i64];
    w.allreduce_typed(&mut x, ReduceOp::Sum)
        .expect("world allreduce");
    assert_eq!(x[0], size as i64);

    let threads: Vec<_> = opened
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                if !t.is_member() {
                    let Err(e) = t.open("x") else {
                        panic!("a non-member opened a communicator");
                    };
                    assert!(e.to_string().contains("not a member"), "{e}");
                    return None;
                }
                let me = t.rank();
                let mut a = t.open("a").unwrap();
                let mut b = t.open("b").unwrap();
                assert!(t.open("c").is_err(), "only two were opened");
                let world_rank = t.members()[me] as i64;
                // Two communicators of one subset used in an interleaved way.
                let mut sum = vec![world_rank + 1; 1000];
                a.allreduce_typed(&mut sum, ReduceOp::Sum).unwrap();
                let mut gathered = vec![0u8; 8 * t.size()];
                b.allgather(&world_rank.to_le_bytes(), &mut gathered)
                    .unwrap();
                let gathered: Vec<i64> = gathered
                    .chunks(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let mut bc = [world_rank * 10; 3];
                let root = t.size() - 1;
                b.broadcast(bytemuck::cast_slice_mut(&mut bc), root)
                    .unwrap();
                a.barrier().unwrap();
                Some((vec![sum[0], sum[999]], gathered, bc.to_vec()))
            })
        })
        .collect();
    threads.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check(size: usize, results: Vec<PerSet>) {
    for (rank, per_set) in results.into_iter().enumerate() {
        for (members, got) in sets(size).iter().zip(per_set) {
            let mut m = members.clone();
            m.sort_unstable();
            if !m.contains(&rank) {
                assert!(got.is_none());
                continue;
            }
            let total: i64 = m.iter().map(|&r| r as i64 + 1).sum();
            let want = (
                vec![total, total],
                m.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                vec![*m.last().unwrap() as i64 * 10; 3],
            );
            assert_eq!(got, Some(want), "rank {rank}, set {m:?}");
        }
    }
}

fn run_on(worlds: Vec<Box<dyn Transport>>) -> Vec<PerSet> {
    let handles: Vec<_> = worlds
        .into_iter()
        .map(|w| std::thread::spawn(move || body(w)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn subsets_on_the_local_backend_np3_and_np4() {
    for size in [3, 4] {
        let worlds = LocalWorld::new(size)
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .collect();
        check(size, run_on(worlds));
    }
}

fn info(rank: usize, size: usize, port: u16) -> LaunchInfo {
    LaunchInfo {
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(JobToken::new("subset-test-token")),
        timeout: Duration::from_secs(20),
        ..LaunchInfo::bare(rank, size)
    }
}

#[test]
fn subsets_on_the_tcp_backend_np4() {
    let size = 4;
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            std::thread::spawn(move || {
                let info = info(rank, size, port);
                let t = TcpTransport::connect(&info, TcpOptions::from_info(&info)).unwrap();
                body(Box::new(t))
            })
        })
        .collect();
    check(
        size,
        handles.into_iter().map(|h| h.join().unwrap()).collect(),
    );
}

#[cfg(target_os = "linux")]
#[test]
fn subsets_on_the_shm_backend_np4() {
    use fh_transport::backend::shm::{self, ShmTransport};
    let size = 4;
    let token = shm_common::token();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let token = token.clone();
            std::thread::spawn(move || {
                let t = ShmTransport::join(&token, rank, size, shm_common::small_opts()).unwrap();
                body(Box::new(t))
            })
        })
        .collect();
    check(
        size,
        handles.into_iter().map(|h| h.join().unwrap()).collect(),
    );
    assert_eq!(
        shm_common::leftovers(&shm::segment_prefix(&token)),
        Vec::<String>::new()
    );
}

#[test]
fn a_lost_member_is_reported_by_world_rank() {
    // World of 3; subset {1, 2}; rank 2 drops its end: rank 1 sees rank 2 (world) lost.
    let handles: Vec<_> = LocalWorld::new(3)
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let mut s = open_subset(&mut t, &[1, 2], &["pair".to_string()]).unwrap();
                if t.rank() != 1 {
                    return None;
                }
                let mut c: Box<dyn Communicator> = s.open("c").unwrap();
                let mut x = [0u8; 4];
                Some(c.recv(1, &mut x).unwrap_err())
            })
        })
        .collect();
    let errs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let e = errs[1].as_ref().expect("rank 1 reports");
    assert!(matches!(e, TransportError::PeerLost { rank: 2, .. }), "{e}");
}
