//! Owned host tensors: what is submitted to the engine and what a handle gives back.
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

use fh_core::{DType, Element};

use crate::SchedulerError;

/// A dense host tensor: element type, shape and bytes in native byte order.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl Tensor {
    /// A tensor from raw bytes; `data.len()` must equal the shape's element count times the
    /// element size.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self, SchedulerError> {
        let want = elements(&shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| SchedulerError::InvalidArgument(format!("shape {shape:?} overflows")))?;
        if want != data.len() {
            return Err(SchedulerError::InvalidArgument(format!(
                "a {dtype} tensor of shape {shape:?} needs {want} bytes, the buffer has {}",
                data.len()
            )));
        }
        Ok(Tensor { dtype, shape, data })
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
            data: bytemuck::cast_slice::<T, u8>(values).to_vec(),
        }
    }

    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Self, SchedulerError> {
        let n = elements(&shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| SchedulerError::InvalidArgument(format!("shape {shape:?} overflows")))?;
        Ok(Tensor {
            dtype,
            shape,
            data: vec![0; n],
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
        self.data.len() / self.dtype.size()
    }

    /// The bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The bytes, mutably.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// Take the bytes.
    pub fn into_data(self) -> Vec<u8> {
        self.data
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
        Ok(read_vec(&self.data))
    }

    pub(crate) fn from_parts(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Self {
        Tensor { dtype, shape, data }
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
}
