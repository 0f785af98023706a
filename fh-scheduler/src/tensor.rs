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
//!
//! # Device tensors
//!
//! [`Tensor::from_device`] describes a tensor in GPU memory ([`DeviceMemory`]: device index,
//! device pointer, length, and the producer's CUDA stream), again with an [`OwnerGuard`]. The
//! engine never copies it to the host: at submission it records a readiness event on the
//! producer's stream, a channel's CUDA stream waits on that event (no host synchronization),
//! runs the collective on the device, and records a completion event, which the tensor given
//! back by the handle carries (`Tensor::wait_on_stream`, `Tensor::wait_on_host`, feature
//! `cuda`). A device tensor has no host bytes: [`Tensor::data`] is empty and
//! [`Tensor::to_vec`] is an error. Device tensors are accepted for allreduce (fused per
//! device, partitioned across channels like host ones) and broadcast; submitting one to an
//! engine built without the `cuda` feature, or started without [`crate::Config::cuda`], is an
//! error at submission, before any negotiation.
//!
//! The guard of a device tensor is dropped with the last clone of the tensor, which may be
//! before the completion event has fired: the framework must order the memory's reuse after
//! that event (fh-torch makes the framework's stream wait on it in `synchronize`, and
//! PyTorch's allocator orders frees on that stream).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

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
    Device(DeviceStorage),
}

/// Where a device tensor's memory lies, as plain numbers (describing one needs no CUDA types,
/// so that a build without the `cuda` feature can still say clearly why it refuses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceMemory {
    /// The CUDA device ordinal (as seen by this process, after `CUDA_VISIBLE_DEVICES`).
    pub device: u32,
    /// The device address of the first byte (`CUdeviceptr`; PyTorch's `data_ptr()`).
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The producer's CUDA stream, as its raw `CUstream` handle (PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream). The
    /// engine records the tensor's readiness event on it at submission.
    pub stream: u64,
}

struct DeviceStorage {
    mem: DeviceMemory,
    /// Readiness, recorded on the producer's stream at submission.
    #[cfg(feature = "cuda")]
    ready: Option<Arc<fh_transport::backend::cuda::CudaEvent>>,
    /// Completion, one event per channel that worked on the tensor.
    #[cfg(feature = "cuda")]
    done: Vec<Arc<fh_transport::backend::cuda::CudaEvent>>,
    // Shared by clones (a clone of a device tensor aliases its memory).
    _guard: Arc<dyn OwnerGuard>,
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
            Storage::External { len: 0, .. } | Storage::Device(_) => &[],
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
            Storage::External { len: 0, .. } | Storage::Device(_) => &mut [],
            // SAFETY: as in `bytes`, and `&mut self` makes this the only access.
            Storage::External { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
        }
    }
}

/// A dense tensor: element type, shape and bytes in native byte order, in host memory the
/// tensor owns (a `Vec<u8>`), in external host memory kept alive by an [`OwnerGuard`], or in
/// GPU memory ([`Tensor::from_device`]).
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
            .field("device", &self.device_memory())
            .finish()
    }
}

/// A clone of a host tensor is always owned (external memory is copied); a clone of a device
/// tensor aliases the same device memory (nothing is copied on the device) and shares its
/// guard and events.
impl Clone for Tensor {
    fn clone(&self) -> Self {
        let data = match &self.data {
            Storage::Device(d) => Storage::Device(DeviceStorage {
                mem: d.mem,
                #[cfg(feature = "cuda")]
                ready: d.ready.clone(),
                #[cfg(feature = "cuda")]
                done: d.done.clone(),
                _guard: Arc::clone(&d._guard),
            }),
            other => Storage::Owned(other.bytes().to_vec()),
        };
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data,
        }
    }
}

/// Equal dtype, shape and bytes (wherever they live); device tensors are equal when they
/// describe the same device memory.
impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.device_memory() == other.device_memory()
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

    /// A tensor in GPU memory the engine does not own, described by `mem`; `guard` keeps that
    /// memory alive and is dropped with the last clone of the tensor. `mem.len` must equal the
    /// shape's element count times the element size. Building one needs no GPU; submitting it
    /// needs an engine with the GPU path (see the [module docs](self)).
    ///
    /// # Safety
    ///
    /// Until the guard is dropped, `mem.ptr..mem.ptr + mem.len` must be memory of device
    /// `mem.device` that nothing else writes while an operation on it is in flight (reads and
    /// writes by the framework must be ordered after the completion events the handle's
    /// tensor carries), and `mem.stream` must be a live stream of that device (or 0).
    pub unsafe fn from_device(
        dtype: DType,
        shape: Vec<usize>,
        mem: DeviceMemory,
        guard: Box<dyn OwnerGuard>,
    ) -> Result<Self, SchedulerError> {
        let want = byte_len(dtype, &shape)?;
        if want != mem.len {
            return Err(SchedulerError::InvalidArgument(format!(
                "a {dtype} tensor of shape {shape:?} needs {want} bytes, the device buffer has {}",
                mem.len
            )));
        }
        if mem.ptr == 0 && mem.len > 0 {
            return Err(SchedulerError::InvalidArgument(
                "a null device pointer for a non-empty tensor".into(),
            ));
        }
        Ok(Tensor {
            dtype,
            shape,
            data: Storage::Device(DeviceStorage {
                mem,
                #[cfg(feature = "cuda")]
                ready: None,
                #[cfg(feature = "cuda")]
                done: Vec::new(),
                _guard: Arc::from(guard),
            }),
        })
    }

    /// Where the tensor lives: [`Device::Cpu`](fh_core::message::Device::Cpu), or the GPU of a
    /// device tensor.
    pub fn device(&self) -> fh_core::message::Device {
        match &self.data {
            Storage::Device(d) => fh_core::message::Device::Gpu(d.mem.device),
            _ => fh_core::message::Device::Cpu,
        }
    }

    /// Whether the tensor lives in GPU memory ([`Tensor::from_device`]).
    pub fn is_device(&self) -> bool {
        matches!(self.data, Storage::Device(_))
    }

    /// The device memory of a device tensor (`None` for a host tensor).
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        match &self.data {
            Storage::Device(d) => Some(d.mem),
            _ => None,
        }
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
        match &self.data {
            Storage::Device(d) => d.mem.len / self.dtype.size(),
            _ => self.data.bytes().len() / self.dtype.size(),
        }
    }

    /// Whether the bytes live in external memory ([`Tensor::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.data, Storage::External { .. })
    }

    /// The bytes (empty for a device tensor, whose bytes are not in host memory).
    pub fn data(&self) -> &[u8] {
        self.data.bytes()
    }

    /// The bytes, mutably (empty for a device tensor).
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.data.bytes_mut()
    }

    /// Take the bytes (a copy when they live in external memory, which is then released;
    /// empty for a device tensor).
    pub fn into_data(self) -> Vec<u8> {
        match self.data {
            Storage::Owned(v) => v,
            ext => ext.bytes().to_vec(),
        }
    }

    /// Copy the elements out as `T`, which must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, SchedulerError> {
        if let Some(m) = self.device_memory() {
            return Err(SchedulerError::InvalidArgument(format!(
                "the tensor lives on gpu:{}; copy it to the host first",
                m.device
            )));
        }
        if T::DTYPE != self.dtype {
            return Err(SchedulerError::InvalidArgument(format!(
                "tensor holds {} elements, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        Ok(read_vec(self.data()))
    }

    /// The readiness event recorded at submission (device tensors).
    #[cfg(feature = "cuda")]
    pub(crate) fn ready_event(&self) -> Option<&fh_transport::backend::cuda::CudaEvent> {
        match &self.data {
            Storage::Device(d) => d.ready.as_deref(),
            _ => None,
        }
    }

    /// Set the readiness event (device tensors; ignored otherwise).
    #[cfg(feature = "cuda")]
    pub(crate) fn set_ready(&mut self, ev: fh_transport::backend::cuda::CudaEvent) {
        if let Storage::Device(d) = &mut self.data {
            d.ready = Some(Arc::new(ev));
        }
    }

    /// Add a completion event (device tensors; ignored otherwise).
    #[cfg(feature = "cuda")]
    pub(crate) fn push_done(&mut self, ev: Arc<fh_transport::backend::cuda::CudaEvent>) {
        if let Storage::Device(d) = &mut self.data {
            d.done.push(ev);
        }
    }

    /// The completion events of a device tensor given back by a handle: one per channel that
    /// worked on it, recorded on that channel's stream after the collective (empty for a host
    /// tensor, or a device tensor not yet through the engine).
    #[cfg(feature = "cuda")]
    pub fn completion_events(&self) -> Vec<&fh_transport::backend::cuda::CudaEvent> {
        match &self.data {
            Storage::Device(d) => d.done.iter().map(|e| &**e).collect(),
            _ => Vec::new(),
        }
    }

    /// Make `stream` (a raw `CUstream` handle of the tensor's device, 0 for the legacy
    /// default stream) wait, on the device, for the tensor's completion events, so that work
    /// enqueued on it afterwards sees the result; no host synchronization. A no-op for a host
    /// tensor.
    ///
    /// # Safety
    /// `stream` is a live CUDA stream of the tensor's device (or 0).
    #[cfg(feature = "cuda")]
    pub unsafe fn wait_on_stream(&self, stream: u64) -> Result<(), SchedulerError> {
        for ev in self.completion_events() {
            // SAFETY: the caller's promise about `stream`; the event is alive (borrowed).
            unsafe {
                fh_transport::backend::cuda::stream_wait(
                    stream as usize as fh_transport::backend::cuda::CUstream,
                    ev,
                )
            }
            .map_err(SchedulerError::from_transport_owned)?;
        }
        Ok(())
    }

    /// Wait on the host, at most `timeout`, until the tensor's completion events have fired
    /// (a no-op for a host tensor).
    #[cfg(feature = "cuda")]
    pub fn wait_on_host(&self, timeout: std::time::Duration) -> Result<(), SchedulerError> {
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(20);
        for ev in self.completion_events() {
            loop {
                let done = ev.try_is_complete().map_err(|e| {
                    SchedulerError::InvalidArgument(format!("cuEventQuery failed: {e:?}"))
                })?;
                if done {
                    break;
                }
                if start.elapsed() >= timeout {
                    return Err(SchedulerError::InvalidArgument(format!(
                        "the device collective did not complete within {timeout:?}"
                    )));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(2));
            }
        }
        Ok(())
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
