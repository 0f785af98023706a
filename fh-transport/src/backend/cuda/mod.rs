//! The GPU path (Cargo feature `cuda`, off by default): collectives on CUDA device memory,
//! through NCCL, one NCCL communicator and one CUDA stream per channel.
//!
//! Build it with `cargo build --features fh-transport/cuda`. Building needs no CUDA toolkit and
//! no NCCL: the CUDA driver is reached through `cudarc` with dynamic loading (driver API only),
//! and NCCL through `fh_nccl_sys`, whose committed bindgen bindings are loaded at run time
//! from `libnccl.so.2` (`FH_NCCL_LIBRARY`, the loader's path, or the Python environment's
//! `nvidia/nccl/lib`, where PyTorch's `nvidia-nccl-cu12`/`-cu13` wheel puts it).
//!
//! # Shape
//! - [`probe`] asks, without touching anything that could panic, whether the driver, a device
//!   and NCCL are there ([`Probe`]).
//! - `CudaWorld::new` picks this rank's device (`local_rank % device count`) and the mode
//!   ([`DeviceMode`]): NCCL, or **host staging** when this host runs more ranks than it has
//!   GPUs (NCCL refuses two ranks on one GPU) — logged as a warning and reported by
//!   `CudaWorld::mode`. With no driver, no device, or (in NCCL mode) no NCCL, it returns
//!   [`TransportError::BackendUnavailable`](crate::TransportError::BackendUnavailable) naming
//!   what is missing and how to fix it; nothing panics.
//! - `CudaWorld::open` is collective, like [`Transport::open`](crate::Transport::open): it takes
//!   a host [`Communicator`](crate::Communicator) (the control plane), agrees on the mode over
//!   it, sends NCCL's unique id from rank 0 over it, and returns a `DeviceChannel`: one
//!   `DeviceCommunicator` (NCCL communicator, or the host communicator for staging), one CUDA
//!   stream, a device fusion buffer and the scaling kernels.
//! - `DeviceCommunicator` is the device twin of [`Communicator`](crate::Communicator): small
//!   and object-safe; NCCL provides allreduce, broadcast, allgather and reduce-scatter, and
//!   alltoall(v) is written once over grouped `ncclSend`/`ncclRecv`.
//! - `DeviceChannel` adds what is written once for every backend: readiness (the channel
//!   stream waits on the producer's CUDA event — no host synchronization), completion (an
//!   event recorded on the channel stream, which the framework's stream can wait on), fused
//!   allreduce (pack into the fusion buffer with device-to-device copies on the channel stream,
//!   prescale, reduce, postscale, unpack) and on-device scaling with a small PTX kernel
//!   (`scale.ptx`, generated from `scale.ll` by LLVM and loaded by the driver's JIT; no nvcc).
//!
//! Every operation is *enqueued* on the channel stream and returns at once; the memory it
//! names must stay valid until the completion event recorded after it has fired.
//!
//! # How the engine hooks in (fh-scheduler's `gpu` module, feature `cuda`)
//! One code path: a request's signature already carries its device, and the planner fuses only
//! tensors of one device, so a fused group is all host memory or all this rank's GPU.
//! 1. At start-up with `FH_CUDA=1` (agreed like the other planning settings), every rank
//!    reports `cuda::available().is_ok()` (an allgather on the control communicator, so every
//!    rank can name the ranks that cannot). If all can, each builds
//!    `CudaWorld::new(topology, Staging::Auto)` and, after the host data channels, opens one
//!    device twin per channel with `world.open(transport.open(label)?, label)` — collective,
//!    same order on every rank (it agrees on staging and carries NCCL's id).
//! 2. A device tensor (`fh_scheduler::Tensor::from_device`: pointer, device, the producer's
//!    stream, an owner guard) gets a readiness event `record_on_stream(ctx, stream)` at
//!    submission.
//! 3. The channel worker, for a device group: `wait_ready(&event)` for each tensor, then
//!    `allreduce_fused` over `DeviceBytesMut::from_raw` views (a partition chunk is its range
//!    of the tensor, reduced in place; an average is a sum with the division folded into the
//!    postscale) or `comm().broadcast`, then `record_completion()`. The tensor given back keeps
//!    that event: the framework's stream waits on it (`stream_wait`, no host sync), or the
//!    host does, bounded.
//! 4. Join: a joined rank contributes a zero-filled device buffer (allocated on the channel
//!    stream, freed once the group's completion event has fired).
//!
//! `fasthorovod.torch`'s `cuda_built()` and `nccl_built()` are [`COMPILED`]; whether a GPU and
//! NCCL are usable here is [`available`].
//!
//! # Limits
//! Device scaling covers `f16`, `bf16`, `f32` and `f64` (a factor other than 1 on an integer
//! tensor is an error). NCCL has no bitwise reductions (`BitAnd`/`BitOr` are refused, except on
//! `bool`, where they are `Min`/`Max`). `ncclCommInitRank` has no timeout: it runs on a helper
//! thread and opening a channel gives up after `CudaWorld::set_timeout` (default 120 s) with
//! an error, leaving that thread blocked in NCCL (nothing can cancel it). Waiting for
//! completion is bounded (`DeviceChannel::wait_completion`), and aborts the NCCL communicator
//! on timeout.

/// Whether this build of `fh-transport` contains the GPU path (Cargo feature `cuda`).
pub const COMPILED: bool = cfg!(feature = "cuda");

#[cfg(feature = "cuda")]
mod buffers;
#[cfg(feature = "cuda")]
mod channel;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_types;
#[cfg(feature = "cuda")]
mod scale;
#[cfg(feature = "cuda")]
mod staged;
#[cfg(feature = "cuda")]
mod world;

#[cfg(feature = "cuda")]
pub use buffers::{DeviceBytes, DeviceBytesMut};
#[cfg(feature = "cuda")]
pub use channel::DeviceChannel;
/// The CUDA types of the device API, re-exported so that callers (the engine, fh-torch) need
/// no direct `cudarc` dependency (tidy allows `cudarc` in fh-transport only).
#[cfg(feature = "cuda")]
pub use cudarc::driver::{
    sys::{CUdeviceptr, CUstream},
    CudaContext, CudaEvent, CudaSlice, CudaStream,
};
#[cfg(feature = "cuda")]
pub use device::DeviceCommunicator;
#[cfg(feature = "cuda")]
pub use driver::{record_on_stream, stream_wait};
#[cfg(feature = "cuda")]
pub use world::{CudaWorld, Staging, DEFAULT_INIT_TIMEOUT};

/// How a device channel moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceMode {
    /// NCCL, device to device: the host is not in the data path.
    Nccl,
    /// Host staging: device → host copy, the host transport's collective, host → device copy.
    /// Used when a host runs more ranks than it has GPUs (NCCL refuses two ranks on one GPU).
    HostStaged,
}

impl std::fmt::Display for DeviceMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceMode::Nccl => "nccl",
            DeviceMode::HostStaged => "host-staged",
        })
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Whether the CUDA driver library (`libcuda.so.1`) could be loaded and initialised.
    pub driver: bool,
    /// Number of visible CUDA devices (0 without a driver).
    pub devices: usize,
    /// NCCL's version `(major, minor, patch)`, or why it could not be loaded.
    pub nccl: Result<(u32, u32, u32), String>,
}

/// Whether the GPU path could run here: the driver, the device count and NCCL, found without
/// anything that could panic or abort. Without the `cuda` feature: no driver, no devices, and
/// NCCL "not compiled in".
pub fn probe() -> Probe {
    #[cfg(feature = "cuda")]
    {
        driver::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Probe {
            driver: false,
            devices: 0,
            nccl: Err(NOT_COMPILED.into()),
        }
    }
}

/// Why the GPU path is missing from a build without the feature, and how to get it.
pub const NOT_COMPILED: &str = "this build does not include the GPU path; rebuild with \
     `cargo build --features fh-transport/cuda` (needs no CUDA toolkit: the driver and \
     libnccl.so.2 are loaded at run time)";

/// The GPU path's availability as a `Result`: `Ok` when it could run here (driver, a device,
/// and NCCL), else [`TransportError::BackendUnavailable`](crate::TransportError::BackendUnavailable)
/// saying what is missing and how to fix it.
pub fn available() -> crate::Result<Probe> {
    let p = probe();
    let unavailable = |reason: String| crate::TransportError::BackendUnavailable {
        backend: "nccl",
        reason,
    };
    if !COMPILED {
        return Err(unavailable(NOT_COMPILED.into()));
    }
    if !p.driver {
        return Err(unavailable(NO_DRIVER.into()));
    }
    if p.devices == 0 {
        return Err(unavailable(NO_DEVICE.into()));
    }
    if let Err(e) = &p.nccl {
        return Err(unavailable(e.clone()));
    }
    Ok(p)
}

/// The message for a machine without the CUDA driver.
pub(crate) const NO_DRIVER: &str = "no CUDA driver: libcuda.so.1 could not be loaded or \
     initialised; install NVIDIA's driver (and check `nvidia-smi`), or put the directory of \
     libcuda.so.1 on LD_LIBRARY_PATH; CPU tensors use the host transports";

/// The message for a driver that sees no device.
pub(crate) const NO_DEVICE: &str = "the CUDA driver sees no GPU (check `nvidia-smi` and \
     CUDA_VISIBLE_DEVICES)";

#[cfg(test)]
mod tests {
    use super::*;

    /// Many threads probing at once (several engines or process sets starting together) all
    /// get the same answer, and nothing crashes: the driver is checked once per process and
    /// NCCL is loaded once and never unloaded.
    #[test]
    fn probing_from_many_threads_at_once_agrees() {
        const THREADS: usize = 16;
        let start = std::sync::Barrier::new(THREADS);
        let seen: Vec<(Probe, std::result::Result<Probe, String>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        (probe(), available().map_err(|e| e.to_string()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a probing thread panicked"))
                .collect()
        });
        let first = &seen[0];
        assert!(seen.iter().all(|s| s == first), "{seen:?}");
        let again = (probe(), available().map_err(|e| e.to_string()));
        assert_eq!(&again, first);
        if !first.0.driver {
            assert!(first.1.as_ref().is_err_and(|e| !e.is_empty()));
        }
    }

    /// Without a driver (CI), the GPU path says so clearly; with one, it reports devices.
    #[test]
    fn availability_is_a_clear_error_or_a_device() {
        match available() {
            Ok(p) => {
                assert!(p.driver && p.devices > 0 && p.nccl.is_ok(), "{p:?}");
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    matches!(
                        e,
                        crate::TransportError::BackendUnavailable {
                            backend: "nccl",
                            ..
                        }
                    ),
                    "{msg}"
                );
                let p = probe();
                if !COMPILED {
                    assert!(msg.contains("--features fh-transport/cuda"), "{msg}");
                } else if !p.driver {
                    assert!(msg.contains("libcuda.so.1"), "{msg}");
                } else if p.devices == 0 {
                    assert!(msg.contains("sees no GPU"), "{msg}");
                } else {
                    assert!(msg.contains("libnccl.so.2"), "{msg}");
                }
            }
        }
    }
}
