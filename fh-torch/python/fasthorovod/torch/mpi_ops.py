"""Collectives on torch tensors: blocking, ``_async`` (returning a handle), in-place (``_``)
and grouped forms, with Horovod's signatures.

CPU tensors cross into the engine without copies: the engine reduces in the tensor's own
memory while the tensor is kept alive by the pending operation. Do not read or write a tensor
while an in-place operation on it is in flight (Horovod's rule too).
"""

import torch

from fasthorovod import _core
from fasthorovod.common.exceptions import HorovodInternalError  # noqa: F401
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import Adasum, Average, Max, Min, Product, Sum, poll, synchronize
from fasthorovod.torch.gather_ops import (HorovodAllgather, HorovodAlltoall, HorovodBroadcast,
                                          allgather, allgather_async, alltoall, alltoall_async,
                                          broadcast, broadcast_, broadcast_async,
                                          broadcast_async_, grouped_allgather,
                                          grouped_allgather_async)
from fasthorovod.torch.reduce_ops import (HorovodAllreduce, HorovodGroupedAllreduce,
                                          HorovodReducescatter, allreduce, allreduce_,
                                          allreduce_async, allreduce_async_, grouped_allreduce,
                                          grouped_allreduce_, grouped_allreduce_async,
                                          grouped_allreduce_async_, grouped_reducescatter,
                                          grouped_reducescatter_async, reducescatter,
                                          reducescatter_async)

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
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodBroadcast",
    "HorovodAlltoall", "HorovodReducescatter",
]

# Sparse tensors (allgathered indices and values), as Horovod's mpi_ops has them.
from fasthorovod.torch.sparse import sparse_allreduce_async  # noqa: E402

__all__.append("sparse_allreduce_async")
