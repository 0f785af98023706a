"""Collectives on torch tensors: blocking, ``_async`` (returning a handle), in-place (``_``)
and grouped forms, with Horovod's signatures.

CPU tensors cross into the engine without copies: the engine reduces in the tensor's own
memory while the tensor is kept alive by the pending operation. Do not read or write a tensor
while an in-place operation on it is in flight (Horovod's rule too).
"""

import ctypes
import itertools
import threading

import torch

from fasthorovod import _core
from fasthorovod.common.exceptions import HorovodInternalError
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import _rank_of, _root_in_set, _size_of
from fasthorovod.common.process_sets import global_process_set

# Reduce ops (Horovod's constants; compare with ``==``).
Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"

_ALL_OPS = (Average, Sum, Adasum, Min, Max, Product)

_lock = threading.Lock()
_handles = {}
_next_handle = itertools.count(1)
# Unnamed operations issued so far by this process, per process set id.
_unnamed = {}


def _op_name(prefix, name, ps=0):
    """Horovod's internal names: ``allreduce.<name>``, or ``allreduce.noname.<n>`` with n
    counting this process's unnamed operations in process set ``ps`` (each set has its own
    count: ranks outside a set do not see its operations), so every rank of the set must issue
    the same sequence of unnamed operations for them to meet (named ones do not shift the
    count, unlike Horovod, where a named operation issued by one rank only shifts every later
    unnamed name)."""
    if name is None:
        with _lock:
            n = _unnamed.get(ps, 0)
            _unnamed[ps] = n + 1
        return f"{prefix}.noname.{n}"
    if not isinstance(name, str):
        raise ValueError(f"name must be a string, got {type(name).__name__}")
    return f"{prefix}.{name}"


def _resolve_op(op, average, default=Average):
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; give only one of them")
    if op is None:
        if average is None:
            return default
        return Average if average else Sum
    if op not in _ALL_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max or hvd.Product")
    if op == Adasum:
        raise NotImplementedError("op=Adasum is not supported by FastHorovod; use hvd.Average "
                                  "or hvd.Sum")
    return op


def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        if not _core.cuda_built():
            raise NotImplementedError(
                f"{what}: this build of FastHorovod lacks CUDA (built without the `cuda` "
                "feature), so CUDA tensors are not supported: rebuild it with `maturin build "
                "--features cuda` (no CUDA toolkit needed), or move the tensor to the CPU "
                "with .cpu()"
            )
    elif tensor.device.type != "cpu":
        raise NotImplementedError(
            f"{what}: {tensor.device.type} tensors are not supported by FastHorovod (CPU "
            "and CUDA tensors only): move the tensor to the CPU with .cpu()"
        )
    if tensor.is_sparse:
        raise NotImplementedError(f"{what}: sparse tensors are not supported; use .to_dense()")


def _contiguous(tensor):
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _device_and_stream(tensor):
    """``(device index, raw current stream)`` of a CUDA tensor, ``(-1, 0)`` for a CPU one: the
    engine records the tensor's readiness on that stream (the work enqueued so far)."""
    if tensor.device.type != "cuda":
        return -1, 0
    index = tensor.device.index if tensor.device.index is not None else \
        torch.cuda.current_device()
    return index, int(torch.cuda.current_stream(index).cuda_stream)


def _stream_of(core):
    """The current stream of a core handle's CUDA device (``None`` for a CPU tensor):
    ``synchronize`` makes it wait for the collective's completion."""
    if core.device < 0:
        return None
    return int(torch.cuda.current_stream(core.device).cuda_stream)


def _submit(kind, tensor, name, op=Average, prescale=1.0, postscale=1.0, root=0, splits=None,
            priority=0, ps=0):
    """Hand ``tensor`` (contiguous; CPU, or CUDA with its device's current stream) to the
    engine of process set ``ps``; the core handle keeps it alive."""
    nbytes = tensor.numel() * tensor.element_size()
    device, stream = _device_and_stream(tensor)
    return _core.submit(kind, name, tensor, tensor.data_ptr(), nbytes, str(tensor.dtype),
                        list(tensor.shape), op, float(prescale), float(postscale), int(root),
                        splits, int(priority), device, stream, int(ps))


def _register(core_handles, finish):
    """A Horovod-style integer handle over one or more core handles; ``finish`` turns their
    results into what ``synchronize`` returns."""
    h = next(_next_handle)
    with _lock:
        _handles[h] = (core_handles, finish)
    return h


def _from_bytes(result, dtype):
    data, shape = result
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def poll(handle):
    """Whether the operation behind ``handle`` has completed (``synchronize`` will not block)."""
    with _lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    return all(c.poll() for c in entry[0])


def synchronize(handle):
    """Wait for the operation behind ``handle`` (the GIL released) and return its result.
    For CUDA tensors the device's current stream is made to wait for the collective (no
    host synchronization), so that work enqueued on it afterwards sees the result."""
    with _lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    core_handles, finish = entry
    results = []
    error = None
    for c in core_handles:
        try:
            results.append(c.wait(stream=_stream_of(c)))
        except BaseException as e:  # wait for every member even when one failed
            if error is None:
                error = e
            results.append(None)
    if error is not None:
        raise error
    return finish(results)


# ---------------------------------------------------------------------------------------------
# allreduce


def _allreduce_into(out, tensor, name, op, prescale, postscale, priority, prefix="allreduce",
                    ps=0):
    """Reduce into ``out`` (same shape as ``tensor``; may be ``tensor`` itself)."""
    work = _contiguous(out)
    name = _op_name(prefix, name, ps)
    core = _submit("allreduce", work, name, op, prescale, postscale, priority=priority, ps=ps)

    def finish(_results):
        if work is not out:
            with torch.no_grad():
                out.copy_(work)
        return out

    return _register([core], finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, _priority=0):
    """Start an allreduce of ``tensor`` into a new tensor; returns a handle for
    ``synchronize``."""
    _check_tensor(tensor, "allreduce")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, average)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_into(out, tensor, name, op, prescale_factor, postscale_factor, _priority,
                           ps=ps)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, _priority=0):
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


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Allreduce ``tensor`` across ranks and return the result in a new tensor
    (differentiable). ``op`` defaults to Average."""
    from fasthorovod.torch.compression import Compression

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
    members = []
    for i, w in enumerate(works):
        members.append((w, w.data_ptr(), w.numel() * w.element_size(), str(w.dtype),
                        list(w.shape)))
    device, stream = _device_and_stream(works[0])
    cores = _core.submit_group(base, members, op, float(prescale), float(postscale), 0, device,
                               stream, int(ps))

    def finish(_results):
        with torch.no_grad():
            for o, w in zip(outs, works):
                if w is not o:
                    o.copy_(w)
        return list(outs)

    return _register(cores, finish)


def _check_group(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{what} takes a list of tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise ValueError(f"{what} needs at least one tensor")
    for t in tensors:
        _check_tensor(t, what)
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{what}: the tensors of a group must be on one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")


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


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Allreduce a list of tensors as one group; returns new tensors (differentiable)."""
    from fasthorovod.torch.compression import Compression

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
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
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


# ---------------------------------------------------------------------------------------------
# reducescatter


def reducescatter_async(tensor, name=None, compression=None, op=Average,
                        process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start a reduce-scatter: the reduction of every rank's tensor, of which this rank keeps
    its slice of the first dimension (the lowest ranks get one extra row when it does not
    divide evenly)."""
    _check_tensor(tensor, "reducescatter")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, None)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    work = _contiguous(tensor.detach())
    dtype = work.dtype
    core = _submit("reducescatter", work, _op_name("reducescatter", name, ps), op, prescale_factor,
                   postscale_factor, ps=ps)
    return _register([core], lambda r: _from_bytes(r[0], dtype))


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reduce-scatter: the gradient is the allgather of the incoming
    gradient, scaled as the forward pass scaled."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op = op
        ctx.scale = prescale_factor * postscale_factor
        ctx.process_set = process_set
        return synchronize(reducescatter_async(tensor, name, None, op, process_set,
                                               prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allgather(grad_output, process_set=ctx.process_set)
        scale = ctx.scale
        if ctx.op == Average:
            scale = scale / _size_of(ctx.process_set)
        if scale != 1.0:
            grad = grad * scale
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce-scatter ``tensor`` (differentiable); returns this rank's slice."""
    from fasthorovod.torch.compression import Compression

    compression = compression or Compression.none
    _check_tensor(tensor, "reducescatter")
    op = _resolve_op(op, None)
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, compression=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Start a reduce-scatter of each tensor of a list."""
    _check_group(tensors, "grouped_reducescatter")
    ps = _check_process_set(process_set)
    op = _resolve_op(op, None)
    base = _op_name("grouped_reducescatter", name, ps)
    cores, dtypes = [], []
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError("reducescatter needs tensors with at least one dimension")
        work = _contiguous(t.detach())
        dtypes.append(work.dtype)
        cores.append(_submit("reducescatter", work, f"{base}_{i}of{len(tensors)}", op,
                             prescale_factor, postscale_factor, ps=ps))
    return _register(cores, lambda rs: [_from_bytes(r, d) for r, d in zip(rs, dtypes)])


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter each tensor of a list; returns this rank's slices."""
    return synchronize(grouped_reducescatter_async(tensors, name, compression, op,
                                                   process_set, prescale_factor,
                                                   postscale_factor))


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


def _bytes_of(tensor):
    """The bytes of a contiguous uint8 CPU tensor (no numpy needed)."""
    n = tensor.numel()
    return ctypes.string_at(tensor.data_ptr(), n) if n else b""


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
]
