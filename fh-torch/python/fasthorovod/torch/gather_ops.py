"""Collectives that move data without reducing it: allgather, broadcast, alltoall
(blocking, async, in-place, grouped, autograd)."""

import torch

from fasthorovod import _core
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _rank_of, _root_in_set, _size_of
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import (Average, _check_group, _check_tensor, _contiguous,
                                    _from_bytes, _op_name, _register, _submit, synchronize)
from fasthorovod.torch import reduce_ops as _reduce


# ---------------------------------------------------------------------------------------------
# allgather


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start an allgather: every rank's tensor concatenated along the first dimension (which
    may differ per rank; the other dimensions must agree)."""
    _check_tensor(tensor, "allgather")
    ps = _check_process_set(process_set)
    work = _contiguous(tensor.detach())
    if work.dim() == 0:
        work = work.reshape(1)
    dtype = work.dtype
    core = _submit("allgather", work, _op_name("allgather", name, ps), ps=ps)
    return _register([core], lambda r: _from_bytes(r[0], dtype))


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather: the gradient is this rank's slice of the averaged incoming
    gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() > 0 else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = _reduce.allreduce(grad_output, op=Average, process_set=ctx.process_set)
        dims = synchronize(allgather_async(torch.tensor([ctx.dim], dtype=torch.int64),
                                           process_set=ctx.process_set))
        offset = int(dims[:_rank_of(ctx.process_set)].sum())
        grad = grad_reduced.narrow(0, offset, ctx.dim)
        if ctx.scalar:
            grad = grad.reshape(())
        return grad, None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Allgather ``tensor`` (differentiable); returns a new tensor."""
    _check_tensor(tensor, "allgather")
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor of a list."""
    _check_group(tensors, "grouped_allgather")
    ps = _check_process_set(process_set)
    base = _op_name("grouped_allgather", name, ps)
    cores, dtypes = [], []
    for i, t in enumerate(tensors):
        work = _contiguous(t.detach())
        if work.dim() == 0:
            work = work.reshape(1)
        dtypes.append(work.dtype)
        cores.append(_submit("allgather", work, f"{base}_{i}of{len(tensors)}", ps=ps))
    return _register(cores, lambda rs: [_from_bytes(r, d) for r, d in zip(rs, dtypes)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of a list; returns new tensors."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ---------------------------------------------------------------------------------------------
# broadcast


def _broadcast_into(out, root_rank, name, ps=0):
    work = _contiguous(out)
    core = _submit("broadcast", work, _op_name("broadcast", name, ps), root=root_rank, ps=ps)

    def finish(_results):
        if work is not out:
            with torch.no_grad():
                out.copy_(work)
        return out

    return _register([core], finish)


def _check_root(root_rank, process_set):
    """``root_rank`` (a world rank) as a rank within ``process_set``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise ValueError(f"root_rank must be an int, got {root_rank!r}")
    size = _core.topology()[1]
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank {root_rank} is out of range 0..{size - 1}")
    return _root_in_set(process_set, root_rank)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast of ``root_rank``'s tensor into a new tensor on every rank."""
    _check_tensor(tensor, "broadcast")
    ps = _check_process_set(process_set)
    root = _check_root(root_rank, process_set)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _broadcast_into(out, root, name, ps)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast of ``root_rank``'s tensor into ``tensor`` on every rank."""
    _check_tensor(tensor, "broadcast")
    ps = _check_process_set(process_set)
    root = _check_root(root_rank, process_set)
    return _broadcast_into(tensor, root, name, ps)


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast: the root gets the averaged incoming gradient, others zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = _reduce.allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if _core.topology()[0] != ctx.root_rank:
            grad_reduced = grad_reduced * 0
        return grad_reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``root_rank``'s tensor; returns a new tensor (differentiable)."""
    _check_tensor(tensor, "broadcast")
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``root_rank``'s tensor into ``tensor`` in place and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------------------------------
# alltoall


def _splits_list(splits, size):
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be an int32 tensor, got {splits.dtype}")
        values = [int(x) for x in splits.reshape(-1).tolist()]
    elif isinstance(splits, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in splits):
            raise ValueError(f"alltoall splits must be integers, got {splits!r}")
        values = list(splits)
    else:
        raise ValueError(f"alltoall splits must be an int32 tensor, got {type(splits).__name__}")
    if len(values) != size:
        raise ValueError(f"alltoall splits must have one entry per rank ({size}), got "
                         f"{len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"alltoall splits must be non-negative, got {values}")
    return values


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall: ``splits[r]`` first-dimension rows go to rank r (equal parts when
    ``splits`` is None). ``synchronize`` returns the output, plus the received splits (int32)
    when ``splits`` was given."""
    _check_tensor(tensor, "alltoall")
    ps = _check_process_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    size = _size_of(process_set)
    work = _contiguous(tensor.detach())
    dtype = work.dtype
    base = _op_name("alltoall", name, ps)
    if splits is None:
        if work.shape[0] % size != 0:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the number of ranks ({size}), got {work.shape[0]}")
        core = _submit("alltoall", work, base, ps=ps)
        return _register([core], lambda r: _from_bytes(r[0], dtype))
    values = _splits_list(splits, size)
    if sum(values) != work.shape[0]:
        raise ValueError(f"alltoall splits {values} must add up to the first dimension "
                         f"{work.shape[0]}")
    send = torch.tensor(values, dtype=torch.int32)
    recv = torch.empty(size, dtype=torch.int32)
    core = _submit("alltoall", work, base, splits=values, ps=ps)
    # Each rank tells every other how many rows it sends it: an alltoall of the splits.
    core_splits = _submit("alltoall", send, base + ".splits", ps=ps)

    def finish(results):
        out = _from_bytes(results[0], dtype)
        got = _from_bytes(results[1], torch.int32)
        recv.copy_(got)
        return out, recv

    return _register([core, core_splits], finish)


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient travels back with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        size = _size_of(process_set)
        if splits is None:
            out = synchronize(alltoall_async(tensor, None, name, process_set))
            ctx.recv_splits = None
            return out, torch.full((size,), tensor.shape[0] // size if tensor.dim() else 0,
                                   dtype=torch.int32)
        out, recv = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.recv_splits = recv
        return out, recv

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        if ctx.recv_splits is None:
            grad = alltoall(grad_output, process_set=ctx.process_set)
        else:
            grad, _ = alltoall(grad_output, splits=ctx.recv_splits,
                               process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Alltoall (differentiable): returns the output, and the received splits too when
    ``splits`` was given."""
    _check_tensor(tensor, "alltoall")
    if splits is not None:
        _splits_list(splits, _size_of(process_set))
    out, recv = HorovodAlltoall.apply(tensor, splits, name, process_set)
    if splits is None:
        return out
    return out, recv


__all__ = [
    "allgather_async",
    "HorovodAllgather",
    "allgather",
    "grouped_allgather_async",
    "grouped_allgather",
    "broadcast_async",
    "broadcast_async_",
    "HorovodBroadcast",
    "broadcast",
    "broadcast_",
    "alltoall_async",
    "HorovodAlltoall",
    "alltoall",
]
