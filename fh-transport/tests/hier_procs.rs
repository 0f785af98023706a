//! The hierarchical backend with one process per rank, several hosts simulated on this machine:
//! this test binary re-runs itself as the ranks (`child` below) with the `FH_*` environment a
//! launcher would set for the given host layout, over 127.0.0.1. A guard kills and reaps every
//! child, also when an assertion fails, and every wait is bounded.
#![cfg(target_os = "linux")]

mod shm_common;
mod support;

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fh_core::{DType, ReduceOp};
use fh_transport::backend::shm;
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};
use shm_common::*;
use support::{free_port, launcher_env, rank_command, serial, Children};

const ROLE: &str = "FH_HIER_TEST_ROLE";
const VICTIM: &str = "FH_HIER_TEST_VICTIM";
const HOSTS: &str = "FH_HIER_TEST_HOSTS";
const DIR: &str = "FH_HIER_TEST_DIR";
/// Set: the victim of a `kill` test dies in the middle of a pipelined allreduce.
const DURING: &str = "FH_HIER_TEST_DURING";
/// The hierarchical allreduce's pipeline chunk ([`fh_transport::backend::tcp::streams`]).
const PIPELINE: &str = "FH_HIER_PIPELINE";

/// `hosts[h]` lists the global ranks on simulated host `h`, by local rank.
fn layout_string(hosts: &[Vec<usize>]) -> String {
    hosts
        .iter()
        .map(|h| h.iter().map(usize::to_string).collect::<Vec<_>>().join(","))
        .collect::<Vec<_>>()
        .join(";")
}

fn parse_layout(s: &str) -> Vec<Vec<usize>> {
    s.split(';')
        .map(|h| h.split(',').map(|r| r.parse().unwrap()).collect())
        .collect()
}

/// Where one rank sits: (rank, local rank, local size, cross rank, cross size).
type Place = (usize, usize, usize, usize, usize);

/// Every wait of a rank, unless a test says otherwise (`FH_TIMEOUT_SECONDS`).
const TIMEOUT_S: u32 = 15;

impl Children {
    fn spawn(
        hosts: &[Vec<usize>],
        transport: &str,
        role: &str,
        token: &str,
        extra: &[(&str, String)],
    ) -> Children {
        Self::spawn_timed(hosts, transport, role, token, extra, TIMEOUT_S)
    }

    /// [`Children::spawn`] with every wait of a rank bounded by `timeout_s`.
    fn spawn_timed(
        hosts: &[Vec<usize>],
        transport: &str,
        role: &str,
        token: &str,
        extra: &[(&str, String)],
        timeout_s: u32,
    ) -> Children {
        let mut places = Vec::new();
        for (h, ranks) in hosts.iter().enumerate() {
            for (l, &r) in ranks.iter().enumerate() {
                places.push((r, l, ranks.len(), h, hosts.len()));
            }
        }
        places.sort();
        Self::spawn_places(&places, hosts, transport, role, token, extra, timeout_s)
    }

    /// Spawn one rank per place (in that order).
    fn spawn_places(
        places: &[Place],
        hosts: &[Vec<usize>],
        transport: &str,
        role: &str,
        token: &str,
        extra: &[(&str, String)],
        timeout_s: u32,
    ) -> Children {
        let rendezvous = format!("127.0.0.1:{}", free_port());
        let mut kids = Children(Vec::new());
        for &(rank, local_rank, local_size, cross_rank, cross_size) in places {
            let place = support::Place {
                rank,
                size: places.len(),
                local_rank,
                local_size,
                cross_rank,
                cross_size,
            };
            let mut cmd = rank_command("child", false);
            cmd.env(ROLE, role).env(HOSTS, layout_string(hosts));
            launcher_env(&mut cmd, &place, transport, &rendezvous, token, timeout_s);
            let child = cmd
                .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn a rank");
            kids.0.push(child);
        }
        kids
    }
}

fn hier_token() -> String {
    token()
}

/// Segments of every simulated host of the job with this token left in /dev/shm.
fn host_leftovers(tok: &str, hosts: usize) -> Vec<String> {
    (0..hosts)
        .flat_map(|h| {
            let host = fh_transport::compose::hier::host_token(&fh_job::JobToken::new(tok), h);
            leftovers(&shm::segment_prefix(host.expose()))
        })
        .collect()
}

/// Allreduce of long vectors (primes, past a slot and the ring threshold) against the
/// sequential reference.
fn long_allreduces(c: &mut dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    for (i, (d, o, len)) in [
        (DType::F32, ReduceOp::Sum, (1usize << 20) + 3),
        (DType::F32, ReduceOp::Average, 65_537),
        (DType::I32, ReduceOp::Max, 100_003),
        (DType::BF16, ReduceOp::Sum, 40_009),
        (DType::I64, ReduceOp::Average, 30_011),
    ]
    .into_iter()
    .enumerate()
    {
        let inputs: Vec<_> = (0..n).map(|r| values(d, 77, i as u64, r, len)).collect();
        let mut buf = inputs[me].clone();
        c.allreduce(&mut buf, d, o).unwrap();
        assert!(
            buf == reference(d, o, &inputs),
            "allreduce {d} {o:?} of {len} elements differs from the reference"
        );
    }
}

/// Allreduces of a vector in slices of uneven sizes (some empty) where they lie
/// (`Communicator::allreduce_segments`), `finish` dividing by the world size: each byte must be
/// finished exactly once, and every slice end with the reference.
fn segmented_allreduces(c: &mut dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let lens = [0usize, 3, 100_000, 1, 70_007, 0, 250_001];
    let x = |r: usize, i: usize| ((i * 7 + r * 13) % 1001) as f64 - 500.0;
    let mut vecs: Vec<Vec<f64>> = Vec::new();
    let mut at = 0;
    for &len in &lens {
        vecs.push((at..at + len).map(|i| x(me, i)).collect());
        at += len;
    }
    let mut segs: Vec<&mut [u8]> = vecs
        .iter_mut()
        .map(|v| bytemuck::cast_slice_mut::<f64, u8>(v))
        .collect();
    c.allreduce_segments(&mut segs, DType::F64, ReduceOp::Sum, &mut |b| {
        for e in b.chunks_exact_mut(8) {
            let v = f64::from_ne_bytes(e.try_into().unwrap()) / n as f64;
            e.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })
    .unwrap();
    let mut i = 0;
    for v in &vecs {
        for &got in v {
            let want = (0..n).map(|r| x(r, i)).sum::<f64>() / n as f64;
            assert_eq!(got, want, "rank {me}: element {i} of the sliced allreduce");
            i += 1;
        }
    }
}

/// The body of a rank; does nothing when run as an ordinary test.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let hosts = parse_layout(&std::env::var(HOSTS).expect("layout"));
    let size: usize = hosts.iter().map(Vec::len).sum();
    match role.as_str() {
        "suite" => {
            let mut world = fh_transport::from_env().unwrap();
            assert_eq!(world.backend(), "hier");
            let t = world.topology();
            assert_eq!((t.size, t.cross_size), (size, hosts.len()));
            assert_eq!(hosts[t.cross_rank][t.local_rank], t.rank);
            let mut c = world.open("suite").unwrap();
            let mut d = world.open("second").unwrap();
            suite_allreduce(&mut *c, 4242 + size as u64);
            suite_parts(&mut *c, 31);
            long_allreduces(&mut *c);
            segmented_allreduces(&mut *c);
            suite_others(&mut *c, 17);
            suite_p2p(&mut *c, 18);
            // Rejected arguments leave the communicator usable.
            let mut odd = [0u8; 7];
            assert!(c.allreduce(&mut odd, DType::F32, ReduceOp::Sum).is_err());
            assert!(c.allreduce(&mut odd, DType::U8, ReduceOp::Average).is_ok());
            assert!(c.broadcast(&mut odd, size).is_err());
            let mut v = [1i64; 3];
            c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, [size as i64; 3]);
            // A second communicator works independently of the first.
            suite_allreduce(&mut *d, 99);
            c.barrier().unwrap();
            d.barrier().unwrap();
            // A subset without rank 0 (a process set) spans the hosts; its topology numbers
            // the members' hosts, and the suite runs on it while rank 0 holds its ends idle.
            let members: Vec<usize> = (1..size).collect();
            let labels = ["sub-control".to_string(), "sub-data".to_string()];
            let mut sub =
                fh_transport::compose::subset::open_subset(world.as_mut(), &members, &labels)
                    .unwrap();
            assert_eq!(sub.is_member(), t.rank != 0);
            if sub.is_member() {
                let st = sub.topology();
                let my_host: Vec<usize> = hosts[t.cross_rank]
                    .iter()
                    .copied()
                    .filter(|&r| r != 0)
                    .collect();
                assert_eq!((st.rank, st.size), (t.rank - 1, size - 1));
                assert_eq!(st.local_size, my_host.len());
                let hosts_left = hosts.iter().filter(|h| h.iter().any(|&r| r != 0)).count();
                assert_eq!(st.cross_size, hosts_left);
                let mut s = sub.open("x").unwrap();
                suite_allreduce(&mut *s, 7 + size as u64);
                suite_parts(&mut *s, 9);
                suite_others(&mut *s, 8);
                s.barrier().unwrap();
            }
            drop(sub);
            c.barrier().unwrap();
        }
        "pipeline" => {
            // Run with a small FH_HIER_PIPELINE chunk: the long vectors split into many
            // chunks of uneven sizes.
            let mut world = fh_transport::from_env().unwrap();
            assert_eq!(world.backend(), "hier");
            let mut c = world.open("pipeline").unwrap();
            long_allreduces(&mut *c);
            segmented_allreduces(&mut *c);
            // Values whose sums round: every rank must still end with the same bits, close to
            // the exact sum.
            let (n, me) = (c.size(), c.rank());
            let x = |r: usize, i: usize| ((i * 7 + r * 13) as f64 * 0.37).sin() * 1.1;
            for (o, len) in [(ReduceOp::Sum, 300_007usize), (ReduceOp::Average, 70_001)] {
                let mut buf: Vec<f32> = (0..len).map(|i| x(me, i) as f32).collect();
                c.allreduce_typed(&mut buf, o).unwrap();
                let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
                let mut all = vec![0u8; bytes.len() * n];
                c.allgather(&bytes, &mut all).unwrap();
                assert!(
                    all.chunks(bytes.len()).all(|b| b == bytes.as_slice()),
                    "rank {me}: allreduce {o:?} of {len} f32 differs between ranks"
                );
                let div = if o == ReduceOp::Average {
                    n as f64
                } else {
                    1.0
                };
                for (i, v) in buf.iter().enumerate() {
                    let want = (0..n).map(|r| x(r, i) as f32 as f64).sum::<f64>() / div;
                    assert!(
                        (*v as f64 - want).abs() < 1e-4,
                        "element {i}: {v} vs {want}"
                    );
                }
            }
            c.barrier().unwrap();
        }
        "fallback" => {
            let mut world = fh_transport::from_env().unwrap();
            assert_eq!(world.backend(), "tcp", "one rank per host: no hierarchy");
            let mut c = world.open("fallback").unwrap();
            let mut v = vec![1.0f32 + c.rank() as f32; 1000];
            c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
            let want = (size * (size + 1) / 2) as f32;
            assert!(v.iter().all(|&x| x == want));
        }
        "bad_layout" => {
            let err = match fh_transport::from_env() {
                Ok(_) => panic!("a hierarchical world from an inconsistent layout"),
                Err(e) => e,
            };
            assert!(
                // Settled at the rendezvous: rank 2's FH_CROSS_SIZE contradicts the two hosts.
                matches!(&err, TransportError::Config { var, reason }
                    if var == "FH_CROSS_RANK/FH_CROSS_SIZE" && reason.contains("contradict")),
                "unexpected error: {err}"
            );
        }
        "kill" => {
            let victim: usize = std::env::var(VICTIM).unwrap().parse().unwrap();
            let mut world = fh_transport::from_env().unwrap();
            let mut c = world.open("victim").unwrap();
            let during = std::env::var(DURING).is_ok();
            // While pipelined (a small FH_HIER_PIPELINE chunk): many chunks in flight.
            let mut buf = vec![1.0f32; if during { 1 << 20 } else { 50_000 }];
            for _ in 0..5 {
                buf.fill(1.0);
                c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            }
            if c.rank() == victim && during {
                // Killed by a thread of its own in the middle of an allreduce.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    // SAFETY: sending a signal to ourselves.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                });
                loop {
                    buf.fill(1.0);
                    let _ = c.allreduce_typed(&mut buf, ReduceOp::Sum);
                }
            }
            if c.rank() == victim {
                // SAFETY: sending a signal to ourselves.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                unreachable!("SIGKILL did not kill the process");
            }
            let start = Instant::now();
            let err = loop {
                if let Err(e) = c.allreduce_typed(&mut buf, ReduceOp::Sum) {
                    break e;
                }
            };
            assert!(
                matches!(err, TransportError::PeerLost { rank, .. } if rank == victim),
                "rank {}: expected PeerLost naming rank {victim}, got {err}",
                c.rank()
            );
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the loss was only noticed after {:?}",
                start.elapsed()
            );
            // Later calls fail at once.
            assert!(c.allreduce_typed(&mut buf, ReduceOp::Sum).is_err());
        }
        "cut" => {
            // The ranks of the host the parent stops (an unreachable host, as seen from the
            // others): every other rank must fail naming one of them.
            let far: Vec<usize> = std::env::var(VICTIM)
                .unwrap()
                .split(',')
                .map(|r| r.parse().unwrap())
                .collect();
            let dir = std::path::PathBuf::from(std::env::var(DIR).unwrap());
            let mut world = fh_transport::from_env().unwrap();
            let mut c = world.open("cut").unwrap();
            let fill = |buf: &mut Vec<f32>, rank: usize| {
                buf.clear();
                buf.resize(50_000, rank as f32 + 1.0);
            };
            let mut buf = Vec::new();
            for _ in 0..3 {
                fill(&mut buf, c.rank());
                c.allreduce_typed(&mut buf, ReduceOp::Sum).unwrap();
            }
            std::fs::write(dir.join(format!("looping-{}", c.rank())), b"").unwrap();
            let err = loop {
                fill(&mut buf, c.rank());
                if let Err(e) = c.allreduce_typed(&mut buf, ReduceOp::Sum) {
                    break e;
                }
            };
            eprintln!("cut: rank {}: {err}", c.rank());
            assert!(
                err.is_peer_failure() && err.blamed_rank().is_some_and(|r| far.contains(&r)),
                "rank {}: expected an error naming one of ranks {far:?} (the host it cannot \
                 reach), got: {err}",
                c.rank()
            );
        }
        other => panic!("unknown role {other}"),
    }
}

fn run_suite(hosts: &[Vec<usize>], transport: &str) {
    let tok = hier_token();
    let mut kids = Children::spawn(hosts, transport, "suite", &tok, &[]);
    let st = kids.wait_all(Duration::from_secs(120));
    assert!(st.iter().all(ExitStatus::success), "{hosts:?}: {st:?}");
    assert_eq!(host_leftovers(&tok, hosts.len()), Vec::<String>::new());
}

#[test]
fn auto_picks_hier_for_two_hosts_of_two() {
    let _s = serial();
    // Hosts hold non-consecutive ranks on purpose.
    run_suite(&[vec![0, 3], vec![1, 2]], "auto");
}

#[test]
fn inhomogeneous_hosts() {
    let _s = serial();
    run_suite(&[vec![0, 1], vec![2], vec![3, 4]], "hier");
}

#[test]
fn auto_uses_tcp_with_one_rank_per_host() {
    let _s = serial();
    let tok = hier_token();
    let hosts = [vec![0], vec![1], vec![2]];
    let mut kids = Children::spawn(&hosts, "auto", "fallback", &tok, &[]);
    let st = kids.wait_all(Duration::from_secs(60));
    assert!(st.iter().all(ExitStatus::success), "{st:?}");
}

#[test]
fn inconsistent_layout_is_a_config_error() {
    let _s = serial();
    let tok = hier_token();
    let hosts = [vec![0, 1], vec![2]];
    // Rank 2 counts three hosts where the others count two.
    let places = [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 1, 1, 3)];
    let mut kids =
        Children::spawn_places(&places, &hosts, "hier", "bad_layout", &tok, &[], TIMEOUT_S);
    let st = kids.wait_all(Duration::from_secs(60));
    assert!(st.iter().all(ExitStatus::success), "{st:?}");
}

fn kill_test(hosts: &[Vec<usize>], victim: usize) {
    kill_test_with(hosts, victim, &[]);
}

fn kill_test_with(hosts: &[Vec<usize>], victim: usize, extra: &[(&str, String)]) {
    let tok = hier_token();
    let mut env = vec![(VICTIM, victim.to_string())];
    env.extend_from_slice(extra);
    let mut kids = Children::spawn(hosts, "hier", "kill", &tok, &env);
    let st = kids.wait_all(Duration::from_secs(60));
    for (r, s) in st.iter().enumerate() {
        if r == victim {
            assert_eq!(s.signal(), Some(libc::SIGKILL), "victim: {s:?}");
        } else {
            assert!(s.success(), "survivor {r}: {s:?}");
        }
    }
    assert_eq!(host_leftovers(&tok, hosts.len()), Vec::<String>::new());
}

#[test]
fn killed_non_leader_is_named_by_every_survivor() {
    let _s = serial();
    kill_test(&[vec![0, 1], vec![2, 3]], 1);
}

#[test]
fn killed_leader_is_named_by_every_survivor() {
    let _s = serial();
    kill_test(&[vec![0, 1], vec![2, 3]], 2);
}

/// A rank killed while pipelined allreduces of many chunks are in flight is named by every
/// survivor, on its host and across.
#[test]
fn killed_in_the_middle_of_a_pipeline_is_named_by_every_survivor() {
    let _s = serial();
    let extra = [(PIPELINE, "64K".to_string()), (DURING, "1".to_string())];
    for victim in [1, 2] {
        kill_test_with(&[vec![0, 1], vec![2, 3]], victim, &extra);
    }
}

#[test]
fn pipelined_allreduce_of_many_uneven_chunks() {
    let _s = serial();
    for hosts in [
        vec![vec![0, 3], vec![1, 2]],
        vec![vec![0, 1, 2], vec![3, 4, 5]],
    ] {
        let tok = hier_token();
        let extra = [(PIPELINE, "64K".to_string())];
        let mut kids = Children::spawn(&hosts, "hier", "pipeline", &tok, &extra);
        let st = kids.wait_all(Duration::from_secs(120));
        assert!(st.iter().all(ExitStatus::success), "{hosts:?}: {st:?}");
        assert_eq!(host_leftovers(&tok, hosts.len()), Vec::<String>::new());
    }
}

#[test]
fn killed_remote_host_is_named_by_the_ranks_waiting_for_their_leader() {
    let _s = serial();
    // Hosts of different sizes: rank 1 waits in shared memory for its leader, which learns
    // of the loss over TCP and must pass the name on.
    kill_test(&[vec![0, 1], vec![2]], 2);
}

/// The ranks of the last host of `hosts` stop (SIGSTOP: their host is unreachable, as after a
/// cut link, since a stopped process answers nothing) while every rank loops over allreduces;
/// every rank of the other hosts must fail by itself with an error naming a rank of the stopped
/// host, never a live peer of its own host that waits across hosts itself.
fn cut_test(hosts: &[Vec<usize>], transport: &str) {
    cut_test_with(hosts, transport, 3, 90);
}

/// [`cut_test`] with every wait of a rank bounded by `timeout_s` (`FH_TIMEOUT_SECONDS`), every
/// survivor's end by `bound_s` seconds.
fn cut_test_with(hosts: &[Vec<usize>], transport: &str, timeout_s: u32, bound_s: u64) {
    let tok = hier_token();
    let far = hosts.last().unwrap().clone();
    let dir = std::env::temp_dir().join(format!("fh-hier-cut-{tok}"));
    std::fs::create_dir_all(&dir).unwrap();
    let list: Vec<String> = far.iter().map(usize::to_string).collect();
    let extra = [(VICTIM, list.join(",")), (DIR, dir.display().to_string())];
    let mut kids = Children::spawn_timed(hosts, transport, "cut", &tok, &extra, timeout_s);
    let size = kids.0.len();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(0..size).all(|r| dir.join(format!("looping-{r}")).exists()) {
        let exited: Vec<usize> = (0..size)
            .filter(|&r| matches!(kids.0[r].try_wait(), Ok(Some(_))))
            .collect();
        assert!(exited.is_empty(), "ranks {exited:?} exited before the cut");
        assert!(Instant::now() < deadline, "the ranks did not start looping");
        std::thread::sleep(Duration::from_millis(10));
    }
    for &r in &far {
        // SAFETY: a signal to a child process of this test.
        let rc = unsafe { libc::kill(kids.0[r].id() as libc::pid_t, libc::SIGSTOP) };
        assert_eq!(rc, 0, "SIGSTOP rank {r}");
    }
    let survivors: Vec<usize> = (0..size).filter(|r| !far.contains(r)).collect();
    let st = kids
        .wait_for(
            &survivors,
            Duration::from_secs(bound_s),
            Duration::from_millis(10),
        )
        .unwrap_or_else(|done| panic!("survivors still running after {bound_s} s: {done:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    for (r, s) in survivors.iter().zip(&st) {
        assert!(s.success(), "rank {r} (see its message above): {s:?}");
    }
}

#[test]
fn an_unreachable_host_is_named_by_a_rank_waiting_for_its_leader() {
    let _s = serial();
    // Rank 1 waits in shared memory for its leader's broadcast while the leader waits across
    // hosts for rank 2: rank 1 must wait for the leader's verdict, not blame the leader.
    cut_test(&[vec![0, 1], vec![2]], "hier");
}

#[test]
fn an_unreachable_host_is_named_by_every_rank_of_the_other_host() {
    let _s = serial();
    cut_test(&[vec![0, 1], vec![2, 3]], "hier");
}

#[test]
fn an_unreachable_host_is_named_by_every_rank_of_the_other_host_over_tcp() {
    let _s = serial();
    cut_test(&[vec![0, 1], vec![2, 3]], "tcp");
}

/// With a timeout of 60 s, a host that freezes (every rank of it stopped) is named by every
/// rank of the other host through the heartbeats, far sooner than the timeout (the promise is
/// 2 s; the bound here leaves room for a loaded machine), over `hier` and over plain `tcp`.
#[test]
fn a_frozen_host_is_named_long_before_the_timeout() {
    let _s = serial();
    for transport in ["hier", "tcp"] {
        cut_test_with(&[vec![0, 1], vec![2, 3]], transport, 60, 30);
    }
}
