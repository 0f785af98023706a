//! The unit of work a channel runs: a negotiated operation ([`Op`]) on its way through one or
//! more channels, and a fused group of parts of operations ([`Job`]). Built by the control
//! thread's dispatch, run by a channel's executor (`crate::exec`) or, for device tensors, by
//! the GPU path (`crate::gpu`); neither of those imports the other's types.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fh_core::message::{Response, Signature};

use crate::shared::Resolver;
use crate::{SchedulerError, Tensor};

/// What an operation holds while it runs: its tensor (taken back at the end), alltoall
/// splits, the first error of any of its parts, and the owner of its completion.
pub(crate) struct OpState {
    pub tensor: Option<Tensor>,
    pub splits: Option<Vec<usize>>,
    pub error: Option<SchedulerError>,
    /// `None` for the zero tensors a joined rank contributes. Taken by the last part; an op
    /// dropped before that (a job lost with its channel) resolves its handle through the
    /// resolver's drop.
    pub resolver: Option<Resolver>,
}

/// One negotiated operation on its way through a channel (possibly split over several).
pub(crate) struct Op {
    /// The agreed response (shared with the response cache: no copy per step).
    pub resp: Arc<Response>,
    /// Its flight-recorder number on this rank (0: none, e.g. a joined rank's zeros).
    pub rec: u64,
    pub state: Mutex<OpState>,
    /// Parts (chunks) not yet done.
    pub remaining: AtomicUsize,
    /// Set for an allreduce split into chunks that each run alone on a channel: its buffer,
    /// taken once at dispatch, so that every chunk is reduced in place, concurrently with the
    /// other chunks, without packing and unpacking.
    pub chunks: std::sync::OnceLock<ChunkedBuf>,
}

/// The buffer of an allreduce whose chunks run on several channels at once.
///
/// Each chunk job touches only its own byte range (the planner gives every byte to exactly one
/// part), and nothing else touches the tensor until its last part is done (the op's
/// `remaining` count, decremented with release/acquire ordering, hands the tensor back).
pub(crate) struct ChunkedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a `ChunkedBuf` is only turned into disjoint `&mut [u8]` ranges, one per chunk job,
// while the tensor it points into stays alive and untouched inside its `Op` (see above).
unsafe impl Send for ChunkedBuf {}
// SAFETY: as above; shared references only hand out disjoint ranges.
unsafe impl Sync for ChunkedBuf {}

impl ChunkedBuf {
    /// The buffer of `tensor`, taken once for all its chunks.
    pub(crate) fn of(tensor: &mut Tensor) -> Self {
        let d = tensor.data_mut();
        ChunkedBuf {
            ptr: std::ptr::NonNull::new(d.as_mut_ptr()).unwrap_or(std::ptr::NonNull::dangling()),
            len: d.len(),
        }
    }

    /// The chunk `off..off + len`, or `None` when out of range.
    ///
    /// # Safety
    /// No other live reference may overlap `off..off + len`: callers pass the range of their
    /// own chunk only, while the op's tensor is alive and not otherwise accessed.
    // Handing out `&mut` from `&self` is the point: each caller gets its own disjoint range.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, off: usize, len: usize) -> Option<&mut [u8]> {
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: in bounds (checked above) of a live allocation; exclusive per the contract.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) })
    }
}

impl Op {
    /// The tensor's name.
    pub(crate) fn name(&self) -> &str {
        &self.resp.name
    }

    /// The agreed signature.
    pub(crate) fn sig(&self) -> &Signature {
        &self.resp.sig
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One part finished; the last one completes the operation.
    pub(crate) fn part_done(&self, err: Option<SchedulerError>) {
        if let Some(e) = err {
            let mut st = self.lock();
            if st.error.is_none() {
                st.error = Some(e);
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut st = self.lock();
            let result = match (st.error.take(), st.tensor.take()) {
                (Some(e), _) => Err(e),
                (None, Some(t)) => Ok(t),
                (None, None) => Err(SchedulerError::internal(format!(
                    "'{}' lost its tensor",
                    self.name()
                ))),
            };
            let resolver = st.resolver.take();
            drop(st);
            if let Some(r) = resolver {
                r.resolve(result);
            }
        }
    }
}

/// A fused group for one channel.
pub(crate) struct Job {
    pub parts: Vec<(Arc<Op>, usize, usize)>,
    /// The `Average` divisor: every rank of the engine, joined ranks included (they contribute
    /// zeros), as Horovod divides by `size()`.
    pub divisor: usize,
    /// `Some(mine)`: the group is its round's only one, an allreduce of host tensors run on
    /// the negotiation thread's behalf, and its round skipped the can-run step; its one
    /// allreduce also agrees whether every rank can run it (`mine`: whether this rank can,
    /// [`fh_transport::Communicator::allreduce_agreeing`]). When one cannot, no rank delivers
    /// the result: the operations are held until the agreed fault stops the engine.
    pub agree: Option<bool>,
}
