//! Engine mixing: the control plane over one backend, the data plane over another.
//!
//! `FH_TRANSPORT=CONTROL+DATA` (for example `mpi+tcp`: negotiation over MPI, tensors over TCP,
//! or `tcp+mpi`) builds both worlds and routes every [`Transport::open`] by its label: labels
//! containing `control` (the scheduler's `fh-control`) open on the control world, all others
//! (`fh-channel-N`) on the data world. Both worlds must number the ranks identically, which
//! holds when one launcher started them (`mpirun` sets both MPI's ranks and the
//! `OMPI_COMM_WORLD_*` variables TCP reads); this is checked.

use crate::{Communicator, Result, Topology, Transport, TransportError};

/// A world whose control communicators come from one backend and data communicators from
/// another.
pub struct SplitTransport {
    control: Box<dyn Transport>,
    data: Box<dyn Transport>,
    name: &'static str,
}

impl std::fmt::Debug for SplitTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitTransport")
            .field("backend", &self.name)
            .field("topology", &self.data.topology())
            .finish()
    }
}

/// Whether a communicator label belongs to the control plane.
pub fn is_control_label(label: &str) -> bool {
    label.contains("control")
}

impl SplitTransport {
    /// Combine two worlds of the same ranks. Errors when they disagree on rank or size.
    pub fn new(control: Box<dyn Transport>, data: Box<dyn Transport>) -> Result<Self> {
        let (c, d) = (control.topology(), data.topology());
        if (c.rank, c.size) != (d.rank, d.size) {
            return Err(TransportError::Config {
                var: "FH_TRANSPORT".into(),
                reason: format!(
                    "the control backend '{}' sees rank {} of {} but the data backend '{}' sees \
                     rank {} of {}; start both from one launcher (mpirun or fhrun --mpi)",
                    control.backend(),
                    c.rank,
                    c.size,
                    data.backend(),
                    d.rank,
                    d.size
                ),
            });
        }
        let name = match (control.backend(), data.backend()) {
            ("mpi", "tcp") => "mpi+tcp",
            ("tcp", "mpi") => "tcp+mpi",
            ("mpi", "shm") => "mpi+shm",
            ("shm", "mpi") => "shm+mpi",
            ("tcp", "shm") => "tcp+shm",
            ("shm", "tcp") => "shm+tcp",
            _ => "split",
        };
        Ok(SplitTransport {
            control,
            data,
            name,
        })
    }
}

impl Transport for SplitTransport {
    fn backend(&self) -> &'static str {
        self.name
    }

    fn topology(&self) -> Topology {
        self.data.topology()
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        if is_control_label(label) {
            self.control.open(label)
        } else {
            self.data.open(label)
        }
    }

    fn liveness(&self) -> Option<crate::liveness::Watch> {
        self.data.liveness().or_else(|| self.control.liveness())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::local::LocalWorld;
    use crate::CollectivesExt;
    use fh_core::ReduceOp;

    #[test]
    fn routes_by_label_and_checks_ranks() {
        let handles: Vec<_> = LocalWorld::new(2)
            .into_iter()
            .zip(LocalWorld::new(2))
            .map(|(c, d)| {
                std::thread::spawn(move || {
                    let mut t = SplitTransport::new(Box::new(c), Box::new(d)).expect("split");
                    // Interleaved opens: each world sees its own sequence.
                    let mut ctl = t.open("fh-control").expect("control");
                    let mut data = t.open("fh-channel-0").expect("data");
                    let mut v = [t.rank() as i32 + 1; 2];
                    data.allreduce_typed(&mut v, ReduceOp::Sum).expect("data");
                    let mut w = [t.rank() as i32; 1];
                    ctl.allreduce_typed(&mut w, ReduceOp::Max).expect("control");
                    (v, w)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().expect("rank"), ([3, 3], [1]));
        }
        let mut a = LocalWorld::new(2).into_iter();
        let b = LocalWorld::new(3).into_iter().next().expect("rank");
        let err = SplitTransport::new(Box::new(a.next().expect("rank")), Box::new(b))
            .expect_err("sizes differ");
        assert!(matches!(err, TransportError::Config { .. }), "{err}");
        assert!(is_control_label("fh-control") && !is_control_label("fh-channel-3"));
    }
}
