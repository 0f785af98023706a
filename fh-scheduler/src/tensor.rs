//! Tensors: what is submitted to the engine and what a handle gives back.
//!
//! # Buffer ownership
//!
//! A submission *moves* its [`Tensor`] into the engine; the engine owns the bytes while the
//! collective is in flight (packing them into fusion buffers, reducing in place) and hands
//! them back through [`crate::Handle::wait`] (or the completion callback) once the operation
//! is done on this rank. The caller therefore cannot read, write or free a buffer that a
//! collective is still using: the borrow checker forbids it, with no `unsafe` and no runtime
//! check. Allreduce, broadcast and reduce-scatter return a tensor of the same dtype; allgather,
//! alltoall and reduce-scatter return a tensor of the shape the collective produces. If a
//! handle is dropped before completion the operation still takes place (the other ranks rely on
//! it) and the result is dropped.
//!
//! # Memory the engine does not own
//!
//! A framework adapter (fh-torch) hands the engine a framework tensor's own memory, so that a
//! gradient is reduced where it lies, without a copy: [`Tensor::from_external`] wraps a pointer
//! and a length together with an [`OwnerGuard`], a value that keeps the memory alive (for
//! fh-torch, a reference to the Python tensor object). The guard is dropped when the `Tensor`
//! is dropped: after the handle has given the tensor back and the caller let go of it, or on
//! the engine's thread when the handle was dropped first. Such a tensor behaves like an owned
//! one: in-place collectives (allreduce, broadcast) write into the external memory; the
//! out-of-place ones (allgather, alltoall, reduce-scatter) return a new, owned tensor and drop
//! the external one (and its guard) once the input has been read.

use std::fmt;
use std::ptr::NonNull;

use fh_core::{DType, Element};

use crate::SchedulerError;

/// Keeps external memory alive while a [`Tensor`] refers to it; dropped with the tensor.
///
/// Implementations must not block or run foreign code in `drop` that needs a lock held by a
/// caller (fh-torch's guard holds a Python reference, whose release PyO3 defers while the
/// GIL is not held, so an engine thread never takes the GIL).
pub trait OwnerGuard: Send + Sync + 'static {}

impl<T: Send + Sync + 'static> OwnerGuard for T {}

enum Storage {
    Owned(Vec<u8>),
    External {
        ptr: NonNull<u8>,
        len: usize,
        // Dropped after the last use of `ptr` (when the tensor is dropped).
        _guard: Box<dyn OwnerGuard>,
    },
}

// SAFETY: an external buffer is, by `Tensor::from_external`'s contract, memory that only this
// `Tensor` accesses while it exists (like a `Vec<u8>` it owns), so moving the tensor to another
// thread or sharing `&Tensor` (read-only access through `data()`) is as safe as for a `Vec`.
// The guard itself is `Send + Sync`.
unsafe impl Send for Storage {}
// SAFETY: see above; `&Storage` only gives out `&[u8]`.
unsafe impl Sync for Storage {}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Owned(v) => v,
            Storage::External { len: 0, .. } => &[],
            // SAFETY: `from_external`'s contract: `ptr` is valid for reads and writes of `len`
            // bytes, exclusively ours, for as long as the guard (dropped with us) lives.
            Storage::External { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Owned(v) => v,
            Storage::External { len: 0, .. } => &mut [],
            // SAFETY: as in `bytes`, and `&mut self` makes this the only access.
            Storage::External { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
        }
    }
}

/// A dense host tensor: element type, shape and bytes in native byte order, in memory the
/// tensor owns (a `Vec<u8>`) or in external memory kept alive by an [`OwnerGuard`].
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Storage,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.bytes().len())
            .field("external", &self.is_external())
            .finish()
    }
}

/// A clone is always owned (external memory is copied).
impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: Storage::Owned(self.data.bytes().to_vec()),
        }
    }
}

/// Equal dtype, shape and bytes (wherever they live).
impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.data.bytes() == other.data.bytes()
    }
}

fn elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize, SchedulerError> {
    elements(shape)
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| SchedulerError::InvalidArgument(format!("shape {shape:?} overflows")))
}

impl Tensor {
    /// A tensor from raw bytes; `data.len()` must equal the shape's element count times the
    /// element size.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self, SchedulerError> {
        let want = byte_len(dtype, &shape)?;
        if want != data.len() {
            return Err(SchedulerError::InvalidArgument(format!(
                "a {dtype} tensor of shape {shape:?} needs {want} bytes, the buffer has {}",
                data.len()
            )));
        }
        Ok(Tensor {
            dtype,
            shape,
            data: Storage::Owned(data),
        })
    }

    /// A tensor over `len` bytes of memory the engine does not own, starting at `ptr`;
    /// `guard` keeps that memory alive and is dropped with the tensor. `len` must equal the
    /// shape's element count times the element size.
    ///
    /// # Safety
    ///
    /// Until the returned tensor (and so `guard`) is dropped, `ptr` must be valid for reads and
    /// writes of `len` bytes, and nothing else may read or write that memory: the engine reads
    /// and writes it from its own threads while an operation is in flight. `ptr` needs no
    /// particular alignment. A null `ptr` is accepted only with `len == 0`.
    pub unsafe fn from_external(
        dtype: DType,
        shape: Vec<usize>,
        ptr: *mut u8,
        len: usize,
        guard: Box<dyn OwnerGuard>,
    ) -> Result<Self, SchedulerError> {
        let want = byte_len(dtype, &shape)?;
        if want != len {
            return Err(SchedulerError::InvalidArgument(format!(
                "a {dtype} tensor of shape {shape:?} needs {want} bytes, the buffer has {len}"
            )));
        }
        let ptr = match NonNull::new(ptr) {
            Some(p) => p,
            None if len == 0 => NonNull::dangling(),
            None => {
                return Err(SchedulerError::InvalidArgument(
                    "a null pointer for a non-empty tensor".into(),
                ))
            }
        };
        Ok(Tensor {
            dtype,
            shape,
            data: Storage::External {
                ptr,
                len,
                _guard: guard,
            },
        })
    }

    /// A tensor from typed elements.
    pub fn from_vec<T: Element>(shape: Vec<usize>, values: Vec<T>) -> Result<Self, SchedulerError> {
        let data = bytemuck::cast_slice::<T, u8>(&values).to_vec();
        Tensor::new(T::DTYPE, shape, data)
    }

    /// A one-dimensional tensor from a slice.
    pub fn from_slice<T: Element>(values: &[T]) -> Self {
        Tensor {
            dtype: T::DTYPE,
            shape: vec![values.len()],
            data: Storage::Owned(bytemuck::cast_slice::<T, u8>(values).to_vec()),
        }
    }

    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Self, SchedulerError> {
        let n = byte_len(dtype, &shape)?;
        Ok(Tensor {
            dtype,
            shape,
            data: Storage::Owned(vec![0; n]),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.bytes().len() / self.dtype.size()
    }

    /// Whether the bytes live in external memory ([`Tensor::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.data, Storage::External { .. })
    }

    /// The bytes.
    pub fn data(&self) -> &[u8] {
        self.data.bytes()
    }

    /// The bytes, mutably.
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.data.bytes_mut()
    }

    /// Take the bytes (a copy when they live in external memory, which is then released).
    pub fn into_data(self) -> Vec<u8> {
        match self.data {
            Storage::Owned(v) => v,
            ext @ Storage::External { .. } => ext.bytes().to_vec(),
        }
    }

    /// Copy the elements out as `T`, which must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, SchedulerError> {
        if T::DTYPE != self.dtype {
            return Err(SchedulerError::InvalidArgument(format!(
                "tensor holds {} elements, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        Ok(read_vec(self.data()))
    }

    pub(crate) fn from_parts(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Self {
        Tensor {
            dtype,
            shape,
            data: Storage::Owned(data),
        }
    }
}

/// Copy bytes out as elements of `T` (any alignment).
pub(crate) fn read_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_checked() {
        assert!(Tensor::new(DType::F32, vec![2, 3], vec![0; 24]).is_ok());
        let e = Tensor::new(DType::F32, vec![2, 3], vec![0; 20]).unwrap_err();
        assert!(e.to_string().contains("24 bytes"), "{e}");
        let t = Tensor::from_vec(vec![2], vec![1.5f64, -2.0]).unwrap();
        assert_eq!(t.to_vec::<f64>().unwrap(), [1.5, -2.0]);
        assert!(t.to_vec::<f32>().is_err());
    }

    #[test]
    fn external_memory_is_used_in_place_and_released_with_the_tensor() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let mut backing = vec![1.0f32, 2.0, 3.0];
        let dropped = Arc::new(AtomicBool::new(false));
        let ptr = backing.as_mut_ptr().cast::<u8>();
        // SAFETY: `backing` outlives the tensor and is not touched until it is dropped.
        let mut t = unsafe {
            Tensor::from_external(
                DType::F32,
                vec![3],
                ptr,
                12,
                Box::new(Flag(dropped.clone())),
            )
        }
        .unwrap();
        assert!(t.is_external());
        t.data_mut()[..4].copy_from_slice(&7.0f32.to_ne_bytes());
        let copy = t.clone();
        assert!(!copy.is_external());
        assert_eq!(copy, t);
        assert!(!dropped.load(Ordering::SeqCst));
        drop(t);
        assert!(dropped.load(Ordering::SeqCst));
        assert_eq!(backing, [7.0, 2.0, 3.0]);
        // Lengths are checked; null is refused unless empty.
        let bad = unsafe { Tensor::from_external(DType::F32, vec![3], ptr, 8, Box::new(())) };
        assert!(bad.is_err());
        let null = unsafe {
            Tensor::from_external(DType::F32, vec![3], std::ptr::null_mut(), 12, Box::new(()))
        };
        assert!(null.is_err());
        let empty = unsafe {
            Tensor::from_external(DType::F32, vec![0], std::ptr::null_mut(), 0, Box::new(()))
        }
        .unwrap();
        assert!(empty.data().is_empty());
    }
}
