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
