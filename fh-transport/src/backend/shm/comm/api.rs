//! The [`Communicator`] face of [`ShmComm`]: argument checks, then the native collectives
//! inside [`ShmComm::guarded`].

use std::sync::atomic::Ordering::{Relaxed, Release};

use fh_core::{DType, ReduceOp};

use super::super::segment::ST_ABORTED;
use super::{ShmComm, BLAME_RANK};
use crate::{algorithms, Communicator, Interrupt, Result};

impl Communicator for ShmComm {
    fn backend(&self) -> &'static str {
        "shm"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.guarded(|c| c.send_inner(peer, data))
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.guarded(|c| c.recv_inner(peer, buf))
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.check_peer(to)?;
        self.check_peer(from)?;
        self.guarded(|c| c.send_recv_inner(to, send, from, recv))
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        algorithms::check_reduction("allreduce", dtype, op, buf.len())?;
        if self.size == 1 || buf.is_empty() {
            return Ok(()); // Average over one rank is the identity.
        }
        self.guarded(|c| c.allreduce_inner(buf, dtype, op))
    }

    fn allreduce_parts(&mut self, buf: &mut [u8], parts: &[algorithms::ReducePart]) -> Result<()> {
        // One synchronisation when the whole buffer fits one slot and the direct threshold
        // (what the parts are for: a few small pieces); one allreduce per part otherwise.
        if buf.len() > self.small || buf.len() > self.seg.layout.slot_bytes {
            return algorithms::allreduce_each_part(self, buf, parts);
        }
        algorithms::check_parts(buf.len(), parts)?;
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.allreduce_parts_inner(buf, parts))
    }

    fn parts_in_band(&self) -> bool {
        true
    }

    /// Native: a fused group (or a lone tensor) is reduced where it lies, finished on this
    /// rank's shares only (see *Protocol* in the communicator's module).
    fn segments_in_place(&self) -> bool {
        true
    }

    fn allreduce_segments(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Result<()> {
        let mut total = 0usize;
        for s in segs.iter() {
            algorithms::check_reduction("allreduce", dtype, op, s.len())?;
            total += s.len();
        }
        if self.size == 1 || total == 0 {
            for s in segs.iter_mut() {
                finish(s)?;
            }
            return Ok(());
        }
        if total <= self.small {
            // One synchronisation for the whole buffer: packed, as a small allreduce.
            return algorithms::allreduce_segments_packed(self, segs, dtype, op, finish);
        }
        self.guarded(|c| c.allreduce_segments_inner(segs, dtype, op.combining(), finish))
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        algorithms::check_allgatherv(send.len(), recv.len(), counts, self.rank, self.size)?;
        self.guarded(|c| c.allgatherv_inner(send, recv, counts))
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        crate::algorithms::check_root(root, self.size)?;
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.broadcast_inner(buf, root))
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        algorithms::check_alltoallv(send.len(), send_counts, recv.len(), recv_counts, me, n)?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.guarded(|c| c.alltoallv_inner(send, send_counts, recv, recv_counts))
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        algorithms::check_reduce_scatter(send.len(), recv.len(), counts, me, n, dtype, op)?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        if send.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.reduce_scatter_inner(send, recv, counts, dtype, op))
    }

    fn barrier(&mut self) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        self.guarded(|c| c.barrier_inner())
    }

    fn abort(&mut self, lost: usize) {
        if self.broken.is_some() {
            return;
        }
        self.broken = Some(format!("this rank gave up after losing rank {lost}"));
        let info = self.seg.info(self.rank);
        info.outside.store(0, Relaxed);
        if lost != self.rank && (lost as u32) < BLAME_RANK {
            info.blame.store(lost as u32 + 1, Relaxed);
        }
        info.state.store(ST_ABORTED, Release);
        self.notify_others();
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}
