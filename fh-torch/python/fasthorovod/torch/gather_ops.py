"""Collectives that move data without reducing it: allgather, broadcast, alltoall
(blocking, async, in-place, grouped, autograd; the gradients of allgather and broadcast are
allreduces, from ``reduce_ops``)."""

import torch

from fasthorovod import _core
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _rank_of, _root_in_set, _size_of
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import (Average, _allgather, _alltoall, _broadcast, _check_group,
                                    _check_tensor, _contiguous, _from_bytes, _op_name,
                                    _register, synchronize)
from fasthorovod.torch.reduce_ops import allreduce, grouped_allreduce


# ---------------------------------------------------------------------------------------------
# allgather


def _allgather_work(tensor):
    work = _contiguous(tensor.detach())
    return work.reshape(1) if work.dim() == 0 else work


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start an allgather: every rank's tensor concatenated along the first dimension (which
    may differ per rank; the other dimensions must agree)."""
    _check_tensor(tensor, "allgather")
    ps = _check_process_set(process_set)
    work = _allgather_work(tensor)
    core = _allgather(work, _op_name("allgather", name, ps), ps)
    return _register([core], lambda r: _from_bytes(r[0], work.dtype))


def _rows_of_every_rank(rows, process_set):
    """``rows[i]`` (this rank's first dimension of member i) of every rank of the set: a list
    of per-member lists, one entry per rank. One allgather for all members."""
    mine = torch.tensor(rows, dtype=torch.int64)
    every = synchronize(allgather_async(mine, process_set=process_set))
    every = every.reshape(_size_of(process_set), len(rows))
    return [every[:, i].tolist() for i in range(len(rows))]


def _my_rows(grad, rows_per_rank, process_set):
    """This rank's rows of a gathered tensor's gradient."""
    offset = sum(rows_per_rank[:_rank_of(process_set)])
    mine = rows_per_rank[_rank_of(process_set)]
    return grad.narrow(0, offset, mine)


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather: the gradient is this rank's rows of the incoming gradient
    averaged over the ranks (Horovod's convention: the objective is the mean of the ranks'
    losses)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() > 0 else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        (rows,) = _rows_of_every_rank([ctx.rows], ctx.process_set)
        grad = _my_rows(averaged, rows, ctx.process_set)
        if ctx.scalar:
            grad = grad.reshape(())
        return grad, None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Allgather ``tensor`` (differentiable); returns a new tensor."""
    _check_tensor(tensor, "allgather")
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor of a list (members ``<base>_<i>of<n>``)."""
    _check_group(tensors, "grouped_allgather")
    ps = _check_process_set(process_set)
    base = _op_name("grouped_allgather", name, ps)
    works = [_allgather_work(t) for t in tensors]
    cores = [_allgather(w, f"{base}_{i}of{len(works)}", ps) for i, w in enumerate(works)]
    return _register(cores, lambda rs: [_from_bytes(r, w.dtype) for r, w in zip(rs, works)])


class HorovodGroupedAllgather(torch.autograd.Function):
    """Differentiable grouped allgather: each member's gradient as in ``HorovodAllgather``,
    the reductions grouped."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() > 0 else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_output):
        averaged = grouped_allreduce(list(grad_output), op=Average,
                                     process_set=ctx.process_set)
        every = _rows_of_every_rank(ctx.rows, ctx.process_set)
        grads = []
        for g, rows, scalar in zip(averaged, every, ctx.scalars):
            g = _my_rows(g, rows, ctx.process_set)
            grads.append(g.reshape(()) if scalar else g)
        return (None, None, *grads)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of a list (differentiable); returns new tensors."""
    _check_group(tensors, "grouped_allgather")
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------------------------------------
# broadcast


def _broadcast_into(out, root_rank, name, ps=0):
    work = _contiguous(out)
    core = _broadcast(work, _op_name("broadcast", name, ps), root_rank, ps)

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
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
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
    ``splits`` is None). ``synchronize`` returns ``(output, received_splits)`` (int32, the
    rows received from each rank), as Horovod's does, with or without ``splits``."""
    _check_tensor(tensor, "alltoall")
    ps = _check_process_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    size = _size_of(process_set)
    work = _contiguous(tensor.detach())
    base = _op_name("alltoall", name, ps)
    if splits is None:
        if work.shape[0] % size != 0:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the number of ranks ({size}), got {work.shape[0]}")
        values = [work.shape[0] // size] * size
        core = _alltoall(work, base, None, ps)
    else:
        values = _splits_list(splits, size)
        if sum(values) != work.shape[0]:
            raise ValueError(f"alltoall splits {values} must add up to the first dimension "
                             f"{work.shape[0]}")
        core = _alltoall(work, base, values, ps)
    # Each rank tells every other how many rows it sends it (an alltoall of the splits): the
    # received splits, which the gradient travels back with.
    send = torch.tensor(values, dtype=torch.int32)
    core_splits = _alltoall(send, base + ".splits", None, ps)

    def finish(results):
        return (_from_bytes(results[0], work.dtype),
                _from_bytes(results[1], torch.int32).clone())

    return _register([core, core_splits], finish)


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient travels back with the received splits (each rank
    gets back the gradient of the rows it sent)."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad_output, *_dead):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Alltoall (differentiable): returns the output, and the received splits too when
    ``splits`` was given."""
    _check_tensor(tensor, "alltoall")
    if splits is not None:
        _splits_list(splits, _size_of(process_set))
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


__all__ = [
    "allgather_async",
    "HorovodAllgather",
    "allgather",
    "grouped_allgather_async",
    "HorovodGroupedAllgather",
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
