//! Cutting a vector held in slices (a fused group's tensors) around a rank's block: what the
//! lanes' allreduce ([`super::lanes`]) and its pipeline ([`super::pipeline`]) share.

/// Lane `i`'s share of `n` elements split over `l` lanes (the first `n % l` get one more).
pub(super) fn share(n: usize, l: usize, i: usize) -> usize {
    n / l + usize::from(i < n % l)
}

/// Cut `segs` at byte `at` of their concatenation: the slices before it and those from it on.
pub(super) fn cut_at(segs: Vec<&mut [u8]>, at: usize) -> (Vec<&mut [u8]>, Vec<&mut [u8]>) {
    let (mut head, mut tail) = (Vec::new(), Vec::new());
    let mut off = 0;
    for s in segs {
        let len = s.len();
        if off + len <= at {
            head.push(s);
        } else if off >= at {
            tail.push(s);
        } else {
            let (h, t) = s.split_at_mut(at - off);
            head.push(h);
            tail.push(t);
        }
        off += len;
    }
    (head, tail)
}

/// Read-only views of `segs`.
pub(super) fn shared<'a>(segs: &'a [&mut [u8]]) -> Vec<&'a [u8]> {
    segs.iter().map(|s| &**s).collect()
}

/// A chunk of the buffer (in slices) cut around this rank's block.
pub(super) struct Around<'a> {
    pub(super) before: Vec<&'a mut [u8]>,
    pub(super) own: Vec<&'a mut [u8]>,
    pub(super) after: Vec<&'a mut [u8]>,
}

/// `chunk` cut around local rank `me`'s block of `counts` (elements of `esz` bytes, blocks in
/// rank order).
pub(super) fn around<'a>(
    chunk: Vec<&'a mut [u8]>,
    counts: &[usize],
    me: usize,
    esz: usize,
) -> Around<'a> {
    let lo = counts[..me].iter().sum::<usize>() * esz;
    let (before, rest) = cut_at(chunk, lo);
    let (own, after) = cut_at(rest, counts[me] * esz);
    Around { before, own, after }
}
