//! A lane's view of the TCP world: the ranks of the other hosts in one lane as a communicator
//! of their own ([`Group`]), marking whom a rank waits for across hosts ([`Marks`]).

use super::super::ranks::RankView;
use crate::backend::shm::OutsideWord;
use crate::backend::tcp::TcpComm;
use crate::{Communicator, Result};

/// How a rank waiting on TCP tells the ranks of its host whom it waits for: through its
/// shared-memory communicator's `outside` word ([`ShmComm::waiting_outside`]), set before each
/// message (the rank it receives from, when that rank is on another host) and cleared after the
/// step. A local peer that times out waiting for this rank meanwhile then waits for this rank's
/// verdict instead of blaming it.
pub(super) struct Marks<'a> {
    pub(super) word: &'a OutsideWord,
    pub(super) host_of: &'a [usize],
    /// This rank's host.
    pub(super) host: usize,
}

impl Marks<'_> {
    /// This rank is about to wait for global rank `peer`.
    pub(super) fn waiting_for(&self, peer: usize) {
        let far = matches!(self.host_of.get(peer), Some(&h) if h != self.host).then_some(peer);
        self.word.set(Some(far));
    }

    /// This rank no longer waits across hosts.
    pub(super) fn clear(&self) {
        self.word.set(None);
    }
}

/// A view of a communicator restricted to some of its ranks: peer `i` of the view is rank
/// `members[i]` of the inner communicator. Errors name the inner communicator's ranks.
pub(super) struct Group<'a> {
    pub(super) inner: &'a mut TcpComm,
    pub(super) members: &'a [usize],
    pub(super) rank: usize,
    pub(super) marks: Marks<'a>,
}

impl Group<'_> {
    fn member(&self, peer: usize) -> Result<usize> {
        RankView(self.members).world(peer)
    }
}

impl Communicator for Group<'_> {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let p = self.member(peer)?;
        self.marks.waiting_for(p);
        self.inner.send(p, data)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let p = self.member(peer)?;
        self.marks.waiting_for(p);
        self.inner.recv(p, buf)
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        let (t, f) = (self.member(to)?, self.member(from)?);
        self.marks
            .waiting_for(if from == self.rank { t } else { f });
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
        let (t, f) = (self.member(to)?, self.member(from)?);
        self.marks
            .waiting_for(if from == self.rank { t } else { f });
        self.inner.send_recv_vectored(t, send, f, recv)
    }
}
