//! One negotiation round: the bit-vector AND of what is pending on every rank, then the
//! optional steps its flags ask for, in a fixed order (see the module above).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fh_core::bitvec::{BitVec, NegotiationVec, Status};
use fh_core::cache::Lookup;
use fh_core::fusion::PlanMode;
use fh_core::message::{Request, Response};
use fh_core::{wire, ReduceOp};

use crate::negotiate::coordinator::refused_while_joined;
use crate::negotiate::{collect, fault, shutdown};
use crate::stats::Counters;
use crate::{SchedulerError, Tensor};

use super::eager::Riding;
use super::waiting::Announce;
use super::Control;

/// This rank's side of a round (step 1): its vector, and the cache slots whose signature
/// changed here.
struct LocalBits {
    vec: NegotiationVec,
    invalid: Vec<usize>,
    cap: usize,
    channel_bits: usize,
    /// The small allreduces riding in the round: this rank's data where its bit is set
    /// (zeros elsewhere); after the round, the reduced bytes.
    eager: Vec<u8>,
}

/// The shortest time between two flight records written for disagreeing tensors.
const MISMATCH_RECORD_EVERY: Duration = Duration::from_secs(1);

impl Control {
    /// Channel bits in the round's vector: one per data channel under the FastHorovod planner
    /// (the same count on every rank: it is part of the start-up agreement), none otherwise.
    pub(super) fn channel_bits(&self) -> usize {
        match self.plan.opts.mode {
            PlanMode::Fast => self.plan.opts.channels,
            PlanMode::Horovod => 0,
        }
    }

    pub(super) fn add_bytes(&self, n: usize) {
        Counters::add(&self.inner.counters.negotiation_bytes_sent, n as u64);
    }

    /// One negotiation round, as a list of its steps (each below). Returns `Some(reason)`
    /// when the job shuts down.
    pub(super) fn round(&mut self) -> Result<Option<String>, SchedulerError> {
        let start = Instant::now();
        self.pacing.last_round = start;
        self.pacing.fresh = false;
        let span = tracing::trace_span!("round", rank = self.inner.rank);
        let _g = span.enter();

        let mut local = self.classify_pending(start)?;
        let agreed = self.agree_on_bits(&mut local)?;
        if agreed.status(Status::Fault) {
            return Err(self.stop_on_agreed_fault()?);
        }
        if agreed.status(Status::Shutdown) {
            return self.agree_on_shutdown().map(Some);
        }
        if agreed.status(Status::Trace) && agreed.status(Status::Pending) {
            self.report_readiness()?;
        }
        let joined_changed = self.update_joined(&agreed)?;
        let all_joined = self.join.set.iter().all(|&j| j);
        let evicted = self.evict_invalidated(&agreed, &local.invalid)?;
        let mut ready = self.ready_from_cache(&agreed, &evicted, all_joined);
        // Before the coordinator inserts anything: riders are the responses cached as the
        // round began.
        let riders = self.take_riders(&mut ready, &local.eager);
        let coordinate = agreed.status(Status::Uncached) || !evicted.is_empty() || joined_changed;
        if coordinate {
            self.coordinate_uncached(&mut ready, start)?;
        } else {
            Counters::add(&self.inner.counters.bitvector_rounds, 1);
        }
        if agreed.status(Status::Stalled) {
            // Ages as of now: the round may have waited a heartbeat for an idle rank.
            self.inspect_stall(Instant::now())?;
        }
        if all_joined {
            self.complete_join();
        }
        self.record_negotiation(start, &ready, &riders, coordinate);
        let rode = !riders.is_empty();
        self.complete_riders(riders, &local.eager);
        // Grouped members wait for the rest of their group; plan and dispatch.
        self.pacing.last_progress = rode || !ready.is_empty();
        let ready = self.release_groups(ready);
        if !ready.is_empty() {
            self.dispatch(ready)?;
        }
        Ok(None)
    }

    /// Step 1: classify what is pending here into this rank's vector: cache slots ready,
    /// slots whose signature changed, channels idle, and the status flags.
    fn classify_pending(&mut self, start: Instant) -> Result<LocalBits, SchedulerError> {
        let cap = self.cache.capacity();
        let channel_bits = self.channel_bits();
        let mut vec = NegotiationVec::with_channels(cap, channel_bits);
        self.eager.refresh(&self.cache);
        let mut eager = vec![0u8; self.eager.len()];
        for (c, ch) in self.inner.counters.channels().iter().enumerate() {
            vec.set_idle(c, ch.queued.load(Ordering::Relaxed) == 0);
        }
        let mut uncached = false;
        let mut invalid = Vec::new();
        let mut oldest = Duration::ZERO;
        for p in self.work.pending.values() {
            oldest = oldest.max(start.saturating_duration_since(p.entry.submitted));
            if p.state == Announce::Held {
                continue;
            }
            match self.cache.lookup(
                &p.entry.req.name,
                &p.entry.req.sig,
                p.entry.req.group.as_ref(),
            ) {
                Lookup::Hit(slot) => {
                    vec.set_slot(slot, true);
                    self.eager.fill(&mut eager, slot, p.entry.tensor.data())?;
                }
                Lookup::Changed(slot) => invalid.push(slot),
                Lookup::Miss => uncached |= p.state == Announce::New,
            }
        }
        if self.join.active {
            // A joined rank is ready for every cached response: an allreduce its zeros are
            // right for runs with them, any other fails on the ranks that submitted it (step 6),
            // rather than wait forever for this rank's bit.
            for slot in 0..cap {
                if self.cache.get(slot).is_some() {
                    vec.set_slot(slot, true);
                }
            }
        }
        let stall_due = self.inner.config.stall_check.is_some_and(|d| {
            oldest >= d && start.saturating_duration_since(self.pacing.last_stall_check) >= d
        });
        vec.set_status(Status::Shutdown, self.shutdown.asked);
        vec.set_status(Status::Uncached, uncached);
        vec.set_status(Status::Invalidated, !invalid.is_empty());
        vec.set_status(Status::Stalled, stall_due);
        vec.set_status(Status::Joined, self.join.active);
        vec.set_status(Status::Pending, !self.work.pending.is_empty());
        vec.set_status(Status::Fault, self.fault.is_some());
        vec.set_status(Status::Trace, self.tracing());
        Ok(LocalBits {
            vec,
            invalid,
            cap,
            channel_bits,
            eager,
        })
    }

    /// Step 2: the bit-vector AND of every rank's vector, in the same collective as the
    /// riders' data (reduced in place in `local.eager`); notes which channels are idle on
    /// every rank.
    fn agree_on_bits(&mut self, local: &mut LocalBits) -> Result<NegotiationVec, SchedulerError> {
        let mut bytes = local.vec.to_bytes();
        self.add_bytes(bytes.len() + 16 + local.eager.len());
        collect::reduce_bits_with(
            self.comm.as_mut(),
            &mut bytes,
            ReduceOp::BitAnd,
            self.incarnation,
            &mut local.eager,
            self.eager.parts(),
        )?;
        let agreed =
            NegotiationVec::from_bytes_with_channels(&bytes, local.cap, local.channel_bits)
                .ok_or_else(|| SchedulerError::internal("negotiation vector length"))?;
        self.plan.idle_channels = agreed.idle_mask();
        Counters::add(&self.inner.counters.rounds, 1);
        Ok(agreed)
    }

    /// Some rank raised a fault: every rank agrees on one error and records it before any rank
    /// stops its channels (a peer still in a collective with a stopped rank then reports this
    /// error, not a lost rank). Returns the error the round ends with.
    fn stop_on_agreed_fault(&mut self) -> Result<SchedulerError, SchedulerError> {
        let err = self.agree_on_fault()?;
        self.inner.fail(err.clone());
        self.comm.barrier()?;
        Ok(err)
    }

    /// Some rank shuts down: every rank learns who asked and why (one exchange, at the end of
    /// the job).
    fn agree_on_shutdown(&mut self) -> Result<String, SchedulerError> {
        let mine = shutdown::encode(self.shutdown.asked, self.shutdown.reason.as_deref());
        self.add_bytes(mine.len());
        let all = collect::allgather_blobs(self.comm.as_mut(), &mine, self.incarnation)?;
        let inner = &self.inner;
        Ok(shutdown::describe(&all, inner.rank, |r| {
            inner.world_rank(r)
        }))
    }

    /// Step 4: the joined ranks (nothing exchanged, and nothing allocated, while nobody has
    /// joined). Returns whether the joined set changed.
    fn update_joined(&mut self, agreed: &NegotiationVec) -> Result<bool, SchedulerError> {
        let size = self.inner.size;
        if !agreed.status(Status::Joined) {
            if self.join.set.iter().any(|&j| j) {
                self.join.set.iter_mut().for_each(|j| *j = false);
                return Ok(true);
            }
            return Ok(false);
        }
        let mut jv = BitVec::zeros(size);
        jv.set(self.inner.rank, self.join.active);
        let jv = self.agree_on_union(jv, size, "joined")?;
        let now: Vec<bool> = (0..size).map(|r| jv.get(r)).collect();
        // Every rank sees the same joined vectors, so every rank names the same last rank.
        if let Some(r) = (0..size)
            .rev()
            .find(|&r| now[r] && !self.join.set.get(r).copied().unwrap_or(false))
        {
            self.join.last = Some(r);
        }
        let changed = now != self.join.set;
        self.join.set = now;
        Ok(changed)
    }

    /// The union (bitwise OR) of every rank's `bits` of length `len`, in one exchange; `what`
    /// names the vector in the internal error a wrong length would be.
    fn agree_on_union(
        &mut self,
        bits: BitVec,
        len: usize,
        what: &str,
    ) -> Result<BitVec, SchedulerError> {
        let mut b = bits.to_bytes();
        self.add_bytes(b.len() + 16);
        collect::reduce_bits(
            self.comm.as_mut(),
            &mut b,
            ReduceOp::BitOr,
            self.incarnation,
        )?;
        BitVec::from_bytes(&b, len)
            .ok_or_else(|| SchedulerError::internal(format!("{what} vector length")))
    }

    /// Step 5: slots whose signature changed on some rank are dropped on every rank. Returns
    /// the slots dropped.
    fn evict_invalidated(
        &mut self,
        agreed: &NegotiationVec,
        invalid: &[usize],
    ) -> Result<Vec<usize>, SchedulerError> {
        let mut evicted = Vec::new();
        if !agreed.status(Status::Invalidated) {
            return Ok(evicted);
        }
        let cap = self.cache.capacity();
        let mut iv = BitVec::zeros(cap);
        for &s in invalid {
            iv.set(s, true);
        }
        let iv = self.agree_on_union(iv, cap, "invalidation")?;
        for s in iv.ones() {
            self.cache.evict(s);
            evicted.push(s);
        }
        Ok(evicted)
    }

    /// Step 6: the responses ready on every rank from the cache, in slot order (sharing the
    /// cached response: a reference count, no copy). A response a joined rank cannot take
    /// part in fails here, the same on every rank.
    fn ready_from_cache(
        &mut self,
        agreed: &NegotiationVec,
        evicted: &[usize],
        all_joined: bool,
    ) -> Vec<Arc<Response>> {
        let mut ready: Vec<Arc<Response>> = Vec::new();
        if !all_joined {
            let joined_ranks = self.joined_world_ranks();
            for slot in agreed.pending_slots() {
                if evicted.contains(&slot) {
                    continue;
                }
                let Some(r) = self.cache.get(slot).map(Arc::clone) else {
                    continue;
                };
                self.cache.touch(slot);
                // The same decision on every rank: the response and the joined set are agreed.
                if let Some(e) = refused_while_joined(&r.sig, &joined_ranks) {
                    self.ready_times.take(&r.name);
                    self.fail_response(&r, SchedulerError::from_negotiation(&r.name, &e));
                    continue;
                }
                ready.push(r);
            }
        }
        Counters::add(&self.inner.counters.cache_hits, ready.len() as u64);
        ready
    }

    /// Step 7: the coordinator, when some rank has uncached names (or the joined set or the
    /// cache changed): this rank's new requests go out, the agreed responses come back into
    /// the cache and `ready`, and responses the ranks disagreed on fail on every rank (each
    /// rank writes its flight record then, at most once a second: a script may try
    /// disagreeing tensors in a loop).
    fn coordinate_uncached(
        &mut self,
        ready: &mut Vec<Arc<Response>>,
        start: Instant,
    ) -> Result<(), SchedulerError> {
        Counters::add(&self.inner.counters.coordinator_rounds, 1);
        let mut mine: Vec<Request> = Vec::new();
        for p in self.work.pending.values_mut() {
            if p.state == Announce::New
                && self.cache.lookup(
                    &p.entry.req.name,
                    &p.entry.req.sig,
                    p.entry.req.group.as_ref(),
                ) == Lookup::Miss
            {
                mine.push(p.entry.req.clone());
                p.state = Announce::Sent;
            }
        }
        let responses = self.coordinate(&mine)?;
        Counters::add(
            &self.inner.counters.coordinator_responses,
            responses.len() as u64,
        );
        let mut mismatch = None;
        for r in responses {
            if let Some(e) = &r.error {
                self.ready_times.take(&r.name);
                let err = SchedulerError::from_negotiation(&r.name, e);
                mismatch.get_or_insert_with(|| err.to_string());
                self.fail_response(&r, err);
                continue;
            }
            let r = Arc::new(r);
            self.cache.insert(Arc::clone(&r));
            ready.push(r);
        }
        if let Some(what) = mismatch {
            if self
                .last_mismatch_record
                .is_none_or(|t| start.saturating_duration_since(t) >= MISMATCH_RECORD_EVERY)
            {
                self.last_mismatch_record = Some(start);
                self.inner.dump_flight(&format!("ranks disagreed: {what}"));
            }
        }
        Ok(())
    }

    /// Step 9: every rank has joined: each `join()` completes with the last rank to join.
    fn complete_join(&mut self) {
        let last = self.join.last.take().unwrap_or(self.inner.rank) as i64;
        for c in self.work.join_cells.drain(..) {
            c.resolve(Ok(Tensor::from_slice(&[last])));
        }
        self.join.active = false;
    }

    /// The round's negotiation time in the counters, and in the timeline: the round, and each
    /// tensor agreed in it from the first rank's ready time.
    fn record_negotiation(
        &mut self,
        start: Instant,
        ready: &[Arc<Response>],
        riders: &[Riding],
        coordinate: bool,
    ) {
        let neg_end = Instant::now();
        Counters::add(
            &self.inner.counters.negotiation_nanos,
            neg_end.duration_since(start).as_nanos() as u64,
        );
        if let Some(tl) = self.inner.timeline() {
            if !ready.is_empty() || !riders.is_empty() || coordinate {
                tl.round(coordinate, ready.len() + riders.len(), start, neg_end);
            }
            for r in ready.iter().chain(riders.iter().map(|(r, _)| r)) {
                if let Some(times) = self.ready_times.take(&r.name) {
                    tl.negotiated(r.name.to_string(), times, neg_end);
                }
            }
        }
    }

    /// The ranks that have joined, as errors name them (world ranks).
    pub(super) fn joined_world_ranks(&self) -> Vec<usize> {
        (0..self.join.set.len())
            .filter(|&r| self.join.set[r])
            .map(|r| self.inner.world_rank(r))
            .collect()
    }

    /// A response that failed on every rank: its submission here (if any) fails with `err`,
    /// and so does the rest of its group. A rank that holds no part of the group (a joined
    /// rank, which never submitted it) remembers nothing, so that a later group of the same
    /// name is not failed by it.
    pub(super) fn fail_response(&mut self, r: &Response, err: SchedulerError) {
        let mine = self.work.by_name.contains_key(&*r.name)
            || r.group
                .as_ref()
                .is_some_and(|g| self.work.held.contains_key(&g.name));
        self.fail_name(&r.name, err.clone());
        if let Some(g) = &r.group {
            if mine || !self.join.active {
                self.fail_group(g, err);
            }
        }
    }

    /// Whether this rank asks for readiness reports: rank 0 while it writes a timeline. A
    /// timeline that ended on a write error is dropped here; without one, rank 0 forgets the
    /// ready times it collected.
    pub(super) fn tracing(&mut self) -> bool {
        if self.inner.rank != 0 {
            return false;
        }
        match self.inner.timeline() {
            Some(t) if t.is_live() => true,
            Some(t) => {
                self.inner.clear_timeline_if(&t);
                self.ready_times.clear();
                false
            }
            None => {
                self.ready_times.clear();
                false
            }
        }
    }

    /// The readiness report (rank 0 writes a timeline): every rank sends rank 0 the names it
    /// has newly pending (not reported before, not yet agreed) with how long ago each was
    /// submitted; rank 0 records, per name and rank, when it learned and that age. A gather to
    /// rank 0, as in the coordinator step.
    pub(super) fn report_readiness(&mut self) -> Result<(), SchedulerError> {
        let now = Instant::now();
        let mut mine = Vec::new();
        for p in self.work.pending.values_mut() {
            if !p.reported && p.state != Announce::Held {
                p.reported = true;
                let age = now.saturating_duration_since(p.entry.submitted);
                let micros = u64::try_from(age.as_micros()).unwrap_or(u64::MAX);
                mine.push((p.entry.req.name.to_string(), micros));
            }
        }
        let bytes = wire::encode_names(&mine);
        if self.inner.rank != 0 {
            self.add_bytes(bytes.len() + 16);
        }
        let Some(lists) = collect::gather_to_root(self.comm.as_mut(), &bytes, self.incarnation)?
        else {
            return Ok(());
        };
        let learned = Instant::now();
        for (r, b) in lists.iter().enumerate() {
            let report = wire::decode_names(b).map_err(|e| SchedulerError::Transport {
                lost_rank: Some(r),
                message: format!("rank {r} sent a malformed readiness report: {e}"),
                source: None,
            })?;
            self.ready_times.record(r, report, learned);
        }
        Ok(())
    }

    /// The coordinator step: every rank's new requests are gathered to rank 0 (O(N) bytes in
    /// all, not an allgather), which answers with the responses of the names now complete,
    /// broadcast to every rank.
    pub(super) fn coordinate(&mut self, mine: &[Request]) -> Result<Vec<Response>, SchedulerError> {
        let bytes = wire::encode_requests(mine);
        if self.inner.rank != 0 {
            self.add_bytes(bytes.len() + 16);
        }
        let mut out = Vec::new();
        if let Some(lists) = collect::gather_to_root(self.comm.as_mut(), &bytes, self.incarnation)?
        {
            for (r, list) in lists.iter().enumerate() {
                let reqs = wire::decode_requests(list).map_err(|e| SchedulerError::Transport {
                    lost_rank: Some(r),
                    message: format!("rank {r} sent a malformed request list: {e}"),
                    source: None,
                })?;
                for mut q in reqs {
                    q.rank = r as u32;
                    self.table.add(q);
                }
            }
            let responses = self.table.take_ready(&self.join.set);
            out = wire::encode_responses(&responses);
            self.add_bytes(out.len() + 16);
        }
        let out = collect::broadcast_blob(self.comm.as_mut(), out, self.incarnation)?;
        wire::decode_responses(&out).map_err(|e| SchedulerError::Transport {
            lost_rank: Some(0),
            message: format!("rank 0 sent a malformed response list: {e}"),
            source: None,
        })
    }

    /// Some rank raised the fault flag: every rank learns every rank's fault and stops with
    /// the same error, naming the lowest faulty rank, its tensor and what went wrong.
    pub(super) fn agree_on_fault(&mut self) -> Result<SchedulerError, SchedulerError> {
        let mine = fault::encode(self.fault.as_ref());
        self.add_bytes(mine.len() + 16);
        let all = collect::allgather_blobs(self.comm.as_mut(), &mine, self.incarnation)?;
        Ok(fault::agreed(&all, |r| self.inner.world_rank(r)))
    }
}
