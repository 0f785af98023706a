//! The [`Communicator`] face of [`TcpComm`]: every operation is one transfer of the poll loop
//! in the parent module; the collectives are the algorithms' over it.

use super::TcpComm;
use crate::{Communicator, Interrupt, Result, TransportError};

impl Communicator for TcpComm {
    fn allreduce_agreeing(
        &mut self,
        buf: &mut [u8],
        dtype: fh_core::DType,
        op: fh_core::ReduceOp,
        mine: bool,
    ) -> Result<bool> {
        // The allreduce runs over this communicator's own messages: the flag rides in them.
        crate::algorithms::allreduce_agreeing(self, buf, dtype, op, mine)
    }

    fn agrees_in_band(&self) -> bool {
        true
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.transfer("send", Some((peer, &[data])), None)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.transfer("recv", None, Some((peer, &mut [buf])))
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.transfer("send_recv", Some((to, &[send])), Some((from, &mut [recv])))
    }

    fn vectored_io(&self) -> bool {
        true
    }

    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        self.transfer("send_recv", Some((to, send)), Some((from, recv)))
    }

    fn abort(&mut self, lost: usize) {
        self.give_up(&TransportError::PeerLost {
            rank: lost,
            detail: format!("this rank gave up on communicator '{}'", self.label),
        });
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}
