//! Hosts from facts: ranks started with only `FH_RANK`, `FH_SIZE`, `FH_RENDEZVOUS_ADDR` and
//! `FH_JOB_TOKEN` learn at the rendezvous which of them share a host, from their host
//! identities (`FH_HOST_ID` here, to simulate hosts on this machine; or separate UTS
//! namespaces with their own host names), and `FH_TRANSPORT=auto` picks the backend from
//! that. A launcher whose local size contradicts the facts stops every rank at once with the
//! same error. This test binary re-runs itself as the ranks (`child` below) over 127.0.0.1; a
//! guard kills and reaps every child, and every wait is bounded.
#![cfg(target_os = "linux")]

mod support;

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::{CollectivesExt, TransportError};
use support::{free_port, rank_command, serial, Children};

const ROLE: &str = "FH_TEST_HOSTS_ROLE";
/// What a rank expects: `backend local_rank local_size cross_rank cross_size`.
const EXPECT: &str = "FH_TEST_HOSTS_EXPECT";
const TOKEN: &str = "hosts-test-token-0123456789abcdef";

/// One rank: its host name (`None`: the facts of this machine) and its extra variables.
struct Rank {
    host_id: Option<&'static str>,
    expect: String,
    extra: Vec<(&'static str, String)>,
}

fn rank(host_id: Option<&'static str>, expect: &str) -> Rank {
    Rank {
        host_id,
        expect: expect.into(),
        extra: Vec::new(),
    }
}

/// Start the ranks with only the variables of a bare launch ([`LaunchInfo::bare`]: rank,
/// size, rendezvous, token, timeout; and `FH_HOST_ID`), then the rank's `extra` ones, each
/// through `wrap` (a command and arguments run before the rank, e.g. `unshare`), if given.
fn spawn(
    ranks: &[Rank],
    role: &str,
    transport: &str,
    wrap: impl Fn(usize) -> Vec<String>,
) -> Children {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let mut kids = Children(Vec::new());
    for (r, spec) in ranks.iter().enumerate() {
        let inner = rank_command("child", false);
        let prefix = wrap(r);
        let mut cmd = match prefix.split_first() {
            None => inner,
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(inner.get_program()).args(inner.get_args());
                c
            }
        };
        let launch = LaunchInfo {
            rendezvous: Some(rendezvous.clone()),
            token: Some(JobToken::new(TOKEN)),
            timeout: Duration::from_secs(30),
            host_id: spec.host_id.map(String::from),
            ..LaunchInfo::bare(r, ranks.len())
        };
        cmd.env(ROLE, role)
            .env(EXPECT, &spec.expect)
            .env("FH_TRANSPORT", transport);
        for v in [
            "FH_LOCAL_RANK",
            "FH_LOCAL_SIZE",
            "FH_CROSS_RANK",
            "FH_CROSS_SIZE",
            "FH_HOST_ID",
        ] {
            cmd.env_remove(v);
        }
        cmd.envs(launch.to_vars());
        cmd.envs(spec.extra.iter().map(|(k, v)| (*k, v.as_str())));
        let child = cmd.stdout(Stdio::piped()).spawn().expect("spawn a rank");
        kids.0.push(child);
    }
    kids
}

/// Wait for every rank (at most `limit`), check that each succeeded, and return what each
/// printed on stdout.
fn finish(mut kids: Children, limit: Duration) -> Vec<String> {
    let st = kids.wait_all(limit);
    let out: Vec<String> = kids
        .0
        .iter_mut()
        .map(|c| {
            let mut s = String::new();
            if let Some(mut o) = c.stdout.take() {
                let _ = o.read_to_string(&mut s);
            }
            s
        })
        .collect();
    assert!(
        st.iter().all(ExitStatus::success),
        "{st:?}\n{}",
        out.join("\n")
    );
    out
}

/// The body of a rank; does nothing when run as an ordinary test.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let expect = std::env::var(EXPECT).unwrap_or_default();
    match role.as_str() {
        "run" => {
            let mut world = fh_transport::from_env().unwrap_or_else(|e| panic!("joining: {e}"));
            let t = world.topology();
            let got = format!(
                "{} {} {} {} {}",
                world.backend(),
                t.local_rank,
                t.local_size,
                t.cross_rank,
                t.cross_size
            );
            assert_eq!(got, expect, "rank {}", t.rank);
            let mut c = world.open("hosts").unwrap();
            let mut v = vec![1.0f32 + t.rank as f32; 1000];
            c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
            let want = (t.size * (t.size + 1) / 2) as f32;
            assert!(v.iter().all(|&x| x == want));
        }
        "refused" => match fh_transport::from_env() {
            Ok(w) => panic!("started a {} world against the facts", w.backend()),
            Err(e @ TransportError::Config { .. }) => println!("REFUSED: {e}"),
            Err(e) => panic!("expected a configuration error, got: {e}"),
        },
        other => panic!("unknown role {other}"),
    }
}

fn no_wrap(_: usize) -> Vec<String> {
    Vec::new()
}

#[test]
fn four_ranks_on_two_hosts_get_hier_and_local_ranks_from_the_facts() {
    let _s = serial();
    // Hosts interleaved: ranks 0 and 2 on one, 1 and 3 on the other.
    let ranks = [
        rank(Some("node-a"), "hier 0 2 0 2"),
        rank(Some("node-b"), "hier 0 2 1 2"),
        rank(Some("node-a"), "hier 1 2 0 2"),
        rank(Some("node-b"), "hier 1 2 1 2"),
    ];
    finish(
        spawn(&ranks, "run", "auto", no_wrap),
        Duration::from_secs(60),
    );
}

#[test]
fn ranks_of_one_machine_get_shm_and_one_per_host_get_tcp() {
    let _s = serial();
    let one = [
        rank(None, "shm 0 3 0 1"),
        rank(None, "shm 1 3 0 1"),
        rank(None, "shm 2 3 0 1"),
    ];
    finish(spawn(&one, "run", "auto", no_wrap), Duration::from_secs(60));
    let spread = [
        rank(Some("x"), "tcp 0 1 0 3"),
        rank(Some("y"), "tcp 0 1 1 3"),
        rank(Some("z"), "tcp 0 1 2 3"),
    ];
    finish(
        spawn(&spread, "run", "auto", no_wrap),
        Duration::from_secs(60),
    );
}

/// Every rank printed the same refusal; return it.
fn one_refusal(out: &[String]) -> String {
    let lines: Vec<&str> = out
        .iter()
        .map(|o| {
            o.lines()
                .find_map(|l| l.split_once("REFUSED: ").map(|(_, m)| m))
                .unwrap_or_else(|| panic!("a rank did not say why it stopped:\n{o}"))
        })
        .collect();
    assert!(lines.windows(2).all(|w| w[0] == w[1]), "{lines:#?}");
    lines[0].to_owned()
}

#[test]
fn a_local_size_against_the_facts_stops_every_rank_fast() {
    let _s = serial();
    // The launcher says one host of four; the facts say two hosts of two.
    let ranks: Vec<Rank> = ["node-a", "node-a", "node-b", "node-b"]
        .into_iter()
        .enumerate()
        .map(|(r, h)| Rank {
            extra: vec![
                ("FH_LOCAL_RANK", r.to_string()),
                ("FH_LOCAL_SIZE", "4".into()),
            ],
            ..rank(Some(h), "")
        })
        .collect();
    let start = Instant::now();
    // Far below FH_TIMEOUT_SECONDS=30: nobody waits for a peer that never comes.
    let out = finish(
        spawn(&ranks, "refused", "auto", no_wrap),
        Duration::from_secs(15),
    );
    let took = start.elapsed();
    let msg = one_refusal(&out);
    println!("{msg} (after {took:?})");
    for part in [
        "invalid configuration FH_LOCAL_RANK/FH_LOCAL_SIZE",
        "rank 0 has FH_LOCAL_RANK=0 and FH_LOCAL_SIZE=4, but 2 ranks share its host (0-1)",
        "ranks 0-1 on \"FH_HOST_ID=node-a\"; ranks 2-3 on \"FH_HOST_ID=node-b\"",
        "set FH_HOST_ID",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn explicit_shm_across_hosts_is_refused_on_every_rank() {
    let _s = serial();
    let ranks = [rank(Some("node-a"), ""), rank(Some("node-b"), "")];
    let out = finish(
        spawn(&ranks, "refused", "shm", no_wrap),
        Duration::from_secs(15),
    );
    let msg = one_refusal(&out);
    assert!(msg.contains("the ranks run on 2 hosts"), "{msg}");
}

/// Whether this process may make UTS namespaces with `unshare` (root, and the tool works).
fn unshare_works() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not running as root".into());
    }
    match Command::new("unshare")
        .args(["--uts", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("`unshare --uts true` failed ({s})")),
        Err(e) => Err(format!("cannot run unshare: {e}")),
    }
}

#[test]
fn ranks_in_separate_uts_namespaces_are_separate_hosts() {
    let _s = serial();
    if let Err(why) = unshare_works() {
        eprintln!("SKIPPED ranks_in_separate_uts_namespaces_are_separate_hosts: {why}");
        return;
    }
    // Each rank in a UTS namespace of its own, named after its host: no FH_HOST_ID, only the
    // host name tells the two hosts apart (boot id, /dev/shm and pid namespace are shared).
    let names = ["fh-uts-a", "fh-uts-a", "fh-uts-b", "fh-uts-b"];
    let ranks = [
        rank(None, "hier 0 2 0 2"),
        rank(None, "hier 1 2 0 2"),
        rank(None, "hier 0 2 1 2"),
        rank(None, "hier 1 2 1 2"),
    ];
    let wrap = |r: usize| {
        [
            "unshare",
            "--uts",
            "sh",
            "-c",
            "hostname \"$0\" && exec \"$@\"",
            names[r],
        ]
        .map(String::from)
        .to_vec()
    };
    finish(spawn(&ranks, "run", "auto", wrap), Duration::from_secs(60));
}
