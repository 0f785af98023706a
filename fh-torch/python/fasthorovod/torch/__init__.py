"""``fasthorovod.torch``: a drop-in for ``horovod.torch``.

Change ``import horovod.torch as hvd`` to ``import fasthorovod.torch as hvd``; the rest of a
Horovod training script stays as it is. Launch with ``fhrun -np N python train.py``,
``torchrun``, ``mpirun`` or ``srun``.
"""

import atexit
import sys

from fasthorovod import _core
from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from fasthorovod.common.process_sets import (ProcessSet, _forget_sets, _init_sets,
                                             add_process_set, global_process_set,
                                             remove_process_set)
from fasthorovod.torch.compression import Compression
from fasthorovod.torch.functions import (allgather_object, broadcast_object,
                                         broadcast_optimizer_state, broadcast_parameters)
from fasthorovod.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                       allgather_async, allreduce, allreduce_, allreduce_async,
                                       allreduce_async_, alltoall, alltoall_async, barrier,
                                       broadcast, broadcast_, broadcast_async, broadcast_async_,
                                       grouped_allgather, grouped_allgather_async,
                                       grouped_allreduce, grouped_allreduce_,
                                       grouped_allreduce_async, grouped_allreduce_async_,
                                       grouped_reducescatter, grouped_reducescatter_async, join,
                                       poll, reducescatter, reducescatter_async, synchronize)
from fasthorovod.torch.optimizer import DistributedOptimizer

_homogeneous = None


def init(comm=None, process_sets=None):
    """Start the runtime (collective: every rank calls it). The world comes from the
    launcher's environment (``fhrun``, ``torchrun``, ``mpirun``, Slurm); alone, a script
    runs as a single rank. Calling it again is a no-op.

    ``process_sets``: a list of ``ProcessSet`` to register now (collectively, in this order,
    with the same ids on every rank), or ``"dynamic"`` to allow ``add_process_set`` /
    ``remove_process_set`` later (as ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does)."""
    global _homogeneous
    if comm is not None:
        raise NotImplementedError("init(comm=...) is not supported by FastHorovod: the world "
                                  "is the launcher's (fhrun, torchrun, mpirun, srun)")
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"init(process_sets=...) takes ProcessSet objects or "
                                 f"'dynamic', got {ps!r}")
    if _core.is_initialized():
        return
    _core.init()
    import torch

    local = torch.tensor([local_size()], dtype=torch.int64)
    sizes = synchronize(allgather_async(local, name="fasthorovod.init.local_sizes"))
    _homogeneous = bool((sizes == sizes[0]).all())
    _init_sets(process_sets)


def shutdown():
    """Stop the runtime (every rank should call it; also done at interpreter exit).
    Pending operations fail; on the other ranks, operations that needed this rank fail with
    an error naming it."""
    _forget_sets()
    _core.shutdown("hvd.shutdown() was called")


# Why this process is leaving, told to the other ranks when the runtime shuts down: set by
# the exception hook below, else "the process exited".
_exit_reason = None


def _shutdown_at_exit():
    _forget_sets()
    _core.shutdown(_exit_reason or "the process exited")


atexit.register(_shutdown_at_exit)


def _describe(kind, value):
    lines = str(value).strip().splitlines()
    text = f"raised {kind.__name__}"
    return f"{text}: {lines[0][:200]}" if lines else text


def _excepthook(kind, value, tb, _previous=sys.excepthook):
    """An uncaught exception: print it as Python does, then shut the runtime down at once,
    telling the other ranks which exception this rank raised (they fail at once with an error
    naming this rank, instead of waiting for this interpreter to finish exiting)."""
    global _exit_reason
    _previous(kind, value, tb)
    if _exit_reason is None:
        _exit_reason = _describe(kind, value)
    try:
        if _core.is_initialized():
            _forget_sets()
            _core.shutdown(_exit_reason)
    except Exception:  # the engine had stopped already: the others know why
        pass


sys.excepthook = _excepthook


def is_initialized():
    """Whether ``init()`` has been called (and ``shutdown()`` has not)."""
    return _core.is_initialized()


def rank():
    """This process's rank (0 .. size() - 1)."""
    return _core.topology()[0]


def size():
    """Number of ranks."""
    return _core.topology()[1]


def local_rank():
    """This process's rank among the ranks of its host."""
    return _core.topology()[2]


def local_size():
    """Number of ranks on this host."""
    return _core.topology()[3]


def cross_rank():
    """Index of this process's host among the hosts."""
    return _core.topology()[4]


def cross_size():
    """Number of hosts."""
    return _core.topology()[5]


def is_homogeneous():
    """Whether every host runs the same number of ranks."""
    _core.topology()  # raises when not initialized
    return bool(_homogeneous)


def mpi_built():
    """Whether this build can use MPI as its transport."""
    return _core.mpi_built()


def mpi_enabled():
    """Whether the running job uses MPI as its transport."""
    return _core.backend().startswith("mpi")


def mpi_threads_supported():
    """Whether MPI is in use with multi-threading support (the MPI transport requires it)."""
    return mpi_enabled()


def gloo_built():
    """FastHorovod has no Gloo: always False."""
    return False


def gloo_enabled():
    """FastHorovod has no Gloo: always False."""
    return False


def nccl_built():
    """Whether NCCL support is compiled in."""
    return _core.nccl_built()


def cuda_built():
    """Whether CUDA support is compiled in."""
    return _core.cuda_built()


def rocm_built():
    """FastHorovod has no ROCm support: always False."""
    return False


def ddl_built():
    """Always False."""
    return False


def ccl_built():
    """Always False."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it)."""
    _core.start_timeline(str(file_path))


def stop_timeline():
    """Stop writing the timeline."""
    _core.stop_timeline()


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("atexit", "sys")]
