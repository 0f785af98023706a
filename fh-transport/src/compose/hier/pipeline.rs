//! The lanes' allreduce as a pipeline of chunks: shared memory on the calling thread, the
//! cross-host TCP allreduce of each chunk on a scoped thread, so that they overlap
//! (`FH_HIER_PIPELINE`).

use std::sync::mpsc;

use fh_core::{DType, ReduceOp};

use super::slices::{around, cut_at, share, shared};
use super::{Group, HierComm, Marks, Side, Step};
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
    /// [`HierComm::allreduce_lanes`] as a pipeline over `chunks` (element counts, in order): the
    /// calling thread runs the shared-memory steps, a scoped thread the cross-host allreduce of
    /// each chunk's block, so that chunk `k`'s allreduce over TCP overlaps the reduce-scatter
    /// of chunk `k + 1` and the allgather of chunk `k - 1`. Every step works on `segs` in place:
    /// the reduce-scatter leaves this rank's block of a chunk reduced where it lies, the TCP
    /// thread allreduces (and `finish`es) that block there, and the allgather fills the rest of
    /// the chunk around it. Each communicator is used by one thread; every rank runs the same
    /// steps in the same order (the chunking depends on sizes only). A failure on either side
    /// ends the other: the TCP thread stops when the calling thread stops feeding it, and the
    /// calling thread when the TCP thread stops answering (a local peer waiting for it
    /// meanwhile sees it waiting across hosts, [`Marks`]); the TCP side's error wins when both
    /// failed, as it would have come first without the pipeline.
    pub(super) fn lanes_pipelined(
        &mut self,
        segs: Vec<&mut [u8]>,
        chunks: &[usize],
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Step<()> {
        let (l, me) = (self.topology.local_size, self.topology.local_rank);
        let esz = dtype.size();
        let counts = |c: usize| -> Vec<usize> { (0..l).map(|i| share(c, l, i)).collect() };
        let mut parts = Vec::with_capacity(chunks.len());
        let mut rest = segs;
        for &c in chunks {
            let (chunk, tail) = cut_at(rest, c * esz);
            parts.push(around(chunk, &counts(c), me, esz));
            rest = tail;
        }
        // Staged ([`super::STAGED_VAR`]): a block of `staging` per chunk for the TCP step.
        let mut staging = std::mem::take(&mut self.staging);
        let need = if self.staged {
            chunks.iter().map(|&c| share(c, l, me) * esz).sum()
        } else {
            0
        };
        if staging.len() < need {
            staging.resize(need, 0);
        }
        let mut stages: Vec<&mut [u8]> = Vec::with_capacity(chunks.len());
        let mut rest_stage = &mut staging[..need];
        if self.staged {
            for &c in chunks {
                let (stage, tail) =
                    std::mem::take(&mut rest_stage).split_at_mut(share(c, l, me) * esz);
                stages.push(stage);
                rest_stage = tail;
            }
        }
        let HierComm {
            tcp,
            shm,
            group,
            group_rank,
            host_of,
            topology,
            outside,
            ..
        } = self;
        let marks = Marks {
            word: outside,
            host_of,
            host: topology.cross_rank,
        };
        let (shm_res, tcp_res) = std::thread::scope(|s| {
            let (to_tcp, tcp_in) = mpsc::channel::<Vec<&mut [u8]>>();
            let (tcp_out, from_tcp) = mpsc::channel::<Vec<&mut [u8]>>();
            let across = s.spawn(move || -> Result<()> {
                let mut g = Group {
                    inner: tcp,
                    members: group,
                    rank: *group_rank,
                    marks,
                };
                for mut block in tcp_in {
                    let r = algorithms::allreduce_segments(&mut g, &mut block, dtype, op, finish);
                    g.marks.clear();
                    r?;
                    if tcp_out.send(block).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            // `Ok(false)`: the TCP thread stopped answering (its error says why).
            let shm_res = (|| -> Result<bool> {
                // Staged: the blocks whose copies the TCP thread holds, in order.
                let mut owns = std::collections::VecDeque::with_capacity(2);
                let mut stages = stages.into_iter();
                for k in 0..=chunks.len() {
                    if let Some(&c) = chunks.get(k) {
                        let p = &mut parts[k];
                        shm.reduce_scatter_in_place(
                            &shared(&p.before),
                            &mut p.own,
                            &shared(&p.after),
                            &counts(c),
                            dtype,
                            op,
                        )?;
                        let own = std::mem::take(&mut p.own);
                        let block = match stages.next() {
                            Some(stage) => {
                                let mut at = 0;
                                for s in &own {
                                    stage[at..at + s.len()].copy_from_slice(s);
                                    at += s.len();
                                }
                                owns.push_back(own);
                                vec![stage]
                            }
                            None => own,
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
                        let own = match owns.pop_front() {
                            Some(mut own) => {
                                let mut at = 0;
                                for s in own.iter_mut() {
                                    s.copy_from_slice(&block[0][at..at + s.len()]);
                                    at += s.len();
                                }
                                own
                            }
                            None => block,
                        };
                        let p = &mut parts[j];
                        let bytes: Vec<usize> = counts(chunks[j]).iter().map(|c| c * esz).collect();
                        shm.allgatherv_in_place(
                            &mut p.before,
                            &shared(&own),
                            &mut p.after,
                            &bytes,
                        )?;
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
        self.staging = staging;
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
