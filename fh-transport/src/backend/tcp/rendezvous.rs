//! The rendezvous: rank 0 collects every rank's data-listener address and [`Place`] (its host
//! identity and its launcher's claims, [`fh_job::hosts`]) at the rendezvous address
//! (`FH_RENDEZVOUS_ADDR`) and sends back the address book and every rank's place.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accept::Acceptor;
use super::handshake::{connect_handshake, read_msg, write_by, ReadFail};
use super::settings::{self, StreamSettings};
use super::wire::{self, ConnKind, Hello};
use super::TcpTransport;
use crate::{Result, TransportError};
use fh_job::hosts::{self, Place};

/// Why reading the rendezvous's answer from rank 0 failed, as an error.
fn from_root(f: ReadFail, what: &'static str, timeout: Duration) -> TransportError {
    match f {
        ReadFail::Closed => TransportError::PeerLost {
            rank: 0,
            detail: format!(
                "rank 0 closed the rendezvous before sending {what} (see rank 0's log)"
            ),
        },
        ReadFail::TimedOut => TransportError::Timeout {
            rank: 0,
            op: "rendezvous (waiting for rank 0's answer)",
            after: timeout,
        },
        ReadFail::Decode(e) => TransportError::Protocol {
            rank: 0,
            detail: format!("bad {what}: {e}"),
        },
        ReadFail::Io(e) => TransportError::PeerLost {
            rank: 0,
            detail: format!("reading {what} failed: {e}"),
        },
        ReadFail::Cancelled(e) => e,
    }
}

/// Why reading `what` (its host place, its stream settings) from member `rank` at the
/// rendezvous failed, as an error; `op` names the wait.
fn from_member(
    f: ReadFail,
    rank: usize,
    what: &str,
    op: &'static str,
    timeout: Duration,
) -> TransportError {
    match f {
        ReadFail::Decode(e) => TransportError::Protocol {
            rank,
            detail: format!("bad {what} at the rendezvous: {e}"),
        },
        ReadFail::TimedOut => TransportError::Timeout {
            rank,
            op,
            after: timeout,
        },
        ReadFail::Closed => TransportError::PeerLost {
            rank,
            detail: format!("it closed the rendezvous before sending its {what}"),
        },
        ReadFail::Io(e) => TransportError::PeerLost {
            rank,
            detail: format!("reading its {what} failed: {e}"),
        },
        ReadFail::Cancelled(e) => e,
    }
}

impl TcpTransport {
    pub(super) fn rendezvous_root(
        &mut self,
        addrs: &[SocketAddr],
        rdv: &str,
        me: Place,
    ) -> Result<Vec<Place>> {
        let size = self.topology.size;
        let mut bind_errors = Vec::new();
        let mut bound = None;
        for a in addrs {
            match TcpListener::bind(a) {
                Ok(l) => {
                    bound = Some((l, *a));
                    break;
                }
                Err(e) => bind_errors.push(format!("{a}: {e}")),
            }
        }
        let Some((rdv_listener, rdv_addr)) = bound else {
            return Err(TransportError::Config {
                var: "FH_RENDEZVOUS_ADDR".into(),
                reason: format!(
                    "rank 0 cannot listen on {rdv} ({}); it must be a free port on an address \
                     of rank 0's host",
                    bind_errors.join(", ")
                ),
            });
        };
        let (data, beat) = bind_data(rdv_addr.ip(), self.opts.liveness.is_some())?;
        self.beat_socket = beat;
        let my_addr = data
            .local_addr()
            .map_err(|e| TransportError::io("reading the data listener's address", e))?;
        // The job's world id: fresh random bytes, never all zeros (that means "unknown").
        let mut world = [0u8; wire::WORLD_ID_LEN];
        while world == [0; wire::WORLD_ID_LEN] {
            getrandom::fill(&mut world).map_err(|e| {
                TransportError::io("drawing the world id", std::io::Error::other(e.to_string()))
            })?;
        }
        self.world = world;
        let _ = self.world_cell.set(world);
        self.acceptor = Some(Acceptor::spawn(data, self.rules(ConnKind::Data))?);
        let rdv_rules = self.rules(ConnKind::Rendezvous);
        let rdv_done = Arc::clone(&rdv_rules.world);
        let mut rdv_acceptor = Acceptor::spawn(rdv_listener, rdv_rules)?;
        tracing::info!(%rdv_addr, size, "rank 0 waiting for the other ranks");

        let deadline = Instant::now() + self.opts.timeout;
        let mut members: Vec<Option<(TcpStream, SocketAddr)>> = (0..size).map(|_| None).collect();
        let mut places: Vec<Option<Place>> = (0..size).map(|_| None).collect();
        places[0] = Some(me);
        // Every member's stream settings, checked against rank 0's once all are in.
        let mut settings: Vec<(usize, StreamSettings)> = Vec::with_capacity(size);
        let mut missing = size - 1;
        while missing > 0 {
            let Some((hello, stream, from)) = rdv_acceptor.next(deadline) else {
                let absent: Vec<usize> = (1..size).filter(|&r| members[r].is_none()).collect();
                let lost = absent.first().copied().unwrap_or(0);
                tell_failure(
                    &mut members,
                    lost,
                    &format!(
                        "rank(s) {absent:?} did not join the rendezvous within {:?}",
                        self.opts.timeout
                    ),
                );
                return Err(TransportError::Handshake {
                    peer: format!("rank(s) {absent:?}"),
                    reason: format!(
                        "they did not join the rendezvous at {rdv_addr} within {:?} (did they \
                         start, with the same FH_RENDEZVOUS_ADDR and FH_JOB_TOKEN?){}",
                        self.opts.timeout,
                        rdv_acceptor.refusal_note()
                    ),
                });
            };
            let r = hello.rank as usize;
            if let Some((_, first)) = &members[r] {
                // Two processes that know the token claim one rank: two jobs with the same
                // token and rendezvous address are starting together. Never mix them: stop
                // this world, telling every member (the second claimant too).
                let reason = format!(
                    "two processes claim rank {r} at the rendezvous (one from {first}, one from \
                     {from}): another job with the same FH_JOB_TOKEN and rendezvous address is \
                     starting; give every job its own token (fhrun draws one per job) and \
                     rendezvous port"
                );
                refuse(stream, &reason);
                tell_failure(&mut members, 0, &reason);
                return Err(TransportError::Config {
                    var: "FH_JOB_TOKEN".into(),
                    reason,
                });
            }
            // A member sends its place right after its handshake.
            let mut stream = stream;
            let place_deadline = Instant::now() + self.opts.handshake_timeout;
            let place = read_msg(&mut stream, place_deadline, hosts::MAX_PLACE_LEN, |b| {
                Place::decode(b)
            })
            .map_err(|f| {
                let op = "rendezvous (waiting for its host place)";
                from_member(f, r, "host place", op, self.opts.handshake_timeout)
            });
            // And its stream settings right after its place.
            let place = place.and_then(|(p, _)| {
                read_msg(&mut stream, place_deadline, settings::ENCODED_LEN, |b| {
                    StreamSettings::decode(b)
                })
                .map(|(s, _)| (p, s))
                .map_err(|f| {
                    let op = "rendezvous (waiting for its stream settings)";
                    from_member(f, r, "stream settings", op, self.opts.handshake_timeout)
                })
            });
            let place = match place {
                Ok((p, s)) => {
                    settings.push((r, s));
                    p
                }
                Err(e) => {
                    tell_failure(&mut members, r, &e.to_string());
                    return Err(e);
                }
            };
            places[r] = Some(place);
            members[r] = Some((stream, SocketAddr::new(from.ip(), hello.port)));
            missing -= 1;
        }
        // The streams between two ranks must be the same on both ends: a rank whose settings
        // differ from rank 0's stops every rank, naming both values.
        settings.sort_by_key(|(r, _)| *r);
        if let Some((r, (var, reason))) = settings
            .iter()
            .find_map(|(r, s)| self.opts.streams.mismatch(*r, s).map(|m| (*r, m)))
        {
            tell_failure(&mut members, r, &reason);
            return Err(TransportError::Config { var, reason });
        }
        // From now on the rendezvous listener refuses every claimant, naming this world; the
        // port stays taken for the life of the transport.
        let _ = rdv_done.set(world);
        self.board.rendezvous_completed();
        let late = Instant::now();
        while let Some((hello, stream, from)) = rdv_acceptor.next(late) {
            let reason = format!(
                "rank {} (claimed, from {from}): the rendezvous of this job (world {}) is \
                 complete and that rank joined it already: is another job with the same \
                 FH_JOB_TOKEN and rendezvous address running? Give every job its own token",
                hello.rank,
                wire::world_hex(&world)
            );
            refuse(stream, &reason);
            // Every rank had joined: this claimant or that rank's member is another job's.
            self.board.late_claim(hello.rank, from);
        }
        self.rendezvous = Some(rdv_acceptor);

        let mut book = vec![my_addr];
        let mut entries = vec![format!(":{}", my_addr.port())];
        for m in members.iter().skip(1) {
            let (_, addr) = m
                .as_ref()
                .ok_or_else(|| TransportError::Closed("rendezvous bookkeeping".into()))?;
            book.push(*addr);
            entries.push(addr.to_string());
        }
        let places: Vec<Place> = places.into_iter().flatten().collect();
        if places.len() != size {
            return Err(TransportError::Closed("rendezvous bookkeeping".into()));
        }
        let mut encoded = wire::encode_book(&entries);
        encoded.extend_from_slice(&hosts::encode_places(&places));
        encoded.extend_from_slice(&world);
        // A book is small (it fits in any socket buffer), so these writes do not wait on a
        // slow reader; one deadline bounds them all.
        let book_deadline = Instant::now() + self.opts.timeout;
        for (r, m) in members.iter_mut().enumerate().skip(1) {
            if let Some((stream, _)) = m {
                write_by(stream, &encoded, book_deadline).map_err(|e| {
                    TransportError::PeerLost {
                        rank: r,
                        detail: format!("sending the address book failed: {e}"),
                    }
                })?;
            }
        }
        self.book = book;
        Ok(places)
    }

    pub(super) fn rendezvous_member(
        &mut self,
        addrs: &[SocketAddr],
        rdv: &str,
        me: Place,
    ) -> Result<Vec<Place>> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let deadline = Instant::now() + self.opts.timeout;
        // The data listener goes on the interface this rank reaches rank 0 through, learnt from
        // the first connection (and kept for the retries).
        let mut data_port: Option<u16> = None;
        let rules = self.rules(ConnKind::Data);
        let mut rules = Some(rules);
        let mut acceptor = None;
        let mut beat_socket = None;
        let beats = self.opts.liveness.is_some();
        let peer = format!("rank 0 (rendezvous at {rdv})");
        let mut stream = connect_handshake(
            addrs,
            |s| {
                let port = match data_port {
                    Some(p) => p,
                    None => {
                        let local_ip = s.local_addr().map_err(|e| {
                            TransportError::io("reading the rendezvous connection's address", e)
                        })?;
                        let (data, beat) = bind_data(local_ip.ip(), beats)?;
                        beat_socket = beat;
                        let port = data
                            .local_addr()
                            .map_err(|e| {
                                TransportError::io("reading the data listener's address", e)
                            })?
                            .port();
                        let r = rules.take().ok_or_else(|| {
                            TransportError::Closed("data listener set up twice".into())
                        })?;
                        acceptor = Some(Acceptor::spawn(data, r)?);
                        data_port = Some(port);
                        port
                    }
                };
                Ok(Hello {
                    version: wire::PROTOCOL_VERSION,
                    kind: ConnKind::Rendezvous,
                    size: size as u32,
                    rank: rank as u32,
                    seq: 0,
                    port,
                    lost: 0,
                    world: [0; wire::WORLD_ID_LEN],
                    nonce: [0; wire::NONCE_LEN],
                })
            },
            &self.key.clone(),
            &peer,
            deadline,
            self.opts.handshake_timeout,
            None,
            &|| None,
        )?;
        self.acceptor = acceptor;
        self.beat_socket = beat_socket;
        let _ = stream.set_nodelay(true);
        // Its place, then its stream settings (rank 0 checks that they agree).
        let mut msg = me.encode();
        msg.extend_from_slice(&self.opts.streams.encode());
        write_by(&mut stream, &msg, deadline).map_err(|e| TransportError::PeerLost {
            rank: 0,
            detail: format!("sending this rank's host place to the rendezvous failed: {e}"),
        })?;
        // Rank 0's address, for its entry of the book. Read now, but not yet an error when it
        // fails: rank 0 may have closed the connection after sending why (two jobs claiming
        // one rendezvous), and that reason, read below, is the error to give.
        let root_ip: Option<IpAddr> = stream.peer_addr().ok().map(|a| a.ip());

        // Rank 0 answers once everybody is in: wait up to its timeout, plus a margin, in all.
        let book_deadline = Instant::now() + self.opts.timeout + self.opts.handshake_timeout;
        let timeout = self.opts.timeout;
        let (answer, _) = read_msg(
            &mut stream,
            book_deadline,
            wire::max_rendezvous_answer_len(size),
            |b| wire::decode_rendezvous_answer(b, size),
        )
        .map_err(|f| from_root(f, "the address book", timeout))?;
        let entries = match answer {
            wire::RendezvousAnswer::Book(entries) => entries,
            wire::RendezvousAnswer::Failed { lost, reason } => {
                return Err(TransportError::PeerLost {
                    rank: lost as usize,
                    detail: format!("rank 0 ended the rendezvous: {reason}"),
                })
            }
        };
        let (places, _) = read_msg(
            &mut stream,
            book_deadline,
            hosts::max_places_len(size),
            |b| hosts::decode_places(b, size),
        )
        .map_err(|f| from_root(f, "the host list", timeout))?;
        let (world, _) = read_msg(&mut stream, book_deadline, wire::WORLD_ID_LEN, |b| {
            fh_job::world::decode_world_id(b)
        })
        .map_err(|f| from_root(f, "the world id", timeout))?;
        let root_ip = root_ip.ok_or_else(|| TransportError::PeerLost {
            rank: 0,
            detail: "rank 0 closed the rendezvous connection while sending the address book \
                     (see rank 0's log)"
                .into(),
        })?;
        self.world = world;
        let _ = self.world_cell.set(world);
        let mut book = Vec::with_capacity(size);
        for (r, e) in entries.iter().enumerate() {
            let addr = if r == 0 {
                e.strip_prefix(':')
                    .and_then(|p| p.parse::<u16>().ok())
                    .map(|p| SocketAddr::new(root_ip, p))
            } else {
                e.parse::<SocketAddr>().ok()
            };
            book.push(addr.ok_or_else(|| TransportError::Protocol {
                rank: 0,
                detail: format!("bad address book entry for rank {r}: {e:?}"),
            })?);
        }
        self.book = book;
        Ok(places)
    }
}

/// Refuse a claimant at the rendezvous, saying why: its host place (sent right after the
/// handshake) is read first, so that closing leaves no unread data, which would make the close
/// a reset that can destroy the reason before the claimant reads it. Bounded (about 1 s).
fn refuse(mut stream: TcpStream, reason: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    let _ = read_msg(&mut stream, deadline, hosts::MAX_PLACE_LEN, |b| {
        Place::decode(b)
    });
    let _ = read_msg(&mut stream, deadline, settings::ENCODED_LEN, |b| {
        StreamSettings::decode(b)
    });
    let _ = write_by(
        &mut stream,
        &wire::encode_rendezvous_failure(0, reason),
        deadline,
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Rank 0 gives up: tell every member that joined whom to blame (best effort, bounded), so
/// that they name that rank rather than rank 0.
fn tell_failure(members: &mut [Option<(TcpStream, SocketAddr)>], lost: usize, reason: &str) {
    let notice = wire::encode_rendezvous_failure(lost as u32, reason);
    let deadline = Instant::now() + Duration::from_secs(1);
    for (stream, _) in members.iter_mut().flatten() {
        let _ = write_by(stream, &notice, deadline);
    }
}

pub(super) fn resolve(addr: &str) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| TransportError::Config {
            var: "FH_RENDEZVOUS_ADDR".into(),
            reason: format!("cannot resolve {addr:?}: {e}"),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(TransportError::Config {
            var: "FH_RENDEZVOUS_ADDR".into(),
            reason: format!("{addr:?} resolves to no address"),
        });
    }
    Ok(addrs)
}

/// Bind this rank's data listener on `ip` and, with heartbeats (`beats`), a UDP socket on the
/// same port number: the address book then gives every rank's heartbeat address too. Tries
/// other ports while the UDP socket's port is taken for TCP.
fn bind_data(ip: IpAddr, beats: bool) -> Result<(TcpListener, Option<UdpSocket>)> {
    let what = || format!("binding a data listener on {ip}");
    if !beats {
        let l =
            TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| TransportError::io(what(), e))?;
        return Ok((l, None));
    }
    let mut last = None;
    for _ in 0..64 {
        let udp = UdpSocket::bind(SocketAddr::new(ip, 0))
            .map_err(|e| TransportError::io(format!("binding a heartbeat socket on {ip}"), e))?;
        let port = udp
            .local_addr()
            .map_err(|e| TransportError::io("reading the heartbeat socket's address", e))?
            .port();
        match TcpListener::bind(SocketAddr::new(ip, port)) {
            Ok(l) => return Ok((l, Some(udp))),
            Err(e) => last = Some(e),
        }
    }
    Err(TransportError::io(
        format!("{} (no port free for both TCP and UDP in 64 tries)", what()),
        last.unwrap_or_else(|| std::io::ErrorKind::AddrInUse.into()),
    ))
}
