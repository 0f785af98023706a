"""Horovod's ``horovod.torch.mpi_ops``: the collectives on torch tensors (blocking, ``_async``
returning a handle, in-place ``_`` and grouped forms, with Horovod's signatures), the reduce
ops, and the runtime's lifecycle (``init``, ``shutdown``; set by the package, which owns them),
topology (``rank``, ``size``, ...) and build queries (``mpi_built``, ``nccl_built``, ...).

CPU tensors cross into the engine without copies: the engine reduces in the tensor's own
memory while the tensor is kept alive by the pending operation. Do not read or write a tensor
while an in-place operation on it is in flight (Horovod's rule too).
"""

import torch

from fasthorovod import _core
from fasthorovod.common.exceptions import HorovodInternalError  # noqa: F401
from fasthorovod.common.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                             global_process_set, remove_process_set)
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.torch._ops import (Adasum, Average, Max, Min, Product, Sum, _resolve_op, poll,
                                    synchronize)
from fasthorovod.torch.compression import Compression  # noqa: F401
from fasthorovod.torch.gather_ops import (HorovodAllgather, HorovodAlltoall, HorovodBroadcast,
                                          HorovodGroupedAllgather, allgather, allgather_async,
                                          alltoall, alltoall_async, broadcast, broadcast_,
                                          broadcast_async, broadcast_async_, grouped_allgather,
                                          grouped_allgather_async)
from fasthorovod.torch.reduce_ops import (HorovodAllreduce, HorovodGroupedAllreduce,
                                          HorovodGroupedReducescatter, HorovodReducescatter,
                                          allreduce, allreduce_, allreduce_async,
                                          allreduce_async_, grouped_allreduce,
                                          grouped_allreduce_, grouped_allreduce_async,
                                          grouped_allreduce_async_, grouped_reducescatter,
                                          grouped_reducescatter_async, reducescatter,
                                          reducescatter_async)

# Whether every host runs the same number of ranks (found by ``init``).
_homogeneous = None
# How many times init() has started the runtime in this process: a cache agreed over the
# ranks of one world (DistributedOptimizer's gradient layouts) is dropped when it changes.
_world_count = 0

# ---------------------------------------------------------------------------------------------
# topology and build queries


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
    """FastHorovod has no IBM DDL support: always False."""
    return False


def ccl_built():
    """FastHorovod has no oneCCL support: always False."""
    return False


def handle_average_backwards_compatibility(op, average):
    """The reduce op meant by ``op`` and the deprecated ``average`` flag (Horovod's helper):
    ``op`` when given, else Average or Sum as ``average`` says, else Average."""
    return _resolve_op(op, average)

# ---------------------------------------------------------------------------------------------
# join and barrier


def join(device=-1):
    """Declare that this rank has no more data. Other ranks' allreduces go on with this rank
    contributing zeros; returns, once every rank has joined, the rank that joined last."""
    handle = _core.join()
    data, _shape = handle.wait()
    return int(torch.frombuffer(data, dtype=torch.int64)[0])


def barrier(process_set=global_process_set):
    """Block until every rank (of ``process_set``) has reached this barrier."""
    ps = _check_process_set(process_set)
    _core.barrier(ps).wait()


# ``init``, ``shutdown``, ``start_timeline`` and ``stop_timeline`` are set on this module by
# ``fasthorovod.torch`` (the same functions as ``hvd.init`` ...), which is always imported first.


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "handle_average_backwards_compatibility",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "poll", "synchronize", "join", "barrier",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
    "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
    "HorovodGroupedReducescatter",
]

# Sparse tensors (allgathered indices and values), as Horovod's mpi_ops has them.
from fasthorovod.torch.sparse import sparse_allreduce_async  # noqa: E402

__all__.append("sparse_allreduce_async")
