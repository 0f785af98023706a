//! Execution of fused groups on a channel: packing into the channel's fusion buffer, the
//! collective, unpacking, completion.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use fh_core::kernels;
use fh_core::message::{CollectiveKind, Signature};
use fh_core::ReduceOp;
use fh_transport::{algorithms, CollectivesExt, Communicator, TransportError};

use collective::{
    finish_divisor, from_u64s, recv_layout, reduce_in_place, reduce_segments, reduce_unfinished,
    row_bytes, u64s,
};

use crate::job::Job;

mod collective;
#[cfg(feature = "cuda")]
mod device;
use crate::shared::Inner;
use crate::stats::Counters;
use crate::{SchedulerError, Tensor};

/// A channel: its communicator and its fusion buffer, reused across steps.
pub(crate) struct Executor {
    comm: Box<dyn Communicator>,
    buf: Vec<u8>,
    channel: usize,
    inner: Arc<Inner>,
    /// Time spent packing, in the collective and unpacking, for the timeline (fused groups
    /// only; staged groups interleave the three, so the timeline shows them as totals).
    phases: Option<(
        std::time::Duration,
        std::time::Duration,
        std::time::Duration,
    )>,
    /// The channel's device twin (GPU path open): runs the groups of device tensors.
    #[cfg(feature = "cuda")]
    device: Option<fh_transport::backend::cuda::DeviceChannel>,
    /// What the running group's agreeing allreduce answered ([`Job::agree`]); `None` until it
    /// ran.
    agreed: Option<bool>,
}

impl Executor {
    /// The executor of channel `channel` over its data communicator (and its device twin).
    pub(crate) fn new(
        comm: Box<dyn Communicator>,
        channel: usize,
        inner: Arc<Inner>,
        #[cfg(feature = "cuda")] device: Option<fh_transport::backend::cuda::DeviceChannel>,
    ) -> Executor {
        Executor {
            comm,
            buf: Vec::new(),
            channel,
            inner,
            phases: None,
            #[cfg(feature = "cuda")]
            device,
            agreed: None,
        }
    }

    /// Its channel's index.
    pub(crate) fn channel(&self) -> usize {
        self.channel
    }

    /// Tell the channel's peers that this rank gives up because `lost` was lost.
    pub(crate) fn abort(&mut self, lost: usize) {
        self.comm.abort(lost);
    }
}

impl Executor {
    /// Run one job; failures are delivered to its operations, and a communication failure
    /// also stops the engine.
    pub(crate) fn run(&mut self, job: Job) {
        if let Some(e) = self.inner.failure() {
            if let Some(c) = self.inner.counters.channels().get(self.channel) {
                let bytes: usize = job.parts.iter().map(|p| p.2).sum();
                c.queued.fetch_sub(bytes as u64, Ordering::Relaxed);
            }
            for (op, _, _) in &job.parts {
                op.part_done(Some(e.clone()));
            }
            return;
        }
        let begin = Instant::now();
        self.inner.flight.started(
            job.parts.iter().map(|(op, _, _)| op.rec),
            self.channel,
            begin,
        );
        let span = tracing::debug_span!("group", channel = self.channel, parts = job.parts.len());
        let _g = span.enter();
        self.phases = None;
        self.agreed = None;
        let mut result = self.execute(&job);
        // A group that agrees whether every rank can run it (its round skipped the can-run
        // step) is held, not delivered, when one cannot: the agreed fault stops the engine.
        let held = match (job.agree, &result) {
            (Some(_), Ok(())) => match self.agreed.take() {
                Some(agreed) => !agreed,
                None => {
                    result = Err(TransportError::Internal(
                        "a group that agrees whether every rank can run it ran no agreeing \
                         allreduce"
                            .into(),
                    ));
                    false
                }
            },
            _ => false,
        };
        let end = Instant::now();
        if let Some(tl) = self.inner.timeline() {
            if let Some((pack, reduce, unpack)) = self.phases {
                // Laid end to end from the group's start: a piece at a time interleaves them.
                let lane = self.channel + 1;
                let packed = (begin + pack).min(end);
                let reduced = (packed + reduce).min(end);
                let unpacked = (reduced + unpack).min(end);
                // A group reduced in place has no packing or unpacking to show.
                if !pack.is_zero() {
                    tl.span(lane, "pack", begin, packed);
                }
                tl.span(lane, "collective", packed, reduced);
                if !unpack.is_zero() {
                    tl.span(lane, "unpack", reduced, unpacked);
                }
            }
            if let Some((first, _, _)) = job.parts.first() {
                let names: Vec<String> = job
                    .parts
                    .iter()
                    .map(|(o, _, _)| o.name().to_string())
                    .collect();
                let bytes: usize = job.parts.iter().map(|p| p.2).sum();
                tl.group(self.channel + 1, first.sig().kind, names, bytes, begin, end);
            }
        }
        let bytes: usize = job.parts.iter().map(|p| p.2).sum();
        let bucket = crate::stats::group_bucket(bytes as u64);
        if let Some(n) = self.inner.counters.group_sizes.get(bucket) {
            Counters::add(n, 1);
        }
        if let Some(c) = self.inner.counters.channels().get(self.channel) {
            Counters::add(&c.bytes, bytes as u64);
            Counters::add(&c.groups, 1);
            Counters::add(
                &c.busy_nanos,
                end.saturating_duration_since(begin).as_nanos() as u64,
            );
            if c.queued.fetch_sub(bytes as u64, Ordering::Relaxed) == bytes as u64 {
                // This channel is free now: a round deferred under back-pressure may start.
                self.inner.channel_drained();
            }
        }
        let err = match result {
            Ok(()) => None,
            Err(e) => {
                // When the engine already stopped for an agreed reason (e.g. a fault every rank
                // reports), a collective broken by that stop reports the same reason.
                tracing::error!(channel = self.channel, error = %e, "collective failed; shutting the engine down");
                let se = self
                    .inner
                    .failure()
                    .filter(|f| !f.is_shutdown())
                    .unwrap_or_else(|| SchedulerError::from_transport_owned(e));
                self.inner.fail(se.clone());
                // Peers waiting for this rank on this channel blame the lost rank, not this one.
                if let Some(lost) = se.lost_rank() {
                    self.comm.abort(lost);
                }
                Some(se)
            }
        };
        if held {
            let resolvers: Vec<_> = job
                .parts
                .iter()
                .filter_map(|(op, _, _)| op.lock().resolver.take())
                .collect();
            self.inner.hold(resolvers);
            return;
        }
        for (op, _, _) in &job.parts {
            op.part_done(err.clone());
        }
    }

    /// Whether a fused group is reduced where its tensors lie ([`Executor::run_fused_in_place`])
    /// rather than through the fusion buffer ([`crate::Config::fused_in_place`]: under
    /// `fasthorovod`, on a transport that reduces slices in place for less,
    /// [`Communicator::segments_in_place`]; over the others it would copy more, not less), when every part is a whole tensor that
    /// is not split across channels and the group is large enough for the ring (smaller ones
    /// would be packed anyway, for recursive doubling). Decided from agreed facts only (the
    /// preset, the backend, the planned parts and the agreed sizes), so every rank runs the same
    /// collectives.
    fn in_place_ok(&self, job: &Job, sig: &Signature, bytes: usize) -> bool {
        job.agree.is_none()
            && job.parts.len() > 1
            && self.on_ring_in_place(sig, bytes)
            && job.parts.iter().all(|(op, off, len)| {
                *off == 0 && *len as u64 == op.sig().bytes() && op.chunks.get().is_none()
            })
    }

    /// Whether `bytes` of `sig`'s dtype are reduced in place on the ring, finished on this
    /// rank's block only ([`crate::Config::fused_in_place`] over this channel's transport, and
    /// large enough for the ring): from the agreed preset, backend and size, the same on every
    /// rank.
    fn on_ring_in_place(&self, sig: &Signature, bytes: usize) -> bool {
        let elements = bytes / sig.dtype.size().max(1);
        self.inner
            .config
            .fused_in_place(self.comm.segments_in_place())
            && algorithms::AllreduceAlgorithm::Auto.resolve(bytes, elements, self.comm.size())
                == algorithms::AllreduceAlgorithm::Ring
    }

    /// A fused group of host tensors reduced in place: the transport sends straight from the
    /// tensors and receives straight into them, and the average's division and the postscale
    /// run once, on this rank's block of the ring ([`algorithms::allreduce_segments`]). No
    /// fusion buffer, no packing and no unpacking.
    fn run_fused_in_place(&mut self, job: &Job, sig: &Signature) -> Result<(), TransportError> {
        // Taken out of their ops for the collective (a handle polled meanwhile sees it
        // running, not a lock held for the whole collective), and put back whatever happens.
        let mut tensors: Vec<Option<Tensor>> = job
            .parts
            .iter()
            .map(|(op, _, _)| op.lock().tensor.take())
            .collect();
        let t0 = Instant::now();
        Counters::add(&self.inner.counters.in_place_groups, 1);
        let result = if tensors.iter().any(Option::is_none) {
            Err(TransportError::Internal(
                "a fused tensor went missing".into(),
            ))
        } else {
            let mut segs: Vec<&mut [u8]> =
                tensors.iter_mut().flatten().map(|t| t.data_mut()).collect();
            reduce_segments(self.comm.as_mut(), &mut segs, sig, job.divisor)
        };
        for ((op, _, _), t) in job.parts.iter().zip(tensors) {
            if t.is_some() {
                op.lock().tensor = t;
            }
        }
        // For the timeline: all collective, no packing or unpacking.
        let zero = std::time::Duration::ZERO;
        self.phases = Some((zero, t0.elapsed(), zero));
        result
    }

    /// A fused group of host tensors, staged through the channel's fusion buffer a piece of
    /// at most the configured stage size at a time (`FH_STAGE_BYTES`, agreed at start-up, so
    /// every rank runs the same collectives): pack the piece, allreduce it, unpack and
    /// finalise it (average, postscale) in one pass. A piece small enough to stay in cache
    /// makes the fusion buffer's passes cache hits instead of a round trip through memory.
    fn run_fused(
        &mut self,
        job: &Job,
        sig: &Signature,
        bytes: usize,
    ) -> Result<(), TransportError> {
        let elem = sig.dtype.size().max(1);
        let stage = self.inner.config.stage_bytes as usize;
        // A group that agrees runs one allreduce (the agreement is in it): one piece.
        let piece = if stage == 0 || stage >= bytes || job.agree.is_some() {
            bytes
        } else {
            (stage / elem).max(1) * elem
        };
        // Every part must still hold its tensor: the ranks agreed to reduce all of them.
        let mut ends = Vec::with_capacity(job.parts.len());
        let mut total = 0usize;
        for (op, _, len) in &job.parts {
            if op.lock().tensor.is_none() {
                return Err(TransportError::Internal(
                    "a fused tensor went missing".into(),
                ));
            }
            total += *len;
            ends.push(total);
        }
        if total != bytes {
            return Err(TransportError::Internal(
                "a fused group's parts do not add up to its size".into(),
            ));
        }
        if bytes == 0 {
            // Nothing to reduce (every part empty), but a group that agrees still carries the
            // agreement: every rank takes part in it, as for any other size.
            if job.agree.is_some() {
                self.agreed = Some(reduce_unfinished(
                    self.comm.as_mut(),
                    &mut [],
                    sig,
                    job.agree,
                )?);
            }
            return Ok(());
        }
        if self.buf.len() < piece {
            self.buf.resize(piece, 0);
        }
        let n = finish_divisor(sig, job.divisor);
        let (mut packing, mut reducing, mut unpacking) = (
            std::time::Duration::ZERO,
            std::time::Duration::ZERO,
            std::time::Duration::ZERO,
        );
        // The parts overlapping bytes [a, z) of the group, from part `first` on: each with its
        // range in the part's tensor and its range in the fusion buffer.
        let overlapping = |first: usize, a: usize, z: usize| {
            job.parts[first..]
                .iter()
                .zip(&ends[first..])
                .take_while(move |((_, _, len), &end)| end - len < z)
                .map(move |((op, off, len), &end)| {
                    let start = end - len;
                    let (lo, hi) = (a.max(start), z.min(end));
                    (op, off + (lo - start)..off + (hi - start), lo - a..hi - a)
                })
        };
        let mut first_part = 0usize; // the first part overlapping the piece
        let mut a = 0usize;
        while a < bytes {
            let z = (a + piece).min(bytes);
            while ends[first_part] <= a {
                first_part += 1;
            }
            let t0 = Instant::now();
            for (op, src, dst) in overlapping(first_part, a, z) {
                if let Some(t) = &op.lock().tensor {
                    self.buf[dst].copy_from_slice(&t.data()[src]);
                }
            }
            let t1 = Instant::now();
            let agreed =
                reduce_unfinished(self.comm.as_mut(), &mut self.buf[..z - a], sig, job.agree)?;
            if job.agree.is_some() {
                self.agreed = Some(agreed);
                if !agreed {
                    return Ok(());
                }
            }
            let t2 = Instant::now();
            for (op, src, dst) in overlapping(first_part, a, z) {
                if let Some(t) = &mut op.lock().tensor {
                    kernels::copy_divide_and_scale(
                        sig.dtype,
                        &self.buf[dst],
                        &mut t.data_mut()[src],
                        n,
                        sig.postscale,
                    )?;
                }
            }
            packing += t1 - t0;
            reducing += t2 - t1;
            unpacking += t2.elapsed();
            a = z;
        }
        self.phases = Some((packing, reducing, unpacking));
        Ok(())
    }

    fn execute(&mut self, job: &Job) -> Result<(), TransportError> {
        let (first, off0, len0) = &job.parts[0];
        let sig = first.sig();
        let bytes: usize = job.parts.iter().map(|p| p.2).sum();
        Counters::add(&self.inner.counters.fused_groups, 1);
        Counters::add(&self.inner.counters.data_bytes, bytes as u64);
        if sig.device != fh_core::message::Device::Cpu {
            return self.execute_device(job, sig);
        }
        let comm = self.comm.as_mut();
        match sig.kind {
            CollectiveKind::Allreduce => {
                if let (1, Some(buf)) = (job.parts.len(), first.chunks.get()) {
                    // A chunk of a partitioned tensor: reduce it in place.
                    // SAFETY: this job is the only one given this chunk's range (see
                    // `ChunkedBuf`), and the tensor stays in its op until every chunk is done.
                    let chunk = unsafe { buf.range(*off0, *len0) }.ok_or_else(|| {
                        TransportError::Internal(format!(
                            "chunk {off0}+{len0} of '{}' out of range",
                            first.name()
                        ))
                    })?;
                    let own = self.on_ring_in_place(sig, *len0);
                    let agreed = reduce_in_place(
                        self.comm.as_mut(),
                        chunk,
                        sig,
                        job.divisor,
                        own,
                        job.agree,
                    )?;
                    self.agreed = job.agree.map(|_| agreed);
                    return Ok(());
                }
                let whole = job.parts.len() == 1
                    && *off0 == 0
                    && first.lock().tensor.as_ref().map(|t| t.data().len()) == Some(*len0);
                if whole {
                    // Single tensor: reduce in place, no copy.
                    let mut t = first.lock().tensor.take();
                    let r = match &mut t {
                        Some(t) => {
                            let own = self.on_ring_in_place(sig, *len0);
                            reduce_in_place(
                                self.comm.as_mut(),
                                t.data_mut(),
                                sig,
                                job.divisor,
                                own,
                                job.agree,
                            )
                        }
                        None => Ok(true),
                    };
                    first.lock().tensor = t;
                    self.agreed = job.agree.map(|_| matches!(r, Ok(true)));
                    return r.map(|_| ());
                }
                if self.in_place_ok(job, sig, bytes) {
                    return self.run_fused_in_place(job, sig);
                }
                self.run_fused(job, sig, bytes)
            }
            CollectiveKind::Broadcast => {
                let mut st = first.lock();
                if let Some(t) = &mut st.tensor {
                    comm.broadcast(t.data_mut(), sig.root as usize)?;
                }
                Ok(())
            }
            CollectiveKind::Barrier | CollectiveKind::Join => comm.barrier(),
            CollectiveKind::Allgather => {
                let mut st = first.lock();
                let Some(t) = st.tensor.take() else {
                    return Ok(());
                };
                let n = comm.size();
                let row = row_bytes(&t);
                let mut dims = vec![0u8; 8 * n];
                comm.allgather(&u64s(&[t.shape().first().copied().unwrap_or(1)]), &mut dims)?;
                let layout = from_u64s(&dims, n, "first dimensions")
                    .and_then(|dims| Ok((recv_layout(&dims, row)?, dims)));
                let ((counts, mut out), dims) = match layout {
                    Ok(l) => l,
                    Err(e) => {
                        st.tensor = Some(t);
                        return Err(e);
                    }
                };
                let r = comm.allgatherv(t.data(), &mut out, &counts);
                let mut shape = t.shape().to_vec();
                if shape.is_empty() {
                    shape.push(n);
                } else {
                    // Bounded by MAX_RECV_BYTES above (rows are at least one byte, or empty).
                    shape[0] = dims.iter().fold(0usize, |a, &d| a.saturating_add(d));
                }
                st.tensor = Some(Tensor::from_parts(t.dtype(), shape, out));
                if r.is_err() {
                    st.tensor = Some(t);
                }
                r
            }
            CollectiveKind::Alltoall => {
                let mut st = first.lock();
                let Some(t) = st.tensor.take() else {
                    return Ok(());
                };
                let n = comm.size();
                let row = row_bytes(&t);
                let dim0 = t.shape().first().copied().unwrap_or(1);
                let splits = st
                    .splits
                    .clone()
                    .unwrap_or_else(|| vec![dim0 / n.max(1); n]);
                let mut recv_splits = vec![0u8; 8 * n];
                comm.alltoall(&u64s(&splits), &mut recv_splits)?;
                let send_counts: Vec<usize> = splits.iter().map(|s| s * row).collect();
                let layout = from_u64s(&recv_splits, n, "splits")
                    .and_then(|splits| Ok((recv_layout(&splits, row)?, splits)));
                let ((recv_counts, mut out), recv_splits) = match layout {
                    Ok(l) => l,
                    Err(e) => {
                        st.tensor = Some(t);
                        return Err(e);
                    }
                };
                comm.alltoallv(t.data(), &send_counts, &mut out, &recv_counts)?;
                let mut shape = t.shape().to_vec();
                if shape.is_empty() {
                    shape.push(0);
                }
                shape[0] = recv_splits.iter().fold(0usize, |a, &d| a.saturating_add(d));
                st.tensor = Some(Tensor::from_parts(t.dtype(), shape, out));
                Ok(())
            }
            CollectiveKind::ReduceScatter => {
                let mut st = first.lock();
                let Some(t) = st.tensor.take() else {
                    return Ok(());
                };
                let n = comm.size();
                let me = comm.rank();
                let dim0 = t.shape().first().copied().unwrap_or(1);
                let row_elems = t.numel() / dim0.max(1);
                let rows: Vec<usize> = (0..n)
                    .map(|r| dim0 / n + usize::from(r < dim0 % n))
                    .collect();
                let counts: Vec<usize> = rows.iter().map(|r| r * row_elems).collect();
                let mut out = vec![0u8; counts[me] * sig.dtype.size()];
                // The input is not ours to change (it may be the caller's own memory):
                // prescale a copy.
                let scaled;
                let input: &[u8] = if sig.prescale != 1.0 {
                    let mut v = t.data().to_vec();
                    kernels::scale(sig.dtype, &mut v, sig.prescale)?;
                    scaled = v;
                    &scaled
                } else {
                    t.data()
                };
                comm.reduce_scatter(input, &mut out, &counts, sig.dtype, sig.op.combining())?;
                if sig.op == ReduceOp::Average {
                    kernels::divide(sig.dtype, &mut out, job.divisor.max(1))?;
                }
                kernels::scale(sig.dtype, &mut out, sig.postscale)?;
                let mut shape = t.shape().to_vec();
                if shape.is_empty() {
                    shape.push(rows[me]);
                } else {
                    shape[0] = rows[me];
                }
                st.tensor = Some(Tensor::from_parts(t.dtype(), shape, out));
                Ok(())
            }
        }
    }
}

impl Executor {
    /// A group of device tensors: through the channel's device twin.
    #[cfg(feature = "cuda")]
    fn execute_device(&mut self, job: &Job, sig: &Signature) -> Result<(), TransportError> {
        match self.device.as_mut() {
            Some(ch) => device::run_job(ch, job, sig),
            None => Err(TransportError::Internal(format!(
                "a group of {} tensors reached channel {} without a device \
                 channel",
                sig.device, self.channel
            ))),
        }
    }

    /// A group of device tensors in a build without the GPU path (refused at submission, so
    /// never reached; an error rather than a panic all the same).
    #[cfg(not(feature = "cuda"))]
    fn execute_device(&mut self, _job: &Job, sig: &Signature) -> Result<(), TransportError> {
        Err(TransportError::Internal(format!(
            "a group of {} tensors reached a build without the GPU path",
            sig.device
        )))
    }
}
