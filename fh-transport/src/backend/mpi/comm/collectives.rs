//! The MPI communicator's `Communicator` implementation: point-to-point messages and the
//! collectives, each on MPI's native call where the arguments fit MPI's `int` counts and on
//! the shared `algorithms` otherwise. Arguments are checked with the shared, overflow-checked
//! `algorithms::check_*`.

use std::ffi::{c_int, c_void};

use fh_core::{kernels, CoreError, DType, ReduceOp};
use mpi::ffi;

use super::{MpiComm, TAG_LAST, TAG_MORE};
use crate::backend::mpi::call::{chunk_ranges, int_counts, recv_ptr, send_ptr};
use crate::backend::mpi::runtime::{bytes_type, ThreadMode};
use crate::{algorithms, Communicator, Result};

impl Communicator for MpiComm {
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let peer = self.check_peer(peer)?;
        match self.rt().mode {
            ThreadMode::Multiple => {
                for (range, last) in chunk_ranges(data.len(), self.max_count) {
                    let part = &data[range];
                    let tag = if last { TAG_LAST } else { TAG_MORE };
                    // SAFETY: `part` is valid for reads of its length during the call.
                    let rc = unsafe {
                        ffi::MPI_Send(
                            send_ptr(part),
                            part.len() as c_int,
                            bytes_type(),
                            peer,
                            tag,
                            self.handle.raw,
                        )
                    };
                    self.check(rc, "MPI_Send", Some(peer as usize))?;
                }
                Ok(())
            }
            ThreadMode::Serialized => {
                let mut reqs = self.isend_all(peer, data)?;
                self.wait_all(&mut reqs, "MPI_Isend")
            }
        }
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let peer = self.check_peer(peer)?;
        self.recv_exact(peer, buf)
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        let to = self.check_peer(to)?;
        let from = self.check_peer(from)?;
        let mut reqs = self.isend_all(to, send)?;
        let received = self.recv_exact(from, recv);
        // The sends borrow `send`: complete them whatever the receive did.
        let sent = self.wait_all(&mut reqs, "MPI_Isend");
        received.and(sent)
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        algorithms::check_reduction("allreduce", dtype, op, buf.len())?;
        if self.size > 1 && !buf.is_empty() {
            let (datatype, mop) = self
                .rt()
                .native(dtype, op)
                .ok_or(CoreError::UnsupportedOp { op, dtype })?;
            let esz = dtype.size();
            let comm = self.handle.raw;
            let in_place = self.rt().in_place.pointer();
            for chunk in buf.chunks_mut(self.max_count * esz) {
                let count = (chunk.len() / esz) as c_int;
                let copy;
                let send: *const c_void = match in_place {
                    Some(p) => p,
                    None => {
                        copy = chunk.to_vec();
                        copy.as_ptr().cast()
                    }
                };
                let recv: *mut c_void = recv_ptr(chunk);
                self.run(
                    "MPI_Allreduce",
                    // SAFETY: `send` is MPI_IN_PLACE or a copy of `chunk`, `recv` is `chunk`;
                    // both hold `count` elements of `datatype` and outlive the call.
                    &mut || unsafe { ffi::MPI_Allreduce(send, recv, count, datatype, mop, comm) },
                    // SAFETY: as above; the request is waited before the buffers go.
                    &mut |req| unsafe {
                        ffi::MPI_Iallreduce(send, recv, count, datatype, mop, comm, req)
                    },
                )?;
                self.check_half_op(dtype, "MPI_Allreduce")?;
            }
        }
        if op == ReduceOp::Average {
            kernels::divide(dtype, buf, self.size)?;
        }
        Ok(())
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        algorithms::check_allgatherv(send.len(), recv.len(), counts, self.rank, self.size)?;
        let Some((cs, ds)) = int_counts(counts, self.max_count) else {
            return algorithms::allgatherv(self, send, recv, counts);
        };
        let comm = self.handle.raw;
        let (sp, sn) = (send_ptr(send), send.len() as c_int);
        let rp = recv_ptr(recv);
        let bt = bytes_type();
        self.run(
            "MPI_Allgatherv",
            // SAFETY: buffers and count arrays match the validated layout and outlive the call.
            &mut || unsafe {
                ffi::MPI_Allgatherv(sp, sn, bt, rp, cs.as_ptr(), ds.as_ptr(), bt, comm)
            },
            // SAFETY: as above; the request is waited before the buffers go.
            &mut |req| unsafe {
                ffi::MPI_Iallgatherv(sp, sn, bt, rp, cs.as_ptr(), ds.as_ptr(), bt, comm, req)
            },
        )
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        crate::algorithms::check_root(root, self.size)?;
        if self.size == 1 {
            return Ok(());
        }
        let root = root as c_int;
        let comm = self.handle.raw;
        let bt = bytes_type();
        for chunk in buf.chunks_mut(self.max_count) {
            let (p, n) = (recv_ptr(chunk), chunk.len() as c_int);
            self.run(
                "MPI_Bcast",
                // SAFETY: `chunk` holds `n` bytes and outlives the call.
                &mut || unsafe { ffi::MPI_Bcast(p, n, bt, root, comm) },
                // SAFETY: as above; the request is waited before the buffer goes.
                &mut |req| unsafe { ffi::MPI_Ibcast(p, n, bt, root, comm, req) },
            )?;
        }
        Ok(())
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (send_len, recv_len) = (send.len(), recv.len());
        algorithms::check_alltoallv(
            send_len,
            send_counts,
            recv_len,
            recv_counts,
            self.rank,
            self.size,
        )?;
        if self.rt().mode == ThreadMode::Serialized {
            // Open MPI 4.1's MPI_Ialltoallv (libnbc) was seen to leave the communicator unable
            // to complete the next nonblocking collective; a pairwise exchange over MPI
            // point-to-point is what it would do anyway.
            return algorithms::alltoallv(self, send, send_counts, recv, recv_counts);
        }
        let native =
            int_counts(send_counts, self.max_count).zip(int_counts(recv_counts, self.max_count));
        // Only this rank knows whether its counts fit MPI's `int`s: agree on the path first.
        let mut all_native = [u8::from(native.is_some())];
        self.allreduce(&mut all_native, DType::Bool, ReduceOp::BitAnd)?;
        let Some(((sc, sd), (rc, rd))) = native.filter(|_| all_native[0] != 0) else {
            return algorithms::alltoallv(self, send, send_counts, recv, recv_counts);
        };
        let comm = self.handle.raw;
        let sp = send_ptr(send);
        let rp = recv_ptr(recv);
        let bt = bytes_type();
        self.run(
            "MPI_Alltoallv",
            // SAFETY: buffers and count arrays match the validated layout and outlive the call.
            &mut || unsafe {
                ffi::MPI_Alltoallv(
                    sp,
                    sc.as_ptr(),
                    sd.as_ptr(),
                    bt,
                    rp,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    bt,
                    comm,
                )
            },
            // SAFETY: as above; the request is waited before the buffers go.
            &mut |req| unsafe {
                ffi::MPI_Ialltoallv(
                    sp,
                    sc.as_ptr(),
                    sd.as_ptr(),
                    bt,
                    rp,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    bt,
                    comm,
                    req,
                )
            },
        )
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (send_len, recv_len) = (send.len(), recv.len());
        algorithms::check_reduce_scatter(
            send_len, recv_len, counts, self.rank, self.size, dtype, op,
        )?;
        if self.size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let Some((cs, _)) = int_counts(counts, self.max_count) else {
            return algorithms::reduce_scatter(self, send, recv, counts, dtype, op);
        };
        let (datatype, mop) = self
            .rt()
            .native(dtype, op)
            .ok_or(CoreError::UnsupportedOp { op, dtype })?;
        let comm = self.handle.raw;
        let sp = send_ptr(send);
        let rp = recv_ptr(recv);
        if cs.iter().all(|&c| c == cs[0]) {
            let n = cs[0];
            self.run(
                "MPI_Reduce_scatter_block",
                // SAFETY: `send` holds size*n and `recv` n elements (validated above).
                &mut || unsafe { ffi::MPI_Reduce_scatter_block(sp, rp, n, datatype, mop, comm) },
                // SAFETY: as above; the request is waited before the buffers go.
                &mut |req| unsafe {
                    ffi::MPI_Ireduce_scatter_block(sp, rp, n, datatype, mop, comm, req)
                },
            )?;
        } else {
            self.run(
                "MPI_Reduce_scatter",
                // SAFETY: `send` holds sum(counts) and `recv` counts[rank] elements.
                &mut || unsafe {
                    ffi::MPI_Reduce_scatter(sp, rp, cs.as_ptr(), datatype, mop, comm)
                },
                // SAFETY: as above; the request is waited before the buffers go.
                &mut |req| unsafe {
                    ffi::MPI_Ireduce_scatter(sp, rp, cs.as_ptr(), datatype, mop, comm, req)
                },
            )?;
        }
        self.check_half_op(dtype, "MPI_Reduce_scatter")?;
        if op == ReduceOp::Average {
            kernels::divide(dtype, recv, self.size)?;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        let comm = self.handle.raw;
        self.run(
            "MPI_Barrier",
            // SAFETY: `comm` is a valid communicator.
            &mut || unsafe { ffi::MPI_Barrier(comm) },
            // SAFETY: as above.
            &mut |req| unsafe { ffi::MPI_Ibarrier(comm, req) },
        )
    }
}
