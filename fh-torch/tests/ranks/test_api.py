"""Horovod 0.28's public ``horovod.torch`` surface, function by function: the same names in
``fasthorovod.torch`` and ``fasthorovod.torch.mpi_ops``, with the same signatures (parameter
names, order, kinds and defaults), so that positional calls mean what they mean in Horovod.

The table below is Horovod 0.28.1's, taken from its ``horovod/torch/__init__.py``,
``mpi_ops.py``, ``functions.py``, ``optimizer.py``, ``sync_batch_norm.py`` and
``horovod/common/basics.py`` / ``process_sets.py``. FastHorovod may add parameters of its own
only after Horovod's, keyword-only and with a default.
"""

import inspect

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.torch import mpi_ops

_PS = "process_set=global_process_set"
_REDUCE = f"average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, {_PS}"
_REDUCE_C = ("average=None, name=None, compression=Compression.none, op=None, "
             f"prescale_factor=1.0, postscale_factor=1.0, {_PS}")
_RS = f"name=None, op=Average, {_PS}, prescale_factor=1.0, postscale_factor=1.0"
_RS_C = (f"name=None, compression=Compression.none, op=Average, {_PS}, prescale_factor=1.0, "
         "postscale_factor=1.0")

# Horovod 0.28's horovod.torch.mpi_ops: name -> signature.
MPI_OPS = {
    "init": "(comm=None, process_sets=None)",
    "shutdown": "()",
    "is_initialized": "()",
    "start_timeline": "(file_path, mark_cycles=False)",
    "stop_timeline": "()",
    **{q: "()" for q in ["size", "local_size", "cross_size", "rank", "local_rank",
                         "cross_rank", "is_homogeneous", "mpi_threads_supported",
                         "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
                         "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]},
    "allreduce": f"(tensor, {_REDUCE_C})",
    "allreduce_async": f"(tensor, {_REDUCE})",
    "allreduce_": f"(tensor, {_REDUCE})",
    "allreduce_async_": f"(tensor, {_REDUCE})",
    "grouped_allreduce": f"(tensors, {_REDUCE_C})",
    "grouped_allreduce_async": f"(tensors, {_REDUCE})",
    "grouped_allreduce_": f"(tensors, {_REDUCE})",
    "grouped_allreduce_async_": f"(tensors, {_REDUCE})",
    "sparse_allreduce_async": f"(tensor, name, op, {_PS})",
    "allgather": f"(tensor, name=None, {_PS})",
    "allgather_async": f"(tensor, name=None, {_PS})",
    "grouped_allgather": f"(tensors, name=None, {_PS})",
    "grouped_allgather_async": f"(tensors, name=None, {_PS})",
    "broadcast": f"(tensor, root_rank, name=None, {_PS})",
    "broadcast_async": f"(tensor, root_rank, name=None, {_PS})",
    "broadcast_": f"(tensor, root_rank, name=None, {_PS})",
    "broadcast_async_": f"(tensor, root_rank, name=None, {_PS})",
    "alltoall": f"(tensor, splits=None, name=None, {_PS})",
    "alltoall_async": f"(tensor, splits=None, name=None, {_PS})",
    "reducescatter": f"(tensor, {_RS_C})",
    "reducescatter_async": f"(tensor, {_RS})",
    "grouped_reducescatter": f"(tensors, {_RS_C})",
    "grouped_reducescatter_async": f"(tensors, {_RS})",
    "poll": "(handle)",
    "synchronize": "(handle)",
    "join": "(device=-1)",
    "barrier": f"({_PS})",
    "add_process_set": "(process_set)",
    "remove_process_set": "(process_set)",
    "handle_average_backwards_compatibility": "(op, average)",
}

# Horovod 0.28's horovod.torch adds these (functions.py, optimizer.py, sync_batch_norm.py).
PACKAGE = {
    **{k: v for k, v in MPI_OPS.items() if k != "handle_average_backwards_compatibility"},
    "broadcast_parameters": f"(params, root_rank, {_PS})",
    "broadcast_optimizer_state": f"(optimizer, root_rank, model=None, {_PS})",
    "broadcast_object": f"(obj, root_rank=0, name=None, {_PS})",
    "allgather_object": f"(obj, name=None, {_PS})",
    "DistributedOptimizer": ("(optimizer, named_parameters=None, compression=Compression.none, "
                             "backward_passes_per_step=1, op=Average, "
                             "gradient_predivide_factor=1.0, num_groups=0, groups=None, "
                             f"sparse_as_dense=False, {_PS})"),
    "SyncBatchNorm": "(num_features, eps=1e-05, momentum=0.1, affine=True, "
                     "track_running_stats=True)",
}

# Names Horovod exports that are not functions (checked to exist).
CONSTANTS = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet",
             "global_process_set", "HorovodInternalError", "Compression"]

def horovod_signature(text):
    """The signature that ``text`` spells, with Horovod's defaults as FastHorovod's objects."""
    namespace = {"Compression": hvd.Compression, "global_process_set": hvd.global_process_set,
                 "Average": hvd.Average}
    exec(f"def f{text}: pass", namespace)  # noqa: S102 - the table above, not input
    return inspect.signature(namespace["f"])


def differences(name, ours, theirs):
    """What differs between our signature and Horovod's (empty when compatible)."""
    ours_p = list(ours.parameters.values())
    theirs_p = list(theirs.parameters.values())
    found = []
    for i, h in enumerate(theirs_p):
        if i >= len(ours_p):
            found.append(f"lacks parameter {i} '{h.name}'")
            continue
        o = ours_p[i]
        if o.name != h.name:
            found.append(f"parameter {i} is '{o.name}', Horovod's is '{h.name}'")
        if o.kind != h.kind:
            found.append(f"parameter '{o.name}' is {o.kind.description}, Horovod's is "
                         f"{h.kind.description}")
        if h.default is inspect.Parameter.empty:
            if o.default is not inspect.Parameter.empty:
                found.append(f"parameter '{o.name}' has a default, Horovod's has none")
        elif not (o.default is h.default
                  or (type(o.default) is type(h.default) and o.default == h.default)):
            found.append(f"parameter '{o.name}' defaults to {o.default!r}, Horovod's to "
                         f"{h.default!r}")
    for o in ours_p[len(theirs_p):]:
        if o.kind != inspect.Parameter.KEYWORD_ONLY or o.default is inspect.Parameter.empty:
            found.append(f"extra parameter '{o.name}' must be keyword-only with a default")
    return [f"{name}{ours}: {d}" for d in found]


def _check_module(module, table):
    problems = []
    for name, text in table.items():
        obj = getattr(module, name, None)
        if obj is None:
            problems.append(f"{name}: missing")
            continue
        found = differences(name, inspect.signature(obj), horovod_signature(text))
        problems.extend(found)
    for name in CONSTANTS:
        if not hasattr(module, name):
            problems.append(f"{name}: missing")
    assert not problems, f"{module.__name__} differs from Horovod 0.28:\n" + "\n".join(problems)


def test_package_signatures_are_horovods():
    _check_module(hvd, PACKAGE)


def test_mpi_ops_signatures_are_horovods():
    _check_module(mpi_ops, MPI_OPS)


def test_the_signature_check_can_fail():
    horovods = horovod_signature(MPI_OPS["reducescatter_async"])

    def misordered(tensor, name=None, compression=None, op=hvd.Average,
                   process_set=hvd.global_process_set, prescale_factor=1.0,
                   postscale_factor=1.0):
        pass

    def positional_extra(tensor, name=None, op=hvd.Average, process_set=hvd.global_process_set,
                         prescale_factor=1.0, postscale_factor=1.0, extra=1):
        pass

    def keyword_extra(tensor, name=None, op=hvd.Average, process_set=hvd.global_process_set,
                      prescale_factor=1.0, postscale_factor=1.0, *, _extra=1):
        pass

    found = differences("misordered", inspect.signature(misordered), horovods)
    assert any("parameter 2 is 'compression'" in d for d in found), found
    found = differences("positional_extra", inspect.signature(positional_extra), horovods)
    assert found and all("'extra' must be keyword-only" in d for d in found), found
    assert differences("keyword_extra", inspect.signature(keyword_extra), horovods) == []


def test_mpi_ops_defines_the_runtime_functions():
    assert mpi_ops.init is hvd.init and mpi_ops.shutdown is hvd.shutdown
    assert mpi_ops.is_initialized()
    assert (mpi_ops.rank(), mpi_ops.size(), mpi_ops.local_rank(), mpi_ops.local_size(),
            mpi_ops.cross_rank(), mpi_ops.cross_size()) == \
        (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
         hvd.cross_size())
    assert 0 <= mpi_ops.rank() < mpi_ops.size()
    assert mpi_ops.gloo_built() is False and mpi_ops.gloo_enabled() is False
    assert mpi_ops.mpi_threads_supported() == mpi_ops.mpi_enabled()
    assert mpi_ops.handle_average_backwards_compatibility(None, False) == hvd.Sum
    assert mpi_ops.handle_average_backwards_compatibility(None, None) == hvd.Average


def test_positional_calls_mean_what_they_mean_in_horovod():
    n, r = hvd.size(), hvd.rank()
    x = torch.full((2 * n, 2), float(r + 1))
    s = float(n * (n + 1) // 2)  # the sum over the ranks of r + 1
    got = hvd.synchronize(hvd.reducescatter_async(x, "pos.rs", hvd.Sum))
    assert torch.equal(got, torch.full((2, 2), s)), f"rank {r}: reducescatter_async: {got}"
    got = hvd.synchronize(hvd.grouped_reducescatter_async([x], "pos.grs", hvd.Sum))[0]
    assert torch.equal(got, torch.full((2, 2), s)), f"rank {r}: grouped_reducescatter_async"
    got = hvd.reducescatter(x, "pos.rs2", hvd.Compression.none, hvd.Sum)
    assert torch.equal(got, torch.full((2, 2), s)), f"rank {r}: reducescatter: {got}"
    got = hvd.synchronize(hvd.allreduce_async(x, None, "pos.ar", hvd.Sum, 2.0))
    assert torch.equal(got, torch.full((2 * n, 2), 2 * s)), f"rank {r}: allreduce_async"
    got = hvd.allreduce(x, False, "pos.ar2")
    assert torch.equal(got, torch.full((2 * n, 2), s)), f"rank {r}: allreduce(average=False)"


def test_alltoall_async_returns_the_received_splits_as_horovod():
    # Horovod's synchronize on an alltoall handle returns (output, received_splits), with or
    # without splits; the blocking alltoall returns the output alone without splits.
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    out, received = hvd.synchronize(hvd.alltoall_async(x))
    assert received.dtype == torch.int32 and received.tolist() == [2] * n, \
        f"rank {r}: received splits {received.tolist()}"
    want = torch.cat([torch.tensor([2 * r, 2 * r + 1], dtype=torch.float32) + 100 * q
                      for q in range(n)])
    assert torch.equal(out, want), f"rank {r}: {out} != {want}"
    assert isinstance(hvd.alltoall(x), torch.Tensor)


def test_elastic_names_are_horovods():
    # Their behaviour: test_elastic.py and test_elastic_sampler.py.
    from fasthorovod.common import exceptions

    for name in ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
                 "HorovodInternalError", "HostsUpdatedInterrupt"]:
        assert hasattr(hvd.elastic, name), f"hvd.elastic.{name} is missing"
    assert hvd.elastic.HostsUpdatedInterrupt is exceptions.HostsUpdatedInterrupt
    assert hvd.elastic.HorovodInternalError is exceptions.HorovodInternalError
    assert issubclass(hvd.elastic.TorchState, hvd.elastic.ObjectState)
    assert issubclass(hvd.elastic.ElasticSampler, torch.utils.data.Sampler)


def test_what_fasthorovod_lacks_says_so():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="comm"):
        hvd.init(comm=object())


def test_core_boundary_is_typed():
    # One function per collective, keyword-only, checked before anything is submitted (so no
    # rank waits for another here).
    from fasthorovod import _core

    t = torch.ones(4)
    with pytest.raises(TypeError):
        _core.allreduce(t, "api.pos", "sum")
    with pytest.raises(TypeError):
        _core.allreduce(t, name="api.scale", op="sum", prescale="2")
    with pytest.raises(ValueError, match="takes a torch.Tensor"):
        _core.allreduce([1.0, 2.0], name="api.list", op="sum")
    with pytest.raises(ValueError, match="contiguous"):
        _core.allreduce(torch.ones(3, 2).t(), name="api.t", op="sum")
    with pytest.raises(ValueError, match="hvd.Average"):
        _core.reducescatter(t, name="api.op", op="median")
    with pytest.raises(ValueError, match="finite"):
        _core.allreduce(t, name="api.inf", op="sum", postscale=float("inf"))
    with pytest.raises(ValueError, match="non-negative"):
        _core.alltoall(t, name="api.splits", splits=[-1] + [1] * hvd.size())
    with pytest.raises(ValueError, match="root_rank"):
        _core.broadcast(t, name="api.root", root=hvd.size())
    with pytest.raises(ValueError, match="at least one tensor"):
        _core.grouped_allreduce([], name="api.empty", op="sum")
