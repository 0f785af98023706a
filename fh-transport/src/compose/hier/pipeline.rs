//! The lanes' allreduce as a pipeline of chunks: shared memory on the calling thread, the
//! cross-host TCP allreduce of each chunk on a scoped thread, so that they overlap
//! (`FH_HIER_PIPELINE`).

use std::sync::mpsc;

use fh_core::{kernels, DType, ReduceOp};

use super::{around, share, Group, HierComm, Marks, Side, Step};
use crate::{algorithms, Result, TransportError};

/// The chunks (element counts, in order) of the allreduce pipeline for `elements` elements of
/// `esz` bytes with chunks of about `chunk` bytes (0: no pipeline): one chunk when the buffer
/// is no larger than a chunk, else `ceil(bytes / chunk)` chunks of nearly equal size. From
/// sizes only, so the same on every rank.
pub(super) fn pipeline_chunks(elements: usize, esz: usize, chunk: usize) -> Vec<usize> {
    let bytes = elements * esz;
    if chunk == 0 || bytes <= chunk {
        return vec![elements];
    }
    let n = bytes.div_ceil(chunk).min(elements);
    (0..n).map(|i| share(elements, n, i)).collect()
}

impl HierComm {
    /// [`HierComm::lanes_with`] as a pipeline over `chunks` (element counts, in order): the
    /// calling thread runs the shared-memory steps, a scoped thread the cross-host allreduce of
    /// each chunk's block, so that chunk `k`'s allreduce over TCP overlaps the reduce-scatter
    /// of chunk `k + 1` and the allgather of chunk `k - 1`. Every step works on `buf` in place:
    /// the reduce-scatter leaves this rank's block of a chunk reduced where it lies, the TCP
    /// thread allreduces that block there, and the allgather fills the rest of the chunk around
    /// it. Each communicator is used by one thread; every rank runs the same steps in the same
    /// order (the chunking depends on sizes only). A failure on either side ends the other: the
    /// TCP thread stops when the calling thread stops feeding it, and the calling thread when
    /// the TCP thread stops answering (a local peer waiting for it meanwhile sees it waiting
    /// across hosts, [`Marks`]); the TCP side's error wins when both failed, as it would have
    /// come first without the pipeline.
    pub(super) fn lanes_pipelined(
        &mut self,
        buf: &mut [u8],
        staging: &mut [u8],
        chunks: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Step<()> {
        let (l, me) = (self.topology.local_size, self.topology.local_rank);
        let esz = dtype.size();
        let counts = |c: usize| -> Vec<usize> { (0..l).map(|i| share(c, l, i)).collect() };
        // Each chunk as (before this rank's block, the block, after it); with staging, a block
        // of `staging` per chunk too.
        let mut parts = Vec::with_capacity(chunks.len());
        let mut stages: Vec<&mut [u8]> = Vec::with_capacity(chunks.len());
        let (mut rest, mut rest_stage) = (buf, staging);
        for &c in chunks {
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(c * esz);
            parts.push(around(chunk, &counts(c), me, esz));
            rest = tail;
            if self.staged {
                let (stage, tail) =
                    std::mem::take(&mut rest_stage).split_at_mut(share(c, l, me) * esz);
                stages.push(stage);
                rest_stage = tail;
            }
        }
        let size = self.topology.size;
        let HierComm {
            tcp,
            shm,
            group,
            group_rank,
            host_of,
            topology,
            outside,
            staged,
            ..
        } = self;
        let staged = *staged;
        let marks = Marks {
            word: outside,
            host_of,
            host: topology.cross_rank,
        };
        let (to_tcp, tcp_in) = mpsc::channel::<&mut [u8]>();
        let (tcp_out, from_tcp) = mpsc::channel::<&mut [u8]>();
        let (shm_res, tcp_res) = std::thread::scope(|s| {
            let across = s.spawn(move || -> Result<()> {
                let mut g = Group {
                    inner: tcp,
                    members: group,
                    rank: *group_rank,
                    marks,
                };
                for block in tcp_in {
                    let r = algorithms::allreduce(&mut g, block, dtype, op.combining());
                    g.marks.clear();
                    r?;
                    if op == ReduceOp::Average {
                        kernels::divide(dtype, block, size)?;
                    }
                    if tcp_out.send(block).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            // `Ok(false)`: the TCP thread stopped answering (its error says why).
            let shm_res = (|| -> Result<bool> {
                // The blocks the TCP thread holds, in order (staged: this rank's blocks, to
                // copy the allreduced stage back into).
                let mut owns = std::collections::VecDeque::with_capacity(2);
                let mut stages = stages.into_iter();
                for k in 0..=chunks.len() {
                    if let Some(&c) = chunks.get(k) {
                        let (before, own, after) = &mut parts[k];
                        shm.reduce_scatter_in_place(
                            before,
                            own,
                            after,
                            &counts(c),
                            dtype,
                            op.combining(),
                        )?;
                        let own = std::mem::take(own);
                        let block = match stages.next() {
                            Some(stage) if staged => {
                                stage.copy_from_slice(own);
                                owns.push_back(own);
                                stage
                            }
                            _ => own,
                        };
                        if to_tcp.send(block).is_err() {
                            return Ok(false);
                        }
                    }
                    if k > 0 {
                        let j = k - 1;
                        let Ok(block) = from_tcp.recv() else {
                            return Ok(false);
                        };
                        let own: &mut [u8] = match owns.pop_front() {
                            Some(own) => {
                                own.copy_from_slice(block);
                                own
                            }
                            None => block,
                        };
                        let (before, _, after) = &mut parts[j];
                        let bytes: Vec<usize> = counts(chunks[j]).iter().map(|c| c * esz).collect();
                        shm.allgatherv_in_place(before, own, after, &bytes)?;
                    }
                }
                Ok(true)
            })();
            // Stop feeding the TCP thread: it ends after the blocks it holds.
            drop(to_tcp);
            let tcp_res = across.join().unwrap_or_else(|_| {
                Err(TransportError::Internal(
                    "the hierarchical allreduce's TCP thread panicked".into(),
                ))
            });
            (shm_res, tcp_res)
        });
        match (shm_res, tcp_res) {
            (_, Err(e)) => Err((Side::Tcp, e)),
            (Err(e), Ok(())) => Err((Side::Shm, e)),
            (Ok(true), Ok(())) => Ok(()),
            (Ok(false), Ok(())) => Err((
                Side::Tcp,
                TransportError::Internal(
                    "the hierarchical allreduce's TCP thread stopped without an error".into(),
                ),
            )),
        }
    }
}
