//! A rank's GPU world (`CudaWorld`): the driver probe, its device, the mode its channels use
//! (NCCL, or host staging when ranks outnumber GPUs), and opening device channels.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result as cu, CudaContext};
use fh_core::ReduceOp;

use super::channel::DeviceChannel;
use super::device::DeviceCommunicator;
use super::driver::{cuda_err, driver_present};
use super::{nccl::NcclComm, staged::StagedComm, DeviceMode};
use crate::{CollectivesExt, Communicator, Result, Topology, TransportError};

/// Whether to stage through the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Staging {
    /// Stage only when this host runs more ranks than it has GPUs.
    #[default]
    Auto,
    /// Always stage (for tests of the staged path on machines with enough GPUs).
    Always,
}

/// NCCL, unless staging is forced or this host runs more ranks than it has GPUs (NCCL refuses
/// two ranks on one GPU).
pub(crate) fn choose_mode(local_size: usize, devices: usize, staging: Staging) -> DeviceMode {
    if staging == Staging::Always || local_size > devices {
        DeviceMode::HostStaged
    } else {
        DeviceMode::Nccl
    }
}

/// A rank's GPU world: its device context and the mode its channels will use.
#[derive(Debug)]
pub struct CudaWorld {
    ctx: Arc<CudaContext>,
    topology: Topology,
    mode: DeviceMode,
    devices: usize,
    timeout: Duration,
}

/// How long opening a device channel waits for NCCL's initialisation, unless
/// [`CudaWorld::set_timeout`] says otherwise.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);

impl CudaWorld {
    /// Probe the driver and NCCL, pick device `local_rank % devices` and the mode (NCCL, or
    /// host staging when `local_size > devices` or `staging` is `Always`). Errors, never
    /// panics, when the driver, a device or (NCCL mode) NCCL is missing.
    pub fn new(topology: Topology, staging: Staging) -> Result<Self> {
        let unavailable = |reason: String| TransportError::BackendUnavailable {
            backend: "nccl",
            reason,
        };
        if !driver_present() {
            return Err(unavailable(super::NO_DRIVER.into()));
        }
        cu::init().map_err(|e| {
            unavailable(format!(
                "the CUDA driver failed to initialise ({e:?}); check `nvidia-smi`"
            ))
        })?;
        let devices = cu::device::get_count()
            .map_err(cuda_err("cuDeviceGetCount"))
            .map(|n| usize::try_from(n).unwrap_or(0))?;
        if devices == 0 {
            return Err(unavailable(super::NO_DEVICE.into()));
        }
        let mode = choose_mode(topology.local_size, devices, staging);
        if mode == DeviceMode::Nccl {
            fh_nccl_sys::load().map_err(|e| unavailable(e.to_string()))?;
        }
        let ordinal = topology.local_rank % devices;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        if mode == DeviceMode::HostStaged && staging == Staging::Auto {
            tracing::warn!(
                local_ranks = topology.local_size,
                gpus = devices,
                "this host runs {} ranks but sees {} GPU(s), and NCCL refuses two ranks on one \
                 GPU: device collectives are staged through host memory over the host \
                 transport (slower); give each rank its own GPU to use NCCL",
                topology.local_size,
                devices
            );
        }
        Ok(CudaWorld {
            ctx,
            topology,
            mode,
            devices,
            timeout: DEFAULT_INIT_TIMEOUT,
        })
    }

    /// How long [`CudaWorld::open`] waits for NCCL's initialisation (the engine passes its
    /// `FH_TIMEOUT_SECONDS`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The mode chosen locally (channels agree on one: staging wins if any rank needs it).
    pub fn mode(&self) -> DeviceMode {
        self.mode
    }

    /// This rank's device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Number of GPUs this process sees.
    pub fn devices(&self) -> usize {
        self.devices
    }

    /// Collectively open a device channel. `host` is a communicator over the same ranks,
    /// opened from the host transport (every rank opens it in the same order); it carries the
    /// mode agreement and NCCL's unique id, and in host-staged mode the data itself.
    pub fn open(&mut self, mut host: Box<dyn Communicator>, label: &str) -> Result<DeviceChannel> {
        if host.size() != self.topology.size || host.rank() != self.topology.rank {
            return Err(TransportError::InvalidArgument(format!(
                "device channel {label}: the host communicator is rank {} of {}, but this world \
                 is rank {} of {}",
                host.rank(),
                host.size(),
                self.topology.rank,
                self.topology.size
            )));
        }
        // Agree on the mode: if any rank must stage, all do (NCCL needs every rank).
        let mut staged = [u8::from(self.mode == DeviceMode::HostStaged)];
        host.allreduce_typed(&mut staged, ReduceOp::Max)?;
        let mode = if staged[0] == 1 {
            DeviceMode::HostStaged
        } else {
            DeviceMode::Nccl
        };
        if mode != self.mode {
            tracing::warn!(
                channel = label,
                "another rank must stage device collectives through the host; this channel \
                 does too"
            );
        }
        let stream = self.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let comm: Box<dyn DeviceCommunicator> = match mode {
            DeviceMode::Nccl => Box::new(NcclComm::connect(
                &mut *host,
                stream.clone(),
                label,
                self.timeout,
            )?),
            DeviceMode::HostStaged => Box::new(StagedComm::new(host, stream.clone())),
        };
        DeviceChannel::new(comm, self.ctx.clone(), stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_when_ranks_outnumber_gpus() {
        assert_eq!(choose_mode(1, 1, Staging::Auto), DeviceMode::Nccl);
        assert_eq!(choose_mode(8, 8, Staging::Auto), DeviceMode::Nccl);
        assert_eq!(choose_mode(2, 1, Staging::Auto), DeviceMode::HostStaged);
        assert_eq!(choose_mode(9, 8, Staging::Auto), DeviceMode::HostStaged);
        assert_eq!(choose_mode(1, 8, Staging::Always), DeviceMode::HostStaged);
    }

    /// With no driver (CI), choosing the GPU path is a clear error, not a panic.
    #[test]
    fn without_a_driver_the_world_is_unavailable() {
        if driver_present() {
            eprintln!("skipped: a CUDA driver is present (the GPU tests cover this machine)");
            return;
        }
        let err = CudaWorld::new(Topology::single_host(0, 1), Staging::Auto).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                TransportError::BackendUnavailable {
                    backend: "nccl",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("libcuda.so.1") && msg.contains("nvidia-smi"),
            "{msg}"
        );
    }
}
