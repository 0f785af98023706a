//! Seeing inside a running rank: the culprit's own Python stack when a stall names this rank.
//!
//! Python's `faulthandler` writes the stack of every thread from a signal handler, without
//! the GIL. `fasthorovod.torch.init()` registers it for [`stack_signal`] and then calls
//! [`enable_stack_dumps`]; from then on every engine this process starts gets a culprit hook
//! that raises that signal on its control thread, so the stacks appear on stderr next to the
//! stall warning, whatever the Python threads are doing (sleeping, loading data, holding the
//! GIL in a long computation).

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

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
    if let State::Running(e, _) = &*state() {
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
