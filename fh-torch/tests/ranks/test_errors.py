"""Each error case raises the exception type Horovod users catch, on every rank."""

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.common.exceptions import HorovodInternalError

needs_two = pytest.mark.skipif("hvd.size() < 2", reason="needs 2 ranks")


def _ranks(ranks):
    """How a mismatch message names a set of ranks: "rank 1", "ranks 0 and 2", "ranks 0, 2
    and 5", runs of three or more as ranges ("ranks 0-7 and 9")."""
    rs = sorted(set(ranks))
    items, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            items.append(f"{rs[i]}-{rs[j]}")
        else:
            items.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    if len(items) == 1 and "-" not in items[0]:
        return f"rank {items[0]}"
    if len(items) == 1:
        return f"ranks {items[0]}"
    return "ranks " + ", ".join(items[:-1]) + " and " + items[-1]


def _rank0_against_the_rest(what, mine, theirs):
    """The message when rank 0 alone sent `mine` and every other rank `theirs`."""
    rest = _ranks(range(1, hvd.size()))
    return f"Mismatched {what}: rank 0 sent {mine}; {rest} sent {theirs}"


def test_rank_phrases():
    assert _ranks([1]) == "rank 1"
    assert _ranks([2, 0]) == "ranks 0 and 2"
    assert _ranks([0, 2, 5]) == "ranks 0, 2 and 5"
    assert _ranks([0, 1]) == "ranks 0 and 1"
    assert _ranks(list(range(8)) + [9]) == "ranks 0-7 and 9"


@needs_two
def test_dtype_mismatch_names_both_dtypes_and_their_ranks():
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    with pytest.raises(HorovodInternalError) as e:
        hvd.allreduce(torch.ones(3, dtype=dtype), name="dtype_mismatch")
    assert isinstance(e.value, RuntimeError)
    msg = str(e.value)
    assert _rank0_against_the_rest("allreduce data types", "f32", "f64") in msg, msg


@needs_two
def test_shape_mismatch_names_both_shapes_and_their_ranks():
    shape = (17, 17) if hvd.rank() == 0 else (18, 18)
    with pytest.raises(HorovodInternalError) as e:
        hvd.allreduce(torch.ones(shape), name="shape_mismatch")
    msg = str(e.value)
    want = _rank0_against_the_rest("allreduce tensor shapes", "[17, 17]", "[18, 18]")
    assert want in msg, msg


@needs_two
def test_op_root_and_scale_mismatch():
    every_rank_its_own = "; ".join(f"rank {r} sent {{{r}}}" for r in range(hvd.size()))
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(HorovodInternalError) as e:
        hvd.allreduce(torch.ones(2), name="op_mismatch", op=op)
    assert _rank0_against_the_rest("allreduce reduce ops", "sum", "max") in str(e.value)
    with pytest.raises(HorovodInternalError) as e:
        hvd.broadcast(torch.ones(2), root_rank=hvd.rank(), name="root_mismatch")
    roots = every_rank_its_own.format(*range(hvd.size()))
    assert f"Mismatched broadcast root ranks: {roots}" in str(e.value), str(e.value)
    with pytest.raises(HorovodInternalError) as e:
        hvd.allreduce(torch.ones(2), name="scale_mismatch",
                      prescale_factor=1.0 + hvd.rank())
    scales = every_rank_its_own.format(*(f"{1.0 + r}" for r in range(hvd.size())))
    assert f"Mismatched allreduce prescale factors: {scales}" in str(e.value), str(e.value)
    # The engine goes on after refused names.
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after"),
                       torch.full((2,), float(hvd.size())))


@needs_two
def test_duplicate_name_is_refused_at_submission():
    # (On one rank the first operation may finish before the second is submitted.)
    t = torch.ones(2)
    if hvd.rank() == 0:
        h = hvd.allreduce_async(t, name="dup")
        with pytest.raises(ValueError, match="dup"):
            hvd.allreduce_async(torch.ones(2), name="dup")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(t, name="dup")
    hvd.synchronize(h)


def test_alltoall_bad_splits_are_value_errors():
    n = hvd.size()
    x = torch.ones(n + 1, 2)
    with pytest.raises(ValueError, match="add up"):
        hvd.alltoall(x, splits=torch.ones(n, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(x, splits=torch.ones(n, dtype=torch.int64))
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            hvd.alltoall(torch.ones(n + 1, 2))
    with pytest.raises(ValueError, match="one entry per rank"):
        hvd.alltoall(x, splits=torch.tensor([n + 1] + [0] * n, dtype=torch.int32))


def test_bad_arguments():
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2), op="median")
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="complex64"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size())
    with pytest.raises(ValueError):
        hvd.synchronize(123456789)
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.tensor(1.0))


def test_process_sets_need_registration_and_dynamic_mode(monkeypatch):
    assert hvd.global_process_set.size() == hvd.size()
    assert hvd.global_process_set.rank() == hvd.rank()
    assert hvd.global_process_set.included()
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum,
                                     process_set=hvd.global_process_set),
                       torch.full((1,), float(hvd.size())))
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    # Without dynamic process sets, adding after init is refused on every rank (no
    # collective starts, so nothing waits).
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
        hvd.add_process_set([0])
    if hvd.size() > 1:
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))


def test_optimizer_argument_errors():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                 backward_passes_per_step=0)
    with pytest.raises(ValueError, match="duplicates"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight),
                                                        ("w", model.bias)])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight)])
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                 op=hvd.Sum, gradient_predivide_factor=2.0)


class _FakeCuda(torch.Tensor):
    """A CPU tensor claiming to live on cuda:0: enough for the checks made before submission
    (no GPU is needed to build one)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_cuda_tensors_need_a_cuda_build():
    fake = torch.ones(2).as_subclass(_FakeCuda)
    assert fake.device.type == "cuda"
    if hvd.cuda_built():
        # The build has the GPU path; a real CUDA tensor is covered by scripts/gpu-check.sh.
        return
    with pytest.raises(NotImplementedError, match="lacks CUDA"):
        hvd.allreduce(fake)
    with pytest.raises(NotImplementedError, match="lacks CUDA"):
        hvd.broadcast_(fake, root_rank=0)
    with pytest.raises(NotImplementedError, match="lacks CUDA"):
        hvd.grouped_allreduce([fake])


def test_other_devices_are_refused():
    class _FakeXpu(torch.Tensor):
        @property
        def device(self):
            return torch.device("meta")

    with pytest.raises(NotImplementedError, match="CPU and CUDA tensors only"):
        hvd.allreduce(torch.ones(2).as_subclass(_FakeXpu))
