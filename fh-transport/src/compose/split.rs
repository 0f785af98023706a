//! Engine mixing: the control plane over one backend, the data plane over another.
//!
//! `FH_TRANSPORT=CONTROL+DATA` (for example `mpi+tcp`: negotiation over MPI, tensors over TCP,
//! or `tcp+mpi`) builds both worlds and routes every communicator by its [`Role`]: the
//! scheduler's control communicator ([`Transport::open_as`] with [`Role::Control`]) opens on
//! the control world, everything else (data, and a plain [`Transport::open`]) on the data
//! world. Both worlds must number the ranks identically, which
//! holds when one launcher started them (`mpirun` sets both MPI's ranks and the
//! `OMPI_COMM_WORLD_*` variables TCP reads); this is checked.

use crate::{Communicator, Result, Role, Topology, Transport, TransportError};

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

    fn wire(&self) -> crate::WireKind {
        self.data.wire()
    }

    fn topology(&self) -> Topology {
        self.data.topology()
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
        self.data.open(label)
    }

    fn open_as(&mut self, role: Role, label: &str) -> Result<Box<dyn Communicator>> {
        match role {
            Role::Control => self.control.open(label),
            Role::Data => self.data.open(label),
        }
    }

    fn liveness(&self) -> Option<crate::liveness::Watch> {
        self.data.liveness().or_else(|| self.control.liveness())
    }

    fn stream_choice(&self) -> Option<crate::backend::tcp::StreamChoice> {
        self.data.stream_choice()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::backend::local::LocalWorld;
    use crate::{CollectivesExt, WireKind};
    use fh_core::ReduceOp;

    /// A world that writes down which labels it opened.
    struct Recording {
        inner: Box<dyn Transport>,
        name: &'static str,
        log: Arc<Mutex<Vec<(&'static str, String)>>>,
    }

    impl Transport for Recording {
        fn backend(&self) -> &'static str {
            self.inner.backend()
        }
        fn wire(&self) -> WireKind {
            self.inner.wire()
        }
        fn topology(&self) -> Topology {
            self.inner.topology()
        }
        fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>> {
            self.log
                .lock()
                .unwrap()
                .push((self.name, label.to_string()));
            self.inner.open(label)
        }
    }

    #[test]
    fn routes_by_role_and_checks_ranks() {
        let handles: Vec<_> = LocalWorld::new(2)
            .into_iter()
            .zip(LocalWorld::new(2))
            .map(|(c, d)| {
                std::thread::spawn(move || {
                    let log = Arc::new(Mutex::new(Vec::new()));
                    let control = Recording {
                        inner: Box::new(c),
                        name: "control",
                        log: Arc::clone(&log),
                    };
                    let data = Recording {
                        inner: Box::new(d),
                        name: "data",
                        log: Arc::clone(&log),
                    };
                    let mut t =
                        SplitTransport::new(Box::new(control), Box::new(data)).expect("split");
                    // Interleaved opens: each world sees its own sequence.
                    let mut ctl = t.open_as(Role::Control, "negotiation").expect("control");
                    let mut data = t.open_as(Role::Data, "fh-channel-0").expect("data");
                    let _plain = t.open("fh-control").expect("a plain open is data");
                    let mut v = [t.rank() as i32 + 1; 2];
                    data.allreduce_typed(&mut v, ReduceOp::Sum).expect("data");
                    let mut w = [t.rank() as i32; 1];
                    ctl.allreduce_typed(&mut w, ReduceOp::Max).expect("control");
                    let opened = log.lock().unwrap().clone();
                    (v, w, opened)
                })
            })
            .collect();
        for h in handles {
            let (v, w, opened) = h.join().expect("rank");
            assert_eq!((v, w), ([3, 3], [1]));
            let want: Vec<(&str, String)> = vec![
                ("control", "negotiation".into()),
                ("data", "fh-channel-0".into()),
                ("data", "fh-control".into()),
            ];
            assert_eq!(opened, want, "roles, never labels, pick the world");
        }
        let mut a = LocalWorld::new(2).into_iter();
        let b = LocalWorld::new(3).into_iter().next().expect("rank");
        let err = SplitTransport::new(Box::new(a.next().expect("rank")), Box::new(b))
            .expect_err("sizes differ");
        assert!(matches!(err, TransportError::Config { .. }), "{err}");
    }
}
