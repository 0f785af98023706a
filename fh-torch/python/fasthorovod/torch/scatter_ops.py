"""The reduce-scatter collectives: blocking, async, grouped, autograd (their gradient is an
allgather, from ``gather_ops``)."""

import torch

from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _size_of
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import (Average, Sum, _check_group, _check_tensor, _contiguous,
                                    _from_bytes, _op_name, _reducescatter, _register,
                                    _resolve_op, synchronize)
from fasthorovod.torch.compression import Compression
from fasthorovod.torch.gather_ops import allgather, grouped_allgather

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
        grad = allgather(grad, process_set=ctx.process_set)
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
        grads = grouped_allgather(grads, process_set=ctx.process_set)
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
    "reducescatter_async",
    "HorovodReducescatter",
    "reducescatter",
    "grouped_reducescatter_async",
    "HorovodGroupedReducescatter",
    "grouped_reducescatter",
]
