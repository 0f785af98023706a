//! [`Communicator::allreduce_parts`](crate::Communicator::allreduce_parts) of the hierarchical
//! communicator: a few small parts with their own dtype and op (the negotiation's bit vector
//! and the allreduces that ride in it), each step one collective for all of them.

use super::{on_shm, HierComm, View};
use crate::{algorithms, Communicator, Result};

impl HierComm {
    /// Through the leaders: the host's ranks in shared memory, the leaders over TCP, the
    /// leader's result back in shared memory; above the ring threshold one allreduce per part.
    pub(super) fn allreduce_parts_via_leaders(
        &mut self,
        buf: &mut [u8],
        parts: &[algorithms::ReducePart],
    ) -> Result<()> {
        algorithms::check_parts(buf.len(), parts)?;
        if self.topology.size == 1 || buf.is_empty() {
            return Ok(());
        }
        if buf.len() >= algorithms::ALLREDUCE_RING_THRESHOLD_BYTES {
            return algorithms::allreduce_each_part(self, buf, parts);
        }
        let combining: Vec<algorithms::ReducePart> = parts
            .iter()
            .map(|p| algorithms::ReducePart {
                op: p.op.combining(),
                ..*p
            })
            .collect();
        self.guarded(|c| {
            on_shm(c.shm.allreduce_parts(buf, &combining))?;
            if c.topology.local_rank == 0 {
                c.on_view(View::Leaders, |g| {
                    algorithms::allreduce_parts(g, buf, &combining)
                })?;
            }
            on_shm(c.shm.broadcast(buf, 0))
        })?;
        algorithms::divide_average_parts(parts, buf, self.topology.size)
    }
}
