//! The MPI runtime: initialising (or joining) MPI once per process, its thread mode and lock,
//! the registered half-precision operations, the library's errors, and the helpers every call
//! shares (counts, chunks, buffers, waits).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use fh_core::{kernels, DType, ReduceOp};
use mpi::ffi;

use crate::{Result, TransportError};

/// The largest count (elements, or bytes for byte transfers) passed to one MPI call.
pub(super) const MAX_COUNT: usize = i32::MAX as usize;

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
pub(super) enum InPlace {
    /// Open MPI: `((void *) 1)`.
    OpenMpi,
    /// MPICH and its derivatives (Intel MPI, MVAPICH, Cray MPICH): `((void *) -1)`.
    Mpich,
    /// Unknown library: copy the input instead of reducing in place.
    Unknown,
}

impl InPlace {
    pub(super) fn detect(version: &str) -> Self {
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

    pub(super) fn pointer(self) -> Option<*const c_void> {
        match self {
            InPlace::OpenMpi => Some(std::ptr::without_provenance(1)),
            InPlace::Mpich => Some(std::ptr::without_provenance(usize::MAX)),
            InPlace::Unknown => None,
        }
    }
}

/// Set when a user-defined (f16/bf16) reduction fails inside MPI, where it cannot return an
/// error; checked after every collective that used one.
pub(super) static HALF_OP_FAILED: AtomicBool = AtomicBool::new(false);

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
pub(super) fn half_op_index(dtype: DType, op: ReduceOp) -> Option<usize> {
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
pub(super) struct Registry {
    /// The runtime in use, shared by every live transport and communicator.
    pub(super) live: Weak<Runtime>,
    /// Whether this crate called `MPI_Init_thread` in this process.
    pub(super) owned_init: bool,
    /// Whether this crate called `MPI_Finalize` in this process.
    pub(super) finalized: bool,
}

pub(super) static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    live: Weak::new(),
    owned_init: false,
    finalized: false,
});

pub(super) fn unavailable(reason: impl Into<String>) -> TransportError {
    TransportError::BackendUnavailable {
        backend: "mpi",
        reason: reason.into(),
    }
}

/// MPI as initialised for this process; finalized when the last holder drops it.
pub(super) struct Runtime {
    pub(super) mode: ThreadMode,
    pub(super) lock: Mutex<()>,
    pub(super) owns_init: bool,
    pub(super) in_place: InPlace,
    pub(super) half_ops: Vec<ffi::MPI_Op>,
    pub(super) version: String,
}

// SAFETY: the MPI handles inside (`MPI_Op`) are process-global objects, created once and only
// read afterwards; MPI calls made through the runtime from several threads are either allowed
// by MPI_THREAD_MULTIPLE or serialized by `lock`.
unsafe impl Send for Runtime {}
// SAFETY: as above; the only mutable state is behind `lock`.
unsafe impl Sync for Runtime {}

pub(super) fn requested_level() -> Result<ThreadMode> {
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

pub(super) fn level_name(level: c_int) -> &'static str {
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

pub(super) fn success(rc: c_int) -> bool {
    rc == ffi::MPI_SUCCESS as c_int
}

impl Runtime {
    /// The runtime in use, initialising MPI if nobody has.
    pub(super) fn acquire() -> Result<Arc<Runtime>> {
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
    pub(super) fn lock(&self) -> Option<MutexGuard<'_, ()>> {
        match self.mode {
            ThreadMode::Multiple => None,
            ThreadMode::Serialized => {
                Some(self.lock.lock().unwrap_or_else(PoisonError::into_inner))
            }
        }
    }

    /// Describe an MPI return code.
    pub(super) fn describe(&self, code: c_int) -> MpiError {
        let _guard = self.lock();
        self.describe_unlocked(code)
    }

    /// [`Runtime::describe`] for callers that already hold the lock.
    pub(super) fn describe_unlocked(&self, code: c_int) -> MpiError {
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
    pub(super) fn native(
        &self,
        dtype: DType,
        op: ReduceOp,
    ) -> Option<(ffi::MPI_Datatype, ffi::MPI_Op)> {
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
pub(super) unsafe fn native_datatype(dtype: DType) -> ffi::MPI_Datatype {
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
pub(super) fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: reading a handle exported by the MPI shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

pub(super) fn library_version() -> String {
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
pub(super) struct CommHandle {
    pub(super) rt: Arc<Runtime>,
    pub(super) raw: ffi::MPI_Comm,
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

#[cfg(test)]
mod tests {
    use super::*;

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
