"""The ``fasthorovod`` backend of ``torch.distributed`` (``fasthorovod.torch.distributed``), on
every rank: every collective against values worked out from the ranks' inputs, DDP (plain,
``no_sync``, gradient-as-bucket-view, static graph, a communication hook, a subgroup) against
DDP on Gloo in the same processes, FSDP2 against Gloo, subgroups, a mismatch naming the ranks,
and the refusals. The default group shares the engine that the suite's ``hvd.init()`` started.
"""

import functools
import gc
import os
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import fasthorovod.torch as hvd
import fasthorovod.torch.distributed as fhd
from fasthorovod import _core
from fasthorovod.common.exceptions import HorovodInternalError

R = dist.ReduceOp


@pytest.fixture(scope="module")
def groups():
    """The default group on ``fasthorovod`` and a Gloo group of every rank beside it."""
    if "MASTER_ADDR" in os.environ:  # fhrun exports it (and the import exports RANK, ...)
        dist.init_process_group("fasthorovod")
    else:  # one process, no launcher
        dist.init_process_group("fasthorovod", store=dist.HashStore(), rank=0, world_size=1)
    gloo = dist.new_group(backend="gloo")
    yield dist.group.WORLD, gloo
    dist.destroy_process_group()
    assert hvd.is_initialized(), "destroying the group must leave hvd.init()'s engine running"


def _me():
    return dist.get_rank(), dist.get_world_size()


def test_the_default_group_is_the_engine_world(groups):
    me, n = _me()
    assert (me, n) == (hvd.rank(), hvd.size())
    assert dist.get_backend() == "fasthorovod"
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert isinstance(backend, fhd.ProcessGroupFastHorovod) and backend.process_set_id == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64,
                                   torch.bfloat16, torch.float16, torch.uint8])
def test_all_reduce_every_arithmetic_op(groups, dtype):
    me, n = _me()
    values = [r + 2 for r in range(n)]  # rank r holds r + 2 (no zero: PRODUCT)
    exact = {R.SUM: sum(values), R.PRODUCT: functools.reduce(lambda a, b: a * b, values),
             R.MIN: min(values), R.MAX: max(values)}
    if dtype.is_floating_point:
        exact[R.AVG] = sum(values) / n
    for op, want in exact.items():
        t = torch.full((3, 5), values[me], dtype=dtype)
        dist.all_reduce(t, op=op)
        assert torch.equal(t, torch.full((3, 5), want, dtype=dtype)), (op, t)


def test_all_reduce_premul_sum_and_bitwise(groups):
    me, n = _me()
    t = torch.full((7,), float(me + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert torch.equal(t, torch.full((7,), 0.5 * sum(r + 1 for r in range(n))))
    t = torch.full((7,), float(me + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(2.0)))
    assert torch.equal(t, torch.full((7,), 2.0 * sum(r + 1 for r in range(n))))
    bits = [0b1111 ^ (1 << r % 4) | (1 << (4 + r % 3)) for r in range(n)]
    for op, fn in ((R.BAND, lambda a, b: a & b), (R.BOR, lambda a, b: a | b),
                   (R.BXOR, lambda a, b: a ^ b)):
        t = torch.tensor([bits[me], 3 + me], dtype=torch.int64)
        dist.all_reduce(t, op=op)
        want = [functools.reduce(fn, bits), functools.reduce(fn, [3 + r for r in range(n)])]
        assert t.tolist() == want, (op, t)
    flags = torch.tensor([me == 0, True, False])
    dist.all_reduce(flags, op=R.BOR)
    assert flags.tolist() == [True, True, False]


def test_all_reduce_complex_and_non_contiguous(groups):
    me, n = _me()
    z = torch.full((4,), complex(me, -me), dtype=torch.complex64)
    dist.all_reduce(z)
    s = sum(range(n))
    assert torch.equal(z, torch.full((4,), complex(s, -s), dtype=torch.complex64))
    base = torch.full((4, 6), -1.0)
    column = base[:, 2]  # a strided view: reduced in a copy, written back
    column.fill_(float(me))
    dist.all_reduce(column)
    assert torch.equal(base[:, 2], torch.full((4,), float(s)))
    assert torch.equal(base[:, 3], torch.full((4,), -1.0)), "only the view is written"


def test_broadcast_from_every_root(groups):
    me, n = _me()
    for root in range(n):
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * me
        dist.broadcast(t, src=root)
        assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * root)


def test_all_gather_uneven_and_into_tensor(groups):
    me, n = _me()
    outs = [torch.zeros(r + 1, 2) for r in range(n)]
    dist.all_gather(outs, torch.full((me + 1, 2), float(me)))
    for r, o in enumerate(outs):
        assert torch.equal(o, torch.full((r + 1, 2), float(r)))
    out = torch.zeros(n, 3, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.full((3,), me, dtype=torch.int32))
    assert torch.equal(out, torch.arange(n, dtype=torch.int32).repeat_interleave(3).reshape(n, 3))


def test_complex_tensors_move_as_they_are(groups):
    me, n = _me()
    outs = [torch.zeros(3, dtype=torch.complex128) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), complex(me, 2 * me), dtype=torch.complex128))
    assert [o.tolist() for o in outs] == [[complex(r, 2 * r)] * 3 for r in range(n)]
    got = torch.zeros(n, 2, dtype=torch.complex64)
    dist.all_to_all_single(got, torch.tensor([[complex(me, r)] * 2 for r in range(n)],
                                             dtype=torch.complex64))
    assert got.tolist() == [[complex(r, me)] * 2 for r in range(n)]
    t = torch.full((2,), complex(me, 1), dtype=torch.complex64)
    dist.broadcast(t, src=n - 1)
    assert t.tolist() == [complex(n - 1, 1)] * 2


def test_reduce_scatter_and_tensor(groups):
    me, n = _me()
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(10 * r + me)) for r in range(n)])
    assert torch.equal(out, torch.full((2,), float(sum(10 * me + k for k in range(n)))))
    inp = torch.arange(3.0 * n) * (me + 1)
    keep = inp.clone()
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, inp, op=R.AVG)
    mean = sum(r + 1 for r in range(n)) / n
    assert torch.allclose(out, torch.arange(3.0 * me, 3.0 * me + 3) * mean)
    assert torch.equal(inp, keep), "the input of reduce_scatter_tensor is not modified"


def test_all_to_all_single_and_list(groups):
    me, n = _me()
    # Rank me sends r + 1 rows to rank r; each row holds 100 * sender + receiver.
    in_splits = [r + 1 for r in range(n)]
    send = torch.cat([torch.full((r + 1, 2), float(100 * me + r)) for r in range(n)])
    out_splits = [me + 1] * n
    recv = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    want = torch.cat([torch.full((me + 1, 2), float(100 * r + me)) for r in range(n)])
    assert torch.equal(recv, want)
    even = torch.zeros(n)
    dist.all_to_all_single(even, torch.arange(float(n)) + 10 * me)
    assert torch.equal(even, torch.tensor([10.0 * r + me for r in range(n)]))
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * me + r)) for r in range(n)])
    assert [o.tolist() for o in outs] == [[10.0 * r + me] * 2 for r in range(n)]


def test_gather_scatter_reduce_barrier(groups):
    me, n = _me()
    root = n - 1
    gathered = [torch.zeros(2) for _ in range(n)] if me == root else None
    dist.gather(torch.full((2,), float(me)), gathered, dst=root)
    if me == root:
        assert [g.tolist() for g in gathered] == [[float(r)] * 2 for r in range(n)]
    out = torch.zeros(3)
    parts = [torch.full((3,), 7.0 * r) for r in range(n)] if me == root else None
    dist.scatter(out, parts, src=root)
    assert torch.equal(out, torch.full((3,), 7.0 * me))
    t = torch.full((2,), float(me + 1))
    dist.reduce(t, dst=0, op=R.MAX)
    assert torch.equal(t, torch.full((2,), float(n if me == 0 else me + 1))), \
        "the root gets the reduction, the others keep their tensor"
    dist.barrier()
    dist.monitored_barrier()


def test_async_work_and_chained_futures(groups):
    me, n = _me()
    tensors = [torch.full((5,), float(me + k)) for k in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]  # all in flight together
    doubled = works[0].get_future().then(lambda f: f.value()[0] * 2)
    for w in works:
        w.wait()
    for k, t in enumerate(tensors):
        assert torch.equal(t, torch.full((5,), float(sum(r + k for r in range(n)))))
    assert torch.equal(doubled.wait(), tensors[0] * 2)
    coalesced = [torch.full((3,), float(me)), torch.full((2, 2), 1.0)]
    dist.all_reduce_coalesced(coalesced)
    assert torch.equal(coalesced[0], torch.full((3,), float(sum(range(n)))))
    assert torch.equal(coalesced[1], torch.full((2, 2), float(n)))


def test_subgroups_have_worlds_of_their_own(groups):
    me, n = _me()
    first = list(range(max(n - 1, 1)))
    last = [n - 1]
    sub = dist.new_group(first)
    alone = dist.new_group(last)
    if me in first:
        t = torch.full((4,), float(me + 1))
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((4,), float(sum(r + 1 for r in first))))
        b = torch.full((2,), float(me))
        dist.broadcast(b, group_src=len(first) - 1, group=sub)
        assert torch.equal(b, torch.full((2,), float(first[-1])))
        backend = sub._get_backend(torch.device("cpu"))
        assert backend.process_set_id != 0 and backend.stats()["completed"] >= 2
    else:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
    if me in last:
        t = torch.full((2,), 5.0)
        dist.all_reduce(t, group=alone)
        assert torch.equal(t, torch.full((2,), 5.0))
    dist.destroy_process_group(sub) if me in first else None
    dist.destroy_process_group(alone) if me in last else None
    # The world goes on after its subgroups are gone.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _train(pg, steps=4, accumulate=1, hook=None, **ddp_kwargs):
    """Train a DDP copy of the same model on this rank's data; returns the parameters."""
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                    bucket_cap_mb=0.004, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(pg, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        for k in range(accumulate):
            x = torch.randn(5, 12, generator=gen)
            if k + 1 < accumulate:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
            else:
                ddp(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


DDP_CASES = {
    "plain": {},
    "no_sync": {"accumulate": 3},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
}


@pytest.mark.parametrize("case", sorted(DDP_CASES))
def test_ddp_matches_gloo(groups, case):
    world, gloo = groups
    kwargs = DDP_CASES[case]
    got = _train(world, **kwargs)
    want = _train(gloo, **kwargs)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"rank {dist.get_rank()} param {i}: {m}")
    start = _train(world, steps=0)
    assert dist.get_world_size() == 1 or any(not torch.equal(a, b) for a, b in zip(got, start))


def test_ddp_comm_hooks_chain_on_the_backend_futures(groups):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    world, gloo = groups
    for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        got = _train(world, hook=hook)
        want = _train(gloo, hook=hook)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-3 if hook is not
                                       default_hooks.allreduce_hook else 1e-5, atol=1e-5)


def test_ddp_buckets_are_engine_operations(groups):
    """Every step's gradients cross the engine (DDP's bucket allreduces are its operations)."""
    before = dict(_core.stats())
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    steps = 3
    for _ in range(steps):
        ddp(torch.randn(5, 12)).sum().backward()
    after = dict(_core.stats())
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert after["completed"] - before["completed"] >= steps
    if dist.get_world_size() > 1:
        # Through the channels, or riding in the negotiation round (small cached buckets).
        moved = lambda s: s["data_bytes"] + s["eager_bytes"]  # noqa: E731
        assert moved(after) - moved(before) >= steps * grad_bytes


def test_the_period_is_the_whole_step_not_a_run_of_equal_buckets():
    """A step whose buckets are equal (a transformer's layers) repeats with the step's period,
    not with period 1 (which would reuse one name for every bucket and wait for each before
    the next); a run of one collective alone keeps at least ``DEPTH`` names in flight."""
    namer = fhd._names._Namer
    step = [("barrier",), ("all_reduce", 5)] + [("all_reduce", 7)] * 12 + [("all_reduce", 9)]
    assert namer.period_of([("init",)] + step * 2) == len(step)
    assert namer.period_of([("init",)] + step * 3 + step[:4]) == len(step)
    assert namer.period_of(list("abcabcab")) == 3
    assert namer.period_of(list("abcd")) == 0
    assert namer.period_of(["x"] * 40) == 1
    # Names over an agreed period 1: RUN apart; over a longer one, at least DEPTH apart.
    for period, apart in ((1, namer.RUN), (2, namer.DEPTH), (15, 15)):
        names = _agreed_namer(period)
        got = [names.claim(("x",))[0] for _ in range(apart + 1)]
        assert len(set(got[:apart])) == apart and got[apart] == got[0], (period, got)


def _agreed_namer(period):
    """A namer that has applied the agreed ``period`` at its first collective and agrees no
    more (no engine operation)."""
    names = fhd._names._Namer(0)
    names.CHECK = 1 << 62
    names._apply(period, 0)
    return names


def test_a_step_of_equal_buckets_is_never_held_up_by_its_names():
    """In DDP's first steps the longest repetition in the history is a step's run of equal
    buckets, so period 1 is agreed until a whole step repeats. The names must not come back
    while the step's earlier buckets are in flight: DDP submits every bucket of a backward
    before it waits for any, and a name that comes back waits for its last collective (with
    names 4 apart, the thread running DDP's hooks waited at each bucket for the one 4 before
    it). A step of 48 buckets (BERT-large in DDP's 25 MiB buckets) goes through unheld."""
    namer = fhd._names._Namer
    step = [("barrier",), ("all_reduce", 5)] + [("all_reduce", 7)] * 12 + [("all_reduce", 9)]
    assert namer.period_of([("init",)] + step + step[:10]) == 1
    names = _agreed_namer(1)
    for i in range(48):
        name, holder = names.claim(("all_reduce", 7))
        assert holder is None, f"bucket {i} would wait for an earlier bucket of its step"
        names.hold(name, threading.Event())  # in flight: never set here


def test_the_group_keeps_no_tensor_of_a_completed_collective(groups):
    """Under an agreed period the group keeps, per name that will come back, what tells that
    its last collective completed -- never the collective's tensors (an all_gather's outputs
    would otherwise live on until the name comes back)."""
    n = dist.get_world_size()
    for _ in range(40):
        dist.all_gather([torch.empty(3) for _ in range(n)], torch.ones(3))
    assert dist.group.WORLD._get_backend(torch.device("cpu")).period > 0
    out = [torch.empty(3) for _ in range(n)]
    kept = weakref.ref(out[0])
    dist.all_gather(out, torch.ones(3))
    dist.barrier()  # torch itself keeps a group's last Work until the next collective
    del out
    gc.collect()
    assert kept() is None, "a completed all_gather's output is still referenced"


def test_repeating_steps_are_negotiated_through_the_cache(groups):
    """DDP's steps repeat: the members agree on the period of their collectives, the names come
    back, and the engine negotiates them through its bit-vector cache; a mismatch after that
    still meets under one name and is named on every rank."""
    me, n = _me()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    before = dict(_core.stats())
    for _ in range(40):
        opt.zero_grad()
        ddp(torch.randn(5, 12)).square().mean().backward()
        opt.step()
    after = dict(_core.stats())
    assert backend.period > 0, "the members agreed on no period"
    if n > 1:
        assert after["cache_hits"] > before["cache_hits"], (before, after)
        t = torch.ones(5 if me == n - 1 else 4)
        with pytest.raises(HorovodInternalError, match=f"rank {n - 1} sent \\[5\\]"):
            dist.all_reduce(t)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2


def test_fsdp2_fully_shard_matches_gloo(groups):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, gloo = groups
    n = dist.get_world_size()

    def train(backend_group):
        mesh = init_device_mesh("cpu", (n,)) if backend_group is world else \
            dist.device_mesh.DeviceMesh.from_group(backend_group, "cpu")
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(2000 + dist.get_rank())
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 12, generator=gen)).square().mean().backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    for g, w in zip(train(world), train(gloo)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hvd.is_initialized() or hvd.size() < 2, reason="needs 2 ranks")
def test_a_mismatch_names_the_ranks_on_every_rank(groups):
    me, n = _me()
    t = torch.ones(5 if me == n - 1 else 4)
    with pytest.raises(HorovodInternalError) as e:
        dist.all_reduce(t)
    msg = str(e.value)
    assert "Mismatched allreduce tensor shapes" in msg and f"rank {n - 1} sent [5]" in msg \
        and "sent [4]" in msg, msg
    # The group goes on.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2


def test_what_is_not_supported_is_refused_naming_it(groups):
    me, n = _me()
    if n > 1:  # torch itself refuses a send to oneself
        with pytest.raises(NotImplementedError, match="does not support send"):
            dist.send(torch.ones(1), dst=(me + 1) % n)
        with pytest.raises(NotImplementedError, match="does not support recv"):
            dist.recv(torch.ones(1), src=(me + 1) % n)
    with pytest.raises(NotImplementedError, match="does not support all_reduce with BAND of "
                                                  "torch.float32"):
        dist.all_reduce(torch.ones(2), op=R.BAND)
    with pytest.raises(NotImplementedError, match="does not support all_reduce of sparse"):
        dist.all_reduce(torch.ones(2).to_sparse())
    # The group goes on, its members still agreeing on what comes next.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
