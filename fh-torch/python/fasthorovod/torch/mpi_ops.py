"""Horovod's ``horovod.torch.mpi_ops``: the collectives on torch tensors (blocking, ``_async``
returning a handle, in-place ``_`` and grouped forms, with Horovod's signatures), the reduce
ops, and the runtime's lifecycle (``init``, ``shutdown``), topology (``rank``, ``size``, ...) and
build queries (``mpi_built``, ``nccl_built``, ...): the methods of one
``fasthorovod.common.basics.Basics``, which keeps their state.

CPU tensors cross into the engine without copies: the engine reduces in the tensor's own
memory while the tensor is kept alive by the pending operation. Do not read or write a tensor
while an in-place operation on it is in flight (Horovod's rule too).
"""

import torch

from fasthorovod import _core
from fasthorovod.common.basics import Basics as _Basics
from fasthorovod.common.exceptions import HorovodInternalError  # noqa: F401
from fasthorovod.common.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                             global_process_set, remove_process_set)
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.torch._ops import (Adasum, Average, Max, Min, Product, Sum, _refresh_tracing,
                                    _resolve_op, poll, synchronize)
from fasthorovod.torch.compression import Compression  # noqa: F401
from fasthorovod.torch.gather_ops import (HorovodAllgather, HorovodAlltoall, HorovodBroadcast,
                                          HorovodGroupedAllgather, allgather, allgather_async,
                                          alltoall, alltoall_async, broadcast, broadcast_,
                                          broadcast_async, broadcast_async_, grouped_allgather,
                                          grouped_allgather_async)
from fasthorovod.torch.reduce_ops import (HorovodAllreduce, HorovodGroupedAllreduce,
                                          allreduce, allreduce_, allreduce_async,
                                          allreduce_async_, grouped_allreduce,
                                          grouped_allreduce_, grouped_allreduce_async,
                                          grouped_allreduce_async_)
from fasthorovod.torch.scatter_ops import (HorovodGroupedReducescatter, HorovodReducescatter,
                                           grouped_reducescatter, grouped_reducescatter_async,
                                           reducescatter, reducescatter_async)


# The runtime's lifecycle, topology and build queries (Horovod's ``_basics``): one object owns
# them and the state they keep; this module hands its methods on as its functions.
def _local_sizes(local_size):
    """Every rank's ``local_size`` (an allgather: ``init``'s homogeneity query)."""
    local = torch.tensor([local_size], dtype=torch.int64)
    return synchronize(allgather_async(local, name="fasthorovod.init.local_sizes")).tolist()


_basics = _Basics(local_sizes=_local_sizes, tracing_changed=_refresh_tracing)
_basics.install_exit_handlers()

init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
start_timeline = _basics.start_timeline
stop_timeline = _basics.stop_timeline
size = _basics.size
local_size = _basics.local_size
cross_size = _basics.cross_size
rank = _basics.rank
local_rank = _basics.local_rank
cross_rank = _basics.cross_rank
is_homogeneous = _basics.is_homogeneous
tcp_streams = _basics.tcp_streams
mpi_threads_supported = _basics.mpi_threads_supported
mpi_enabled = _basics.mpi_enabled
mpi_built = _basics.mpi_built
gloo_enabled = _basics.gloo_enabled
gloo_built = _basics.gloo_built
nccl_built = _basics.nccl_built
ddl_built = _basics.ddl_built
ccl_built = _basics.ccl_built
cuda_built = _basics.cuda_built
rocm_built = _basics.rocm_built


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
