//! The engine's GPU path: opening one device channel per data channel at start-up, checking
//! device submissions, and running device jobs on a channel (feature `cuda`).
//!
//! Negotiation stays on the host, unchanged: a device tensor's signature carries its device,
//! and the planner's fusion key includes it, so a fused group is all host memory or all one
//! GPU. A channel worker routes a group by that device: host groups through its host
//! communicator as before, device groups through its `DeviceChannel` (NCCL, or host staging
//! when a host runs more ranks than it has GPUs).
//!
//! Every refusal happens at submission, before negotiation, with the same text on every rank
//! that makes the same submission: a build without the feature, an engine started without
//! [`Config::cuda`], a tensor on another device than the engine's, or an operation the device
//! path does not run.

use fh_core::message::{CollectiveKind, Device};
use fh_core::{DType, ReduceOp};
use fh_transport::{CollectivesExt, Communicator, Topology, Transport};

use crate::{Config, SchedulerError};

/// What the engine knows of its GPU: `Ok` with the device ordinal the channels use (and, with
/// the feature, the context to record readiness events in), or why there is no GPU path.
pub(crate) struct GpuState {
    /// The device the channels were opened on, or why there are none.
    pub device: Result<u32, String>,
    /// How the device channels move bytes (GPU path open).
    pub mode: Option<fh_transport::backend::cuda::DeviceMode>,
    /// The device context (feature `cuda`, GPU path open).
    #[cfg(feature = "cuda")]
    pub ctx: Option<std::sync::Arc<fh_transport::backend::cuda::CudaContext>>,
}

/// Why the engine has no GPU path when it was not asked for one.
const NOT_REQUESTED: &str = "the engine was started without the GPU path; set FH_CUDA=1 (or \
     `Config::cuda(true)`) on every rank to open one NCCL channel per data channel at start-up";

impl GpuState {
    /// No GPU path, for `reason`.
    fn none(reason: String) -> Self {
        GpuState {
            device: Err(reason),
            mode: None,
            #[cfg(feature = "cuda")]
            ctx: None,
        }
    }
}

/// Whether the device path runs `kind` with `dtype`/`op` and the scale factors; `Err` says
/// why not and what to do instead. Pure: the same answer on every rank.
pub(crate) fn device_supports(
    kind: CollectiveKind,
    dtype: DType,
    op: ReduceOp,
    prescale: f64,
    postscale: f64,
) -> Result<(), String> {
    let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
    match kind {
        CollectiveKind::Allreduce => {
            if dtype == DType::I16 {
                return Err(
                    "NCCL has no 16-bit integer type: allreduce an int16 device tensor on the \
                     host, or as int32"
                        .into(),
                );
            }
            if matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr) && dtype != DType::Bool {
                return Err(format!(
                    "NCCL has no bitwise reductions ({op} on {dtype}); reduce this tensor on \
                     the host"
                ));
            }
            if op == ReduceOp::Average && !float {
                return Err(format!(
                    "an average of {dtype} device tensors is not supported (the device divides \
                     by scaling, for floating-point tensors only); use Sum, or a host tensor"
                ));
            }
            if !float && (prescale != 1.0 || postscale != 1.0) {
                return Err(format!(
                    "{dtype} device tensors cannot be scaled (device scaling covers f16, bf16, \
                     f32 and f64)"
                ));
            }
            Ok(())
        }
        CollectiveKind::Broadcast => Ok(()),
        other => Err(format!(
            "{other} of device tensors is not supported yet (allreduce and broadcast are); \
             copy the tensor to the host"
        )),
    }
}

/// The device a device tensor's signature carries: every rank drives exactly one GPU, whose
/// ordinal differs between the ranks of a host (local rank modulo the GPUs), so the
/// negotiated signature says "this rank's GPU" as `Gpu(0)` on every rank; the tensor's actual
/// ordinal is checked against the engine's at submission. Host and device tensors still never
/// share a fused group (the planner keys groups on the device).
pub(crate) const RANK_GPU: Device = Device::Gpu(0);

/// Check a submission of a tensor on `tensor_device` asking for `requested` against the
/// engine's GPU state; returns the device the signature carries ([`RANK_GPU`] for a device
/// tensor). Host tensors keep the host path unchanged (and may not claim a GPU).
pub(crate) fn check_submission(
    gpu: &GpuState,
    tensor_device: Device,
    requested: Device,
    kind: CollectiveKind,
    dtype: DType,
    op: ReduceOp,
    scales: (f64, f64),
) -> Result<Device, SchedulerError> {
    let bad = |m: String| Err(SchedulerError::InvalidArgument(m));
    let Device::Gpu(index) = tensor_device else {
        if requested != Device::Cpu {
            return bad(format!(
                "a host tensor was submitted with device {requested}; describe GPU memory with \
                 Tensor::from_device"
            ));
        }
        return Ok(Device::Cpu);
    };
    if requested != Device::Cpu && requested != tensor_device {
        return bad(format!(
            "the tensor lives on {tensor_device} but the options name {requested}"
        ));
    }
    if !fh_transport::backend::cuda::COMPILED {
        return bad(format!(
            "the tensor lives on {tensor_device}, but this build of fh-scheduler lacks the GPU \
             path (rebuild with the `cuda` feature: `--features fh-scheduler/cuda`, or \
             fh-torch's `cuda`)"
        ));
    }
    let ordinal = match &gpu.device {
        Ok(o) => *o,
        Err(reason) => return bad(format!("the tensor lives on {tensor_device}, but {reason}")),
    };
    if index != ordinal {
        return bad(format!(
            "the tensor lives on {tensor_device}, but this rank's engine drives gpu:{ordinal} \
             (local rank modulo the visible GPUs); move the tensor there"
        ));
    }
    device_supports(kind, dtype, op, scales.0, scales.1)
        .map_err(SchedulerError::InvalidArgument)?;
    Ok(RANK_GPU)
}

/// The GPU path at start-up: nothing unless `config.cuda`; otherwise every rank says whether
/// it can run the GPU path (an allgather on the control communicator, so that every rank
/// gives the same answer) and, when all can, opens one device channel per data channel, each
/// over a host communicator of its own. Collective.
pub(crate) fn open(
    transport: &mut dyn Transport,
    control: &mut dyn Communicator,
    config: &Config,
    topology: Topology,
    channels: usize,
) -> Result<(GpuState, Vec<DeviceChannelSlot>), SchedulerError> {
    if !config.cuda {
        return Ok((GpuState::none(NOT_REQUESTED.into()), Vec::new()));
    }
    let here = fh_transport::backend::cuda::available();
    let mut flags = vec![0u8; control.size()];
    control.allgather(&[u8::from(here.is_ok())], &mut flags)?;
    let missing: Vec<usize> = (0..flags.len()).filter(|&r| flags[r] == 0).collect();
    if !missing.is_empty() {
        let why = match here {
            Ok(_) => String::new(),
            Err(e) => format!("; here (rank {}): {e}", topology.rank),
        };
        return Err(SchedulerError::config(
            "FH_CUDA",
            format!("the GPU path was requested, but rank(s) {missing:?} cannot run it{why}"),
        ));
    }
    open_channels(transport, topology, channels)
}

/// A data channel's device twin (with the feature), or nothing.
#[cfg(feature = "cuda")]
pub(crate) type DeviceChannelSlot = fh_transport::backend::cuda::DeviceChannel;
/// A data channel's device twin (with the feature), or nothing.
#[cfg(not(feature = "cuda"))]
pub(crate) type DeviceChannelSlot = std::convert::Infallible;

#[cfg(not(feature = "cuda"))]
fn open_channels(
    _transport: &mut dyn Transport,
    _topology: Topology,
    _channels: usize,
) -> Result<(GpuState, Vec<DeviceChannelSlot>), SchedulerError> {
    // `available()` is an error without the feature, so every rank stopped above.
    Err(SchedulerError::config(
        "FH_CUDA",
        fh_transport::backend::cuda::NOT_COMPILED,
    ))
}

#[cfg(feature = "cuda")]
fn open_channels(
    transport: &mut dyn Transport,
    topology: Topology,
    channels: usize,
) -> Result<(GpuState, Vec<DeviceChannelSlot>), SchedulerError> {
    use fh_transport::backend::cuda::{CudaWorld, Staging};
    let mut world = CudaWorld::new(topology, Staging::Auto)?;
    if let Some(t) = transport_timeout() {
        world.set_timeout(t);
    }
    let ordinal = (topology.local_rank % world.devices().max(1)) as u32;
    let mut out = Vec::with_capacity(channels);
    for c in 0..channels {
        let label = format!("fh-cuda-{c}");
        let host = transport.open(&label)?;
        out.push(world.open(host, &label)?);
    }
    // Every channel agreed on the same mode (staging wins if any rank needs it).
    let mode = out.first().map_or(world.mode(), |c| c.mode());
    tracing::info!(
        rank = topology.rank,
        device = ordinal,
        mode = %mode,
        channels,
        "GPU path open"
    );
    Ok((
        GpuState {
            device: Ok(ordinal),
            mode: Some(mode),
            ctx: Some(world.context().clone()),
        },
        out,
    ))
}

/// `FH_TIMEOUT_SECONDS`, when set to a positive number.
#[cfg(feature = "cuda")]
pub(crate) fn transport_timeout() -> Option<std::time::Duration> {
    std::env::var("FH_TIMEOUT_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|t| t.is_finite() && *t > 0.0 && *t < 1e9)
        .map(std::time::Duration::from_secs_f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_gpu() -> GpuState {
        GpuState::none(NOT_REQUESTED.into())
    }

    #[test]
    fn host_tensors_keep_the_host_path_and_may_not_claim_a_gpu() {
        let g = no_gpu();
        let ok = check_submission(
            &g,
            Device::Cpu,
            Device::Cpu,
            CollectiveKind::Allgather,
            DType::I32,
            ReduceOp::Sum,
            (1.0, 1.0),
        );
        assert_eq!(ok.unwrap(), Device::Cpu);
        let e = check_submission(
            &g,
            Device::Cpu,
            Device::Gpu(0),
            CollectiveKind::Allreduce,
            DType::F32,
            ReduceOp::Sum,
            (1.0, 1.0),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("Tensor::from_device"), "{e}");
    }

    #[test]
    fn device_tensors_without_the_gpu_path_are_refused_naming_what_is_missing() {
        let e = check_submission(
            &no_gpu(),
            Device::Gpu(0),
            Device::Cpu,
            CollectiveKind::Allreduce,
            DType::F32,
            ReduceOp::Sum,
            (1.0, 1.0),
        )
        .unwrap_err()
        .to_string();
        if fh_transport::backend::cuda::COMPILED {
            assert!(e.contains("FH_CUDA=1"), "{e}");
        } else {
            assert!(
                e.contains("lacks the GPU path") && e.contains("cuda"),
                "{e}"
            );
        }
        let e = check_submission(
            &no_gpu(),
            Device::Gpu(0),
            Device::Gpu(1),
            CollectiveKind::Allreduce,
            DType::F32,
            ReduceOp::Sum,
            (1.0, 1.0),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("gpu:0") && e.contains("gpu:1"), "{e}");
    }

    #[test]
    fn a_tensor_on_another_gpu_is_refused() {
        let g = GpuState {
            device: Ok(1),
            mode: None,
            #[cfg(feature = "cuda")]
            ctx: None,
        };
        let r = check_submission(
            &g,
            Device::Gpu(0),
            Device::Cpu,
            CollectiveKind::Allreduce,
            DType::F32,
            ReduceOp::Sum,
            (1.0, 1.0),
        );
        if fh_transport::backend::cuda::COMPILED {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("drives gpu:1"), "{e}");
            let ok = check_submission(
                &g,
                Device::Gpu(1),
                Device::Cpu,
                CollectiveKind::Allreduce,
                DType::F32,
                ReduceOp::Average,
                (0.5, 2.0),
            );
            // Ranks on different GPUs negotiate the same signature.
            assert_eq!(ok.unwrap(), RANK_GPU);
        } else {
            assert!(r.unwrap_err().to_string().contains("lacks the GPU path"));
        }
    }

    #[test]
    fn device_support_matches_what_the_device_channel_runs() {
        use CollectiveKind as K;
        for dtype in DType::ALL {
            let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
            for op in ReduceOp::ALL {
                let r = device_supports(K::Allreduce, dtype, op, 1.0, 1.0);
                let bitwise = matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr);
                // NCCL has no int16 type: every int16 reduction stays on the host.
                let refused = (bitwise && dtype != DType::Bool)
                    || (op == ReduceOp::Average && !float)
                    || dtype == DType::I16;
                assert_eq!(r.is_err(), refused, "{dtype:?} {op:?}: {r:?}");
                let scaled = device_supports(K::Allreduce, dtype, ReduceOp::Max, 2.0, 1.0);
                assert_eq!(scaled.is_err(), !float, "{dtype:?}");
            }
            assert!(device_supports(K::Broadcast, dtype, ReduceOp::Sum, 1.0, 1.0).is_ok());
        }
        for k in [K::Allgather, K::Alltoall, K::ReduceScatter] {
            let e = device_supports(k, DType::F32, ReduceOp::Sum, 1.0, 1.0).unwrap_err();
            assert!(e.contains("copy the tensor to the host"), "{e}");
        }
    }
}
