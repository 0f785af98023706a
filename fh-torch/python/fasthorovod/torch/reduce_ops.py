"""Reducing collectives: allreduce (blocking, async, in-place, grouped, autograd) and
reduce-scatter."""

import torch

from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _size_of
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import (Average, Sum, _allreduce, _check_group, _check_tensor,
                                    _contiguous, _from_bytes, _grouped_allreduce, _op_name,
                                    _reducescatter, _register, _resolve_op, synchronize)
from fasthorovod.torch.compression import Compression
from fasthorovod.torch import gather_ops as _gather


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


# ---------------------------------------------------------------------------------------------
# reducescatter
#
# Gradients follow Horovod's convention (the objective's gradient as Horovod's backward computes
# it; not the derivative of one rank's loss): this rank's gradient for the slice that rank r
# kept is rank r's incoming gradient, times size() for Sum (times 1 for Average), times the
# prescale and postscale factors. So the backward pass scales the incoming gradient and
# allgathers it.


def _reducescatter_work(tensor, what):
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs tensors with at least one dimension, got a scalar")
    return _contiguous(tensor.detach())


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start a reduce-scatter: the reduction of every rank's tensor, of which this rank keeps
    its slice of the first dimension (the lowest ranks get one extra row when it does not
    divide evenly). Returns a handle; ``synchronize`` returns the slice."""
    _check_tensor(tensor, "reducescatter")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, None)
    work = _reducescatter_work(tensor, "reducescatter")
    core = _reducescatter(work, _op_name("reducescatter", name, ps), op, prescale_factor,
                          postscale_factor, ps)
    return _register([core], lambda r: _from_bytes(r[0], work.dtype))


def _reducescatter_grad_scale(ctx, what):
    """The factor of the incoming gradient (Horovod's convention, above). Horovod's
    reduce-scatter reduces with Sum or Average only; the gradient through Min, Max or Product
    is refused rather than given a formula that would be wrong."""
    if ctx.op not in (Sum, Average):
        raise NotImplementedError(
            f"the gradient of {what} with op={ctx.op!r} is not supported (Horovod's "
            "reducescatter has Sum and Average only): use op=hvd.Sum or hvd.Average, or "
            "detach the input")
    scale = ctx.prescale_factor * ctx.postscale_factor
    if ctx.op == Sum:
        scale *= _size_of(ctx.process_set)
    return scale


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reduce-scatter: the gradient is the allgather of the incoming gradients
    times ``size()`` for Sum (1 for Average) and the scale factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op = op
        ctx.process_set = process_set
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        scale = _reducescatter_grad_scale(ctx, "reducescatter")
        grad = grad_output * scale if scale != 1.0 else grad_output
        grad = _gather.allgather(grad, process_set=ctx.process_set)
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce-scatter ``tensor`` (differentiable); returns this rank's slice."""
    compression = compression or Compression.none
    _check_tensor(tensor, "reducescatter")
    op = _resolve_op(op, None)
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a reduce-scatter of each tensor of a list (members ``<base>_<i>of<n>``)."""
    _check_group(tensors, "grouped_reducescatter")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, None)
    base = _op_name("grouped_reducescatter", name, ps)
    works = [_reducescatter_work(t, "grouped_reducescatter") for t in tensors]
    cores = [_reducescatter(w, f"{base}_{i}of{len(works)}", op, prescale_factor,
                            postscale_factor, ps) for i, w in enumerate(works)]
    return _register(cores, lambda rs: [_from_bytes(r, w.dtype) for r, w in zip(rs, works)])


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Differentiable grouped reduce-scatter: each member's gradient as in
    ``HorovodReducescatter``, the allgathers grouped."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op = op
        ctx.process_set = process_set
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_output):
        scale = _reducescatter_grad_scale(ctx, "grouped_reducescatter")
        grads = [g * scale if scale != 1.0 else g for g in grad_output]
        grads = _gather.grouped_allgather(grads, process_set=ctx.process_set)
        return (None, None, None, None, None, *grads)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter each tensor of a list (differentiable); returns this rank's slices."""
    compression = compression or Compression.none
    _check_group(tensors, "grouped_reducescatter")
    op = _resolve_op(op, None)
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


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
    "reducescatter_async",
    "HorovodReducescatter",
    "reducescatter",
    "grouped_reducescatter_async",
    "HorovodGroupedReducescatter",
    "grouped_reducescatter",
]
