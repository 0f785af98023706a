"""The allreduce collectives: blocking, async, in-place, grouped, autograd (reduce-scatter is
``scatter_ops``)."""

import torch

from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import (_allreduce, _check_group, _check_tensor, _contiguous,
                                    _grouped_allreduce, _op_name, _register, _resolve_op,
                                    synchronize)
from fasthorovod.torch.compression import Compression


# ---------------------------------------------------------------------------------------------
# allreduce


def _allreduce_into(out, tensor, name, op, prescale, postscale, priority, prefix="allreduce",
                    ps=0):
    """Reduce into ``out`` (same shape as ``tensor``; may be ``tensor`` itself)."""
    work = _contiguous(out)
    name = _op_name(prefix, name, ps)
    core = _allreduce(work, name, op, prescale, postscale, priority, ps)

    def finish(_results):
        if work is not out:
            with torch.no_grad():
                out.copy_(work)
        return out

    return _register([core], finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *, _priority=0):
    """Start an allreduce of ``tensor`` into a new tensor; returns a handle for
    ``synchronize``. ``_priority`` (FastHorovod's, keyword-only): higher goes first."""
    _check_tensor(tensor, "allreduce")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, average)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_into(out, tensor, name, op, prescale_factor, postscale_factor, _priority,
                           ps=ps)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, _priority=0):
    """Start an in-place allreduce of ``tensor``; returns a handle for ``synchronize``."""
    _check_tensor(tensor, "allreduce")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, average)
    return _allreduce_into(tensor, tensor, name, op, prescale_factor, postscale_factor,
                           _priority, ps=ps)


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average = average
        ctx.op = op
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        ctx.process_set = process_set
        handle = allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                 process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, average=ctx.average, op=ctx.op,
                         prescale_factor=ctx.prescale_factor,
                         postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce ``tensor`` across ranks and return the result in a new tensor
    (differentiable: the gradient is the same allreduce of the incoming gradient, as in
    Horovod). ``op`` defaults to Average."""
    compression = compression or Compression.none
    _check_tensor(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    summed = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                    postscale_factor, process_set)
    return compression.decompress(summed, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Allreduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# ---------------------------------------------------------------------------------------------
# grouped allreduce


def _grouped_into(outs, tensors, name, op, prescale, postscale, ps=0):
    works = [_contiguous(o) for o in outs]
    base = _op_name("grouped_allreduce", name, ps)
    cores = _grouped_allreduce(works, base, op, prescale, postscale, ps)

    def finish(_results):
        with torch.no_grad():
            for o, w in zip(outs, works):
                if w is not o:
                    o.copy_(w)
        return list(outs)

    return _register(cores, finish)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start an allreduce of a list of tensors as one group, into new tensors."""
    _check_group(tensors, "grouped_allreduce")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, average)
    outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return _grouped_into(outs, tensors, name, op, prescale_factor, postscale_factor, ps)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start an in-place allreduce of a list of tensors as one group."""
    _check_group(tensors, "grouped_allreduce")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, average)
    return _grouped_into(list(tensors), tensors, name, op, prescale_factor, postscale_factor,
                         ps)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable grouped allreduce."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        ctx.average = average
        ctx.op = op
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        ctx.process_set = process_set
        handle = grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                         postscale_factor, process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = grouped_allreduce(list(grad_output), average=ctx.average, op=ctx.op,
                                  prescale_factor=ctx.prescale_factor,
                                  postscale_factor=ctx.postscale_factor,
                                  process_set=ctx.process_set)
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Allreduce a list of tensors as one group; returns new tensors (differentiable)."""
    compression = compression or Compression.none
    _check_group(tensors, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    out = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                        process_set, *[p[0] for p in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(out, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors in place as one group; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


__all__ = [
    "allreduce_async",
    "allreduce_async_",
    "HorovodAllreduce",
    "allreduce",
    "allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "HorovodGroupedAllreduce",
    "grouped_allreduce",
    "grouped_allreduce_",
]
