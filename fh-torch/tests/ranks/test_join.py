"""``hvd.join`` with every collective, against Horovod's conventions: a joined rank contributes
zeros to an allreduce with Sum or Average (an average divides by ``size()``, joined ranks
included); every other collective fails with ``HorovodInternalError`` on the ranks that
submitted it while a rank is joined (Horovod refuses broadcast, allgather, alltoall and
reducescatter; FastHorovod also refuses Min, Max and Product, where a zero would silently take
part, and barrier). ``join`` returns the rank that joined last, the same on every rank.

The early joiner is rank 1 (the issue's np-3 case: ranks 0 and 2 go on). Runs at any size; at
size 1 there is nobody to go on, so only the return value is checked."""

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.common.exceptions import HorovodInternalError

needs_two = pytest.mark.skipif("hvd.size() < 2", reason="needs 2 ranks")

EARLY = 1


def _check(got, want, what):
    r = hvd.rank()
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"rank {r}: {what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    for i, (g, w) in enumerate(zip(got.reshape(-1).tolist(), want.reshape(-1).tolist())):
        assert abs(g - w) <= 1e-6 * max(1.0, abs(w)), \
            f"rank {r}: {what}: element {i} is {g}, want {w}"


def _finish_in_order():
    """The ranks still active join one after another, lowest first, so that the last to join
    is known: each rank but the lowest first reduces alone-but-for-zeros, which completes only
    once every lower active rank has joined. Returns what ``join`` returned."""
    n, r = hvd.size(), hvd.rank()
    if r != EARLY and r != min(x for x in range(n) if x != EARLY):
        out = hvd.allreduce(torch.ones(1), name=f"join_order_{r}", op=hvd.Sum)
        _check(out, torch.ones(1), "a rank reducing alone gets its own value")
    return hvd.join()


def _last_active():
    return max(x for x in range(hvd.size()) if x != EARLY)


@needs_two
def test_average_divides_by_size_with_a_joined_rank():
    n, r = hvd.size(), hvd.rank()
    if r == EARLY:
        last = hvd.join()
    else:
        # Rank x sends x + 1; the joined rank zeros. Horovod: sum over the active ranks / n.
        active_sum = sum(x + 1 for x in range(n) if x != EARLY)  # np 2: 1; np 3: 1 + 3 = 4
        avg = hvd.allreduce(torch.full((3,), float(r + 1)), name="join_avg")
        _check(avg, torch.full((3,), active_sum / n), "average with rank 1 joined")
        s = hvd.allreduce(torch.full((2,), float(r + 1)), name="join_sum", op=hvd.Sum)
        _check(s, torch.full((2,), float(active_sum)), "sum with rank 1 joined")
        # Integers truncate: np 2: 1 // 2 = 0; np 3: 4 // 3 = 1.
        i = hvd.allreduce(torch.full((2,), r + 1, dtype=torch.int32), name="join_iavg")
        _check(i, torch.full((2,), active_sum // n, dtype=torch.int32),
               "integer average with rank 1 joined")
        # A grouped allreduce likewise.
        g = hvd.grouped_allreduce([torch.full((2,), float(r + 1)), torch.ones(1)],
                                  name="join_group")
        _check(g[0], torch.full((2,), active_sum / n), "grouped average, member 0")
        _check(g[1], torch.full((1,), (n - 1) / n), "grouped average, member 1")
        last = _finish_in_order()
    assert last == _last_active(), f"rank {r}: join returned {last}, want {_last_active()}"


@needs_two
def test_other_collectives_raise_while_a_rank_is_joined():
    """The issue's hang: rank 1 joins early and the others allgather (np 3 hung). Each
    collective runs once with every rank first, so that its name is cached, then again while
    rank 1 is joined (cached), and under a new name (uncached)."""
    n, r = hvd.size(), hvd.rank()

    def run(kind, sfx):
        if kind == "allgather":
            return hvd.allgather(torch.full((2,), float(r)), name="jag" + sfx)
        if kind == "broadcast":
            return hvd.broadcast(torch.full((2,), float(r)), root_rank=0, name="jbc" + sfx)
        if kind == "alltoall":
            return hvd.alltoall(torch.arange(n, dtype=torch.float32), name="ja2a" + sfx)
        if kind == "reducescatter":
            return hvd.reducescatter(torch.ones(n, 2), name="jrs" + sfx, op=hvd.Sum)
        if kind == "max":
            return hvd.allreduce(torch.full((2,), -1.0), name="jmax" + sfx, op=hvd.Max)
        if kind == "grouped_allgather":
            return hvd.grouped_allgather([torch.ones(1), torch.ones(2)], name="jgag" + sfx)
        raise AssertionError(kind)

    kinds = ["allgather", "broadcast", "alltoall", "reducescatter", "max", "grouped_allgather"]
    for k in kinds:
        run(k, "")
    if r == EARLY:
        last = hvd.join()
    else:
        for sfx in ("", "_new"):
            for k in kinds:
                with pytest.raises(HorovodInternalError) as e:
                    run(k, sfx)
                msg = str(e.value)
                word = "allgather" if k == "grouped_allgather" else k
                assert word in msg and "joined" in msg and f"[{EARLY}]" in msg, \
                    f"rank {r}: {k}{sfx or ' (cached)'}: {msg}"
            with pytest.raises(HorovodInternalError) as e:
                hvd.barrier()
            assert "barrier" in str(e.value) and "joined" in str(e.value), \
                f"rank {r}: barrier: {e.value}"
            # Sum still runs with the joined rank's zeros.
            s = hvd.allreduce(torch.ones(2), name="jsum" + sfx, op=hvd.Sum)
            _check(s, torch.full((2,), float(n - 1)), f"sum after the refusals{sfx}")
        last = _finish_in_order()
    assert last == _last_active(), f"rank {r}: join returned {last}, want {_last_active()}"


def test_join_alone_returns_this_rank():
    if hvd.size() != 1:
        pytest.skip("single process")
    assert hvd.join() == 0
