//! The options every submission method takes.

use fh_core::message::Device;
use fh_core::ReduceOp;

use crate::SchedulerError;

/// Options of a collective: every `*_with` submission method takes them.
///
/// `op`, `prescale` and `postscale` apply to the reducing collectives (allreduce, grouped
/// allreduce, reduce-scatter) and must be left at their defaults otherwise; `priority` and
/// `device` apply to every collective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveOptions {
    /// The reduction (default `Average`, as in Horovod).
    pub op: ReduceOp,
    /// Factor applied to the input before the reduction (reducing collectives only).
    pub prescale: f64,
    /// Factor applied to the result (reducing collectives only).
    pub postscale: f64,
    /// Priority under `FH_PRIORITY=forward` (lower first, e.g. the layer index).
    pub priority: i64,
    /// Where the tensor lives (part of the negotiated signature).
    pub device: Device,
}

/// The options of an allreduce: [`CollectiveOptions`] under the name earlier releases used.
pub type AllreduceOptions = CollectiveOptions;

impl Default for CollectiveOptions {
    fn default() -> Self {
        CollectiveOptions {
            op: ReduceOp::Average,
            prescale: 1.0,
            postscale: 1.0,
            priority: 0,
            device: Device::Cpu,
        }
    }
}

impl CollectiveOptions {
    /// Default options with another reduce op.
    pub fn with_op(op: ReduceOp) -> Self {
        CollectiveOptions {
            op,
            ..Self::default()
        }
    }
    /// Set the reduce op.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }
    /// Set the prescale factor.
    pub fn prescale(mut self, f: f64) -> Self {
        self.prescale = f;
        self
    }
    /// Set the postscale factor.
    pub fn postscale(mut self, f: f64) -> Self {
        self.postscale = f;
        self
    }
    /// Set the priority.
    pub fn priority(mut self, p: i64) -> Self {
        self.priority = p;
        self
    }
    /// Set the device.
    pub fn device(mut self, d: Device) -> Self {
        self.device = d;
        self
    }
}

/// The options of a collective that reduces nothing: scale factors are refused (they would
/// be silently ignored), the op is normalised so that it never makes ranks disagree.
pub(crate) fn no_reduction(
    kind: &str,
    opts: CollectiveOptions,
) -> Result<CollectiveOptions, SchedulerError> {
    if opts.prescale != 1.0 || opts.postscale != 1.0 {
        return Err(SchedulerError::InvalidArgument(format!(
            "{kind} does not reduce: prescale and postscale factors apply only to allreduce and \
             reduce-scatter"
        )));
    }
    Ok(CollectiveOptions {
        op: ReduceOp::Sum,
        ..opts
    })
}
