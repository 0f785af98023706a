//! What every MPI call of the backend shares: messages cut into chunks MPI's `int` counts can
//! take, buffer pointers (never null), counts and displacements as `int`s, and waiting for a
//! request in either thread mode.

use std::ffi::{c_int, c_void};
use std::ops::Range;

use mpi::ffi;

use super::runtime::{success, Runtime, ThreadMode};

/// Split `0..len` into ranges of at most `max` (at least one range, empty when `len == 0`),
/// each flagged whether it is the last.
pub(super) fn chunk_ranges(len: usize, max: usize) -> impl Iterator<Item = (Range<usize>, bool)> {
    let max = max.max(1);
    let n = len.div_ceil(max).max(1);
    (0..n).map(move |i| {
        let start = i * max;
        let end = (start + max).min(len);
        (start..end, i + 1 == n)
    })
}

/// Where empty buffers point instead of their own (dangling) address: an empty Rust slice of
/// bytes points at address 1, which is `MPI_IN_PLACE` in Open MPI.
pub(super) static EMPTY: [u64; 1] = [0];

/// The address MPI gets for `buf`: never a dangling one (see [`EMPTY`]).
pub(super) fn send_ptr(buf: &[u8]) -> *const c_void {
    if buf.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        buf.as_ptr().cast()
    }
}

/// The address MPI gets for an output buffer; with a count of 0 MPI never writes to it.
pub(super) fn recv_ptr(buf: &mut [u8]) -> *mut c_void {
    if buf.is_empty() {
        EMPTY.as_ptr().cast_mut().cast()
    } else {
        buf.as_mut_ptr().cast()
    }
}

pub(super) fn to_int(n: usize) -> Option<c_int> {
    c_int::try_from(n).ok()
}

/// Counts and displacements as MPI `int`s, or `None` when any does not fit under `max`.
pub(super) fn int_counts(counts: &[usize], max: usize) -> Option<(Vec<c_int>, Vec<c_int>)> {
    let mut cs = Vec::with_capacity(counts.len());
    let mut ds = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &c in counts {
        if total > max {
            return None;
        }
        ds.push(to_int(total)?);
        cs.push(to_int(c)?);
        total = total.checked_add(c)?;
    }
    (total <= max).then_some((cs, ds))
}

pub(super) fn empty_status() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers; all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Wait for `req` to complete; returns the failing return code on error.
pub(super) fn wait_request(
    rt: &Runtime,
    req: &mut ffi::MPI_Request,
) -> std::result::Result<ffi::MPI_Status, c_int> {
    let mut status = empty_status();
    match rt.mode {
        ThreadMode::Multiple => {
            // SAFETY: `req` is an active request whose buffers the caller keeps alive.
            let rc = unsafe { ffi::MPI_Wait(req, &mut status) };
            if !success(rc) {
                return Err(rc);
            }
        }
        ThreadMode::Serialized => loop {
            let mut flag: c_int = 0;
            let rc = {
                let _guard = rt.lock();
                // SAFETY: as above.
                unsafe { ffi::MPI_Test(req, &mut flag, &mut status) }
            };
            if !success(rc) {
                return Err(rc);
            }
            if flag != 0 {
                break;
            }
            std::thread::yield_now();
        },
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mpi::runtime::MAX_COUNT;

    #[test]
    fn chunk_ranges_cover_exactly() {
        assert_eq!(chunk_ranges(0, 4).collect::<Vec<_>>(), vec![(0..0, true)]);
        assert_eq!(
            chunk_ranges(9, 4).collect::<Vec<_>>(),
            vec![(0..4, false), (4..8, false), (8..9, true)]
        );
        assert_eq!(
            chunk_ranges(8, 4).collect::<Vec<_>>(),
            vec![(0..4, false), (4..8, true)]
        );
    }

    #[test]
    fn int_counts_refuses_what_mpi_cannot_take() {
        assert_eq!(
            int_counts(&[1, 0, 3], 10),
            Some((vec![1, 0, 3], vec![0, 1, 1]))
        );
        assert_eq!(int_counts(&[6, 6], 10), None);
        assert_eq!(int_counts(&[usize::MAX, 1], MAX_COUNT), None);
    }
}
