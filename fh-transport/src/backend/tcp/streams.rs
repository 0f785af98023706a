//! Parallel streams to a peer on another host: how many connections a communicator holds to
//! each peer, and how a large frame is striped over them.
//!
//! Clouds cap the rate of each TCP flow well below a VM's link; several flows fill it where one
//! cannot. A communicator therefore holds [`StreamSettings::count`](super::settings::StreamSettings::count) connections to every peer
//! on another host (peers on the same host keep one), and a data frame of at least
//! [`StreamSettings::stripe_min`](super::settings::StreamSettings::stripe_min) bytes to such a peer is split into that many contiguous
//! stripes ([`stripe_range`]), stripe `i` sent on stream `i` as a frame of its own. Each stripe's
//! header carries the length of the *whole* message, so a receiver that expects another length
//! refuses it as it would an unstriped frame; the split itself never crosses the wire: both
//! ends compute it from the length and the settings, which the rendezvous checks to be the
//! same on every rank ([`StreamSettings::encode`](super::settings::StreamSettings::encode), sent by every member after its host place).
//!
//! How many: [`StreamCount::Auto`] (the default) is measured when a world spanning hosts
//! starts. Rank 0 and the first rank on another host send for [`PROBE_TIME`] over one stream,
//! then as long over [`PROBE_STREAMS`] at once; [`choose`] turns the two rates into a count
//! (1 where one flow already gets close to what many get), which rank 0 logs and sends every
//! rank. [`FLOW_CAP_VAR`](super::settings::FLOW_CAP_VAR) emulates a cloud's per-flow cap on one machine, so that tests and
//! benches can see the difference.

use std::time::Instant;

use super::settings::{StreamCount, MAX_STREAMS};
use super::{TcpComm, TcpTransport};
use crate::{Communicator, Interrupt, Result, TransportError};

/// Streams the measurement of `auto` tries at once (against one), and the most it chooses.
pub const PROBE_STREAMS: usize = 8;
/// How long each of the measurement's two phases sends.
pub const PROBE_TIME: std::time::Duration = std::time::Duration::from_millis(150);
/// Bytes of each frame the measurement sends on a stream.
pub const PROBE_FRAME: usize = 1 << 20;

/// The streams to use from the measured rates of one stream and of [`PROBE_STREAMS`] at once
/// (bytes per second): 1 where one stream reaches within a quarter of the many-stream rate
/// (one flow already fills the link, or the CPU is the limit), else as many as the ratio says
/// (each flow gets one stream's rate), at least 2 and at most [`PROBE_STREAMS`].
pub fn choose(one: f64, many: f64) -> usize {
    let several_help = one > 0.0 && many >= 1.25 * one;
    if !several_help {
        return 1;
    }
    ((many / one).ceil() as usize).clamp(2, PROBE_STREAMS)
}

/// The streams a TCP world uses to each peer on another host, and what they were chosen
/// from: the same on every rank ([`crate::Transport::stream_choice`]), for reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamChoice {
    /// Connections a communicator holds to each peer on another host.
    pub streams: usize,
    /// The setting it came from ([`STREAMS_VAR`](super::settings::STREAMS_VAR)): [`StreamCount::Auto`] where measured.
    pub setting: StreamCount,
    /// What `auto` measured at the start (`None` where the count was set, or nothing was
    /// measured).
    pub measured: Option<MeasuredRates>,
}

/// The rates `auto`'s start-up measurement saw between rank 0 and the first rank on another
/// host, bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredRates {
    /// One stream alone.
    pub one_stream_bps: f64,
    /// [`MeasuredRates::probe_streams`] streams at once, together.
    pub many_streams_bps: f64,
    /// How many streams the second phase sent over ([`PROBE_STREAMS`]).
    pub probe_streams: usize,
}

impl MeasuredRates {
    /// The rates as rank 0 sends them to every rank with the choice (16 bytes).
    fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.one_stream_bps.to_le_bytes());
        b[8..].copy_from_slice(&self.many_streams_bps.to_le_bytes());
        b
    }

    /// [`MeasuredRates::encode`]'s bytes back; `None` for rates that are not finite and
    /// non-negative.
    fn decode(b: &[u8; 16], probe_streams: usize) -> Option<Self> {
        let one = f64::from_le_bytes(b[..8].try_into().ok()?);
        let many = f64::from_le_bytes(b[8..].try_into().ok()?);
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        (ok(one) && ok(many)).then_some(MeasuredRates {
            one_stream_bps: one,
            many_streams_bps: many,
            probe_streams,
        })
    }
}

/// How many stripes a message of `len` bytes to a peer with `streams` connections takes: all of
/// them from `stripe_min` bytes on (never more than there are bytes), else 1.
pub fn stripe_count(len: usize, streams: usize, stripe_min: usize) -> usize {
    if streams <= 1 || len < stripe_min.max(2) {
        1
    } else {
        streams.min(len)
    }
}

/// The bytes of stripe `i` of `n` of a message of `len` bytes: contiguous, in order, sizes
/// differing by at most one byte.
pub fn stripe_range(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let at = |k: usize| ((len as u128 * k as u128) / n as u128) as usize;
    at(i)..at(i + 1)
}

impl TcpTransport {
    /// `FH_TCP_STREAMS=auto` in a world spanning hosts: rank 0 and the first rank on another
    /// host measure the rate of one stream and of [`PROBE_STREAMS`] at once, each for
    /// [`PROBE_TIME`], over a communicator of their own (the world's first, opened by
    /// every rank), and rank 0 sends every rank the streams the ratio asks for
    /// ([`choose`]) with the rates it measured. Returns both, the same on every rank.
    pub(super) fn measure_streams(&mut self) -> Result<(usize, Option<MeasuredRates>)> {
        let (rank, size) = (self.topology.rank, self.topology.size);
        let host0 = self.layout.topology(0).cross_rank;
        let Some(q) = (1..size).find(|&r| self.layout.topology(r).cross_rank != host0) else {
            return Ok((self.opts.streams.count.resolve(), None));
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let label = "fh-tcp-stream-probe";
        let want: Vec<usize> = (0..size)
            .map(|p| match (rank, p) {
                _ if p == rank => 0,
                (0, p) | (p, 0) if p == q => PROBE_STREAMS,
                _ => 1,
            })
            .collect();
        let peers = self
            .open_mesh(label, seq, &want)
            .map_err(|e| self.tell_formation_failed(e, seq))?;
        let mut c = TcpComm::new(
            label.to_owned(),
            seq,
            rank,
            size,
            peers,
            &self.opts,
            self.link.clone(),
            Interrupt::new(),
        );
        // The count, then the two rates (for reports: every rank knows what was chosen from).
        let mut chosen = [0u8; 24];
        if rank == 0 || rank == q {
            let mut rates = [0.0f64; 2];
            for (phase, k) in [1, PROBE_STREAMS].into_iter().enumerate() {
                c.set_stripe_cap(k);
                // Frames of PROBE_FRAME bytes on each stream in use; the first byte says
                // whether more follow, so the receiver needs no clock.
                let len = (k * PROBE_FRAME).max(self.opts.streams.stripe_min);
                let mut buf = vec![1u8; len];
                let mut ack = [0u8; 8];
                if rank == 0 {
                    let start = Instant::now();
                    let mut sent = 0usize;
                    loop {
                        let last = start.elapsed() >= PROBE_TIME;
                        buf[0] = u8::from(!last);
                        c.send(q, &buf)?;
                        sent += buf.len();
                        if last {
                            break;
                        }
                    }
                    c.recv(q, &mut ack)?;
                    rates[phase] = sent as f64 / start.elapsed().as_secs_f64();
                } else {
                    loop {
                        c.recv(0, &mut buf)?;
                        if buf[0] == 0 {
                            break;
                        }
                    }
                    c.send(0, &ack)?;
                }
            }
            if rank == 0 {
                let s = choose(rates[0], rates[1]);
                tracing::info!(
                    with = q,
                    one_stream_mb_s = rates[0] / 1e6,
                    streams_mb_s = rates[1] / 1e6,
                    probe_streams = PROBE_STREAMS,
                    chosen = s,
                    stripe_min = self.opts.streams.stripe_min,
                    "TCP streams to each peer on another host, measured (FH_TCP_STREAMS=auto)"
                );
                chosen[..8].copy_from_slice(&(s as u64).to_le_bytes());
                let rates = MeasuredRates {
                    one_stream_bps: rates[0],
                    many_streams_bps: rates[1],
                    probe_streams: PROBE_STREAMS,
                };
                chosen[8..].copy_from_slice(&rates.encode());
            }
        }
        c.broadcast(&mut chosen, 0)?;
        let mut count = [0u8; 8];
        count.copy_from_slice(&chosen[..8]);
        let s = u64::from_le_bytes(count) as usize;
        let mut rates = [0u8; 16];
        rates.copy_from_slice(&chosen[8..]);
        if !(1..=MAX_STREAMS).contains(&s) {
            return Err(TransportError::Protocol {
                rank: 0,
                detail: format!("rank 0 chose {s} TCP streams (at most {})", MAX_STREAMS),
            });
        }
        Ok((s, MeasuredRates::decode(&rates, PROBE_STREAMS)))
    }
}

/// The parts of `data` (slices in order) that hold the message's bytes `range`.
pub(super) fn stripe_slices<'a>(data: &[&'a [u8]], range: std::ops::Range<usize>) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    for s in data {
        let (start, end) = (at, at + s.len());
        at = end;
        if end <= range.start || s.is_empty() {
            continue;
        }
        if start >= range.end {
            break;
        }
        let lo = range.start.max(start) - start;
        let hi = range.end.min(end) - start;
        out.push(&s[lo..hi]);
    }
    out
}

/// `bufs` (a message of `len` bytes in order) split into the buffers of its `n` stripes.
pub(super) fn split_stripes<'s>(
    bufs: &'s mut [&mut [u8]],
    len: usize,
    n: usize,
) -> Vec<Vec<&'s mut [u8]>> {
    let mut out: Vec<Vec<&'s mut [u8]>> = (0..n).map(|_| Vec::new()).collect();
    let mut stripe = 0;
    let mut at = 0;
    for b in bufs.iter_mut() {
        let mut rest: &'s mut [u8] = b;
        while !rest.is_empty() {
            while stripe + 1 < n && at >= stripe_range(len, n, stripe).end {
                stripe += 1;
            }
            let take = (stripe_range(len, n, stripe).end - at).min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(take);
            out[stripe].push(head);
            rest = tail;
            at += take;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_the_message_in_order() {
        for len in [0usize, 1, 2, 3, 7, 1000, 1 << 20, (1 << 20) + 3] {
            for streams in 1..=5 {
                let n = stripe_count(len, streams, 2);
                let mut next = 0;
                for i in 0..n {
                    let r = stripe_range(len, n, i);
                    assert_eq!(r.start, next);
                    assert!(n == 1 || !r.is_empty(), "len {len} n {n} stripe {i} empty");
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(stripe_count(999, 4, 1000), 1);
        assert_eq!(stripe_count(1000, 4, 1000), 4);
        assert_eq!(stripe_count(1000, 1, 1), 1);
    }

    #[test]
    fn the_measured_ratio_chooses_the_streams() {
        // One flow fills the link (or the CPU is the limit): one stream.
        assert_eq!(choose(100.0, 110.0), 1);
        assert_eq!(choose(100.0, 60.0), 1);
        assert_eq!(choose(0.0, 60.0), 1);
        assert_eq!(choose(f64::NAN, 60.0), 1);
        // A per-flow cap of a quarter of the link: four.
        assert_eq!(choose(0.48, 1.91), 4);
        assert_eq!(choose(100.0, 130.0), 2);
        // Never more than were tried.
        assert_eq!(choose(1.0, 100.0), PROBE_STREAMS);
    }

    #[test]
    fn measured_rates_travel_with_the_choice() {
        let r = MeasuredRates {
            one_stream_bps: 59.75e6,
            many_streams_bps: 238.7e6,
            probe_streams: PROBE_STREAMS,
        };
        assert_eq!(MeasuredRates::decode(&r.encode(), PROBE_STREAMS), Some(r));
        let mut bad = r.encode();
        bad[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(MeasuredRates::decode(&bad, PROBE_STREAMS), None);
    }
}
