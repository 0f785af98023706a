"""Helpers built on the collectives: broadcasting parameters, optimizer state and Python
objects, gathering objects."""

import io
import pickle

import torch

from fasthorovod import _core
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch._ops import _bytes_of
from fasthorovod.torch.mpi_ops import allgather_async, broadcast_async_, synchronize


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Copy ``root_rank``'s parameters into every rank's: ``params`` is a ``state_dict()``
    (broadcast in key order) or a list of ``(name, tensor)`` pairs (or tensors)."""
    _check_process_set(process_set)
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        handles.append(broadcast_async_(p.data if p.requires_grad else p, root_rank,
                                        name=None if name is None else f"parameter.{name}",
                                        process_set=process_set))
    for h in handles:
        synchronize(h)


def _makes_sparse_gradients(module):
    """Whether ``module`` produces sparse gradients for its parameters."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and \
        bool(getattr(module, "sparse", False))


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Copy ``root_rank``'s optimizer state (tensors and scalar options) into every rank's.

    A new optimizer has no state yet: it is made first, by a step of the (local) optimizer
    on zero gradients, which stay in ``p.grad`` afterwards (as Horovod leaves them); the
    parameters themselves are kept as they were. ``model``: the module the optimizer
    trains; the zero gradients of its parameters that get sparse gradients
    (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``) are made sparse, as they are
    for every parameter of a ``torch.optim.SparseAdam``."""
    _check_process_set(process_set)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if len(optimizer.state_dict()["state"]) == 0:
        sparse = set()
        if model is not None:
            for module in model.modules():
                if _makes_sparse_gradients(module):
                    sparse.update(id(p) for p in module.parameters(recurse=False))
        all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
        saved = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    saved.append((p, p.data.clone()))
                    zero = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    p.grad = zero.to_sparse() if all_sparse or id(p) in sparse else zero
        # The wrapped optimizer's own step: a DistributedOptimizer's would reduce.
        getattr(optimizer, "_fh_local_step", optimizer.step)()
        with torch.no_grad():
            for p, data in saved:
                p.data.copy_(data)
    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Dense tensors are broadcast in place; the rest (numbers, None, sparse tensors such as
    # SGD's momentum for a sparse gradient) travel pickled, with the options.
    tensors, scalars = [], {}
    for pid in sorted(state_dict["state"]):
        for key in sorted(state_dict["state"][pid]):
            value = state_dict["state"][pid][key]
            if isinstance(value, torch.Tensor) and not value.is_sparse:
                tensors.append((f"optimizer.state.{pid}.{key}", value))
            else:
                scalars.setdefault(pid, {})[key] = value
    handles = [broadcast_async_(t, root_rank, name=n, process_set=process_set)
               for n, t in tensors]
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    root = broadcast_object({"options": options, "scalars": scalars}, root_rank,
                            name="optimizer.options", process_set=process_set)
    for h in handles:
        synchronize(h)
    if len(root["options"]) != len(optimizer.param_groups):
        raise ValueError("the optimizers of the ranks have different parameter groups")
    for group, opts in zip(optimizer.param_groups, root["options"]):
        group.update(opts)
    for pid, values in root["scalars"].items():
        if pid < len(params):
            optimizer.state[params[pid]].update(values)


def _to_bytes_tensor(obj):
    buf = io.BytesIO()
    pickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8) \
        if buf.tell() else torch.empty(0, dtype=torch.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Pickle ``obj`` on ``root_rank`` and return a copy of it on every rank."""
    _check_process_set(process_set)
    name = name or type(obj).__name__
    me = _core.topology()[0]
    if me == root_rank:
        payload = _to_bytes_tensor(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    synchronize(broadcast_async_(size, root_rank, name=f"{name}.sz", process_set=process_set))
    if me != root_rank:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    synchronize(broadcast_async_(payload, root_rank, name=f"{name}.t",
                                 process_set=process_set))
    if me == root_rank:
        return obj
    return pickle.loads(_bytes_of(payload))


def allgather_object(obj, name=None, process_set=global_process_set):
    """Pickle ``obj`` on every rank; return the list of every rank's object, in rank order."""
    _check_process_set(process_set)
    name = name or type(obj).__name__
    payload = _to_bytes_tensor(obj)
    sizes = synchronize(allgather_async(torch.tensor([payload.numel()], dtype=torch.int64),
                                        name=f"{name}.sz", process_set=process_set))
    gathered = synchronize(allgather_async(payload, name=f"{name}.t", process_set=process_set))
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(_bytes_of(gathered[offset:offset + n].contiguous())))
        offset += n
    return out
