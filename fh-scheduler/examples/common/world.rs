//! One launcher-built world shared by several engines started one after another in the same
//! process (`fh_transport::from_env()` may run only once per process: MPI initialises once, the
//! TCP rendezvous happens once). Each engine opens its own communicators on it.

use std::sync::{Arc, Mutex};

use fh_transport::{Communicator, Topology, Transport};

/// A cloneable handle on a world; `open` is forwarded to the shared world.
#[derive(Clone)]
pub struct SharedWorld {
    inner: Arc<Mutex<Box<dyn Transport>>>,
    backend: &'static str,
    topology: Topology,
    wire: fh_transport::WireKind,
}

impl SharedWorld {
    /// Wrap `world`.
    pub fn new(world: Box<dyn Transport>) -> Self {
        let (backend, topology, wire) = (world.backend(), world.topology(), world.wire());
        SharedWorld {
            inner: Arc::new(Mutex::new(world)),
            backend,
            topology,
            wire,
        }
    }

    /// A handle to give to `Engine::start`.
    pub fn handle(&self) -> Box<dyn Transport> {
        Box::new(self.clone())
    }
}

impl Transport for SharedWorld {
    fn backend(&self) -> &'static str {
        self.backend
    }

    fn wire(&self) -> fh_transport::WireKind {
        self.wire
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn open(&mut self, label: &str) -> fh_transport::Result<Box<dyn Communicator>> {
        let mut world = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        world.open(label)
    }
}

impl SharedWorld {
    /// This rank.
    pub fn topology_rank(&self) -> usize {
        self.topology.rank
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend
    }
}
