//! The response cache: negotiated responses kept under slot indices that are identical on
//! every rank.
//!
//! The cache is deterministic: its state depends only on the sequence of calls, and the engine
//! makes the same calls on every rank (insertions in the order of the broadcast response list,
//! uses in slot order of the agreed ready set). Hence slot numbers agree everywhere without
//! ever being exchanged.
//!
//! Responses are held as `Arc<Response>`: a round that finds a name in the cache takes a
//! reference count, never a copy of the response (name, shape, group).

use std::collections::HashMap;
use std::sync::Arc;

use crate::message::{GroupTag, Response, Signature};

/// The outcome of looking up a name before a negotiation round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Cached with the same signature: negotiate through the bit vector.
    Hit(usize),
    /// Cached under another signature: the slot must be invalidated everywhere.
    Changed(usize),
    /// Not cached: negotiate through the coordinator.
    Miss,
}

#[derive(Debug, Clone)]
struct Entry {
    response: Arc<Response>,
    last_used: u64,
}

/// A bounded map from names to negotiated responses with stable slot indices.
#[derive(Debug, Clone)]
pub struct ResponseCache {
    slots: Vec<Option<Entry>>,
    by_name: HashMap<Arc<str>, usize>,
    clock: u64,
    generation: u64,
}

impl ResponseCache {
    /// An empty cache with `capacity` slots (0 disables caching).
    pub fn new(capacity: usize) -> Self {
        ResponseCache {
            slots: vec![None; capacity],
            by_name: HashMap::new(),
            clock: 0,
            generation: 0,
        }
    }

    /// A number that changes whenever a slot's response changes (an insertion or an
    /// eviction; not a use): what is derived from the cached responses (the same on every
    /// rank, like the cache) needs computing again only when it moves.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Number of occupied slots.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no slot is occupied.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Classify a pending request by its name, signature and group membership: a hit needs
    /// all three to match the cached response (a cached member of a grouped submission must
    /// not stand for a plain submission of the name, nor for a group of another size).
    pub fn lookup(&self, name: &str, sig: &Signature, group: Option<&GroupTag>) -> Lookup {
        match self.by_name.get(name) {
            None => Lookup::Miss,
            Some(&slot) => match &self.slots[slot] {
                Some(e) if e.response.sig.same_as(sig) && e.response.group.as_ref() == group => {
                    Lookup::Hit(slot)
                }
                _ => Lookup::Changed(slot),
            },
        }
    }

    /// The slot of a name, if cached.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The response cached in a slot (clone the `Arc` to keep it: a reference count).
    pub fn get(&self, slot: usize) -> Option<&Arc<Response>> {
        self.slots.get(slot)?.as_ref().map(|e| &e.response)
    }

    /// When a slot was last used or filled, on the cache's own clock (larger: more recent; the
    /// same on every rank, like the cache); `None` for an empty slot.
    pub fn last_used(&self, slot: usize) -> Option<u64> {
        self.slots.get(slot)?.as_ref().map(|e| e.last_used)
    }

    /// Record that a slot was used in a round (for least-recently-used eviction).
    pub fn touch(&mut self, slot: usize) {
        self.clock += 1;
        let now = self.clock;
        if let Some(Some(e)) = self.slots.get_mut(slot) {
            e.last_used = now;
        }
    }

    /// Drop a slot.
    pub fn evict(&mut self, slot: usize) -> Option<Arc<Response>> {
        let e = self.slots.get_mut(slot)?.take()?;
        self.generation += 1;
        self.by_name.remove(&*e.response.name);
        Some(e.response)
    }

    /// Cache a successful response and return its slot, or `None` when the cache is disabled or
    /// the response is an error. A name already cached keeps its slot; otherwise the lowest free
    /// slot is used, or the least recently used one is evicted (lowest index on ties). The
    /// evicted name, if any, is returned too. The cache keeps `response` itself (shared with
    /// the caller), not a copy.
    pub fn insert(&mut self, response: Arc<Response>) -> Option<(usize, Option<Arc<str>>)> {
        if self.slots.is_empty() || response.error.is_some() {
            return None;
        }
        self.clock += 1;
        self.generation += 1;
        let name = Arc::clone(&response.name);
        let entry = Entry {
            response,
            last_used: self.clock,
        };
        if let Some(&slot) = self.by_name.get(&*name) {
            self.slots[slot] = Some(entry);
            return Some((slot, None));
        }
        let (slot, evicted) = match self.slots.iter().position(Option::is_none) {
            Some(free) => (free, None),
            None => {
                let victim = self
                    .slots
                    .iter()
                    .enumerate()
                    .min_by_key(|(i, e)| (e.as_ref().map_or(0, |e| e.last_used), *i))
                    .map(|(i, _)| i)?;
                let old = self.evict(victim).map(|r| Arc::clone(&r.name));
                (victim, old)
            }
        };
        self.by_name.insert(name, slot);
        self.slots[slot] = Some(entry);
        Some((slot, evicted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{CollectiveKind, Device};
    use crate::{DType, ReduceOp};
    use proptest::prelude::*;

    fn resp(name: &str, len: u64) -> Arc<Response> {
        Arc::new(Response {
            name: name.into(),
            sig: Signature {
                kind: CollectiveKind::Allreduce,
                dtype: DType::F32,
                shape: vec![len],
                device: Device::Cpu,
                op: ReduceOp::Sum,
                root: 0,
                prescale: 1.0,
                postscale: 1.0,
            },
            priority: 0,
            group: None,
            error: None,
        })
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8),
        Touch(u8),
        Evict(u8),
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..24, 1u8..3).prop_map(|(n, l)| Op::Insert(n, l)),
            any::<u8>().prop_map(Op::Touch),
            any::<u8>().prop_map(Op::Evict),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn slots_are_consistent_and_deterministic(cap in 0usize..8, ops in proptest::collection::vec(arb_op(), 0..60)) {
            let mut a = ResponseCache::new(cap);
            let mut b = ResponseCache::new(cap);
            for op in &ops {
                let before = a.generation();
                match *op {
                    Op::Insert(n, l) => {
                        let r = resp(&format!("t{n}"), l as u64);
                        let sa = a.insert(Arc::clone(&r));
                        // An insertion moves the generation; a disabled cache stays put.
                        prop_assert_eq!(a.generation() != before, sa.is_some());
                        prop_assert_eq!(sa.clone(), b.insert(Arc::clone(&r)));
                        if let Some((slot, _)) = sa {
                            prop_assert!(slot < cap);
                            prop_assert_eq!(a.lookup(&r.name, &r.sig, None), Lookup::Hit(slot));
                            let other = resp(&r.name, l as u64 + 7);
                            prop_assert_eq!(a.lookup(&r.name, &other.sig, None), Lookup::Changed(slot));
                            let tag = GroupTag { name: "g".into(), index: 0, size: 2 };
                            prop_assert_eq!(a.lookup(&r.name, &r.sig, Some(&tag)), Lookup::Changed(slot));
                        } else {
                            prop_assert_eq!(cap, 0);
                        }
                    }
                    Op::Touch(s) => {
                        a.touch(s as usize);
                        b.touch(s as usize);
                        prop_assert_eq!(a.generation(), before, "a use is no change");
                    }
                    Op::Evict(s) => {
                        let out = a.evict(s as usize);
                        prop_assert_eq!(a.generation() != before, out.is_some());
                        prop_assert_eq!(out, b.evict(s as usize));
                    }
                }
                prop_assert!(a.len() <= cap);
                // Every named slot holds that name.
                for (name, &slot) in &a.by_name {
                    prop_assert_eq!(&*a.get(slot).unwrap().name, &**name);
                }
                prop_assert_eq!(a.slots.iter().filter(|s| s.is_some()).count(), a.len());
            }
        }
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut c = ResponseCache::new(2);
        let (s0, _) = c.insert(resp("a", 1)).unwrap();
        let (s1, _) = c.insert(resp("b", 1)).unwrap();
        c.touch(s0);
        let (s2, evicted) = c.insert(resp("c", 1)).unwrap();
        assert_eq!(s2, s1);
        assert_eq!(evicted.as_deref(), Some("b"));
        assert_eq!(c.lookup("b", &resp("b", 1).sig, None), Lookup::Miss);
    }

    #[test]
    fn group_membership_is_part_of_the_key() {
        let mut c = ResponseCache::new(4);
        let tag = |size| GroupTag {
            name: "g".into(),
            index: 0,
            size,
        };
        let mut r = Response::clone(&resp("g[0]", 1));
        r.group = Some(tag(3));
        let (slot, _) = c.insert(Arc::new(r.clone())).unwrap();
        assert_eq!(c.lookup("g[0]", &r.sig, Some(&tag(3))), Lookup::Hit(slot));
        // Fewer members under the same names, or the name on its own: not the cached response.
        assert_eq!(
            c.lookup("g[0]", &r.sig, Some(&tag(2))),
            Lookup::Changed(slot)
        );
        assert_eq!(c.lookup("g[0]", &r.sig, None), Lookup::Changed(slot));
    }

    /// A hit costs a reference count: every lookup of a cached slot hands out the very
    /// response that was inserted (pointer-equal), never a deep copy, and the cache holds no
    /// copy of its own.
    #[test]
    fn hits_share_the_cached_response() {
        let mut c = ResponseCache::new(4);
        let r = resp("w", 3);
        let (slot, _) = c.insert(Arc::clone(&r)).unwrap();
        assert_eq!(c.lookup("w", &r.sig, None), Lookup::Hit(slot));
        let first = Arc::clone(c.get(slot).unwrap());
        let second = Arc::clone(c.get(slot).unwrap());
        assert!(Arc::ptr_eq(&first, &r) && Arc::ptr_eq(&second, &r));
        assert!(Arc::ptr_eq(&first.name, &r.name), "the name is shared too");
        // Ours, the cache's and the two taken: four counts on one allocation.
        assert_eq!(Arc::strong_count(&r), 4);
        drop((first, second));
        // Eviction hands back the same allocation.
        let out = c.evict(slot).unwrap();
        assert!(Arc::ptr_eq(&out, &r));
        drop(out);
        assert_eq!(Arc::strong_count(&r), 1);
    }
}
