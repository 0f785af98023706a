//! The MPI world: `MPI_COMM_WORLD` as a [`Transport`], checked against the launcher's size and
//! every rank's release, opening one duplicated communicator per [`Transport::open`].

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;

use mpi::ffi;

use super::call::wait_request;
use super::comm::MpiComm;
use super::runtime::{success, unavailable, CommHandle, Runtime, ThreadMode};

use crate::{Result, Topology, Transport, TransportError};

/// A world of MPI ranks (`MPI_COMM_WORLD`), able to open independent communicators.
///
/// ```no_run
/// # fn main() -> fh_transport::Result<()> {
/// use fh_core::ReduceOp;
/// use fh_transport::{backend::mpi::MpiTransport, CollectivesExt, Transport};
///
/// let mut world = MpiTransport::new()?; // under `mpirun -np N`
/// let mut comm = world.open("data")?;
/// let mut v = [world.rank() as f32; 4];
/// comm.allreduce_typed(&mut v, ReduceOp::Sum)?;
/// # Ok(())
/// # }
/// ```
pub struct MpiTransport {
    pub(super) world: CommHandle,
    pub(super) topology: Topology,
    pub(super) opened: usize,
}

// SAFETY: the MPI handles it holds may be used from any thread: MPI_THREAD_MULTIPLE allows it,
// and in serialized mode every call goes through the runtime's lock.
unsafe impl Send for MpiTransport {}

impl fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiTransport")
            .field("topology", &self.topology)
            .field("mode", &self.world.rt.mode)
            .field("opened", &self.opened)
            .finish()
    }
}

impl MpiTransport {
    /// Initialise MPI (or join the MPI the host program initialised) and build the world.
    ///
    /// Errors: [`TransportError::BackendUnavailable`] when MPI cannot be initialised (or was
    /// finalized already), [`TransportError::Config`] when `FH_SIZE` says the job has another
    /// size than MPI does (ranks started without `mpirun` become MPI singletons) or
    /// `FH_MPI_THREAD_LEVEL` is invalid.
    pub fn new() -> Result<Self> {
        let rt = Runtime::acquire()?;
        let world = {
            let _guard = rt.lock();
            // SAFETY: placeholder handle, overwritten by MPI_Comm_dup.
            let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
            // SAFETY: MPI is initialised; MPI_COMM_WORLD is valid.
            let rc = unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut raw) };
            if !success(rc) {
                let e = rt.describe_unlocked(rc);
                return Err(unavailable(format!(
                    "MPI_Comm_dup(MPI_COMM_WORLD) failed: {e}"
                )));
            }
            CommHandle {
                rt: Arc::clone(&rt),
                raw,
            }
        };
        let mut me = MpiTransport {
            world,
            topology: Topology::single_host(0, 1),
            opened: 0,
        };
        me.topology = me.discover_topology()?;
        me.check_releases()?;
        if let Ok(v) = std::env::var("FH_SIZE") {
            if let Ok(n) = v.trim().parse::<usize>() {
                if n != me.topology.size {
                    return Err(TransportError::Config {
                        var: "FH_SIZE".into(),
                        reason: format!(
                            "FH_SIZE={n} but MPI sees a world of {} rank(s): with FH_TRANSPORT=mpi \
                             start the ranks with `mpirun -np {n} program` (or `fhrun --mpi`), not \
                             with a launcher MPI does not know",
                            me.topology.size
                        ),
                    });
                }
            }
        }
        tracing::info!(
            rank = me.topology.rank,
            size = me.topology.size,
            local_size = me.topology.local_size,
            cross_size = me.topology.cross_size,
            mode = ?me.world.rt.mode,
            "MPI transport ready"
        );
        Ok(me)
    }

    /// The thread mode in use (see [`ThreadMode`]).
    pub fn thread_mode(&self) -> ThreadMode {
        self.world.rt.mode
    }

    /// The MPI library's version string (`MPI_Get_library_version`).
    pub fn library_version(&self) -> &str {
        &self.world.rt.version
    }

    /// Like [`Transport::open`], returning the concrete communicator type.
    pub fn open_mpi(&mut self, label: &str) -> Result<MpiComm> {
        let rt = Arc::clone(&self.world.rt);
        // SAFETY: placeholder handle, overwritten by MPI_Comm_(i)dup.
        let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
        let rc = match rt.mode {
            // SAFETY: `world` is a valid communicator; `raw` receives the duplicate.
            ThreadMode::Multiple => unsafe { ffi::MPI_Comm_dup(self.world.raw, &mut raw) },
            ThreadMode::Serialized => {
                // Nonblocking so that the lock is not held while peers catch up.
                // SAFETY: placeholder request, overwritten by MPI_Comm_idup.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                let rc = {
                    let _guard = rt.lock();
                    // SAFETY: as above; `raw` and `req` outlive the request (waited below).
                    unsafe { ffi::MPI_Comm_idup(self.world.raw, &mut raw, &mut req) }
                };
                if success(rc) {
                    wait_request(&rt, &mut req).err().unwrap_or(rc)
                } else {
                    rc
                }
            }
        };
        if !success(rc) {
            let e = rt.describe(rc);
            return Err(TransportError::io(
                format!("opening MPI communicator '{label}' (MPI_Comm_dup)"),
                std::io::Error::other(e),
            ));
        }
        let handle = CommHandle { rt, raw };
        let comm = MpiComm::new(handle, label, self.topology.rank, self.topology.size);
        comm.set_error_handler_and_name()?;
        self.opened += 1;
        Ok(comm)
    }

    /// Every rank's FastHorovod release, exchanged over the world (as the TCP hello carries it):
    /// a rank of another release is refused on every rank, naming both releases and the ranks.
    pub(super) fn check_releases(&self) -> Result<()> {
        let mut mine = [0u8; RELEASE_FIELD];
        let release = fh_core::RELEASE.as_bytes();
        let n = release.len().min(RELEASE_FIELD);
        mine[..n].copy_from_slice(&release[..n]);
        let size = self.topology.size;
        let mut all = vec![0u8; RELEASE_FIELD * size];
        let rt = &self.world.rt;
        {
            let _guard = rt.lock();
            // SAFETY: `world.raw` is a valid communicator; the buffers hold RELEASE_FIELD
            // bytes and RELEASE_FIELD × size bytes, as the counts say.
            let rc = unsafe {
                ffi::MPI_Allgather(
                    mine.as_ptr().cast(),
                    RELEASE_FIELD as c_int,
                    ffi::RSMPI_UINT8_T,
                    all.as_mut_ptr().cast(),
                    RELEASE_FIELD as c_int,
                    ffi::RSMPI_UINT8_T,
                    self.world.raw,
                )
            };
            if !success(rc) {
                return Err(TransportError::io(
                    "MPI_Allgather of the ranks' FastHorovod releases",
                    std::io::Error::other(rt.describe_unlocked(rc)),
                ));
            }
        }
        match foreign_releases(&all, &mine) {
            None => Ok(()),
            Some(others) => Err(TransportError::Config {
                var: "FH_TRANSPORT".into(),
                reason: format!(
                    "rank {} runs FastHorovod {}, but {others}: install the same FastHorovod \
                     version on every host",
                    self.topology.rank,
                    fh_core::RELEASE,
                ),
            }),
        }
    }

    pub(super) fn discover_topology(&self) -> Result<Topology> {
        let rt = &self.world.rt;
        let _guard = rt.lock();
        let fail = |call: &str, rc: c_int| {
            TransportError::io(
                format!("{call} while discovering the MPI topology"),
                std::io::Error::other(rt.describe_unlocked(rc)),
            )
        };
        let (mut rank, mut size) = (0, 0);
        // SAFETY: `world.raw` is a valid communicator for all the calls below; the split
        // communicators are freed before returning.
        unsafe {
            let rc = ffi::MPI_Comm_rank(self.world.raw, &mut rank);
            if !success(rc) {
                return Err(fail("MPI_Comm_rank", rc));
            }
            let rc = ffi::MPI_Comm_size(self.world.raw, &mut size);
            if !success(rc) {
                return Err(fail("MPI_Comm_size", rc));
            }
            let mut local = ffi::RSMPI_COMM_NULL;
            let rc = ffi::MPI_Comm_split_type(
                self.world.raw,
                ffi::RSMPI_COMM_TYPE_SHARED,
                rank,
                ffi::RSMPI_INFO_NULL,
                &mut local,
            );
            if !success(rc) {
                return Err(fail("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)", rc));
            }
            let (local_rank, local_size) =
                rank_size_and_free(&mut local).map_err(|(c, rc)| fail(c, rc))?;
            let mut cross = ffi::RSMPI_COMM_NULL;
            let rc = ffi::MPI_Comm_split(self.world.raw, local_rank, rank, &mut cross);
            if !success(rc) {
                return Err(fail("MPI_Comm_split", rc));
            }
            let (cross_rank, cross_size) =
                rank_size_and_free(&mut cross).map_err(|(c, rc)| fail(c, rc))?;
            let u = |v: c_int| usize::try_from(v).unwrap_or(0);
            Ok(Topology {
                rank: u(rank),
                size: u(size),
                local_rank: u(local_rank),
                local_size: u(local_size),
                cross_rank: u(cross_rank),
                cross_size: u(cross_size),
            })
        }
    }
}

/// Bytes of a rank's release in the exchange of [`MpiTransport::check_releases`].
pub(super) const RELEASE_FIELD: usize = 32;

/// The ranks whose release field in `all` (one [`RELEASE_FIELD`] per rank) differs from
/// `mine`, as `rank R runs X, …`; `None` when every rank runs this release.
pub(super) fn foreign_releases(all: &[u8], mine: &[u8; RELEASE_FIELD]) -> Option<String> {
    let others: Vec<String> = all
        .chunks(RELEASE_FIELD)
        .enumerate()
        .filter(|(_, b)| *b != mine)
        .map(|(r, b)| {
            let text = String::from_utf8_lossy(b);
            format!("rank {r} runs FastHorovod {}", text.trim_end_matches('\0'))
        })
        .collect();
    (!others.is_empty()).then(|| others.join(", "))
}

/// This rank and the size of `comm`, then free `comm` (freed even when a query fails).
/// On error, the failing call's name and return code.
///
/// # Safety
/// `comm` must be a valid communicator that nothing else uses or frees; the caller holds the
/// runtime's lock where MPI calls are serialised.
pub(super) unsafe fn rank_size_and_free(
    comm: &mut ffi::MPI_Comm,
) -> std::result::Result<(c_int, c_int), (&'static str, c_int)> {
    let (mut rank, mut size) = (0, 0);
    // SAFETY: `comm` is valid until the free below (the caller's contract).
    let (rc1, rc2, rc3) = unsafe {
        (
            ffi::MPI_Comm_rank(*comm, &mut rank),
            ffi::MPI_Comm_size(*comm, &mut size),
            ffi::MPI_Comm_free(comm),
        )
    };
    for (call, rc) in [
        ("MPI_Comm_rank", rc1),
        ("MPI_Comm_size", rc2),
        ("MPI_Comm_free", rc3),
    ] {
        if !success(rc) {
            return Err((call, rc));
        }
    }
    Ok((rank, size))
}

impl Transport for MpiTransport {
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn wire(&self) -> crate::WireKind {
        crate::WireKind::Memory
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn open(&mut self, label: &str) -> Result<Box<dyn crate::Communicator>> {
        Ok(Box::new(self.open_mpi(label)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(release: &str) -> [u8; RELEASE_FIELD] {
        let mut f = [0u8; RELEASE_FIELD];
        f[..release.len()].copy_from_slice(release.as_bytes());
        f
    }

    #[test]
    fn ranks_of_another_release_are_named() {
        let mine = field("0.2.0");
        let same = [mine, mine, mine].concat();
        assert_eq!(foreign_releases(&same, &mine), None);
        let mixed = [mine, field("0.1.9"), mine, field("0.3.0-rc1")].concat();
        assert_eq!(
            foreign_releases(&mixed, &mine).as_deref(),
            Some("rank 1 runs FastHorovod 0.1.9, rank 3 runs FastHorovod 0.3.0-rc1")
        );
    }
}
