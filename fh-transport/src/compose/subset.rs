//! Communicators over a subset of the world's ranks (the transport side of process sets).
//!
//! [`open_subset`] is collective over the **whole world** — every rank, member or not, calls it
//! with the same member list and the same number of communicators, in the same order relative
//! to its other [`Transport::open`] calls (a process set is created collectively, as in
//! Horovod). It opens that many ordinary world communicators on the parent transport and wraps
//! each in a [`SubsetComm`] that numbers the members `0..members.len()` (in ascending world
//! rank) and maps every point-to-point message to the member's world rank. The collectives are
//! the generic ones of [`crate::algorithms`] over those point-to-point messages, so every
//! backend (local, TCP, shared memory, hierarchical, MPI, split) supports subsets without code
//! of its own; the messages of a subset never leave its members.
//!
//! Backends that can connect a group of ranks on their own ([`Transport::can_open_group`]:
//! shared memory) open the subset's communicators with [`Transport::open_group`] instead:
//! only the members take part, and a non-member's loss cannot disturb them (the shared-memory
//! watchdog watches every rank of a segment, so a world segment would). On the others (TCP,
//! hierarchical, MPI, local, split) a non-member's idle ends are never read, so its loss goes
//! unnoticed by the subset.
//!
//! A member gets a [`SubsetTransport`] whose [`Transport::open`] hands out the pre-opened
//! communicators in order (the scheduler's engine opens exactly those at start). A non-member
//! gets a transport that only keeps its ends of the world communicators alive — idle, never
//! read — until it is dropped, and whose `open` fails with a clear error.
//!
//! Errors name **world** ranks (a lost member is reported as the world rank that vanished).

use std::collections::VecDeque;
use std::sync::Arc;

use fh_core::bytes::Reader;
use fh_core::{DType, ReduceOp};

use super::ranks::RankView;
use crate::{Communicator, Result, Topology, Transport, TransportError};

/// Check a member list against a world of `world_size` ranks and return it sorted: it must be
/// non-empty, within `0..world_size`, and without duplicates.
pub fn canonical_members(members: &[usize], world_size: usize) -> Result<Vec<usize>> {
    if members.is_empty() {
        return Err(TransportError::InvalidArgument(
            "a process set needs at least one rank".into(),
        ));
    }
    if let Some(&r) = members.iter().find(|&&r| r >= world_size) {
        return Err(TransportError::InvalidArgument(format!(
            "rank {r} is out of range: the world has ranks 0..{world_size}"
        )));
    }
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(TransportError::InvalidArgument(format!(
            "rank {} appears more than once in the process set {members:?}",
            w[0]
        )));
    }
    Ok(sorted)
}

/// Collectively (over the whole world of `parent`) open one communicator per label (each
/// opened on `parent` under that label, so a [`crate::compose::split::SplitTransport`] still routes
/// control labels to its control world) over the ranks `members` (any order; see
/// [`canonical_members`] for the rules). Every rank must call it with the same arguments. Returns a transport whose topology numbers the members; on a
/// non-member it holds the communicators idle and [`SubsetTransport::is_member`] is false.
pub fn open_subset(
    parent: &mut dyn Transport,
    members: &[usize],
    labels: &[String],
) -> Result<SubsetTransport> {
    let world = parent.topology();
    let members: Arc<[usize]> = canonical_members(members, world.size)?.into();
    if labels.is_empty() {
        return Err(TransportError::InvalidArgument(
            "a subset transport needs at least one communicator".into(),
        ));
    }
    let position = members.iter().position(|&r| r == world.rank);
    let backend = parent.backend();
    let wire = parent.wire();
    let mut comms: VecDeque<Box<dyn Communicator>> = VecDeque::new();
    if parent.can_open_group() {
        // Only the members take part.
        if position.is_none() {
            return Ok(SubsetTransport {
                backend,
                wire,
                members,
                topology: None,
                comms: VecDeque::new(),
                _idle: Vec::new(),
            });
        }
        for label in labels {
            let inner = parent.open_group(label, &members)?;
            comms.push_back(Box::new(GroupComm {
                inner,
                members: Arc::clone(&members),
            }));
        }
    } else {
        let mut raw = Vec::with_capacity(labels.len());
        for label in labels {
            raw.push(parent.open(label)?);
        }
        let Some(rank) = position else {
            // A non-member keeps its ends open (closing them could look like a lost rank to
            // backends that watch every connection) but never uses them.
            return Ok(SubsetTransport {
                backend,
                wire,
                members,
                topology: None,
                comms: VecDeque::new(),
                _idle: raw,
            });
        };
        comms = raw
            .into_iter()
            .map(|inner| {
                Box::new(SubsetComm {
                    inner,
                    members: Arc::clone(&members),
                    rank,
                }) as Box<dyn Communicator>
            })
            .collect();
    }
    // Where every member's host is, to number the members' hosts.
    let n = members.len();
    let mut hosts = vec![0u8; 8 * n];
    crate::CollectivesExt::allgather(
        comms[0].as_mut(),
        &(world.cross_rank as u64).to_le_bytes(),
        &mut hosts,
    )?;
    let mut words = Reader::new(&hosts);
    let host_at: Vec<u64> = (0..n)
        .map(|_| words.u64())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| TransportError::Internal(format!("reading the members' hosts: {e}")))?;
    let host_of = |r: usize| host_at[members.iter().position(|&m| m == r).unwrap_or(0)];
    let topology = position.map(|rank| {
        let me = host_of(world.rank);
        let mut host_list: Vec<u64> = members.iter().map(|&r| host_of(r)).collect();
        host_list.sort_unstable();
        host_list.dedup();
        let on_host: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&r| host_of(r) == me)
            .collect();
        Topology {
            rank,
            size: members.len(),
            local_rank: on_host.iter().position(|&r| r == world.rank).unwrap_or(0),
            local_size: on_host.len(),
            cross_rank: host_list.iter().position(|&h| h == me).unwrap_or(0),
            cross_size: host_list.len(),
        }
    });
    Ok(SubsetTransport {
        backend,
        wire,
        members,
        topology,
        comms,
        _idle: Vec::new(),
    })
}

/// One rank's view of a subset of the world (see the [module docs](self)).
pub struct SubsetTransport {
    backend: &'static str,
    wire: crate::WireKind,
    members: Arc<[usize]>,
    topology: Option<Topology>,
    comms: VecDeque<Box<dyn Communicator>>,
    /// A non-member's ends of the world communicators, held (never read) until drop.
    _idle: Vec<Box<dyn Communicator>>,
}

impl std::fmt::Debug for SubsetTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubsetTransport")
            .field("backend", &self.backend)
            .field("members", &self.members)
            .field("topology", &self.topology)
            .field("unopened", &self.comms.len())
            .finish()
    }
}

impl SubsetTransport {
    /// Whether this rank is a member of the subset.
    pub fn is_member(&self) -> bool {
        self.topology.is_some()
    }

    /// The members' world ranks, ascending (index = rank within the subset).
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Communicators opened by [`open_subset`] and not yet handed out by `open`.
    pub fn remaining(&self) -> usize {
        self.comms.len()
    }
}

impl Transport for SubsetTransport {
    fn backend(&self) -> &'static str {
        self.backend
    }

    fn wire(&self) -> crate::WireKind {
        self.wire
    }

    /// The rank's place within the subset. On a non-member (which has none) this is rank 0 of
    /// size 0 — check [`SubsetTransport::is_member`] first.
    fn topology(&self) -> Topology {
        self.topology.unwrap_or(Topology {
            rank: 0,
            size: 0,
            local_rank: 0,
            local_size: 0,
            cross_rank: 0,
            cross_size: 0,
        })
    }

    /// Hand out the next communicator opened by [`open_subset`] (not collective: they are all
    /// connected already). Fails on a non-member and when all have been handed out.
    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        if !self.is_member() {
            return Err(TransportError::InvalidArgument(format!(
                "cannot open '{label}': this rank is not a member of the subset {:?}",
                self.members
            )));
        }
        match self.comms.pop_front() {
            Some(c) => Ok(c),
            None => Err(TransportError::InvalidArgument(format!(
                "cannot open '{label}': every communicator opened for the subset {:?} is in use \
                 (open_subset opens a fixed number)",
                self.members
            ))),
        }
    }
}

/// A communicator over the members of a subset, numbered `0..members.len()`, carried by a
/// world communicator.
pub struct SubsetComm {
    inner: Box<dyn Communicator>,
    members: Arc<[usize]>,
    rank: usize,
}

impl std::fmt::Debug for SubsetComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubsetComm")
            .field("members", &self.members)
            .field("rank", &self.rank)
            .finish()
    }
}

impl SubsetComm {
    fn world(&self, peer: usize) -> Result<usize> {
        RankView(&self.members).world(peer)
    }
}

impl Communicator for SubsetComm {
    fn allreduce_agreeing(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        mine: bool,
    ) -> Result<bool> {
        // The allreduce runs over this communicator's own messages: the flag rides in them.
        crate::algorithms::allreduce_agreeing(self, buf, dtype, op, mine)
    }

    fn agrees_in_band(&self) -> bool {
        true
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let w = self.world(peer)?;
        self.inner.send(w, data)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let w = self.world(peer)?;
        self.inner.recv(w, buf)
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        let (t, f) = (self.world(to)?, self.world(from)?);
        self.inner.send_recv(t, send, f, recv)
    }

    fn vectored_io(&self) -> bool {
        self.inner.vectored_io()
    }

    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        let (t, f) = (self.world(to)?, self.world(from)?);
        self.inner.send_recv_vectored(t, send, f, recv)
    }

    fn abort(&mut self, lost: usize) {
        // Errors name world ranks here, as the carrying communicator does.
        self.inner.abort(lost);
    }

    fn interrupter(&self) -> Option<crate::Interrupt> {
        // World ranks, as for `abort`.
        self.inner.interrupter()
    }
}

/// A communicator the backend opened over the members themselves
/// ([`Transport::open_group`]): every call goes straight to it (its native collectives
/// included); only the errors change, so that a rank they name is the world rank.
struct GroupComm {
    inner: Box<dyn Communicator>,
    members: Arc<[usize]>,
}

impl GroupComm {
    fn map<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| RankView(&self.members).error_to_world(e))
    }
}

impl Communicator for GroupComm {
    fn allreduce_agreeing(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        mine: bool,
    ) -> Result<bool> {
        // The allreduce runs over this communicator's own messages: the flag rides in them.
        crate::algorithms::allreduce_agreeing(self, buf, dtype, op, mine)
    }

    fn agrees_in_band(&self) -> bool {
        true
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let r = self.inner.send(peer, data);
        self.map(r)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let r = self.inner.recv(peer, buf);
        self.map(r)
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        let r = self.inner.send_recv(to, send, from, recv);
        self.map(r)
    }

    fn vectored_io(&self) -> bool {
        self.inner.vectored_io()
    }

    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        let r = self.inner.send_recv_vectored(to, send, from, recv);
        self.map(r)
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let r = self.inner.allreduce(buf, dtype, op);
        self.map(r)
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        let r = self.inner.allgatherv(send, recv, counts);
        self.map(r)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        let r = self.inner.broadcast(buf, root);
        self.map(r)
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let r = self.inner.alltoallv(send, send_counts, recv, recv_counts);
        self.map(r)
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let r = self.inner.reduce_scatter(send, recv, counts, dtype, op);
        self.map(r)
    }

    fn barrier(&mut self) -> Result<()> {
        let r = self.inner.barrier();
        self.map(r)
    }

    fn abort(&mut self, lost: usize) {
        // Errors name world ranks: blame the member's place in the group, if it is one.
        if let Some(i) = self.members.iter().position(|&m| m == lost) {
            self.inner.abort(i);
        }
    }

    fn interrupter(&self) -> Option<crate::Interrupt> {
        // The backend's group communicator reads its interrupt's cause in world ranks.
        self.inner.interrupter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_lists_are_checked_and_sorted() {
        assert_eq!(canonical_members(&[3, 0, 2], 4).expect("valid"), [0, 2, 3]);
        for (bad, what) in [
            (vec![], "at least one"),
            (vec![0, 4], "out of range"),
            (vec![1, 2, 1], "more than once"),
        ] {
            let e = canonical_members(&bad, 4).expect_err("invalid");
            assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}
