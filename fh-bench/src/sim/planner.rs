//! The engine's planner as the model drives it: fh-core's own planner with the options the
//! engine derives from its configuration, the channel load carried from round to round.

use fh_core::fusion::{plan_round_on, ChannelLoad, FusionKey, Group, PlanItem, PlanOptions};
use fh_core::message::{CollectiveKind, Device};
use fh_core::{DType, ReduceOp};

use super::Schedule;

/// What the replay submits: f32 gradients averaged over the ranks.
const GRADIENT_KEY: FusionKey = FusionKey {
    kind: CollectiveKind::Allreduce,
    dtype: DType::F32,
    op: ReduceOp::Average,
    device: Device::Cpu,
    prescale: 0x3FF0_0000_0000_0000, // 1.0
    postscale: 0x3FF0_0000_0000_0000,
};

/// The engine's planner (fh-core's [`plan_round_on`], with the options the engine derives from
/// its configuration and the channel load carried from round to round), driven by the model.
#[derive(Debug, Clone)]
pub struct ModelPlanner {
    opts: PlanOptions,
    load: ChannelLoad,
}

impl ModelPlanner {
    /// The planner of `sched`'s engine configuration, before the first round.
    pub fn new(sched: &Schedule) -> Self {
        let opts = sched.config().plan_options();
        ModelPlanner {
            load: ChannelLoad::new(opts.channels),
            opts,
        }
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.opts.channels.max(1)
    }

    /// Plan one negotiated round of f32 gradients of `sizes` bytes, in ready order, with the
    /// channels of `idle` idle everywhere when the round started (bit `c` = channel `c`).
    pub fn round(&mut self, sizes: &[u64], idle: u64) -> Vec<Group> {
        let items: Vec<PlanItem> = sizes
            .iter()
            .map(|&bytes| PlanItem {
                key: GRADIENT_KEY,
                bytes,
                elem: 4,
                priority: 0,
                group: None,
            })
            .collect();
        plan_round_on(&items, &self.opts, &mut self.load, idle)
    }
}
