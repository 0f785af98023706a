"""Process sets through Horovod's API (every rank runs these tests in the same order)."""

import random

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.common import process_sets as P

needs3 = pytest.mark.skipif(hvd.size() < 3 if hvd.is_initialized() else True,
                            reason="needs at least 3 ranks")


@pytest.fixture
def dynamic(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


def _sum_of(ranks, f):
    return sum(f(r) for r in ranks)


@needs3
def test_a_mismatch_in_a_set_names_world_ranks(dynamic):
    from fasthorovod.common.exceptions import HorovodInternalError

    ps = hvd.add_process_set([1, 2])
    try:
        if ps.included():
            # World rank 2 is the set's rank 1: the message names world ranks.
            n = 5 if hvd.rank() == 2 else 4
            with pytest.raises(HorovodInternalError) as e:
                hvd.allreduce(torch.ones(n), name="ps_mismatch", process_set=ps)
            msg = str(e.value)
            assert "Mismatched allreduce tensor shapes: rank 1 sent [4]; rank 2 sent [5]" in msg, msg
    finally:
        hvd.remove_process_set(ps)


@needs3
def test_collectives_in_disjoint_sets(dynamic):
    even = hvd.add_process_set([2, 0])  # any order: kept sorted
    odd = hvd.add_process_set(hvd.ProcessSet([1]))
    assert even.ranks == [0, 2] and odd.ranks == [1]
    assert even.process_set_id != odd.process_set_id and even.process_set_id > 0
    me = hvd.rank()
    mine, members = (even, [0, 2]) if me in (0, 2) else (odd, [1])
    if me >= 3:
        mine, members = None, []
    assert even.size() == 2 and odd.size() == 1
    assert even.included() == (me in (0, 2)) and odd.included() == (me == 1)
    assert even.rank() == ([0, 2].index(me) if me in (0, 2) else -1)
    if mine is not None:
        x = torch.full((5,), float(me + 1))
        got = hvd.allreduce(x, op=hvd.Sum, process_set=mine)
        assert torch.equal(got, torch.full((5,), float(_sum_of(members, lambda r: r + 1))))
        avg = hvd.allreduce(x, process_set=mine)
        assert torch.allclose(avg, torch.full((5,), _sum_of(members, lambda r: r + 1)
                                               / len(members)))
        g = hvd.allgather(torch.full((me + 1, 2), me, dtype=torch.int32), process_set=mine)
        want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in members])
        assert torch.equal(g, want)
        root = members[-1]
        b = hvd.broadcast(torch.full((3,), float(me)), root_rank=root, process_set=mine)
        assert torch.equal(b, torch.full((3,), float(root)))
        n = len(members)
        a = hvd.alltoall(torch.arange(n * 2, dtype=torch.float32) + 100 * me, process_set=mine)
        k = mine.rank()
        want = torch.cat([torch.arange(2 * k, 2 * k + 2, dtype=torch.float32) + 100 * r
                          for r in members])
        assert torch.equal(a, want)
        rs = hvd.reducescatter(torch.ones(n * 3, 2), op=hvd.Sum, process_set=mine)
        assert torch.equal(rs, torch.full((3, 2), float(n)))
        outs = hvd.grouped_allreduce([torch.ones(2), torch.ones(3) * 2], op=hvd.Sum,
                                     process_set=mine)
        assert torch.equal(outs[1], torch.full((3,), 2.0 * n))
        hvd.barrier(process_set=mine)
        obj = hvd.broadcast_object({"from": me}, root_rank=root, process_set=mine)
        assert obj == {"from": root}
        assert hvd.allgather_object(me, process_set=mine) == members
    assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)
    assert even.process_set_id is None


@needs3
def test_overlapping_sets_at_once_in_random_orders(dynamic):
    a = hvd.add_process_set([0, 1])
    b = hvd.add_process_set([1, 2])
    me = hvd.rank()
    rng = random.Random(me)
    jobs = []
    for ps in (a, b):
        if ps.included():
            for i in range(8):
                jobs.append((ps, i))
    rng.shuffle(jobs)
    handles = []
    for ps, i in jobs:
        t = torch.full((100 + i,), float(me * 10 + i))
        handles.append((ps, i, hvd.allreduce_async(t, name=f"ov{i}", op=hvd.Sum,
                                                   process_set=ps)))
    rng.shuffle(handles)
    for ps, i, h in handles:
        got = hvd.synchronize(h)
        want = float(sum(r * 10 + i for r in ps.ranks))
        assert torch.equal(got, torch.full((100 + i,), want))
    # The world is undisturbed and the sets negotiate the same names independently.
    assert torch.equal(hvd.allreduce(torch.ones(1), name="ov0", op=hvd.Sum),
                       torch.full((1,), float(hvd.size())))
    hvd.remove_process_set(a)
    hvd.remove_process_set(b)


def test_optimizer_and_broadcasts_in_a_set(dynamic):
    ranks = [0, 1] if hvd.size() >= 2 else [0]
    ps = hvd.add_process_set(ranks) if hvd.size() > len(ranks) else hvd.global_process_set
    if ps.included():
        torch.manual_seed(100 + hvd.rank())  # different initial weights per rank
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=ranks[0], process_set=ps)
        hvd.broadcast_optimizer_state(opt, root_rank=ranks[0], process_set=ps)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       process_set=ps)
        for step in range(3):
            x = torch.full((8, 4), float(hvd.rank() + step))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), process_set=ps)
        for row in gathered:
            assert torch.allclose(row, flat)
    if ps is not hvd.global_process_set:
        hvd.remove_process_set(ps)


@needs3
def test_static_sets_as_init_registers_them():
    # What hvd.init(process_sets=[...]) does once the runtime runs (collective, in order).
    sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2])]
    P._init_sets(sets)
    try:
        assert [s.process_set_id for s in sets] == sorted(s.process_set_id for s in sets)
        ids = hvd.allgather(torch.tensor([sets[0].process_set_id]))
        assert (ids == ids[0]).all()
        if sets[0].included():
            got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=sets[0])
            assert torch.equal(got, torch.full((1,), 2.0))
        # Static sets only: adding after init needs dynamic mode.
        with pytest.raises(ValueError, match="dynamic"):
            P.add_process_set([0])
    finally:
        P._dynamic = True
        for s in sets:
            P.remove_process_set(s)
        P._dynamic = False


@needs3
def test_errors_and_their_types(dynamic):
    me = hvd.rank()
    with pytest.raises(ValueError, match="twice"):
        hvd.ProcessSet([0, 0])
    # Invalid lists are refused on every rank, collectively.
    with pytest.raises(ValueError, match="out of range"):
        hvd.add_process_set([0, hvd.size()])
    with pytest.raises(ValueError, match="whole world"):
        hvd.add_process_set(list(range(hvd.size())))
    # A list that differs on one rank: the same error on every rank.
    with pytest.raises(ValueError, match="different member lists"):
        hvd.add_process_set([0, 1] if me != 2 else [0, 2])
    ps = hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="registered already"):
        hvd.add_process_set(ps)
    with pytest.raises(ValueError, match="exists already"):
        hvd.add_process_set([1, 0])
    if not ps.included():
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(torch.ones(1), process_set=ps)
        with pytest.raises(ValueError, match="not a member"):
            hvd.barrier(process_set=ps)
    else:
        with pytest.raises(ValueError, match="root_rank 2 is not a member"):
            hvd.broadcast(torch.ones(1), root_rank=2, process_set=ps)
    with pytest.raises(ValueError, match="global process set cannot be removed"):
        hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="must be a ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set=[0, 1])
    pending = None
    if ps.included():
        pending = hvd.allreduce_async(torch.ones(1), name="left", op=hvd.Sum, process_set=ps)
        assert torch.equal(hvd.synchronize(pending), torch.full((1,), 2.0))
    hvd.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.remove_process_set(ps)
    # Nothing else was disturbed.
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum),
                       torch.full((1,), float(hvd.size())))
