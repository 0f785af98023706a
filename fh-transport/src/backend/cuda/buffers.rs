//! Device memory as the device communicators see it: read-only and writable byte ranges with
//! a lifetime, checked before use.

use std::marker::PhantomData;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};

use crate::{Result, TransportError};

/// Read-only device memory: `len` bytes at a device address, valid for `'a`.
///
/// Device operations are asynchronous: whoever builds one promises that the memory stays
/// valid (and is not written by anyone else) until the operation it is passed to has completed
/// on the channel stream (see [`DeviceChannel::record_completion`](super::DeviceChannel::record_completion)).
#[derive(Debug, Clone, Copy)]
pub struct DeviceBytes<'a> {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) _borrow: PhantomData<&'a [u8]>,
}

/// Writable device memory: `len` bytes at a device address, valid for `'a`. Same promise as
/// [`DeviceBytes`], and nobody else reads or writes it until the operation has completed.
#[derive(Debug)]
pub struct DeviceBytesMut<'a> {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> DeviceBytes<'a> {
    /// Device memory owned by someone else (a framework's tensor).
    ///
    /// # Safety
    /// `ptr..ptr+len` is device memory of the channel's device (or unified memory), allocated
    /// for at least `'a`, and stays valid until every operation it is passed to completes.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> Self {
        DeviceBytes {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// The bytes of a cudarc allocation.
    ///
    /// # Safety
    /// As [`DeviceBytes::from_raw`]: `slice` must not be freed (dropped) before the operations
    /// using these bytes have completed.
    pub unsafe fn from_slice<T>(slice: &'a CudaSlice<T>, stream: &CudaStream) -> Self {
        let (ptr, _guard) = slice.device_ptr(stream);
        DeviceBytes {
            ptr,
            len: slice.num_bytes(),
            _borrow: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes `start..start + len`, or an error when out of range.
    pub fn slice(&self, start: usize, len: usize) -> Result<DeviceBytes<'a>> {
        check_range(self.len, start, len)?;
        Ok(DeviceBytes {
            ptr: self.ptr + start as u64,
            len,
            _borrow: PhantomData,
        })
    }
}

impl<'a> DeviceBytesMut<'a> {
    /// Writable device memory owned by someone else (a framework's tensor).
    ///
    /// # Safety
    /// As [`DeviceBytes::from_raw`], and nothing else accesses the memory until the operations
    /// it is passed to complete.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> Self {
        DeviceBytesMut {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// The bytes of a cudarc allocation.
    ///
    /// # Safety
    /// As [`DeviceBytesMut::from_raw`].
    pub unsafe fn from_slice<T>(slice: &'a mut CudaSlice<T>, stream: &CudaStream) -> Self {
        let len = slice.num_bytes();
        let (ptr, _guard) = slice.device_ptr(stream);
        DeviceBytesMut {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// A read-only view of the same bytes, for as long as this borrow.
    pub fn as_bytes(&self) -> DeviceBytes<'_> {
        DeviceBytes {
            ptr: self.ptr,
            len: self.len,
            _borrow: PhantomData,
        }
    }

    /// A shorter-lived writable view of the same bytes.
    pub fn reborrow(&mut self) -> DeviceBytesMut<'_> {
        DeviceBytesMut {
            ptr: self.ptr,
            len: self.len,
            _borrow: PhantomData,
        }
    }

    /// Bytes `start..start + len` (writable), or an error when out of range.
    pub fn slice_mut(&mut self, start: usize, len: usize) -> Result<DeviceBytesMut<'_>> {
        check_range(self.len, start, len)?;
        Ok(DeviceBytesMut {
            ptr: self.ptr + start as u64,
            len,
            _borrow: PhantomData,
        })
    }
}

pub(super) fn check_range(have: usize, start: usize, len: usize) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= have => Ok(()),
        _ => Err(TransportError::InvalidArgument(format!(
            "device range {start}+{len} is outside a buffer of {have} bytes"
        ))),
    }
}

impl<'a> DeviceBytesMut<'a> {
    /// The first `len` bytes, keeping the lifetime.
    pub(super) fn slice_mut_owned(self, len: usize) -> Result<DeviceBytesMut<'a>> {
        check_range(self.len, 0, len)?;
        Ok(DeviceBytesMut { len, ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ranges_are_checked() {
        // SAFETY: never dereferenced; only the range arithmetic is exercised.
        let b = unsafe { DeviceBytes::from_raw(0x1000, 64) };
        assert_eq!(b.slice(16, 48).unwrap().device_ptr(), 0x1010);
        assert!(b.slice(16, 49).is_err());
        assert!(b.slice(usize::MAX, 2).is_err());
    }
}
