//! Seeing inside a running rank: the culprit's own Python stack when a stall names this rank,
//! the flight record and the stacks on `SIGUSR1`, the Python side's spans on the timeline,
//! `explain` over a directory of flight records, and the rank's figures (a summary line, the
//! Prometheus endpoint of `FH_METRICS_ADDR`, the steps' exposed communication).
//!
//! Python's `faulthandler` writes the stack of every thread from a signal handler, without
//! the GIL. `fasthorovod.torch.init()` registers it for [`stack_signal`] and then calls
//! [`enable_stack_dumps`]; from then on every engine this process starts gets a culprit hook
//! that raises that signal on its control thread, so the stacks appear on stderr next to the
//! stall warning, whatever the Python threads are doing (sleeping, loading data, holding the
//! GIL in a long computation).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use fh_scheduler::Engine;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::state::{state, State, World};

/// Set once `faulthandler` handles [`stack_signal`] in this process.
static STACK_DUMPS: AtomicBool = AtomicBool::new(false);

/// The signal whose `faulthandler` handler prints every thread's Python stack: a real-time
/// signal near the top of the range, away from those libraries take from the bottom
/// (`SIGRTMIN` and up).
#[pyfunction]
pub(super) fn stack_signal() -> i32 {
    libc::SIGRTMAX() - 3
}

/// Say that `faulthandler` handles [`stack_signal`] in this process (its default action
/// would end the process: the signal is raised only after this call).
#[pyfunction]
pub(super) fn enable_stack_dumps() -> PyResult<()> {
    STACK_DUMPS.store(true, Ordering::Release);
    if let State::Running(World { engine: e, .. }) = &*state() {
        install_culprit_hook(e);
    }
    Ok(())
}

/// Give `engine` the hook that prints this process's Python stacks when a stall names this
/// rank (a no-op until [`enable_stack_dumps`]).
pub(super) fn install_culprit_hook(engine: &Engine) {
    if !STACK_DUMPS.load(Ordering::Acquire) {
        return;
    }
    engine.set_culprit_hook(Arc::new(|_report| raise_stack_signal()));
}

/// Raise [`stack_signal`] in this process: `faulthandler`'s handler writes every thread's
/// stack to stderr. Async-signal-safe and free of the GIL.
fn raise_stack_signal() {
    if STACK_DUMPS.load(Ordering::Acquire) {
        // SAFETY: kill(2) on this process with a signal that faulthandler handles (checked
        // above); no memory is passed.
        unsafe {
            libc::kill(libc::getpid(), stack_signal());
        }
    }
}

/// Whether this rank writes a timeline now (the Python side then records its spans).
#[pyfunction]
pub(super) fn timeline_on() -> bool {
    matches!(&*state(), State::Running(w) if w.engine.timeline_on())
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock of Python's `time.monotonic_ns()` and of
/// Rust's `Instant` on Linux.
fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    // time_t and c_long are i64 on the 64-bit Linux targets this builds for.
    let (sec, nsec): (i64, i64) = (ts.tv_sec, ts.tv_nsec);
    sec.saturating_mul(1_000_000_000).saturating_add(nsec)
}

/// Put a span of the Python side on this rank's timeline (a no-op without one): `name`
/// (`submit`, `synchronize`, `optimizer.step`) from `begin_ns` to `end_ns`, both
/// `time.monotonic_ns()` values, with a detail (the tensor's name).
#[pyfunction]
pub(super) fn timeline_span(name: &str, detail: &str, begin_ns: i64, end_ns: i64) {
    let engine = match &*state() {
        State::Running(World { engine: e, .. }) => Arc::clone(e),
        _ => return,
    };
    let now = Instant::now();
    let mono = monotonic_ns();
    let at = |ns: i64| {
        let ago = u64::try_from(mono.saturating_sub(ns)).unwrap_or(0);
        now.checked_sub(Duration::from_nanos(ago)).unwrap_or(now)
    };
    engine.timeline_span(name, detail, at(begin_ns), at(end_ns.max(begin_ns)));
}

/// What the flight records in `directory` (one file per rank; a process set's in its `set-*`
/// subdirectory; an elastic job's per generation, in `gen-N`) show: the first divergence
/// across ranks and the last collective every rank completed, as text.
#[pyfunction]
pub(super) fn explain(directory: &str) -> PyResult<String> {
    fh_scheduler::flight::explain::explain_dir(Path::new(directory)).map_err(PyValueError::new_err)
}

/// The write end of the pipe the `SIGUSR1` handler writes to (-1: none).
static USR1_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_sigusr1(_sig: libc::c_int) {
    let fd = USR1_PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe; one byte from a static buffer.
        unsafe {
            libc::write(fd, b"1".as_ptr().cast(), 1);
        }
    }
}

/// On `SIGUSR1` (fhrun forwards its own, and sends it at `--timeout`) this process writes its
/// flight record and prints its Python stacks. The handler only writes a byte to a pipe; a
/// thread of its own does the rest, without the GIL. Installed once per process, and only
/// where nobody handles `SIGUSR1` already (a script's own handler is kept).
pub(super) fn install_sigusr1() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: sigaction with a null new action only reads the current one into `old`,
        // a zeroed (valid) sigaction.
        let taken = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut old) != 0
                || old.sa_sigaction != libc::SIG_DFL
        };
        if taken {
            tracing::debug!("SIGUSR1 is handled already; flight records on request are off");
            return;
        }
        let mut fds = [-1; 2];
        // SAFETY: pipe2 writes two descriptors into the two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return;
        }
        let (read_fd, write_fd) = (fds[0], fds[1]);
        // A full pipe drops the byte: requests already queued are enough.
        // SAFETY: fcntl on a descriptor this function owns.
        unsafe {
            libc::fcntl(write_fd, libc::F_SETFL, libc::O_NONBLOCK);
        }
        USR1_PIPE.store(write_fd, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name("fh-sigusr1".into())
            .spawn(move || {
                let mut buf = [0u8; 64];
                loop {
                    // SAFETY: read(2) into a local buffer of its length.
                    let n = unsafe { libc::read(read_fd, buf.as_mut_ptr().cast(), buf.len()) };
                    if n > 0 {
                        on_request();
                    } else if n < 0
                        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                    {
                        continue;
                    } else {
                        return;
                    }
                }
            });
        if spawned.is_err() {
            return;
        }
        // SAFETY: installs a handler that only calls write(2) (async-signal-safe); the
        // sigaction value is fully initialized.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigusr1 as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut());
        }
    });
}

/// `SIGUSR1` arrived: write the flight record of the running engine and print the stacks.
fn on_request() {
    let engine = match &*state() {
        State::Running(World { engine: e, .. }) => Some(Arc::clone(e)),
        _ => None,
    };
    if let Some(e) = engine {
        match e.write_flight_record("SIGUSR1") {
            Ok(Some(path)) => {
                tracing::warn!("SIGUSR1: flight record written to {}", path.display())
            }
            Ok(None) => {}
            Err(err) => tracing::warn!("SIGUSR1: {err}"),
        }
    }
    raise_stack_signal();
}

/// The framework finished a training step that waited `exposed_ns` nanoseconds for its
/// gradients' reductions (`fasthorovod.torch`'s optimizer reports each step).
#[pyfunction]
pub(super) fn record_step(exposed_ns: u64) {
    if let State::Running(World { engine: e, .. }) = &*state() {
        e.record_step(Duration::from_nanos(exposed_ns));
    }
}

/// One line of what this rank did (operations, groups, bytes and rates per channel,
/// negotiation rounds per second, exposed communication per step); `None` when not running.
#[pyfunction]
pub(super) fn summary() -> Option<String> {
    match &*state() {
        State::Running(World { engine: e, .. }) => Some(e.stats().summary_line(e.rank())),
        _ => None,
    }
}

/// The endpoint of `FH_METRICS_ADDR`, kept for the process's life (it serves the running
/// engine, whichever that is).
static METRICS: Mutex<Option<fh_transport::metrics::MetricsServer>> = Mutex::new(None);

/// Serve this rank's figures in Prometheus' text format when `FH_METRICS_ADDR` asks for it:
/// on the port given plus the rank's local rank. A port that cannot be had is a warning.
pub(super) fn start_metrics(engine: &Engine) {
    let Some(mut addr) = engine.config().metrics_addr else {
        return;
    };
    let mut served = METRICS.lock().unwrap_or_else(|p| p.into_inner());
    if served.is_some() {
        return;
    }
    if addr.port() != 0 {
        let port = usize::from(addr.port()) + engine.local_rank();
        addr.set_port(u16::try_from(port).unwrap_or(addr.port()));
    }
    let render: fh_transport::metrics::Render = Arc::new(|| match &*state() {
        State::Running(World { engine: e, .. }) => e.stats().to_prometheus(e.rank()),
        _ => String::new(),
    });
    match fh_transport::metrics::MetricsServer::start(addr, render) {
        Ok(server) => {
            tracing::info!("metrics served at http://{}/metrics", server.local_addr());
            *served = Some(server);
        }
        Err(e) => tracing::warn!("FH_METRICS_ADDR: cannot listen on {addr}: {e}"),
    }
}
