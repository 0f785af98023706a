//! A stable, non-cryptographic hash for names that must come out the same on every rank and
//! host, build and run (a derived job token, a process set's record directory). Not for
//! secrets: those go through `fh_job::token::Key`.

/// The FNV-1a 64-bit offset basis, the usual seed.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// 64-bit FNV-1a of `bytes`, from `seed` ([`FNV_OFFSET`], or another value for a second,
/// independent hash).
pub fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::{fnv1a, FNV_OFFSET};

    #[test]
    fn matches_the_reference_values() {
        assert_eq!(fnv1a(FNV_OFFSET, b""), FNV_OFFSET);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }
}
