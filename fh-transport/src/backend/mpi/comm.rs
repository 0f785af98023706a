//! The MPI backend proper. Every raw MPI call of the crate is in this module (the runtime,
//! the transport and the communicator's helpers here; its `Communicator` implementation in
//! `collectives`); see the parent module for the design.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use fh_core::{kernels, DType, ReduceOp};
use mpi::ffi;

use crate::{Result, Topology, Transport, TransportError};

mod collectives;

/// Tag of the last (often only) MPI message of a point-to-point message.
const TAG_LAST: c_int = 0;
/// Tag of a chunk of a point-to-point message that more chunks follow.
const TAG_MORE: c_int = 1;

/// The largest count (elements, or bytes for byte transfers) passed to one MPI call.
const MAX_COUNT: usize = i32::MAX as usize;

/// An error reported by the MPI library: its code, error class and message.
///
/// Kept as the `source` of the [`TransportError`] that reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiError {
    /// The return code of the failed call.
    pub code: i32,
    /// Its error class (`MPI_Error_class`), comparable across MPI libraries.
    pub class: i32,
    /// The library's message (`MPI_Error_string`).
    pub message: String,
}

impl fmt::Display for MpiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MPI error code {} (class {}): {}",
            self.code, self.class, self.message
        )
    }
}

impl std::error::Error for MpiError {}

/// How MPI calls are made, depending on the thread level the library provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ThreadMode {
    /// `MPI_THREAD_MULTIPLE`: every channel calls MPI directly from its own thread, with the
    /// library's blocking (tuned) operations.
    Multiple,
    /// Fallback when the library provides less than `MPI_THREAD_MULTIPLE` (or when
    /// `FH_MPI_THREAD_LEVEL=serialized` asks for it): every MPI call is made under one
    /// process-wide mutex, and waits are `MPI_Test` polls that release it between tries.
    Serialized,
}

/// How `MPI_IN_PLACE` is spelled by the MPI library we run on. It is a C macro, which bindgen
/// cannot export; its value is part of each library family's ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InPlace {
    /// Open MPI: `((void *) 1)`.
    OpenMpi,
    /// MPICH and its derivatives (Intel MPI, MVAPICH, Cray MPICH): `((void *) -1)`.
    Mpich,
    /// Unknown library: copy the input instead of reducing in place.
    Unknown,
}

impl InPlace {
    fn detect(version: &str) -> Self {
        if version.contains("Open MPI") {
            InPlace::OpenMpi
        } else if ["MPICH", "Intel(R) MPI", "MVAPICH"]
            .iter()
            .any(|s| version.contains(s))
        {
            InPlace::Mpich
        } else {
            InPlace::Unknown
        }
    }

    fn pointer(self) -> Option<*const c_void> {
        match self {
            InPlace::OpenMpi => Some(std::ptr::without_provenance(1)),
            InPlace::Mpich => Some(std::ptr::without_provenance(usize::MAX)),
            InPlace::Unknown => None,
        }
    }
}

/// Set when a user-defined (f16/bf16) reduction fails inside MPI, where it cannot return an
/// error; checked after every collective that used one.
static HALF_OP_FAILED: AtomicBool = AtomicBool::new(false);

macro_rules! half_ops {
    ($($name:ident => ($dtype:expr, $op:expr)),* $(,)?) => {
        $(
            /// MPI user-defined reduction: `inout[i] = op(inout[i], in[i])` on 16-bit floats.
            unsafe extern "C" fn $name(
                invec: *mut c_void,
                inoutvec: *mut c_void,
                len: *mut c_int,
                _datatype: *mut ffi::MPI_Datatype,
            ) {
                // SAFETY: MPI calls this with `*len` elements of the datatype the op was used
                // with (always MPI_UINT16_T, 2 bytes) in each of two distinct buffers.
                let (src, acc) = unsafe {
                    let n = usize::try_from(*len).unwrap_or(0) * 2;
                    (
                        std::slice::from_raw_parts(invec as *const u8, n),
                        std::slice::from_raw_parts_mut(inoutvec as *mut u8, n),
                    )
                };
                if let Err(e) = kernels::reduce($dtype, $op, acc, src) {
                    tracing::error!("{} reduction inside MPI failed: {e}", $dtype.name());
                    HALF_OP_FAILED.store(true, Ordering::SeqCst);
                }
            }
        )*
        /// The user functions, in the order of [`half_op_index`].
        const HALF_FUNCTIONS: [unsafe extern "C" fn(
            *mut c_void,
            *mut c_void,
            *mut c_int,
            *mut ffi::MPI_Datatype,
        ); 8] = [$($name),*];
    };
}

half_ops! {
    f16_sum => (DType::F16, ReduceOp::Sum),
    f16_prod => (DType::F16, ReduceOp::Product),
    f16_min => (DType::F16, ReduceOp::Min),
    f16_max => (DType::F16, ReduceOp::Max),
    bf16_sum => (DType::BF16, ReduceOp::Sum),
    bf16_prod => (DType::BF16, ReduceOp::Product),
    bf16_min => (DType::BF16, ReduceOp::Min),
    bf16_max => (DType::BF16, ReduceOp::Max),
}

/// Index into [`HALF_FUNCTIONS`] for a 16-bit float type and a (combining) operator.
fn half_op_index(dtype: DType, op: ReduceOp) -> Option<usize> {
    let base = match dtype {
        DType::F16 => 0,
        DType::BF16 => 4,
        _ => return None,
    };
    let off = match op.combining() {
        ReduceOp::Sum => 0,
        ReduceOp::Product => 1,
        ReduceOp::Min => 2,
        ReduceOp::Max => 3,
        _ => return None,
    };
    Some(base + off)
}

/// Process-wide bookkeeping of MPI's one-shot lifetime.
struct Registry {
    /// The runtime in use, shared by every live transport and communicator.
    live: Weak<Runtime>,
    /// Whether this crate called `MPI_Init_thread` in this process.
    owned_init: bool,
    /// Whether this crate called `MPI_Finalize` in this process.
    finalized: bool,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    live: Weak::new(),
    owned_init: false,
    finalized: false,
});

fn unavailable(reason: impl Into<String>) -> TransportError {
    TransportError::BackendUnavailable {
        backend: "mpi",
        reason: reason.into(),
    }
}

/// MPI as initialised for this process; finalized when the last holder drops it.
struct Runtime {
    mode: ThreadMode,
    lock: Mutex<()>,
    owns_init: bool,
    in_place: InPlace,
    half_ops: Vec<ffi::MPI_Op>,
    version: String,
}

// SAFETY: the MPI handles inside (`MPI_Op`) are process-global objects, created once and only
// read afterwards; MPI calls made through the runtime from several threads are either allowed
// by MPI_THREAD_MULTIPLE or serialized by `lock`.
unsafe impl Send for Runtime {}
// SAFETY: as above; the only mutable state is behind `lock`.
unsafe impl Sync for Runtime {}

fn requested_level() -> Result<ThreadMode> {
    match std::env::var(super::THREAD_LEVEL_VAR) {
        Err(_) => Ok(ThreadMode::Multiple),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "multiple" => Ok(ThreadMode::Multiple),
            "serialized" => Ok(ThreadMode::Serialized),
            other => Err(TransportError::Config {
                var: super::THREAD_LEVEL_VAR.into(),
                reason: format!(
                    "'{other}' is not a thread level; use 'multiple' (the default) or 'serialized'"
                ),
            }),
        },
    }
}

fn level_name(level: c_int) -> &'static str {
    // SAFETY: reading constants exported by the MPI shim.
    unsafe {
        if level == ffi::RSMPI_THREAD_MULTIPLE {
            "MPI_THREAD_MULTIPLE"
        } else if level == ffi::RSMPI_THREAD_SERIALIZED {
            "MPI_THREAD_SERIALIZED"
        } else if level == ffi::RSMPI_THREAD_FUNNELED {
            "MPI_THREAD_FUNNELED"
        } else {
            "MPI_THREAD_SINGLE"
        }
    }
}

fn success(rc: c_int) -> bool {
    rc == ffi::MPI_SUCCESS as c_int
}

impl Runtime {
    /// The runtime in use, initialising MPI if nobody has.
    fn acquire() -> Result<Arc<Runtime>> {
        let mut reg = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(rt) = reg.live.upgrade() {
            return Ok(rt);
        }
        if reg.finalized {
            return Err(unavailable(
                "MPI was finalized when the last MPI transport and communicator of this process \
                 were dropped, and MPI cannot be initialised twice; keep one MpiTransport alive \
                 for the whole program",
            ));
        }
        if reg.owned_init {
            return Err(unavailable(
                "MPI is being finalized by another thread (the last MPI transport was just \
                 dropped); keep one MpiTransport alive for the whole program",
            ));
        }
        let requested = requested_level()?;
        let (mut initialized, mut finalized) = (0, 0);
        // SAFETY: both functions may be called at any time, even before MPI_Init.
        let rc = unsafe { ffi::MPI_Initialized(&mut initialized) };
        if !success(rc) {
            return Err(unavailable(format!(
                "MPI_Initialized failed with code {rc}"
            )));
        }
        // SAFETY: as above.
        let rc = unsafe { ffi::MPI_Finalized(&mut finalized) };
        if !success(rc) || finalized != 0 {
            return Err(unavailable(
                "MPI was already finalized in this process by its host program",
            ));
        }
        let mut provided: c_int = 0;
        let owns_init = initialized == 0;
        if owns_init {
            // SAFETY: MPI is not initialised (checked above, under the registry lock); NULL
            // argc/argv are allowed since MPI-2.
            let required = unsafe {
                match requested {
                    ThreadMode::Multiple => ffi::RSMPI_THREAD_MULTIPLE,
                    ThreadMode::Serialized => ffi::RSMPI_THREAD_SERIALIZED,
                }
            };
            // SAFETY: as above.
            let rc = unsafe {
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    required,
                    &mut provided,
                )
            };
            if !success(rc) {
                return Err(unavailable(format!(
                    "MPI_Init_thread failed with code {rc}; start the program with `mpirun -np N` \
                     (or srun with PMI), or choose another FH_TRANSPORT"
                )));
            }
            reg.owned_init = true;
            // SAFETY: MPI is initialised; MPI_COMM_WORLD is valid. Errors on the world
            // communicator (and those duplicated from it) are returned, not fatal.
            let rc = unsafe {
                ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN)
            };
            if !success(rc) {
                tracing::warn!("MPI_Comm_set_errhandler(MPI_COMM_WORLD) failed with code {rc}");
            }
        } else {
            // SAFETY: MPI is initialised and not finalized.
            let rc = unsafe { ffi::MPI_Query_thread(&mut provided) };
            if !success(rc) {
                return Err(unavailable(format!(
                    "MPI_Query_thread failed with code {rc}"
                )));
            }
        }
        // SAFETY: reading constants exported by the MPI shim.
        let (multiple, serialized) =
            unsafe { (ffi::RSMPI_THREAD_MULTIPLE, ffi::RSMPI_THREAD_SERIALIZED) };
        let mode = if provided >= multiple && requested == ThreadMode::Multiple {
            ThreadMode::Multiple
        } else {
            ThreadMode::Serialized
        };
        match (mode, requested) {
            (ThreadMode::Multiple, _) => {}
            (ThreadMode::Serialized, ThreadMode::Serialized) => tracing::info!(
                "MPI transport in serialized mode as {} asks (library provides {})",
                super::THREAD_LEVEL_VAR,
                level_name(provided)
            ),
            (ThreadMode::Serialized, ThreadMode::Multiple) => tracing::warn!(
                "the MPI library provides only {} (not MPI_THREAD_MULTIPLE): the MPI transport \
                 serializes every MPI call through one lock, which costs throughput when several \
                 channels are busy",
                level_name(provided)
            ),
        }
        if provided < serialized {
            tracing::warn!(
                "the MPI library provides only {}: calls from several threads are serialized but \
                 the library does not promise to support them; use a single channel if it fails",
                level_name(provided)
            );
        }
        let version = library_version();
        let in_place = InPlace::detect(&version);
        let mut rt = Runtime {
            mode,
            lock: Mutex::new(()),
            owns_init,
            in_place,
            half_ops: Vec::with_capacity(HALF_FUNCTIONS.len()),
            version,
        };
        for f in HALF_FUNCTIONS {
            // SAFETY: reading a handle as a placeholder; MPI_Op_create overwrites it.
            let mut op: ffi::MPI_Op = unsafe { ffi::RSMPI_SUM };
            // SAFETY: `f` is a valid commutative reduction function for the life of the process.
            let rc = unsafe { ffi::MPI_Op_create(Some(f), 1, &mut op) };
            if !success(rc) {
                // Dropping `rt` frees the ops created so far (and finalizes if we own MPI).
                drop(reg);
                return Err(unavailable(format!(
                    "MPI_Op_create failed with code {rc} while registering the f16/bf16 reductions"
                )));
            }
            rt.half_ops.push(op);
        }
        tracing::debug!(
            mode = ?rt.mode,
            provided = level_name(provided),
            in_place = ?rt.in_place,
            "MPI initialised: {}",
            rt.version.lines().next().unwrap_or("")
        );
        let rt = Arc::new(rt);
        reg.live = Arc::downgrade(&rt);
        Ok(rt)
    }

    /// Hold the serialization lock (serialized mode only).
    fn lock(&self) -> Option<MutexGuard<'_, ()>> {
        match self.mode {
            ThreadMode::Multiple => None,
            ThreadMode::Serialized => {
                Some(self.lock.lock().unwrap_or_else(PoisonError::into_inner))
            }
        }
    }

    /// Describe an MPI return code.
    fn describe(&self, code: c_int) -> MpiError {
        let _guard = self.lock();
        self.describe_unlocked(code)
    }

    /// [`Runtime::describe`] for callers that already hold the lock.
    fn describe_unlocked(&self, code: c_int) -> MpiError {
        let mut class: c_int = -1;
        // SAFETY: MPI_Error_class and MPI_Error_string may be called with any code; the buffer
        // has the size MPI requires.
        let message = unsafe {
            if !success(ffi::MPI_Error_class(code, &mut class)) {
                class = -1;
            }
            let mut buf = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
            let mut len: c_int = 0;
            if success(ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len)) {
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            } else {
                "unknown MPI error".to_string()
            }
        };
        MpiError {
            code,
            class,
            message,
        }
    }

    /// The datatype and operator that reduce `dtype` with `op` (already checked supported).
    fn native(&self, dtype: DType, op: ReduceOp) -> Option<(ffi::MPI_Datatype, ffi::MPI_Op)> {
        // SAFETY: reading handles exported by the MPI shim, valid while MPI is initialised.
        unsafe {
            let datatype = native_datatype(dtype);
            let op = match (dtype, op.combining()) {
                (DType::F16 | DType::BF16, o) => *self.half_ops.get(half_op_index(dtype, o)?)?,
                (DType::Bool, ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr) => ffi::RSMPI_LOR,
                (DType::Bool, ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd) => {
                    ffi::RSMPI_LAND
                }
                (_, ReduceOp::Sum) => ffi::RSMPI_SUM,
                (_, ReduceOp::Product) => ffi::RSMPI_PROD,
                (_, ReduceOp::Min) => ffi::RSMPI_MIN,
                (_, ReduceOp::Max) => ffi::RSMPI_MAX,
                (_, ReduceOp::BitAnd) => ffi::RSMPI_BAND,
                (_, ReduceOp::BitOr) => ffi::RSMPI_BOR,
                (_, ReduceOp::Average) => return None,
            };
            Some((datatype, op))
        }
    }
}

/// The one `DType → MPI datatype` mapping. `bool` travels as `u8` (0/1), `f16`/`bf16` as 16-bit
/// words reduced by user-defined operations.
///
/// # Safety
/// MPI must be initialised.
unsafe fn native_datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading handles exported by the MPI shim (the caller guarantees MPI is up).
    unsafe {
        match dtype {
            DType::U8 | DType::Bool => ffi::RSMPI_UINT8_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I16 => ffi::RSMPI_INT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

/// The datatype of byte transfers.
fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: reading a handle exported by the MPI shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

fn library_version() -> String {
    // SAFETY: the buffer has the size MPI requires; the call may be made at any time.
    unsafe {
        let cap = usize::try_from(ffi::RSMPI_MAX_LIBRARY_VERSION_STRING).unwrap_or(8192) + 1;
        let mut buf = vec![0 as c_char; cap];
        let mut len: c_int = 0;
        if success(ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len)) {
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        } else {
            String::new()
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let mut reg = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
        for op in &mut self.half_ops {
            // SAFETY: `op` was created by MPI_Op_create and no communicator is alive any more
            // (they all hold this runtime).
            let rc = unsafe { ffi::MPI_Op_free(op) };
            if !success(rc) {
                tracing::warn!("MPI_Op_free failed with code {rc}");
            }
        }
        if self.owns_init {
            let mut main: c_int = 1;
            // SAFETY: MPI is initialised and not finalized (only this drop finalizes).
            unsafe { ffi::MPI_Is_thread_main(&mut main) };
            if main == 0 {
                tracing::debug!(
                    "MPI_Finalize called from a thread other than the one that initialised MPI"
                );
            }
            // SAFETY: the last transport and communicator are gone (they hold this runtime),
            // so no MPI object of ours is alive; MPI_Finalize runs exactly once (the registry
            // records it and refuses to initialise again).
            let rc = unsafe { ffi::MPI_Finalize() };
            if !success(rc) {
                tracing::error!("MPI_Finalize failed with code {rc}");
            }
            reg.finalized = true;
        }
    }
}

/// A handle on a duplicated MPI communicator, freed on drop.
struct CommHandle {
    rt: Arc<Runtime>,
    raw: ffi::MPI_Comm,
}

impl Drop for CommHandle {
    fn drop(&mut self) {
        let _guard = self.rt.lock();
        // SAFETY: `raw` was created by MPI_Comm_dup/split and is freed once, before the runtime
        // (and so MPI_Finalize) can go.
        let rc = unsafe { ffi::MPI_Comm_free(&mut self.raw) };
        if !success(rc) {
            tracing::warn!("MPI_Comm_free failed with code {rc}");
        }
    }
}

/// Split `0..len` into ranges of at most `max` (at least one range, empty when `len == 0`),
/// each flagged whether it is the last.
fn chunk_ranges(len: usize, max: usize) -> impl Iterator<Item = (Range<usize>, bool)> {
    let max = max.max(1);
    let n = len.div_ceil(max).max(1);
    (0..n).map(move |i| {
        let start = i * max;
        let end = (start + max).min(len);
        (start..end, i + 1 == n)
    })
}

/// Where empty buffers point instead of their own (dangling) address: an empty Rust slice of
/// bytes points at address 1, which is `MPI_IN_PLACE` in Open MPI.
static EMPTY: [u64; 1] = [0];

/// The address MPI gets for `buf`: never a dangling one (see [`EMPTY`]).
fn send_ptr(buf: &[u8]) -> *const c_void {
    if buf.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        buf.as_ptr().cast()
    }
}

/// The address MPI gets for an output buffer; with a count of 0 MPI never writes to it.
fn recv_ptr(buf: &mut [u8]) -> *mut c_void {
    if buf.is_empty() {
        EMPTY.as_ptr().cast_mut().cast()
    } else {
        buf.as_mut_ptr().cast()
    }
}

fn to_int(n: usize) -> Option<c_int> {
    c_int::try_from(n).ok()
}

/// Counts and displacements as MPI `int`s, or `None` when any does not fit under `max`.
fn int_counts(counts: &[usize], max: usize) -> Option<(Vec<c_int>, Vec<c_int>)> {
    let mut cs = Vec::with_capacity(counts.len());
    let mut ds = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &c in counts {
        if total > max {
            return None;
        }
        ds.push(to_int(total)?);
        cs.push(to_int(c)?);
        total = total.checked_add(c)?;
    }
    (total <= max).then_some((cs, ds))
}

fn empty_status() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers; all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

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
    world: CommHandle,
    topology: Topology,
    opened: usize,
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
    fn check_releases(&self) -> Result<()> {
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

    fn discover_topology(&self) -> Result<Topology> {
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
const RELEASE_FIELD: usize = 32;

/// The ranks whose release field in `all` (one [`RELEASE_FIELD`] per rank) differs from
/// `mine`, as `rank R runs X, …`; `None` when every rank runs this release.
fn foreign_releases(all: &[u8], mine: &[u8; RELEASE_FIELD]) -> Option<String> {
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
unsafe fn rank_size_and_free(
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

/// Wait for `req` to complete; returns the failing return code on error.
fn wait_request(
    rt: &Runtime,
    req: &mut ffi::MPI_Request,
) -> std::result::Result<ffi::MPI_Status, c_int> {
    let mut status = empty_status();
    match rt.mode {
        ThreadMode::Multiple => {
            // SAFETY: `req` is an active request whose buffers the caller keeps alive.
            let rc = unsafe { ffi::MPI_Wait(req, &mut status) };
            if !success(rc) {
                return Err(rc);
            }
        }
        ThreadMode::Serialized => loop {
            let mut flag: c_int = 0;
            let rc = {
                let _guard = rt.lock();
                // SAFETY: as above.
                unsafe { ffi::MPI_Test(req, &mut flag, &mut status) }
            };
            if !success(rc) {
                return Err(rc);
            }
            if flag != 0 {
                break;
            }
            std::thread::yield_now();
        },
    }
    Ok(status)
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

/// A communicator of the MPI backend: one duplicated MPI communicator.
pub struct MpiComm {
    handle: CommHandle,
    label: String,
    rank: usize,
    size: usize,
    max_count: usize,
}

// SAFETY: see `MpiTransport`.
unsafe impl Send for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("label", &self.label)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// What a collective call does in each thread mode.
type Start<'a> = &'a mut dyn FnMut(&mut ffi::MPI_Request) -> c_int;

impl MpiComm {
    fn new(handle: CommHandle, label: &str, rank: usize, size: usize) -> Self {
        MpiComm {
            handle,
            label: label.to_string(),
            rank,
            size,
            max_count: MAX_COUNT,
        }
    }

    /// Limit every MPI call to `count` elements (bytes for byte transfers); larger operations
    /// are split or routed through the generic algorithms. The default is `i32::MAX`, MPI's
    /// limit; smaller values exist to test the splitting. Must be set identically on all ranks.
    pub fn set_max_count(&mut self, count: usize) {
        self.max_count = count.clamp(1, MAX_COUNT);
    }

    /// The label given when the communicator was opened.
    pub fn label(&self) -> &str {
        &self.label
    }

    fn set_error_handler_and_name(&self) -> Result<()> {
        let _guard = self.handle.rt.lock();
        // SAFETY: `raw` is a valid communicator.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(self.handle.raw, ffi::RSMPI_ERRORS_RETURN) };
        if !success(rc) {
            return Err(self.error_unlocked("MPI_Comm_set_errhandler", rc));
        }
        let mut name: String = self.label.chars().filter(|&c| c != '\0').collect();
        let max = ffi::MPI_MAX_OBJECT_NAME as usize - 1;
        while name.len() > max {
            name.pop();
        }
        if let Ok(c) = CString::new(name) {
            // SAFETY: `raw` is valid and `c` is NUL-terminated and shorter than the limit.
            let rc = unsafe { ffi::MPI_Comm_set_name(self.handle.raw, c.as_ptr()) };
            if !success(rc) {
                tracing::debug!("MPI_Comm_set_name failed with code {rc}");
            }
        }
        Ok(())
    }

    fn rt(&self) -> &Runtime {
        &self.handle.rt
    }

    fn context(&self, call: &str) -> String {
        format!(
            "{call} on MPI communicator '{}' (rank {} of {})",
            self.label, self.rank, self.size
        )
    }

    fn error_from(&self, call: &str, e: MpiError, peer: Option<usize>) -> TransportError {
        let truncate = ffi::MPI_ERR_TRUNCATE as c_int;
        match peer {
            Some(rank) if e.class == truncate => TransportError::Protocol {
                rank,
                detail: format!("{}: {e}", self.context(call)),
            },
            _ => TransportError::io(self.context(call), std::io::Error::other(e)),
        }
    }

    fn error(&self, call: &str, rc: c_int, peer: Option<usize>) -> TransportError {
        self.error_from(call, self.rt().describe(rc), peer)
    }

    fn error_unlocked(&self, call: &str, rc: c_int) -> TransportError {
        self.error_from(call, self.rt().describe_unlocked(rc), None)
    }

    fn check(&self, rc: c_int, call: &str, peer: Option<usize>) -> Result<()> {
        if success(rc) {
            Ok(())
        } else {
            Err(self.error(call, rc, peer))
        }
    }

    fn wait(
        &self,
        req: &mut ffi::MPI_Request,
        call: &str,
        peer: Option<usize>,
    ) -> Result<ffi::MPI_Status> {
        wait_request(self.rt(), req).map_err(|rc| self.error(call, rc, peer))
    }

    /// Run a collective: the blocking call in multiple mode; in serialized mode the nonblocking
    /// one, started under the lock and polled without it.
    fn run(&self, call: &str, blocking: &mut dyn FnMut() -> c_int, start: Start<'_>) -> Result<()> {
        match self.rt().mode {
            ThreadMode::Multiple => self.check(blocking(), call, None),
            ThreadMode::Serialized => {
                // SAFETY: placeholder request, overwritten by `start`.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                let rc = {
                    let _guard = self.rt().lock();
                    start(&mut req)
                };
                self.check(rc, call, None)?;
                self.wait(&mut req, call, None).map(drop)
            }
        }
    }

    fn check_half_op(&self, dtype: DType, call: &str) -> Result<()> {
        if matches!(dtype, DType::F16 | DType::BF16) && HALF_OP_FAILED.swap(false, Ordering::SeqCst)
        {
            return Err(TransportError::io(
                self.context(call),
                std::io::Error::other(format!(
                    "the {} reduction inside MPI failed (see the error logged above)",
                    dtype.name()
                )),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<c_int> {
        if peer >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "peer {peer} out of range 0..{} on MPI communicator '{}'",
                self.size, self.label
            )));
        }
        to_int(peer).ok_or_else(|| TransportError::InvalidArgument(format!("peer {peer}")))
    }

    /// Start nonblocking sends of `data` to `peer`, in chunks.
    fn isend_all(&self, peer: c_int, data: &[u8]) -> Result<Vec<ffi::MPI_Request>> {
        let mut reqs = Vec::new();
        for (range, last) in chunk_ranges(data.len(), self.max_count) {
            let part = &data[range];
            let tag = if last { TAG_LAST } else { TAG_MORE };
            // SAFETY: placeholder request, overwritten by MPI_Isend.
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            let rc = {
                let _guard = self.rt().lock();
                // SAFETY: `part` stays borrowed until the request is waited by the caller.
                unsafe {
                    ffi::MPI_Isend(
                        send_ptr(part),
                        part.len() as c_int,
                        bytes_type(),
                        peer,
                        tag,
                        self.handle.raw,
                        &mut req,
                    )
                }
            };
            if !success(rc) {
                let err = self.error("MPI_Isend", rc, Some(peer as usize));
                // Complete what was started before reporting: its buffer is borrowed.
                self.wait_all(&mut reqs, "MPI_Isend")?;
                return Err(err);
            }
            reqs.push(req);
        }
        Ok(reqs)
    }

    /// Wait for every request; report the first failure after waiting for all.
    fn wait_all(&self, reqs: &mut [ffi::MPI_Request], call: &str) -> Result<()> {
        let mut first = Ok(());
        for req in reqs {
            if let Err(e) = self.wait(req, call, None) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Match the next message from `peer` (any of our tags).
    fn probe(&self, peer: c_int) -> Result<(ffi::MPI_Message, ffi::MPI_Status)> {
        // SAFETY: placeholder handle, overwritten by the probe.
        let mut msg = unsafe { ffi::RSMPI_MESSAGE_NULL };
        let mut status = empty_status();
        match self.rt().mode {
            ThreadMode::Multiple => {
                // SAFETY: `raw` is a valid communicator; msg/status are out parameters.
                let rc = unsafe {
                    ffi::MPI_Mprobe(
                        peer,
                        ffi::RSMPI_ANY_TAG,
                        self.handle.raw,
                        &mut msg,
                        &mut status,
                    )
                };
                self.check(rc, "MPI_Mprobe", Some(peer as usize))?;
            }
            ThreadMode::Serialized => loop {
                let mut flag: c_int = 0;
                let rc = {
                    let _guard = self.rt().lock();
                    // SAFETY: as above.
                    unsafe {
                        ffi::MPI_Improbe(
                            peer,
                            ffi::RSMPI_ANY_TAG,
                            self.handle.raw,
                            &mut flag,
                            &mut msg,
                            &mut status,
                        )
                    }
                };
                self.check(rc, "MPI_Improbe", Some(peer as usize))?;
                if flag != 0 {
                    break;
                }
                std::thread::yield_now();
            },
        }
        Ok((msg, status))
    }

    /// Receive the matched message `msg` into `buf` (whose length is the message's).
    fn mrecv(&self, msg: &mut ffi::MPI_Message, buf: &mut [u8], peer: c_int) -> Result<()> {
        let count = buf.len() as c_int;
        match self.rt().mode {
            ThreadMode::Multiple => {
                let mut status = empty_status();
                // SAFETY: `msg` was matched by MPI_Mprobe and holds exactly `count` bytes.
                let rc =
                    unsafe { ffi::MPI_Mrecv(recv_ptr(buf), count, bytes_type(), msg, &mut status) };
                self.check(rc, "MPI_Mrecv", Some(peer as usize))
            }
            ThreadMode::Serialized => {
                // SAFETY: placeholder request, overwritten by MPI_Imrecv.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                let rc = {
                    let _guard = self.rt().lock();
                    // SAFETY: as above; `buf` stays borrowed until the request is waited.
                    unsafe { ffi::MPI_Imrecv(recv_ptr(buf), count, bytes_type(), msg, &mut req) }
                };
                self.check(rc, "MPI_Imrecv", Some(peer as usize))?;
                self.wait(&mut req, "MPI_Imrecv", Some(peer as usize))
                    .map(drop)
            }
        }
    }

    fn message_len(&self, status: &ffi::MPI_Status, peer: c_int) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: `status` was filled by a probe of a byte message.
        let rc = unsafe { ffi::MPI_Get_count(status, bytes_type(), &mut count) };
        self.check(rc, "MPI_Get_count", Some(peer as usize))?;
        usize::try_from(count).map_err(|_| TransportError::Protocol {
            rank: peer as usize,
            detail: format!(
                "{}: message of undefined length",
                self.context("MPI_Get_count")
            ),
        })
    }

    /// Receive exactly `buf.len()` bytes from `peer`, in as many chunks as the sender used.
    fn recv_exact(&self, peer: c_int, buf: &mut [u8]) -> Result<()> {
        let mut off = 0usize;
        loop {
            let (mut msg, status) = self.probe(peer)?;
            let n = self.message_len(&status, peer)?;
            let more = status.MPI_TAG == TAG_MORE;
            let end = off.saturating_add(n);
            let fits = if more {
                end < buf.len()
            } else {
                end == buf.len()
            };
            if !fits {
                // Consume the rest of the message so that the communicator stays usable.
                let mut scratch = vec![0u8; n];
                self.mrecv(&mut msg, &mut scratch, peer)?;
                let mut total = end;
                let mut more = more;
                while more {
                    let (mut msg, status) = self.probe(peer)?;
                    let n = self.message_len(&status, peer)?;
                    let mut scratch = vec![0u8; n];
                    self.mrecv(&mut msg, &mut scratch, peer)?;
                    total = total.saturating_add(n);
                    more = status.MPI_TAG == TAG_MORE;
                }
                return Err(TransportError::Protocol {
                    rank: peer as usize,
                    detail: format!(
                        "expected a message of {} bytes on MPI communicator '{}', received {total}",
                        buf.len(),
                        self.label
                    ),
                });
            }
            self.mrecv(&mut msg, &mut buf[off..end], peer)?;
            off = end;
            if !more {
                return Ok(());
            }
        }
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

    #[test]
    fn chunk_ranges_cover_exactly() {
        assert_eq!(chunk_ranges(0, 4).collect::<Vec<_>>(), vec![(0..0, true)]);
        assert_eq!(
            chunk_ranges(9, 4).collect::<Vec<_>>(),
            vec![(0..4, false), (4..8, false), (8..9, true)]
        );
        assert_eq!(
            chunk_ranges(8, 4).collect::<Vec<_>>(),
            vec![(0..4, false), (4..8, true)]
        );
    }

    #[test]
    fn int_counts_refuses_what_mpi_cannot_take() {
        assert_eq!(
            int_counts(&[1, 0, 3], 10),
            Some((vec![1, 0, 3], vec![0, 1, 1]))
        );
        assert_eq!(int_counts(&[6, 6], 10), None);
        assert_eq!(int_counts(&[usize::MAX, 1], MAX_COUNT), None);
    }

    #[test]
    fn in_place_detection() {
        assert_eq!(
            InPlace::detect("Open MPI v4.1.4, package: Debian OpenMPI"),
            InPlace::OpenMpi
        );
        assert_eq!(InPlace::detect("MPICH Version: 4.0"), InPlace::Mpich);
        assert_eq!(InPlace::detect("something else"), InPlace::Unknown);
        assert_eq!(InPlace::Unknown.pointer(), None);
    }

    #[test]
    fn half_ops_cover_every_supported_operator() {
        for dtype in [DType::F16, DType::BF16] {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Average,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
            ] {
                let i = half_op_index(dtype, op).expect("covered");
                assert!(i < HALF_FUNCTIONS.len());
            }
            assert_eq!(half_op_index(dtype, ReduceOp::BitAnd), None);
        }
    }

    #[test]
    fn half_user_function_reduces_like_the_kernels() {
        let a: Vec<u8> = [1.5f32, -2.0, 4.0]
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_ne_bytes())
            .collect();
        let mut b: Vec<u8> = [0.5f32, 3.0, -4.0]
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_ne_bytes())
            .collect();
        let mut len: c_int = 3;
        // SAFETY: two buffers of 3 f16 elements, as MPI would pass them.
        unsafe {
            f16_sum(
                a.as_ptr() as *mut c_void,
                b.as_mut_ptr().cast(),
                &mut len,
                std::ptr::null_mut(),
            )
        };
        let got: Vec<f32> = b
            .chunks(2)
            .map(|c| half::f16::from_ne_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(got, vec![2.0, 1.0, 0.0]);
    }
}
