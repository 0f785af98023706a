//! Bit vectors for the readiness negotiation.
//!
//! A negotiation vector holds [`STATUS_BITS`] status bits, then one bit per data channel (set:
//! the channel is idle on this rank), then one bit per cache slot, packed little-endian into
//! `u64` words so that a bitwise-AND allreduce over its bytes combines the ranks' vectors.
//! Status bits are stored *inverted* (a rank clears the bit to say "yes"), so that after the
//! AND a cleared bit means "at least one rank said yes" while channel bits mean "idle on every
//! rank" and slot bits mean "every rank has this slot pending".

/// Number of status bits at the front of a negotiation vector.
pub const STATUS_BITS: usize = 8;

/// A flag a rank raises in the status bits of a negotiation vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// The rank asks the whole job to shut down.
    Shutdown = 0,
    /// The rank has requests that are not in the cache (a coordinator round is needed).
    Uncached = 1,
    /// The rank found a cached name whose signature changed (its slot must be dropped).
    Invalidated = 2,
    /// The rank has an operation pending for longer than the stall-check time.
    Stalled = 3,
    /// The rank has joined (it has run out of data).
    Joined = 4,
    /// The rank has any operation pending at all.
    Pending = 5,
    /// The rank met a local inconsistency (a negotiated tensor it cannot run): every rank
    /// stops with the error it names.
    Fault = 6,
    /// Rank 0 is writing a timeline: in a round where some rank has operations pending, every
    /// rank reports to rank 0 how long ago its newly pending operations became ready, so that
    /// the timeline can show which rank held each tensor back.
    Trace = 7,
}

impl Status {
    /// Every status flag.
    pub const ALL: [Status; 8] = [
        Status::Shutdown,
        Status::Uncached,
        Status::Invalidated,
        Status::Stalled,
        Status::Joined,
        Status::Pending,
        Status::Fault,
        Status::Trace,
    ];
}

/// A fixed-length bit vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitVec {
    words: Vec<u64>,
    bits: usize,
}

impl BitVec {
    /// `bits` cleared bits.
    pub fn zeros(bits: usize) -> Self {
        BitVec {
            words: vec![0; bits.div_ceil(64)],
            bits,
        }
    }

    /// Number of bits.
    pub fn len(&self) -> usize {
        self.bits
    }

    /// Whether the vector has no bits.
    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }

    /// Set bit `i` to `v`; bits past the end are ignored.
    pub fn set(&mut self, i: usize, v: bool) {
        if i >= self.bits {
            return;
        }
        let (w, b) = (i / 64, i % 64);
        if v {
            self.words[w] |= 1 << b;
        } else {
            self.words[w] &= !(1 << b);
        }
    }

    /// Bit `i` (false past the end).
    pub fn get(&self, i: usize) -> bool {
        i < self.bits && self.words[i / 64] & (1 << (i % 64)) != 0
    }

    /// Indices of the set bits, ascending.
    pub fn ones(&self) -> impl Iterator<Item = usize> + '_ {
        let bits = self.bits;
        self.words.iter().enumerate().flat_map(move |(w, &word)| {
            let mut x = word;
            std::iter::from_fn(move || {
                if x == 0 {
                    return None;
                }
                let b = x.trailing_zeros() as usize;
                x &= x - 1;
                Some(w * 64 + b)
            })
            .filter(move |&i| i < bits)
        })
    }

    /// The little-endian bytes of the words (what goes on the wire).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Rebuild from bytes produced by [`BitVec::to_bytes`] for the same bit count; `None` if
    /// the length does not match.
    pub fn from_bytes(bytes: &[u8], bits: usize) -> Option<Self> {
        let mut r = crate::bytes::Reader::new(bytes);
        let words = (0..bits.div_ceil(64))
            .map(|_| r.u64())
            .collect::<Result<_, _>>()
            .ok()?;
        r.end().ok()?;
        Some(BitVec { words, bits })
    }

    /// Number of bytes [`BitVec::to_bytes`] produces for `bits` bits.
    pub fn byte_len(bits: usize) -> usize {
        bits.div_ceil(64) * 8
    }
}

/// A negotiation vector: status flags, channel bits and slot bits, laid out as the module
/// describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiationVec {
    bits: BitVec,
    channels: usize,
    slots: usize,
}

/// Most data channels a negotiation vector carries bits for.
pub const MAX_CHANNEL_BITS: usize = 64;

impl NegotiationVec {
    /// A vector for `slots` cache slots and no channel bits, with no flag raised and no slot
    /// pending.
    pub fn new(slots: usize) -> Self {
        Self::with_channels(slots, 0)
    }

    /// A vector for `slots` cache slots and `channels` channel bits (at most
    /// [`MAX_CHANNEL_BITS`]), with no flag raised, no channel idle and no slot pending.
    pub fn with_channels(slots: usize, channels: usize) -> Self {
        let channels = channels.min(MAX_CHANNEL_BITS);
        let mut bits = BitVec::zeros(STATUS_BITS + channels + slots);
        for s in 0..STATUS_BITS {
            bits.set(s, true); // inverted: set means "no"
        }
        NegotiationVec {
            bits,
            channels,
            slots,
        }
    }

    /// Number of channel bits.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Mark a channel idle (or not). Channels past the count are ignored.
    pub fn set_idle(&mut self, channel: usize, idle: bool) {
        if channel < self.channels {
            self.bits.set(STATUS_BITS + channel, idle);
        }
    }

    /// The idle channels as a mask (bit `c` = channel `c`; after the AND: idle on every rank).
    pub fn idle_mask(&self) -> u64 {
        (0..self.channels)
            .filter(|&c| self.bits.get(STATUS_BITS + c))
            .fold(0, |m, c| m | 1 << c)
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Raise (or lower) a status flag.
    pub fn set_status(&mut self, s: Status, raised: bool) {
        self.bits.set(s as usize, !raised);
    }

    /// Whether a flag is raised (after the AND: raised by at least one rank).
    pub fn status(&self, s: Status) -> bool {
        !self.bits.get(s as usize)
    }

    /// Mark a slot pending (or not). Slots past the capacity are ignored.
    pub fn set_slot(&mut self, slot: usize, pending: bool) {
        if slot < self.slots {
            self.bits.set(STATUS_BITS + self.channels + slot, pending);
        }
    }

    /// Whether a slot is pending (after the AND: pending on every rank).
    pub fn slot(&self, slot: usize) -> bool {
        slot < self.slots && self.bits.get(STATUS_BITS + self.channels + slot)
    }

    /// Pending slots, ascending.
    pub fn pending_slots(&self) -> impl Iterator<Item = usize> + '_ {
        let first = STATUS_BITS + self.channels;
        self.bits
            .ones()
            .filter(move |&i| i >= first)
            .map(move |i| i - first)
    }

    /// Wire bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.bits.to_bytes()
    }

    /// Rebuild from wire bytes for `slots` slots and no channel bits.
    pub fn from_bytes(bytes: &[u8], slots: usize) -> Option<Self> {
        Self::from_bytes_with_channels(bytes, slots, 0)
    }

    /// Rebuild from wire bytes for `slots` slots and `channels` channel bits; `None` if the
    /// length does not match.
    pub fn from_bytes_with_channels(bytes: &[u8], slots: usize, channels: usize) -> Option<Self> {
        let channels = channels.min(MAX_CHANNEL_BITS);
        BitVec::from_bytes(bytes, STATUS_BITS + channels + slots).map(|bits| NegotiationVec {
            bits,
            channels,
            slots,
        })
    }

    /// Bytes on the wire for `slots` slots (and no channel bits).
    pub fn byte_len(slots: usize) -> usize {
        BitVec::byte_len(STATUS_BITS + slots)
    }

    /// Combine with another rank's vector as the AND allreduce does (for tests and models).
    pub fn and(&mut self, other: &NegotiationVec) {
        for (a, b) in self.bits.words.iter_mut().zip(&other.bits.words) {
            *a &= *b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cached_1024_fits_in_136_bytes() {
        assert_eq!(NegotiationVec::byte_len(1024), 136);
        assert_eq!(NegotiationVec::new(1024).to_bytes().len(), 136);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn and_means_all_for_slots_and_any_for_flags(
            slots in 1usize..300,
            channels in 0usize..70,
            ranks in proptest::collection::vec(
                (proptest::collection::vec(any::<bool>(), 300), proptest::collection::vec(any::<bool>(), Status::ALL.len()), any::<u64>()),
                1..5),
        ) {
            let vecs: Vec<NegotiationVec> = ranks.iter().map(|(pend, flags, idle)| {
                let mut v = NegotiationVec::with_channels(slots, channels);
                for (s, &p) in pend.iter().take(slots).enumerate() { v.set_slot(s, p); }
                for (f, &on) in Status::ALL.iter().zip(flags) { v.set_status(*f, on); }
                for c in 0..channels { v.set_idle(c, idle & (1 << (c % 64)) != 0); }
                // Round trip through the wire on the way.
                NegotiationVec::from_bytes_with_channels(&v.to_bytes(), slots, channels).unwrap()
            }).collect();
            let mut acc = vecs[0].clone();
            for v in &vecs[1..] { acc.and(v); }
            for s in 0..slots {
                let all = ranks.iter().all(|(p, _, _)| p[s]);
                prop_assert_eq!(acc.slot(s), all);
            }
            let listed: Vec<usize> = acc.pending_slots().collect();
            let expected: Vec<usize> = (0..slots).filter(|&s| ranks.iter().all(|(p, _, _)| p[s])).collect();
            prop_assert_eq!(listed, expected);
            for (i, f) in Status::ALL.iter().enumerate() {
                let any = ranks.iter().any(|(_, fl, _)| fl[i]);
                prop_assert_eq!(acc.status(*f), any);
            }
            // Channel bits: idle on every rank.
            let n = channels.min(MAX_CHANNEL_BITS);
            let all = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            let idle = ranks.iter().fold(all, |m, (_, _, i)| m & i);
            prop_assert_eq!(acc.idle_mask(), idle);
        }

        #[test]
        fn bitvec_ones_lists_exactly_the_set_bits(bits in proptest::collection::vec(any::<bool>(), 0..200)) {
            let mut v = BitVec::zeros(bits.len());
            for (i, &b) in bits.iter().enumerate() { v.set(i, b); }
            let ones: Vec<usize> = v.ones().collect();
            let expected: Vec<usize> = bits.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| i).collect();
            prop_assert_eq!(ones, expected);
            prop_assert_eq!(BitVec::from_bytes(&v.to_bytes(), bits.len()).unwrap(), v);
        }
    }

    #[test]
    fn wrong_length_is_refused() {
        assert!(NegotiationVec::from_bytes(&[0u8; 8], 100).is_none());
        let v = BitVec::zeros(65).to_bytes();
        assert_eq!(v.len(), 16);
        assert!(BitVec::from_bytes(&v, 65).is_some());
        assert!(BitVec::from_bytes(&v[..15], 65).is_none());
        assert!(BitVec::from_bytes(&v, 64).is_none());
    }
}
