"""``fasthorovod.torch``: a drop-in for ``horovod.torch``.

Change ``import horovod.torch as hvd`` to ``import fasthorovod.torch as hvd``; the rest of a
Horovod training script stays as it is. Launch with ``fhrun -np N python train.py``,
``torchrun``, ``mpirun`` or ``srun``.
"""

from fasthorovod import _compat

try:
    import torch as _torch
except ImportError as _e:
    raise ImportError(_compat.missing_torch_message()) from _e
_compat.check_torch_version(_torch.__version__, _torch.__file__)

from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: E402
from fasthorovod.common.process_sets import (ProcessSet, add_process_set,
                                             global_process_set, remove_process_set)
from fasthorovod.torch import elastic
from fasthorovod.torch.compression import Compression
from fasthorovod.torch.functions import (allgather_object, broadcast_object,
                                         broadcast_optimizer_state, broadcast_parameters)
from fasthorovod.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum,
                                       allgather, allgather_async, allreduce, allreduce_,
                                       allreduce_async, allreduce_async_, alltoall,
                                       alltoall_async, barrier, broadcast, broadcast_,
                                       broadcast_async, broadcast_async_, ccl_built,
                                       cross_rank, cross_size, cuda_built, ddl_built,
                                       gloo_built, gloo_enabled, grouped_allgather,
                                       grouped_allgather_async, grouped_allreduce,
                                       grouped_allreduce_, grouped_allreduce_async,
                                       grouped_allreduce_async_, grouped_reducescatter,
                                       grouped_reducescatter_async, init, is_homogeneous,
                                       is_initialized, join, local_rank, local_size, mpi_built,
                                       mpi_enabled, mpi_threads_supported, nccl_built, poll,
                                       rank, reducescatter, reducescatter_async, rocm_built,
                                       shutdown, size, start_timeline, stop_timeline,
                                       synchronize, tcp_streams)
from fasthorovod.torch.optimizer import DistributedOptimizer
from fasthorovod.torch.sparse import sparse_allreduce_async
from fasthorovod.torch.sync_batch_norm import SyncBatchNorm

__all__ = [name for name in dir() if not name.startswith("_")]
