//! The elastic session over loopback: a server and clients on threads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::wire::{self, Msg};
use super::*;
use crate::token::JobToken;
use fh_core::bytes::DecodeError;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const WAIT: Duration = Duration::from_secs(10);

fn server() -> Server {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    Server::bind(addr, JobToken::from(TOKEN), Duration::from_secs(5)).unwrap()
}

fn client(s: &Server, worker: &str) -> Client {
    Client::connect(
        &s.local_addr().to_string(),
        worker,
        &JobToken::from(TOKEN),
        WAIT,
    )
    .unwrap()
}

fn event(s: &Server) -> Event {
    s.next_event(WAIT).expect("an event within the wait")
}

fn assignment(rank: usize, size: usize) -> Assignment {
    Assignment {
        generation: 3,
        topology: Topology {
            rank,
            size,
            local_rank: 0,
            local_size: 1,
            cross_rank: rank,
            cross_size: size,
        },
        rendezvous: "127.0.0.1:4242".into(),
        hosts_stamp: 7,
    }
}

#[test]
fn a_wrong_token_is_refused_both_ways() {
    let s = server();
    let err = Client::connect(
        &s.local_addr().to_string(),
        "h0:0",
        &JobToken::from("another-token-entirely-0123456789"),
        WAIT,
    )
    .unwrap_err();
    // The worker refuses a driver that cannot prove its token before proving its own.
    assert!(
        err.to_string().contains("could not prove the job token"),
        "{err}"
    );
    assert_eq!(s.next_event(Duration::from_millis(300)), None);
}

#[test]
fn a_worker_with_a_wrong_token_never_gets_a_session() {
    let s = server();
    // Speak the protocol by hand with the wrong key for the worker's proof.
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    let hello = Msg::Hello {
        worker: "h0:0".into(),
        nonce: [7; 32],
    }
    .encode();
    wire::write_frame(&mut raw, &hello, WAIT).unwrap();
    let body = wire::read_frame(&mut raw, None, &|| false).unwrap();
    let Msg::Challenge { nonce, .. } = Msg::decode(&body).unwrap() else {
        panic!("no challenge")
    };
    let bad = wire::worker_proof(
        &crate::token::Key::new(b"not the token at all, no"),
        &hello,
        &nonce,
    );
    wire::write_frame(&mut raw, &Msg::Proof(bad).encode(), WAIT).unwrap();
    let body = wire::read_frame(&mut raw, None, &|| false).unwrap();
    match Msg::decode(&body).unwrap() {
        Msg::Refuse(why) => assert!(why.contains("could not prove the job token"), "{why}"),
        other => panic!("not refused: {other:?}"),
    }
    assert_eq!(s.next_event(Duration::from_millis(300)), None);
}

#[test]
fn register_and_answer() {
    let s = server();
    let mut c0 = client(&s, "h0:0");
    let mut c1 = client(&s, "h1:0");
    assert_eq!(c0.elastic_timeout(), Duration::from_secs(5));
    let waiting = std::thread::spawn(move || (c0.next_world(), c0));
    let mut registered = Vec::new();
    while registered.is_empty() {
        if let Event::Registered { worker, candidate } = event(&s) {
            assert!(candidate.starts_with("127.0.0.1:"), "{candidate}");
            registered.push(worker);
        }
    }
    assert_eq!(registered, ["h0:0"]);
    s.answer("h0:0", &Membership::Member(assignment(0, 2)))
        .unwrap();
    let (answer, _c0) = waiting.join().unwrap();
    assert_eq!(answer.unwrap(), Membership::Member(assignment(0, 2)));
    let waiting = std::thread::spawn(move || c1.next_world());
    loop {
        if let Event::Registered { worker, .. } = event(&s) {
            assert_eq!(worker, "h1:0");
            break;
        }
    }
    s.answer(
        "h1:0",
        &Membership::Failed("fewer than --min-np 2 ranks remain (lost: h2)".into()),
    )
    .unwrap();
    match waiting.join().unwrap().unwrap() {
        Membership::Failed(why) => assert!(why.contains("lost: h2")),
        other => panic!("{other:?}"),
    }
    // The assignment's world: the generation's key, the rank 0 rendezvous.
    let base = base_info_from(|n| (n == "FH_JOB_TOKEN").then(|| TOKEN.to_string())).unwrap();
    let info = assignment(1, 2).launch_info(&base);
    assert_eq!((info.rank, info.size), (1, 2));
    assert_eq!(info.rendezvous.as_deref(), Some("127.0.0.1:4242"));
    assert_eq!(
        info.token,
        Some(JobToken::from(TOKEN).for_incarnation(ELASTIC_INCARNATION_BASE + 3))
    );
    assert_eq!(info.local_vars, None);
}

#[test]
fn a_register_wait_is_bounded_and_says_what_it_waited_for() {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let s = Server::bind(addr, JobToken::from(TOKEN), Duration::from_millis(200)).unwrap();
    let mut c = Client::connect(
        &s.local_addr().to_string(),
        "h0:0",
        &JobToken::from(TOKEN),
        Duration::from_secs(1),
    )
    .unwrap();
    let err = c.next_world().unwrap_err().to_string();
    assert!(err.contains("h0:0") && err.contains("Register"), "{err}");
}

#[test]
fn host_updates_report_changes_after_the_stamp() {
    let s = server();
    let mut c = client(&s, "h0:0");
    assert_eq!(c.host_updates(0).unwrap(), HostUpdate::default());
    s.set_hosts(1, true, false);
    s.set_hosts(2, false, true);
    assert_eq!(
        c.host_updates(0).unwrap(),
        HostUpdate {
            stamp: 2,
            added: true,
            removed: true
        }
    );
    assert_eq!(
        c.host_updates(1).unwrap(),
        HostUpdate {
            stamp: 2,
            added: false,
            removed: true
        }
    );
    assert_eq!(
        c.host_updates(2).unwrap(),
        HostUpdate {
            stamp: 2,
            added: false,
            removed: false
        }
    );
    let mut asked = 0;
    while asked < 4 {
        match event(&s) {
            Event::HostUpdatesAsked { worker, .. } => {
                assert_eq!(worker, "h0:0");
                asked += 1;
            }
            Event::Connected { .. } => {}
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_closed_session_is_seen_by_the_server() {
    let s = server();
    let c = client(&s, "h2:0");
    assert_eq!(
        event(&s),
        Event::Connected {
            worker: "h2:0".into()
        }
    );
    drop(c);
    match event(&s) {
        Event::Closed { worker, .. } => assert_eq!(worker, "h2:0"),
        other => panic!("{other:?}"),
    }
    // Closed by the driver: the worker's wait ends at once with a clear error.
    let mut c = client(&s, "h1:0");
    assert!(matches!(event(&s), Event::Connected { .. }));
    s.close_session("h1:0");
    let err = c.next_world().unwrap_err().to_string();
    assert!(err.contains("closed") || err.contains("h1:0"), "{err}");
}

#[test]
fn garbage_is_refused_without_a_session_or_a_panic() {
    let s = server();
    for junk in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        &[0xff, 0xff, 0xff, 0xff, 1, 2, 3][..],
        &[5, 0, 0, 0, 1, b'F', b'H', b'E', b'X'][..],
        &[0, 0, 0, 0][..],
    ] {
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        raw.write_all(junk).unwrap();
        raw.set_read_timeout(Some(WAIT)).unwrap();
        // The driver answers a refusal or just closes; either way no session.
        let mut buf = Vec::new();
        let _ = raw.read_to_end(&mut buf);
    }
    assert_eq!(s.next_event(Duration::from_millis(300)), None);
    // And it still serves a real worker.
    let _c = client(&s, "h0:0");
    assert!(matches!(event(&s), Event::Connected { .. }));
}

#[test]
fn decoders_refuse_every_truncation_and_bad_value() {
    let msgs = [
        Msg::Hello {
            worker: "h:1".into(),
            nonce: [1; 32],
        },
        Msg::Welcome { timeout_ms: 5 },
        Msg::Register {
            candidate: "10.0.0.1:5".into(),
        },
        Msg::HostUpdates { since: 9 },
        Msg::Answer(Membership::Member(assignment(1, 2))),
        Msg::Answer(Membership::Removed("host gone".into())),
        Msg::Update(HostUpdate {
            stamp: 4,
            added: true,
            removed: false,
        }),
    ];
    for m in &msgs {
        let body = m.encode();
        assert_eq!(&Msg::decode(&body).unwrap(), m);
        // A frame arrives whole: a short one is malformed, never "wait for more".
        for cut in 0..body.len() {
            assert_eq!(
                Msg::decode(&body[..cut]),
                Err(DecodeError::Invalid("a truncated elastic message".into())),
                "{m:?} cut at {cut}"
            );
        }
        let mut long = body.clone();
        long.push(0);
        assert_eq!(
            Msg::decode(&long),
            Err(DecodeError::Invalid(
                "1 stray bytes after an elastic message".into()
            ))
        );
    }
    // An impossible topology.
    let mut a = assignment(1, 2);
    a.topology.rank = 5;
    let e = Msg::decode(&Msg::Answer(Membership::Member(a)).encode()).unwrap_err();
    assert!(e.to_string().contains("impossible topology"), "{e}");
    assert_eq!(
        Msg::decode(&[0x7f]),
        Err(DecodeError::Invalid(
            "unknown elastic message type 0x7f".into()
        ))
    );
}

#[test]
fn the_route_to_this_machine_starts_at_loopback() {
    assert!(local_ip_towards("127.0.0.1").unwrap().is_loopback());
}
