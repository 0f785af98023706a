use super::*;

/// An acceptor for rank 0 of 2 whose table holds `max_pending` handshakes, in world `world`.
fn acceptor(max_pending: usize, world: [u8; WORLD_ID_LEN]) -> (Acceptor, SocketAddr, Key) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let key = Key::new(b"accept-unit-test-token-5f1d0c3a");
    let cell = WorldCell::default();
    cell.set(world).unwrap();
    let rules = AcceptRules {
        kind: ConnKind::Data,
        key: key.clone(),
        size: 2,
        rank: 0,
        handshake_timeout: Duration::from_secs(5),
        max_pending,
        board: Arc::new(AbortBoard::default()),
        log: RefusalLog::new(),
        world: cell,
    };
    (Acceptor::spawn(listener, rules).unwrap(), addr, key)
}

fn hello(world: [u8; WORLD_ID_LEN]) -> Hello {
    Hello {
        version: wire::PROTOCOL_VERSION,
        kind: ConnKind::Data,
        size: 2,
        rank: 1,
        seq: 0,
        port: 0,
        lost: 0,
        world,
        nonce: [0; wire::NONCE_LEN],
    }
}

#[test]
fn silent_connections_filling_the_table_do_not_keep_a_member_out() {
    let world = [7; WORLD_ID_LEN];
    let (mut acc, addr, key) = acceptor(4, world);
    // Twice as many silent connections as the table holds, kept open.
    let silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(50));
    // One attempt, no retry: the member's connection evicts a silent one.
    let mut s = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let done =
        super::super::handshake::client_handshake(&mut s, hello(world), &key, "rank 0", deadline);
    assert!(done.is_ok(), "{}", done.err().unwrap().into_error());
    let (h, _, _) = acc.next(deadline).expect("the member is handed over");
    assert_eq!(h.rank, 1);
    // The listener dropped silent connections (evicted, or cut off after their first-bytes
    // deadline): at least those beyond the table's room.
    let closed = silent
        .into_iter()
        .filter(|c| {
            let mut c = c;
            let _ = c.set_read_timeout(Some(Duration::from_secs(3)));
            matches!(c.read(&mut [0u8; 8]), Ok(0) | Err(_))
        })
        .count();
    assert!(
        closed >= 4,
        "only {closed} of 8 silent connections were dropped"
    );
}

#[test]
fn a_rank_of_another_world_with_the_same_token_is_refused_naming_both_worlds() {
    let (mut acc, addr, key) = acceptor(4, [7; WORLD_ID_LEN]);
    let mut s = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let Err(e) = super::super::handshake::client_handshake(
        &mut s,
        hello([9; WORLD_ID_LEN]),
        &key,
        "rank 0",
        deadline,
    ) else {
        panic!("a rank of another world was accepted");
    };
    let text = e.into_error().to_string();
    assert!(
        text.contains(&"09".repeat(WORLD_ID_LEN))
            && text.contains(&"07".repeat(WORLD_ID_LEN))
            && text.contains("another job with the same"),
        "{text}"
    );
    assert!(acc
        .next(Instant::now() + Duration::from_millis(200))
        .is_none());
}

#[test]
fn refusals_are_logged_at_a_bounded_rate() {
    let log = RefusalLog::new();
    let from = SocketAddr::from(([127, 0, 0, 1], 9));
    let logged = (0..1000).filter(|_| log.log(from, "garbage")).count();
    assert_eq!(logged, REFUSAL_LOGS_PER_WINDOW as usize);
    // A new window logs again (and summarises the suppressed ones).
    if let Ok(mut st) = log.state.lock() {
        st.0 = Instant::now() - REFUSAL_LOG_WINDOW;
    }
    assert!(log.log(from, "garbage"));
    assert_eq!(log.state.lock().map(|s| s.2).unwrap_or(1), 0);
}

/// A relay to `to` that passes the listener's first answer (the challenge) at once and holds
/// back everything after it (the reply to the proof) for `hold`: a reply delayed as packet
/// loss delays it.
fn slow_reply_relay(to: SocketAddr, hold: Duration) -> SocketAddr {
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = relay.local_addr().unwrap();
    std::thread::spawn(move || {
        for client in relay.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(to) else {
                return;
            };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_in, &mut s_out);
                let _ = s_out.shutdown(std::net::Shutdown::Write);
            });
            let (mut s_in, mut c_out) = (server, client);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut first = true;
                loop {
                    match s_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if !first {
                                std::thread::sleep(hold);
                            }
                            first = false;
                            if c_out.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    addr
}

#[test]
fn a_connector_that_proved_itself_waits_for_the_reply_on_the_same_connection() {
    // The listener keeps a connection once the connector's proof checks out. A connector that
    // gave up on a late reply and connected again would hold another connection than the one
    // the listener handed over (under packet loss each side then blamed the other).
    let world = [7; WORLD_ID_LEN];
    let (mut acc, addr, key) = acceptor(4, world);
    let relay = slow_reply_relay(addr, Duration::from_millis(1200));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut mine = super::super::handshake::connect_handshake(
        &[relay],
        |_| Ok(hello(world)),
        &key,
        "rank 0",
        deadline,
        Duration::from_millis(300),
        None,
        &|| None,
    )
    .expect("the handshake completes");
    let (h, mut theirs, _) = acc.next(deadline).expect("the connection is handed over");
    assert_eq!(h.rank, 1);
    mine.write_all(b"ping").unwrap();
    let mut got = [0u8; 4];
    theirs
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    theirs
        .read_exact(&mut got)
        .expect("the listener's connection is the connector's");
    assert_eq!(&got, b"ping");
    // No second attempt reached the listener.
    assert!(acc
        .next(Instant::now() + Duration::from_millis(300))
        .is_none());
}

#[test]
fn a_wait_for_the_reply_ends_with_the_watch_s_verdict() {
    let world = [7; WORLD_ID_LEN];
    let (_acc, addr, key) = acceptor(4, world);
    let relay = slow_reply_relay(addr, Duration::from_secs(30));
    let t0 = Instant::now();
    let verdict = || {
        (t0.elapsed() > Duration::from_millis(500)).then(|| TransportError::PeerLost {
            rank: 0,
            detail: "declared lost by the heartbeats (test)".into(),
        })
    };
    let err = super::super::handshake::connect_handshake(
        &[relay],
        |_| Ok(hello(world)),
        &key,
        "rank 0",
        t0 + Duration::from_secs(20),
        Duration::from_millis(300),
        None,
        &verdict,
    )
    .expect_err("no reply comes");
    assert!(err.to_string().contains("(test)"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}
