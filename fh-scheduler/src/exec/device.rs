//! Running a fused group of device tensors on a channel's device twin (feature `cuda`): the
//! channel stream waits for each tensor's readiness event, runs the collective, and records
//! the completion event the tensors keep. The GPU path's start-up and state live in
//! `crate::gpu`, which imports nothing of execution.

use fh_core::message::CollectiveKind;
use fh_core::ReduceOp;

use crate::job::Job;

/// How long a channel waits on the host for device work it must see finished (a joined
/// rank's zero buffers): `FH_TIMEOUT_SECONDS`, else 5 minutes.
#[cfg(feature = "cuda")]
fn completion_timeout() -> std::time::Duration {
    crate::gpu::transport_timeout().unwrap_or(std::time::Duration::from_secs(300))
}

/// Run a device job on `ch`: the channel stream waits for each tensor's readiness event,
/// runs the collective (fused allreduce with the scale factors, or broadcast), and records a
/// completion event that every tensor of the job keeps.
#[cfg(feature = "cuda")]
pub(crate) fn run_job(
    ch: &mut fh_transport::backend::cuda::DeviceChannel,
    job: &Job,
    sig: &fh_core::message::Signature,
) -> Result<(), fh_transport::TransportError> {
    use fh_transport::backend::cuda::DeviceBytesMut;
    use fh_transport::TransportError;
    use std::sync::Arc;

    // Device ranges of the parts; a joined rank's host zeros get a zeroed device buffer.
    let mut ranges: Vec<(u64, usize)> = Vec::with_capacity(job.parts.len());
    let mut temps = Vec::new();
    for (op, off, len) in &job.parts {
        let st = op.lock();
        let Some(t) = &st.tensor else {
            return Err(TransportError::Internal(format!(
                "'{}' lost its tensor",
                op.name()
            )));
        };
        match t.device_memory() {
            Some(m) => {
                if off.checked_add(*len).is_none_or(|end| end > m.len) {
                    return Err(TransportError::Internal(format!(
                        "part {off}+{len} of '{}' out of range",
                        op.name()
                    )));
                }
                if let Some(ev) = t.ready_event() {
                    ch.wait_ready(ev)?;
                }
                ranges.push((m.ptr + *off as u64, *len));
            }
            None => {
                // A joined rank contributes zeros (host tensor of the same signature).
                let mut z = ch.stream().alloc_zeros::<u8>((*len).max(1)).map_err(|e| {
                    TransportError::Device {
                        op: "cuMemAlloc (join zeros)".into(),
                        detail: format!("{e:?}"),
                    }
                })?;
                // SAFETY: `z` is kept in `temps` until the work using it has completed.
                let p = unsafe { DeviceBytesMut::from_slice(&mut z, ch.stream()) }.device_ptr();
                temps.push(z);
                ranges.push((p, *len));
            }
        }
    }
    // SAFETY: each range is device memory of a tensor held by its op (kept alive by its guard
    // until the tensor is dropped, after completion as the framework orders it), or a
    // zero buffer held in `temps`; the planner gives every byte to exactly one part.
    let mut bufs: Vec<DeviceBytesMut<'_>> = ranges
        .iter()
        .map(|&(p, l)| unsafe { DeviceBytesMut::from_raw(p, l) })
        .collect();
    match sig.kind {
        CollectiveKind::Allreduce => {
            // Average: sum, then divide by every rank (a joined one contributes zeros).
            let (op, post) = if sig.op == ReduceOp::Average {
                (ReduceOp::Sum, sig.postscale / job.divisor.max(1) as f64)
            } else {
                (sig.op, sig.postscale)
            };
            ch.allreduce_fused(&mut bufs, sig.dtype, op, sig.prescale, post)?;
        }
        CollectiveKind::Broadcast => {
            for b in bufs.iter_mut() {
                ch.comm().broadcast(b.reborrow(), sig.root as usize)?;
            }
        }
        other => {
            return Err(TransportError::Internal(format!(
                "{other} of device tensors reached a channel"
            )))
        }
    }
    drop(bufs);
    let done = Arc::new(ch.record_completion()?);
    if !temps.is_empty() {
        ch.wait_completion(&done, completion_timeout())?;
        drop(temps);
    }
    for (op, _, _) in &job.parts {
        if let Some(t) = &mut op.lock().tensor {
            t.push_done(Arc::clone(&done));
        }
    }
    Ok(())
}
