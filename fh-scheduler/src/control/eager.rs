//! Small allreduces that ride in the negotiation round (`Config::eager_bytes`).
//!
//! A cached allreduce of host tensors small enough gets a place in every round's message,
//! beside the bit vector: each rank whose tensor is pending (its bit set) copies the data
//! there (prescaled), and the round's one collective reduces the bits (AND) and the data
//! (the tensor's op) together ([`fh_transport::Communicator::allreduce_parts`]). When the
//! agreed bit says the tensor was pending on every rank, every rank contributed its data to
//! that very reduction, so the tensor completes in the round: one collective's latency for a
//! small allreduce instead of a negotiation and then a collective. A slot whose bit is not
//! agreed carried partial data, which nobody reads; the tensor rides again in a later round.
//!
//! Which slots ride, and where their bytes lie, is [`EagerLayout`]: a function of the cached
//! responses and their last use alone (the most recently used that qualify, while the bytes
//! last), hence the same on every rank, as the cache is. It is made again when the cache's
//! responses change and every [`RECHOOSE_ROUNDS`] rounds (every rank runs the same rounds), so
//! that names a job stopped using give their bytes to the ones it uses now. A joined rank contributes zeros (the section starts
//! zeroed), as it does to any allreduce it sits out; the ops zeros are wrong for are refused
//! while a rank is joined before anything rides (`ready_from_cache`).

use std::ops::Range;
use std::sync::Arc;

use fh_core::cache::ResponseCache;
use fh_core::message::{CollectiveKind, Device, Response};
use fh_core::{kernels, ReduceOp};
use fh_transport::algorithms::ReducePart;

use crate::stats::Counters;
use crate::{SchedulerError, Tensor};

use super::dispatch::e_id;
use super::Control;

/// A response agreed ready in a round that it rode in, with where its reduced bytes lie in the
/// round's section.
pub(super) type Riding = (Arc<Response>, Range<usize>);

/// Rounds after which the riders are chosen again by their last use.
pub(super) const RECHOOSE_ROUNDS: u32 = 64;

/// Every slot's bytes start at a multiple of this in the section (and take a multiple of it),
/// so that each part holds whole elements of any dtype.
const ALIGN: usize = 8;

/// One riding slot.
struct Rider {
    /// The cached response it stands for (the very one: a slot reused by another response is
    /// not this rider).
    resp: Arc<Response>,
    slot: usize,
    /// Where its bytes lie in the section; `bytes` of them are the tensor's.
    at: usize,
    bytes: usize,
}

/// Which cached responses ride in the rounds, and where (see the module).
pub(super) struct EagerLayout {
    budget: usize,
    /// The cache generation the riders were computed for (`None`: not yet).
    generation: Option<u64>,
    /// Rounds since they were computed.
    age: u32,
    riders: Vec<Rider>,
    /// Rider index by slot (`None`: the slot does not ride).
    by_slot: Vec<Option<u32>>,
    /// The section's length in bytes.
    len: usize,
    /// The section's parts, one per rider (made with the riders, not every round).
    parts: Vec<ReducePart>,
}

/// The bytes of a response that may ride: an allreduce of host tensors outside any group,
/// with an op the host kernels apply to its dtype, of at least one element.
fn rides(r: &Response) -> Option<usize> {
    let s = &r.sig;
    if r.error.is_some()
        || r.group.is_some()
        || s.kind != CollectiveKind::Allreduce
        || s.device != Device::Cpu
        || !kernels::supports(s.dtype, s.op)
    {
        return None;
    }
    s.shape
        .iter()
        .try_fold(s.dtype.size() as u64, |a, &d| a.checked_mul(d))
        .and_then(|b| usize::try_from(b).ok())
        .filter(|&b| b > 0)
}

impl EagerLayout {
    /// A layout that lets at most `budget` bytes ride (`0`: nothing ever rides).
    pub(super) fn new(budget: usize) -> Self {
        EagerLayout {
            budget,
            generation: None,
            age: 0,
            riders: Vec::new(),
            by_slot: Vec::new(),
            len: 0,
            parts: Vec::new(),
        }
    }

    /// Bring the layout up to date with `cache` at the start of a round: made again when the
    /// cache's responses changed, or every [`RECHOOSE_ROUNDS`] rounds.
    pub(super) fn refresh(&mut self, cache: &ResponseCache) {
        if self.budget == 0 {
            return;
        }
        self.age += 1;
        if self.generation == Some(cache.generation()) && self.age < RECHOOSE_ROUNDS {
            return;
        }
        self.generation = Some(cache.generation());
        self.age = 0;
        // The most recently used first (the slot breaks ties): what qualifies, while the
        // bytes last.
        let mut candidates: Vec<(u64, usize, usize)> = (0..cache.capacity())
            .filter_map(|slot| {
                let bytes = rides(cache.get(slot)?)?;
                Some((cache.last_used(slot)?, slot, bytes))
            })
            .collect();
        candidates.sort_unstable_by_key(|&(used, slot, _)| (std::cmp::Reverse(used), slot));
        let mut chosen = Vec::new();
        let mut room_left = self.budget;
        for (_, slot, bytes) in candidates {
            let room = bytes.div_ceil(ALIGN) * ALIGN;
            if room <= room_left {
                room_left -= room;
                chosen.push((slot, bytes));
            }
        }
        chosen.sort_unstable();
        self.riders.clear();
        self.parts.clear();
        self.by_slot.clear();
        self.by_slot.resize(cache.capacity(), None);
        self.len = 0;
        for (slot, bytes) in chosen {
            let Some(r) = cache.get(slot) else { continue };
            let room = bytes.div_ceil(ALIGN) * ALIGN;
            self.by_slot[slot] = Some(self.riders.len() as u32);
            self.riders.push(Rider {
                resp: Arc::clone(r),
                slot,
                at: self.len,
                bytes,
            });
            self.parts.push(ReducePart {
                len: room,
                dtype: r.sig.dtype,
                op: r.sig.op.combining(),
            });
            self.len += room;
        }
    }

    /// The section's length (0: nothing rides this round).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The section's parts for the round's reduction: each rider's op (an average sums; the
    /// division comes with the postscale, [`EagerLayout::finish`]).
    pub(super) fn parts(&self) -> &[ReducePart] {
        &self.parts
    }

    fn rider(&self, slot: usize) -> Option<&Rider> {
        let i = (*self.by_slot.get(slot)?)?;
        self.riders.get(i as usize)
    }

    /// Put this rank's `data` for the tensor cached in `slot` into `section`, prescaled;
    /// `false` when the slot does not ride.
    pub(super) fn fill(
        &self,
        section: &mut [u8],
        slot: usize,
        data: &[u8],
    ) -> Result<bool, SchedulerError> {
        let Some(r) = self.rider(slot) else {
            return Ok(false);
        };
        let dst = section
            .get_mut(r.at..r.at + r.bytes)
            .filter(|d| d.len() == data.len())
            .ok_or_else(|| {
                SchedulerError::internal(format!(
                    "'{}' has {} bytes but its cached response says {}",
                    r.resp.name,
                    data.len(),
                    r.bytes
                ))
            })?;
        dst.copy_from_slice(data);
        kernels::scale(r.resp.sig.dtype, dst, r.resp.sig.prescale)?;
        Ok(true)
    }

    /// Where the reduced bytes of `resp` lie in the section, when it is a rider (the very
    /// response the layout was made from).
    pub(super) fn range_of(&self, resp: &Arc<Response>, slot: usize) -> Option<Range<usize>> {
        self.rider(slot)
            .filter(|r| r.slot == slot && Arc::ptr_eq(&r.resp, resp))
            .map(|r| r.at..r.at + r.bytes)
    }

    /// Finish a rider's reduced bytes: the average's division by `size` and the postscale.
    pub(super) fn finish(
        resp: &Response,
        out: &mut [u8],
        size: usize,
    ) -> Result<(), SchedulerError> {
        let s = &resp.sig;
        let divisor = if s.op == ReduceOp::Average {
            size.max(1)
        } else {
            1
        };
        kernels::divide_and_scale(s.dtype, out, divisor, s.postscale)?;
        Ok(())
    }
}

impl Control {
    /// The round's riders, taken out of `ready` (the responses agreed ready from the cache,
    /// before the coordinator inserted anything): those that rode in this round's `section`.
    /// The same on every rank: the layout, the agreed bits and the ready list are.
    pub(super) fn take_riders(
        &mut self,
        ready: &mut Vec<Arc<Response>>,
        section: &[u8],
    ) -> Vec<Riding> {
        if section.is_empty() || ready.is_empty() {
            return Vec::new();
        }
        let mut riders = Vec::new();
        ready.retain(|r| {
            let range = self
                .cache
                .slot_of(&r.name)
                .and_then(|slot| self.eager.range_of(r, slot));
            match range {
                Some(range) => {
                    riders.push((Arc::clone(r), range));
                    false
                }
                None => true,
            }
        });
        riders
    }

    /// Complete the riders: each tensor submitted here gets its reduced bytes from `section`,
    /// finished (the average's division, the postscale). A joined rank, which contributed
    /// zeros, has nothing to complete. A rider whose bytes cannot be read (a broken invariant)
    /// fails here and raises the fault, so that every rank stops with its error.
    pub(super) fn complete_riders(&mut self, riders: Vec<Riding>, section: &[u8]) {
        if riders.is_empty() {
            return;
        }
        let now = std::time::Instant::now();
        let round = self
            .inner
            .counters
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed);
        for (r, range) in riders {
            let Some(seq) = self.work.by_name.remove(&*r.name) else {
                continue;
            };
            let Some(p) = self.work.pending.remove(&seq) else {
                continue;
            };
            let e = p.entry;
            let mut tensor: Tensor = e.tensor;
            let out = tensor.data_mut();
            let bytes = out.len();
            let result = match section.get(range).filter(|s| s.len() == out.len()) {
                Some(bytes) => {
                    out.copy_from_slice(bytes);
                    EagerLayout::finish(&r, out, self.inner.size).map(|()| tensor)
                }
                None => {
                    let what = "its bytes are not where the layout put them".to_string();
                    self.fault
                        .get_or_insert_with(|| (r.name.to_string(), what.clone()));
                    Err(SchedulerError::internal(format!(
                        "'{}' rode in a negotiation round but {what}",
                        r.name
                    )))
                }
            };
            self.inner.flight.negotiated(e.cell.record(), round, now);
            if let Some(tl) = self.inner.timeline() {
                tl.tensor_span(
                    e_id(&r.name, e.submitted),
                    r.name.to_string(),
                    "queued",
                    e.submitted,
                    now,
                );
            }
            if result.is_ok() {
                Counters::add(&self.inner.counters.eager_tensors, 1);
                Counters::add(&self.inner.counters.eager_bytes, bytes as u64);
            }
            e.cell.resolve(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fh_core::message::{GroupTag, Signature};
    use fh_core::DType;

    fn resp(name: &str, dtype: DType, len: u64, op: ReduceOp) -> Arc<Response> {
        Arc::new(Response {
            name: name.into(),
            sig: Signature {
                kind: CollectiveKind::Allreduce,
                dtype,
                shape: vec![len],
                device: Device::Cpu,
                op,
                root: 0,
                prescale: 1.0,
                postscale: 1.0,
            },
            priority: 0,
            group: None,
            error: None,
        })
    }

    /// Slots in order while the bytes last, each aligned; what does not qualify (too big for
    /// what is left, a broadcast, a device tensor, a group member) does not ride; the layout
    /// follows the cache's changes and nothing else.
    #[test]
    fn riders_are_a_function_of_the_cache() {
        let mut cache = ResponseCache::new(8);
        let a = resp("a", DType::F32, 1, ReduceOp::Sum); // 4 bytes, room 8
        let b = resp("b", DType::F64, 3, ReduceOp::Average); // 24
        let big = resp("big", DType::F32, 100, ReduceOp::Sum); // 400: over what is left
        let mut bcast = Response::clone(&resp("bcast", DType::F32, 1, ReduceOp::Sum));
        bcast.sig.kind = CollectiveKind::Broadcast;
        let mut dev = Response::clone(&resp("dev", DType::F32, 1, ReduceOp::Sum));
        dev.sig.device = Device::Gpu(0);
        let mut member = Response::clone(&resp("member", DType::F32, 1, ReduceOp::Sum));
        member.group = Some(GroupTag {
            name: "g".into(),
            index: 0,
            size: 2,
        });
        let c = resp("c", DType::I32, 2, ReduceOp::Max); // 8
        for r in [
            Arc::clone(&a),
            Arc::clone(&b),
            big,
            Arc::new(bcast),
            Arc::new(dev),
            Arc::new(member),
            Arc::clone(&c),
        ] {
            cache.insert(r);
        }
        let mut l = EagerLayout::new(48);
        l.refresh(&cache);
        assert_eq!(l.len(), 8 + 24 + 8);
        let parts = l.parts();
        assert_eq!(
            parts,
            vec![
                ReducePart {
                    len: 8,
                    dtype: DType::F32,
                    op: ReduceOp::Sum
                },
                ReducePart {
                    len: 24,
                    dtype: DType::F64,
                    op: ReduceOp::Sum
                },
                ReducePart {
                    len: 8,
                    dtype: DType::I32,
                    op: ReduceOp::Max
                },
            ]
        );
        assert_eq!(l.range_of(&a, 0), Some(0..4));
        assert_eq!(l.range_of(&b, 1), Some(8..32));
        assert_eq!(l.range_of(&c, 6), Some(32..40));
        for slot in 2..6 {
            assert!(l.rider(slot).is_none(), "slot {slot} rides");
        }
        // Another response in a rider's slot is not the rider.
        let other = resp("a", DType::F32, 1, ReduceOp::Sum);
        assert_eq!(l.range_of(&other, 0), None);
        // Filling: the data lands prescaled at the rider's place; a wrong length is refused.
        let mut section = vec![0u8; l.len()];
        assert!(l
            .fill(&mut section, 6, bytemuck::cast_slice(&[7i32, -1]))
            .unwrap());
        assert_eq!(&section[32..40], bytemuck::cast_slice::<i32, u8>(&[7, -1]));
        assert!(!l.fill(&mut section, 2, &[0u8; 400]).unwrap());
        assert!(l.fill(&mut section, 0, &[0u8; 8]).is_err());
        // Evicting a rider makes room for what comes after it.
        cache.evict(1);
        l.refresh(&cache);
        assert_eq!(l.range_of(&c, 6), Some(8..16));
        assert_eq!(l.range_of(&b, 1), None);
        // Off: nothing rides.
        let mut off = EagerLayout::new(0);
        off.refresh(&cache);
        assert_eq!(off.len(), 0);
        assert!(off.parts().is_empty());
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// With room for one of two, the most recently used rides; a name used again takes the
    /// room back at the next choice (every `RECHOOSE_ROUNDS` rounds), not before.
    #[test]
    fn the_most_recently_used_ride() {
        let mut cache = ResponseCache::new(4);
        let old = resp("old", DType::F32, 2, ReduceOp::Sum);
        let new = resp("new", DType::F32, 2, ReduceOp::Sum);
        cache.insert(Arc::clone(&old));
        cache.insert(Arc::clone(&new));
        let mut l = EagerLayout::new(8);
        l.refresh(&cache);
        assert_eq!(l.range_of(&new, 1), Some(0..8));
        assert_eq!(l.range_of(&old, 0), None);
        cache.touch(0);
        for _ in 1..RECHOOSE_ROUNDS {
            l.refresh(&cache);
            assert_eq!(l.range_of(&new, 1), Some(0..8), "chosen again too early");
        }
        l.refresh(&cache);
        assert_eq!(l.range_of(&old, 0), Some(0..8));
        assert_eq!(l.range_of(&new, 1), None);
    }

    #[test]
    fn finishing_divides_an_average_and_applies_the_postscale() {
        let mut r = Response::clone(&resp("x", DType::F32, 2, ReduceOp::Average));
        r.sig.postscale = 0.5;
        let mut out = bytemuck::cast_slice::<f32, u8>(&[8.0, 4.0]).to_vec();
        EagerLayout::finish(&r, &mut out, 4).unwrap();
        assert_eq!(f32s(&out), [1.0, 0.5]);
        r.sig.op = ReduceOp::Sum;
        EagerLayout::finish(&r, &mut out, 4).unwrap();
        assert_eq!(f32s(&out), [0.5, 0.25]);
    }
}
