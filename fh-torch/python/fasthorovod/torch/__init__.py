"""``fasthorovod.torch``: a drop-in for ``horovod.torch``.

Change ``import horovod.torch as hvd`` to ``import fasthorovod.torch as hvd``; the rest of a
Horovod training script stays as it is. Launch with ``fhrun -np N python train.py``,
``torchrun``, ``mpirun`` or ``srun``.
"""

import atexit
import os
import sys

from fasthorovod import _compat

try:
    import torch as _torch
except ImportError as _e:
    raise ImportError(_compat.missing_torch_message()) from _e
_compat.check_torch_version(_torch.__version__, _torch.__file__)

from fasthorovod import _core  # noqa: E402
from fasthorovod.common import _elastic_core
from fasthorovod.common import elastic as _common_elastic
from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from fasthorovod.common.process_sets import (ProcessSet, _forget_sets, _init_sets,
                                             add_process_set, global_process_set,
                                             remove_process_set)
from fasthorovod.torch import elastic
from fasthorovod.torch.compression import Compression
from fasthorovod.torch.functions import (allgather_object, broadcast_object,
                                         broadcast_optimizer_state, broadcast_parameters)
from fasthorovod.torch import _ops
from fasthorovod.torch import mpi_ops as _mpi_ops
from fasthorovod.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                       allgather_async, allreduce, allreduce_, allreduce_async,
                                       allreduce_async_, alltoall, alltoall_async, barrier,
                                       broadcast, broadcast_, broadcast_async, broadcast_async_,
                                       ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                       gloo_built, gloo_enabled, grouped_allgather,
                                       grouped_allgather_async, grouped_allreduce,
                                       grouped_allreduce_, grouped_allreduce_async,
                                       grouped_allreduce_async_, grouped_reducescatter,
                                       grouped_reducescatter_async, is_homogeneous,
                                       is_initialized, join, local_rank, local_size, mpi_built,
                                       mpi_enabled, mpi_threads_supported, nccl_built, poll,
                                       rank, reducescatter, reducescatter_async, rocm_built,
                                       size, synchronize)
from fasthorovod.torch.optimizer import DistributedOptimizer
from fasthorovod.torch.sparse import sparse_allreduce_async
from fasthorovod.torch.sync_batch_norm import SyncBatchNorm


def init(comm=None, process_sets=None):
    """Start the runtime (collective: every rank calls it). The world comes from the
    launcher's environment (``fhrun``, ``torchrun``, ``mpirun``, Slurm); alone, a script
    runs as a single rank. Calling it again is a no-op.

    ``process_sets``: a list of ``ProcessSet`` to register now (collectively, in this order,
    with the same ids on every rank), or ``"dynamic"`` to allow ``add_process_set`` /
    ``remove_process_set`` later (as ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does).

    In an elastic job (``fhrun --host-discovery-script``) the world is the driver's next
    one; a worker that the driver leaves out of it exits here with status 0 (a line on
    stderr says why)."""
    if comm is not None:
        raise NotImplementedError("init(comm=...) is not supported by FastHorovod: the world "
                                  "is the launcher's (fhrun, torchrun, mpirun, srun)")
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"init(process_sets=...) takes ProcessSet objects or "
                                 f"'dynamic', got {ps!r}")
    _start(process_sets, _core.init)


def _start(process_sets, start_engine):
    """``init``'s work once its arguments are checked: start the engine with
    ``start_engine()`` (``_core.init``, or ``fasthorovod.torch.distributed``'s start on a
    world agreed through a torch store), then what every world gets: the homogeneity query
    and the process sets. A no-op when the runtime runs already."""
    if _core.is_initialized():
        return
    _install_stack_dumps()
    attempt = 1
    while True:
        try:
            start_engine()
        except _elastic_core.WorkerRemovedError as e:
            _common_elastic.leave(e)
        _mpi_ops._world_count += 1
        _ops._refresh_tracing()
        try:
            _start_world(process_sets)
            return
        except HorovodInternalError as e:
            # An elastic world whose member is lost right after it formed fails here on
            # every member; each registers for the next one, which the driver forms without
            # the lost worker (bounded as _core.init bounds the worlds that fail to form).
            if not _elastic_core.enabled() or attempt >= _WORLD_ATTEMPTS:
                raise
            print(f"fasthorovod: the elastic world failed as it started ({e}); joining the "
                  "next one", file=sys.stderr, flush=True)
            attempt += 1
            _forget_sets()
            try:
                _core.shutdown("its elastic world failed as it started")
            except Exception:  # noqa: BLE001 - the failed engine is stopped all the same
                pass


# How many elastic worlds in a row init() may see fail right after they formed.
_WORLD_ATTEMPTS = 10


def _start_world(process_sets):
    """What ``init`` does on a world that has formed: learn whether it is homogeneous (an
    allgather) and register the static process sets (collectives)."""
    import torch

    local = torch.tensor([local_size()], dtype=torch.int64)
    sizes = synchronize(allgather_async(local, name="fasthorovod.init.local_sizes"))
    _mpi_ops._homogeneous = bool((sizes == sizes[0]).all())
    _init_sets(process_sets)


def _install_stack_dumps():
    """Let the runtime show where this rank is when a stall names it: ``faulthandler`` writes
    every thread's stack to stderr on the runtime's stack signal (from the engine's thread,
    without the GIL). Best effort: without it the stall warning names the rank alone."""
    import faulthandler
    try:
        faulthandler.register(_core.stack_signal(), file=2, all_threads=True, chain=False)
    except Exception:  # noqa: BLE001 - no stack dumps, nothing else changes
        return
    _core.enable_stack_dumps()


def shutdown():
    """Stop the runtime (every rank should call it; also done at interpreter exit).
    Pending operations fail; on the other ranks, operations that needed this rank fail with
    an error naming it."""
    _say_summary()
    _forget_sets()
    _core.shutdown("hvd.shutdown() was called")


_summary_said = False


def _say_summary():
    """With ``FH_SUMMARY=1`` (fhrun sets it), one line on stderr of what this rank did, once,
    before its runtime stops."""
    global _summary_said
    if _summary_said or os.environ.get("FH_SUMMARY", "").strip().lower() not in (
            "1", "true", "yes", "on"):
        return
    try:
        line = _core.summary()
    except Exception:  # noqa: BLE001 - a summary never fails the shutdown
        return
    if line:
        _summary_said = True
        print(line, file=sys.stderr, flush=True)


# Why this process is exiting, when an uncaught exception ends it ("raised ValueError: boom");
# set by the excepthook below, and told to the other ranks when the runtime shuts down (else
# "the process exited").
_exit_reason = None
_notified = False


def _shutdown_at_exit():
    _say_summary()
    _forget_sets()
    _core.shutdown(_exit_reason or "the process exited")


atexit.register(_shutdown_at_exit)


def _describe_exception(etype, value):
    """One line for an uncaught exception: ``raised ValueError: boom`` (cut at 500 chars)."""
    text = " ".join(str(value).split()) if value is not None else ""
    name = getattr(etype, "__name__", str(etype))
    line = f"raised {name}: {text}" if text else f"raised {name}"
    return line if len(line) <= 500 else line[:497] + "..."


def _caused_by_runtime(value):
    """Whether the exception is (or was raised while handling) an error of the runtime: then
    another rank, or the job as a whole, failed first, and this rank is not the cause."""
    seen = 0
    while value is not None and seen < 32:
        if isinstance(value, HorovodInternalError):
            return True
        value = value.__cause__ or value.__context__
        seen += 1
    return False


def _notify_launcher(reason):
    """Tell fhrun (its notice pipe, ``FH_NOTICE_FD``) that this rank fails and why, before the
    runtime tells the other ranks: fhrun then blames this rank, not a survivor that exits
    first. Once; nothing here blocks or raises."""
    global _notified
    rank = os.environ.get("FH_RANK", "")
    if _notified or not rank.isdigit():
        return
    _notified = True
    try:
        _core.notify_launcher(int(rank), reason)
    except Exception:  # noqa: BLE001 - a notice is best effort
        pass


def _excepthook(etype, value, tb):
    """Records the uncaught exception as ``_exit_reason``, prints it through the previous hook,
    tells the launcher this rank is failing (unless the runtime's own error is the cause) and
    shuts the runtime down with that reason."""
    global _exit_reason
    try:
        _exit_reason = _describe_exception(etype, value)
    except Exception:  # noqa: BLE001 - the traceback must still be printed
        _exit_reason = f"raised {getattr(etype, '__name__', etype)}"
    try:
        _previous_excepthook(etype, value, tb)
    finally:
        if not _caused_by_runtime(value):
            _notify_launcher(_exit_reason)
        # Shut down at once, telling the other ranks why: they fail now with an error naming
        # this rank, not when this interpreter has finished exiting.
        try:
            if _core.is_initialized():
                _forget_sets()
                _core.shutdown(_exit_reason)
        except Exception:  # noqa: BLE001 - the engine had stopped already: the others know why
            pass


if not getattr(sys.excepthook, "_fasthorovod", False):
    _previous_excepthook = sys.excepthook
    _excepthook._fasthorovod = True
    sys.excepthook = _excepthook


def start_timeline(file_path, mark_cycles=False):
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it; a path
    holding ``{rank}`` names a file per rank, and every rank writes its own)."""
    _core.start_timeline(str(file_path))
    _ops._refresh_tracing()


def stop_timeline():
    """Stop writing the timeline."""
    _core.stop_timeline()
    _ops._refresh_tracing()


__all__ = [name for name in dir()
           if not name.startswith("_") and name not in ("atexit", "os", "sys")]

# Horovod's mpi_ops defines the lifecycle functions too: the same functions, defined here
# (they own the process sets and the exit handling of this package).
_mpi_ops.init = init
_mpi_ops.shutdown = shutdown
_mpi_ops.start_timeline = start_timeline
_mpi_ops.stop_timeline = stop_timeline
