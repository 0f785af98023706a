"""Sparse tensors across ranks: ``sparse_allreduce_async``.

A sparse COO tensor is reduced without ever being densified: every rank's (coalesced)
indices and values are allgathered, the concatenation becomes one sparse tensor and
coalescing it adds the entries that several ranks share. The traffic is proportional to
the number of non-zero entries, not to the tensor's dense size.
"""

import torch

from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _size_of, global_process_set
from fasthorovod.torch._ops import Average, Sum, _register, _resolve_op, poll, synchronize
from fasthorovod.torch.gather_ops import allgather_async


class _Pending:
    """One allgather inside a sparse allreduce, in the shape ``_ops._register`` expects of
    an engine handle (``poll``, ``wait``, ``device``): waiting synchronizes the allgather's
    own handle, which returns the gathered tensor."""

    device = -1  # host tensors: no CUDA stream to wait on

    def __init__(self, handle):
        self._handle = handle

    def poll(self):
        return poll(self._handle)

    def wait(self, stream=None):
        return synchronize(self._handle)


class SparseHandle(int):
    """The handle of a ``sparse_allreduce_async``: pass it to ``synchronize`` (or ``poll``)
    like any other handle; calling it, as Horovod's optimizer calls its sparse handles,
    does the same as ``synchronize``."""

    def __call__(self):
        return synchronize(self)


def _check_sparse(tensor):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"sparse_allreduce_async takes a torch.Tensor, got "
                         f"{type(tensor).__name__}")
    if tensor.layout != torch.sparse_coo:
        raise ValueError(f"sparse_allreduce_async takes a sparse COO tensor, got layout "
                         f"{tensor.layout}: use allreduce_async for dense tensors")


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start the reduction of the sparse COO ``tensor`` across the ranks of ``process_set``
    (Horovod's signature). Returns a handle; ``synchronize(handle)`` returns a new,
    coalesced sparse tensor of ``tensor``'s size: the sum of every rank's tensor, divided by
    the number of ranks for ``op=Average``. Only ``Sum`` and ``Average`` reduce sparse
    tensors. The tensor's shape must be the same on every rank; the number of non-zero
    entries may differ (or be 0).

    ``name`` names the allgathers (``<name>.indices``, ``<name>.values`` and
    ``<name>.shape``); ``None`` leaves them unnamed, and then every rank must issue the same
    sequence of unnamed operations. Ranks whose tensors differ in shape (or in their numbers
    of sparse and dense dimensions) get an error on every rank."""
    _check_sparse(tensor)
    _check_process_set(process_set)
    op = _resolve_op(op, None)
    if op not in (Sum, Average):
        raise ValueError(f"sparse_allreduce_async reduces with hvd.Sum or hvd.Average, got "
                         f"op={op!r}: densify the tensor (.to_dense()) for other ops")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a string or None, got {type(name).__name__}")
    local = tensor.detach().coalesce()
    shape, device = local.shape, local.device
    # Rows of the allgathers: one per non-zero entry (indices transposed to [nnz, sparse_dim]).
    # They travel from host memory (a sparse gradient's entries are few); the result is made
    # on the tensor's device.
    indices = local.indices().t().contiguous().cpu()
    values = local.values().contiguous().cpu()
    h_indices = allgather_async(indices, name=None if name is None else f"{name}.indices",
                                process_set=process_set)
    h_values = allgather_async(values, name=None if name is None else f"{name}.values",
                               process_set=process_set)
    # The shapes too: the allgathers cannot tell that the ranks' tensors differ in size.
    h_shape = allgather_async(torch.tensor([list(shape)], dtype=torch.int64),
                              name=None if name is None else f"{name}.shape",
                              process_set=process_set)
    divisor = _size_of(process_set) if op == Average else 1

    def finish(results):
        all_indices, all_values, shapes = results
        if not bool((shapes == shapes[0]).all()):
            raise ValueError(f"sparse_allreduce_async: the ranks' tensors differ in shape: "
                             f"{[list(s) for s in shapes.tolist()]} (in the set's rank order)")
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, shape, dtype=local.dtype,
                                      check_invariants=False).coalesce()
        if divisor != 1:
            # Sum first, then divide (as a dense Average does): integers truncate once.
            if out.dtype.is_floating_point or out.dtype.is_complex:
                scaled = out.values() / divisor
            else:
                scaled = torch.div(out.values(), divisor, rounding_mode="trunc")
            out = torch.sparse_coo_tensor(out.indices(), scaled, shape, is_coalesced=True,
                                          check_invariants=False)
        return out.to(device)

    return SparseHandle(_register([_Pending(h_indices), _Pending(h_values), _Pending(h_shape)],
                                  finish))


__all__ = ["sparse_allreduce_async", "SparseHandle"]
