//! Several TCP streams to a peer, every rank a thread of this process on 127.0.0.1 with
//! striping forced on between ranks of one host: messages arrive exact whatever their shape,
//! their bytes really go over every stream, and the fault paths still name the rank to blame.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use fh_core::ReduceOp;
use fh_job::{JobToken, LaunchInfo};
use fh_transport::backend::tcp::settings::{StreamCount, StreamSettings, DEFAULT_STREAMS};
use fh_transport::backend::tcp::streams::{choose, stripe_range, StreamChoice, PROBE_STREAMS};
use fh_transport::backend::tcp::{TcpComm, TcpOptions, TcpTransport};
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};

fn info(rank: usize, size: usize, port: u16, timeout_s: u64) -> LaunchInfo {
    LaunchInfo {
        rendezvous: Some(format!("127.0.0.1:{port}")),
        token: Some(JobToken::new("tcp-streams-test-token")),
        timeout: Duration::from_secs(timeout_s),
        ..LaunchInfo::bare(rank, size)
    }
}

/// Every rank's result of joining a world of `size` ranks, rank `r` with `settings(r)`.
fn join(
    size: usize,
    timeout_s: u64,
    settings: impl Fn(usize) -> StreamSettings,
) -> Vec<Result<TcpTransport, TransportError>> {
    join_on(size, timeout_s, settings, |_| None)
}

/// [`join`] with rank `r` on the host named `host(r)` (`None`: this machine's identity).
fn join_on(
    size: usize,
    timeout_s: u64,
    settings: impl Fn(usize) -> StreamSettings,
    host: impl Fn(usize) -> Option<String>,
) -> Vec<Result<TcpTransport, TransportError>> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let info = LaunchInfo {
                host_id: host(rank),
                ..info(rank, size, port, timeout_s)
            };
            let streams = settings(rank);
            std::thread::spawn(move || {
                let mut opts = TcpOptions::from_info(&info);
                opts.streams = streams;
                TcpTransport::connect(&info, opts)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A world of `size` ranks with `streams` streams between every two, frames of at least
/// `stripe_min` bytes striped.
fn world(size: usize, streams: usize, stripe_min: usize, timeout_s: u64) -> Vec<TcpTransport> {
    join(size, timeout_s, |_| {
        StreamSettings::everywhere(streams, stripe_min)
    })
    .into_iter()
    .map(|t| t.expect("connect"))
    .collect()
}

/// Run `f` on every rank, one thread each; the results by rank.
fn on_every_rank<R: Send + 'static>(
    w: Vec<TcpTransport>,
    f: impl Fn(TcpTransport) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = w
        .into_iter()
        .map(|t| {
            let f = std::sync::Arc::clone(&f);
            std::thread::spawn(move || f(t))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect()
}

/// Cut `data` into slices at `cuts` (positions in order; repeats give empty slices).
fn cut<'a>(data: &'a mut [u8], cuts: &[usize]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    let mut at = 0;
    for &c in cuts {
        let (head, tail) = rest.split_at_mut(c - at);
        out.push(head);
        rest = tail;
        at = c;
    }
    out.push(rest);
    out
}

const MIN: usize = 1000;

#[test]
fn striped_messages_arrive_exact_whatever_their_shape() {
    let size = 4;
    let w = world(size, 3, MIN, 60);
    on_every_rank(w, move |mut t| {
        let r = t.rank();
        let mut c = t.open_tcp("shapes").unwrap();
        for p in (0..size).filter(|&p| p != r) {
            assert_eq!(c.streams(p), 3);
        }
        let (next, prev) = ((r + 1) % size, (r + size - 1) % size);
        // Around the threshold, odd lengths, fewer bytes than streams never happen above it.
        for len in [
            0,
            1,
            2,
            MIN - 1,
            MIN,
            MIN + 1,
            3 * MIN + 2,
            65_537,
            (1 << 20) + 7,
        ] {
            // Around the ring, one way and the other.
            let out = pattern(len, r);
            let mut inp = vec![0u8; len];
            c.send_recv(next, &out, prev, &mut inp).unwrap();
            assert!(inp == pattern(len, prev), "len {len} from {prev}");
            c.send_recv(prev, &out, next, &mut inp).unwrap();
            assert!(inp == pattern(len, next), "len {len} from {next}");
            // Both ways with one peer, vectored, cut across the stripes' borders.
            let partner = r ^ 1;
            let a = pattern(len, r + 10);
            let cuts: Vec<usize> = [0, len / 3, len / 3, len / 2 + 1, len]
                .into_iter()
                .map(|x| x.min(len))
                .collect();
            let send: Vec<&[u8]> = {
                let mut v = Vec::new();
                let mut at = 0;
                for &k in &cuts {
                    v.push(&a[at..k]);
                    at = k;
                }
                v.push(&a[at..]);
                v
            };
            let mut b = vec![0u8; len];
            let mut bufs = cut(&mut b, &cuts);
            c.send_recv_vectored(partner, &send, partner, &mut bufs)
                .unwrap();
            assert!(b == pattern(len, partner + 10), "vectored len {len}");
        }
        // A collective of every peer.
        let mut v: Vec<f32> = (0..300_001).map(|i| (i % 17) as f32 + r as f32).collect();
        c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
        assert!(v
            .iter()
            .enumerate()
            .all(|(i, &x)| x == 4.0 * (i % 17) as f32 + 6.0));
    });
}

#[test]
fn a_large_message_goes_over_every_stream() {
    let len = (4 << 20) + 5;
    let w = world(2, 4, MIN, 60);
    let sent = on_every_rank(w, move |mut t| {
        let r = t.rank();
        let mut c = t.open_tcp("bytes").unwrap();
        let mut buf = vec![0u8; len];
        if r == 0 {
            c.send(1, &pattern(len, 0)).unwrap();
            c.send(1, &[7u8; MIN - 1]).unwrap();
        } else {
            c.recv(0, &mut buf).unwrap();
            assert!(buf == pattern(len, 0));
            c.recv(0, &mut buf[..MIN - 1]).unwrap();
        }
        c.bytes_sent(1 - r)
    });
    // Each stripe and its header on its own stream; the small message on the first.
    let want: Vec<u64> = (0..4)
        .map(|i| stripe_range(len, 4, i).len() as u64 + 8 + if i == 0 { MIN as u64 + 7 } else { 0 })
        .collect();
    assert_eq!(sent[0], want);
    assert_eq!(sent[1], vec![0; 4]);
}

#[test]
fn a_world_on_one_host_reports_no_streams() {
    // Nothing crosses hosts: no stream choice to report (the bench shows none for such rows).
    let w: Vec<TcpTransport> = join(2, 60, |_| StreamSettings::default())
        .into_iter()
        .map(|t| t.expect("connect"))
        .collect();
    let choices = on_every_rank(w, |t| t.stream_choice());
    assert_eq!(choices, vec![None, None]);
}

#[test]
fn one_stream_is_todays_single_connection() {
    let w = world(2, 1, MIN, 60);
    let sent = on_every_rank(w, move |mut t| {
        let mut c = t.open_tcp("one").unwrap();
        let peer = 1 - t.rank();
        let mut v = vec![1.0f32; 1 << 20];
        c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().all(|&x| x == 2.0));
        (c.streams(peer), c.bytes_sent(peer).len())
    });
    assert_eq!(sent, vec![(1, 1), (1, 1)]);
}

#[test]
fn mismatched_stream_settings_stop_every_rank_naming_both_values() {
    let results = join(3, 30, |r| {
        StreamSettings::everywhere(if r == 2 { 2 } else { 3 }, MIN)
    });
    for (r, res) in results.into_iter().enumerate() {
        let err = res.expect_err("a world whose ranks disagree on the streams must not start");
        let text = err.to_string();
        assert!(
            text.contains("FH_TCP_STREAMS is 3 on rank 0 but 2 on rank 2"),
            "rank {r}: {text}"
        );
    }
}

/// Rank 0 sends a message far larger than the socket buffers to rank 1, striped; the test
/// makes rank 1 go away or give up meanwhile. Rank 2 waits for rank 0, rank 3 for rank 1.
fn sending_into(
    then: impl FnOnce(TcpComm, TcpTransport) + Send + 'static,
) -> (TransportError, Duration) {
    let mut w = world(4, 3, MIN, 600);
    let mut t3 = w.pop().unwrap();
    let h3 = std::thread::spawn(move || {
        let mut c = t3.open_tcp("fault").unwrap();
        let mut b = [0u8; 8];
        c.recv(1, &mut b).unwrap_err()
    });
    let mut t2 = w.pop().unwrap();
    let mut t1 = w.pop().unwrap();
    let mut t0 = w.pop().unwrap();
    let h1 = std::thread::spawn(move || {
        let c = t1.open_tcp("fault").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        then(c, t1);
    });
    let h2 = std::thread::spawn(move || {
        let mut c = t2.open_tcp("fault").unwrap();
        let mut b = [0u8; 8];
        // Waits for rank 0, which learns of the fault while it sends to rank 1.
        c.recv(0, &mut b).unwrap_err()
    });
    let mut c0 = t0.open_tcp("fault").unwrap();
    let start = Instant::now();
    let err = c0.send(1, &vec![1u8; 256 << 20]).unwrap_err();
    let took = start.elapsed();
    h1.join().unwrap();
    let err2 = h2.join().unwrap();
    h3.join().unwrap();
    assert_eq!(err2.blamed_rank(), err.blamed_rank(), "rank 2: {err2}");
    (err, took)
}

#[test]
fn a_peer_gone_during_a_striped_send_is_named_at_once() {
    let (err, took) = sending_into(|c, t| {
        drop(c);
        drop(t); // rank 1's process "exits"
    });
    assert!(
        matches!(err, TransportError::PeerLost { rank: 1, .. }),
        "{err}"
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
}

#[test]
fn an_abort_notice_reaches_a_rank_that_only_sends() {
    // Rank 1 gives up blaming rank 3 while rank 0 only sends to it: the notice, in band on
    // the streams rank 0 does not read, names rank 3 (not rank 1, who hung up).
    let (err, _) = sending_into(|mut c, t| {
        c.abort(3);
        std::thread::sleep(Duration::from_secs(1));
        drop(t);
    });
    assert!(
        matches!(err, TransportError::PeerLost { rank: 3, .. }),
        "{err}"
    );
}

#[test]
fn an_interrupt_ends_a_striped_wait() {
    let w = world(2, 3, MIN, 600);
    let errs = on_every_rank(w, |mut t| {
        let mut c = t.open_tcp("interrupted").unwrap();
        let start = Instant::now();
        if t.rank() == 1 {
            // Waits for rank 0, which gives up when interrupted.
            let mut b = [0u8; 8];
            let err = c.recv(0, &mut b).unwrap_err();
            return (err.to_string(), start.elapsed());
        }
        let interrupt = c.interrupter().unwrap();
        let raiser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            interrupt.raise(None, "the test stops this wait");
        });
        // A large striped message that rank 1 never sends.
        let mut big = vec![0u8; 8 << 20];
        let err = c.recv(1, &mut big).unwrap_err();
        raiser.join().unwrap();
        (err.to_string(), start.elapsed())
    });
    assert!(
        errs[0].0.contains("the test stops this wait"),
        "{}",
        errs[0].0
    );
    assert!(errs[1].0.contains("rank 0 gave up"), "{}", errs[1].0);
    for (text, took) in errs {
        assert!(took < Duration::from_secs(30), "{took:?}: {text}");
    }
}

/// Two "hosts" of two ranks each on this machine (named by their host ids): what each rank's
/// communicator holds to every peer, after an allreduce that checks its values; every rank's
/// transport reports the same stream choice, which is returned beside.
fn streams_across_two_hosts(
    count: StreamCount,
    flow_cap: Option<u64>,
) -> (Vec<Vec<usize>>, StreamChoice) {
    let settings = move |_| {
        let mut s = StreamSettings::default();
        s.count = count;
        s.flow_cap = flow_cap;
        s
    };
    let host = |r: usize| Some(if r < 2 { "host-a" } else { "host-b" }.to_string());
    let w: Vec<TcpTransport> = join_on(4, 60, settings, host)
        .into_iter()
        .map(|t| t.expect("connect"))
        .collect();
    let out = on_every_rank(w, |mut t| {
        let mut c = t.open_tcp("across").unwrap();
        let mut v = vec![t.rank() as f32; (3 << 20) / 4 + 1];
        c.allreduce_typed(&mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().all(|&x| x == 6.0));
        let held: Vec<usize> = (0..4).map(|p| c.streams(p)).collect();
        (
            held,
            t.stream_choice()
                .expect("a world across hosts reports its streams"),
        )
    });
    let choice = out[0].1;
    for (r, (_, c)) in out.iter().enumerate() {
        assert_eq!(*c, choice, "rank {r} reports another stream choice");
    }
    assert_eq!(choice.setting, count);
    (out.into_iter().map(|o| o.0).collect(), choice)
}

/// What `auto` reports: the streams every communicator holds, chosen by [`choose`] from the
/// rates it says it measured.
fn check_auto_choice(s: usize, choice: StreamChoice) {
    let m = choice.measured.expect("auto reports what it measured");
    assert_eq!(choice.streams, s);
    assert_eq!(m.probe_streams, PROBE_STREAMS);
    assert!(m.one_stream_bps > 0.0 && m.many_streams_bps > 0.0, "{m:?}");
    assert_eq!(choose(m.one_stream_bps, m.many_streams_bps), s, "{m:?}");
}

#[test]
fn auto_measures_and_every_rank_uses_the_same_streams() {
    let (held, choice) = streams_across_two_hosts(StreamCount::Auto, None);
    let s = held[0][2];
    assert!((1..=PROBE_STREAMS).contains(&s), "{held:?}");
    check_auto_choice(s, choice);
    eprintln!("auto chose {s} stream(s) between the two hosts");
    // One stream within a host, the measured number across, on every rank alike.
    assert_eq!(
        held,
        vec![
            vec![0, 1, s, s],
            vec![1, 0, s, s],
            vec![s, s, 0, 1],
            vec![s, s, 1, 0]
        ]
    );
}

#[test]
fn a_fixed_count_holds_across_hosts_only() {
    let (held, choice) = streams_across_two_hosts(StreamCount::Fixed(3), None);
    // Set, not measured: the report says so.
    assert_eq!((choice.streams, choice.measured), (3, None));
    assert_eq!(
        held,
        vec![
            vec![0, 1, 3, 3],
            vec![1, 0, 3, 3],
            vec![3, 3, 0, 1],
            vec![3, 3, 1, 0]
        ]
    );
}

#[test]
fn auto_takes_several_streams_where_each_flow_is_capped() {
    // Every connection capped at 10 MB/s (a cloud's per-flow cap, emulated by the kernel's
    // pacing) and nothing else: eight flows at once move about eight times what one does,
    // whatever the load of this machine (80 MB/s is little for loopback), so the measurement
    // must choose more streams than the fixed default would give.
    let (held, choice) = streams_across_two_hosts(StreamCount::Auto, Some(10_000_000));
    let s = held[0][2];
    check_auto_choice(s, choice);
    eprintln!("auto chose {s} stream(s) between the two hosts at 10 MB/s per flow");
    assert!(
        (DEFAULT_STREAMS + 1..=PROBE_STREAMS).contains(&s),
        "{held:?}"
    );
    assert_eq!(
        held,
        vec![
            vec![0, 1, s, s],
            vec![1, 0, s, s],
            vec![s, s, 0, 1],
            vec![s, s, 1, 0]
        ]
    );
}
