"""Shared machinery of the collectives: reduce-op names, operation names, argument checks,
submission to the engine, and Horovod-style integer handles (``poll``, ``synchronize``)."""

import ctypes
import functools
import itertools
import threading
import time

import torch

from fasthorovod import _core


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
# Whether this rank writes a timeline: then submissions, waits and optimizer steps put spans
# on its Python lane (set by ``init``, ``start_timeline`` and ``stop_timeline``).
_tracing = False


def _refresh_tracing():
    """Ask the runtime whether this rank writes a timeline now."""
    global _tracing
    _tracing = _core.timeline_on()


def _record_step(exposed_ns):
    """Count a training step that waited ``exposed_ns`` for its reductions."""
    try:
        _core.record_step(max(0, int(exposed_ns)))
    except Exception:  # noqa: BLE001 - a figure never fails the step
        pass


def _span(kind, detail, t0):
    """A span ``kind`` from ``t0`` (``time.monotonic_ns()``) until now on the timeline."""
    try:
        _core.timeline_span(kind, str(detail), t0, time.monotonic_ns())
    except Exception:  # noqa: BLE001 - a span never fails the operation
        pass


def _traced_submission(submit):
    """A submission that, while this rank writes a timeline, shows as a ``submit`` span
    named after its tensor."""
    @functools.wraps(submit)
    def wrapper(*args, **kwargs):
        if not _tracing:
            return submit(*args, **kwargs)
        t0 = time.monotonic_ns()
        try:
            return submit(*args, **kwargs)
        finally:
            _span("submit", kwargs.get("name", args[1] if len(args) > 1 else ""), t0)
    return wrapper


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


def _stream(tensor):
    """The raw current stream of a CUDA tensor's device, 0 for a CPU tensor: the engine records
    the tensor's readiness on that stream (the work enqueued so far)."""
    if not tensor.is_cuda:  # a flag: cheaper than building the tensor's device
        return 0
    index = tensor.device.index if tensor.device.index is not None else \
        torch.cuda.current_device()
    return int(torch.cuda.current_stream(index).cuda_stream)


def _stream_of(core):
    """The current stream of a core handle's CUDA device (``None`` for a CPU tensor):
    ``synchronize`` makes it wait for the collective's completion."""
    if core.device < 0:
        return None
    return int(torch.cuda.current_stream(core.device).cuda_stream)


# Submission to the engine of process set ``ps``: one function of ``_core`` per collective,
# keyword-only. Each takes the contiguous tensor itself (CPU, or CUDA with its device's current
# stream): the engine reads its address, length, dtype, shape and device from it, and the core
# handle keeps it alive until the operation has completed.


@_traced_submission
def _allreduce(tensor, name, op, prescale, postscale, priority=0, ps=0):
    return _core.allreduce(tensor, name=name, op=op, prescale=float(prescale),
                           postscale=float(postscale), priority=int(priority),
                           stream=_stream(tensor), process_set_id=int(ps))


@_traced_submission
def _grouped_allreduce(tensors, name, op, prescale, postscale, ps=0):
    return _core.grouped_allreduce(list(tensors), name=name, op=op, prescale=float(prescale),
                                   postscale=float(postscale), stream=_stream(tensors[0]),
                                   process_set_id=int(ps))


@_traced_submission
def _allgather(tensor, name, ps=0):
    return _core.allgather(tensor, name=name, stream=_stream(tensor), process_set_id=int(ps))


@_traced_submission
def _broadcast(tensor, name, root, ps=0):
    return _core.broadcast(tensor, name=name, root=int(root), stream=_stream(tensor),
                           process_set_id=int(ps))


@_traced_submission
def _alltoall(tensor, name, splits=None, ps=0):
    return _core.alltoall(tensor, name=name, splits=splits, stream=_stream(tensor),
                          process_set_id=int(ps))


@_traced_submission
def _reducescatter(tensor, name, op, prescale, postscale, ps=0):
    return _core.reducescatter(tensor, name=name, op=op, prescale=float(prescale),
                               postscale=float(postscale), stream=_stream(tensor),
                               process_set_id=int(ps))


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
    return finish(_wait_cores(core_handles))


def _wait_cores(core_handles):
    """Wait for every core handle (the GIL released; for CUDA the current stream waits) and
    return their results; the first error is raised once every one has ended."""
    results = []
    error = None
    t0 = time.monotonic_ns() if _tracing else 0
    for c in core_handles:
        try:
            results.append(c.wait(stream=_stream_of(c)))
        except BaseException as e:  # wait for every member even when one failed
            if error is None:
                error = e
            results.append(None)
    if t0:
        _span("synchronize", core_handles[0].name if core_handles else "", t0)
    if error is not None:
        raise error
    return results


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


def _bytes_of(tensor):
    """The bytes of a contiguous uint8 CPU tensor (no numpy needed)."""
    n = tensor.numel()
    return ctypes.string_at(tensor.data_ptr(), n) if n else b""
