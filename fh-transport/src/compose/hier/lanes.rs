//! The allreduce of a [`HierComm`] (the hot path; see the [module documentation](super)):
//! the lanes' (shared-memory reduce-scatter, a cross-host allreduce per lane, shared-memory
//! allgather, all in the caller's slices; pipelined over chunks in [`super::pipeline`]) and the
//! leaders' when hosts differ in size.

use fh_core::{kernels, DType, ReduceOp};

use super::pipeline::pipeline_chunks;
use super::slices::{around, share, shared};
use super::{on_shm, on_tcp, HierComm, Step, View};
use crate::{algorithms, Communicator, Result};

impl HierComm {
    /// Lanes: shared-memory reduce-scatter, cross-host allreduce per lane, shared-memory
    /// allgather, all three in place in the slices `segs` (their concatenation is the vector,
    /// `op` a combining op); `finish` is applied once to every byte of the result, by the lane
    /// rank that owns it in the cross-host step. Pipelined over chunks when the vector is larger
    /// than one ([`HierComm::lanes_pipelined`]).
    pub(super) fn allreduce_lanes(
        &mut self,
        segs: Vec<&mut [u8]>,
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Step<()> {
        let (l, me) = (self.topology.local_size, self.topology.local_rank);
        let mut segs = segs;
        if l == 1 {
            // One rank per host: nothing to do in shared memory.
            return self.allreduce_across_segments(&mut segs, dtype, op, finish);
        }
        let esz = dtype.size();
        let elements = segs.iter().map(|s| s.len()).sum::<usize>() / esz;
        let chunks = pipeline_chunks(elements, esz, self.pipeline_chunk);
        if chunks.len() > 1 {
            return self.lanes_pipelined(segs, &chunks, dtype, op, finish);
        }
        let counts: Vec<usize> = (0..l).map(|i| share(elements, l, i)).collect();
        let mut p = around(segs, &counts, me, esz);
        on_shm(self.shm.reduce_scatter_in_place(
            &shared(&p.before),
            &mut p.own,
            &shared(&p.after),
            &counts,
            dtype,
            op,
        ))?;
        if self.staged {
            let mut staging = std::mem::take(&mut self.staging);
            staging.clear();
            p.own.iter().for_each(|s| staging.extend_from_slice(s));
            let res = self.allreduce_across_segments(&mut [&mut staging], dtype, op, finish);
            let mut at = 0;
            for s in p.own.iter_mut() {
                s.copy_from_slice(&staging[at..at + s.len()]);
                at += s.len();
            }
            self.staging = staging;
            res?;
        } else {
            self.allreduce_across_segments(&mut p.own, dtype, op, finish)?;
        }
        let bytes: Vec<usize> = counts.iter().map(|c| c * esz).collect();
        on_shm(
            self.shm
                .allgatherv_in_place(&mut p.before, &shared(&p.own), &mut p.after, &bytes),
        )
    }

    /// Allreduce the concatenation of `segs` in place with this rank's cross-host group over
    /// TCP (combining with `op`), `finish` applied once to every byte of the result.
    pub(super) fn allreduce_across_segments(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Step<()> {
        self.on_view(View::Across, |g| {
            algorithms::allreduce_segments(g, segs, dtype, op, finish)
        })
    }

    /// Allreduce `buf` with this rank's cross-host group (its lane, or the leaders) over TCP,
    /// dividing by the world size for `Average`.
    pub(super) fn allreduce_across(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Step<()> {
        self.on_view(View::Across, |g| {
            algorithms::allreduce(g, buf, dtype, op.combining())
        })?;
        if op == ReduceOp::Average {
            on_tcp(kernels::divide(dtype, buf, self.topology.size).map_err(Into::into))?;
        }
        Ok(())
    }

    /// Leaders: shared-memory allreduce, cross-host allreduce among the leaders, shared-memory
    /// broadcast from the leader.
    pub(super) fn allreduce_leaders(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Step<()> {
        on_shm(self.shm.allreduce(buf, dtype, op.combining()))?;
        if self.topology.local_rank == 0 {
            self.allreduce_across(buf, dtype, op)?;
        }
        on_shm(self.shm.broadcast(buf, 0))
    }
}
