"""int16 (``torch.int16``/``ShortTensor``) through every collective, with the expected values
worked out by hand for 1, 2 and 3 ranks (values beyond int8's range, negatives, and an
integer average that truncates toward zero)."""

import pytest
import torch

import fasthorovod.torch as hvd

# Rank r sends [r + 1, -1000 * (r + 1), 300, 7 - 2 * r].
# Sums: np1 [1, -1000, 300, 7]; np2 [3, -3000, 600, 12]; np3 [6, -6000, 900, 15].
SUM = {1: [1, -1000, 300, 7], 2: [3, -3000, 600, 12], 3: [6, -6000, 900, 15]}
# Average truncates toward zero: np2 [3/2, -3000/2, 600/2, 12/2] = [1, -1500, 300, 6];
# np3 [6/3, -6000/3, 900/3, 15/3] = [2, -2000, 300, 5].
AVG = {1: [1, -1000, 300, 7], 2: [1, -1500, 300, 6], 3: [2, -2000, 300, 5]}
MIN = {1: [1, -1000, 300, 7], 2: [1, -2000, 300, 5], 3: [1, -3000, 300, 3]}
MAX = {1: [1, -1000, 300, 7], 2: [2, -1000, 300, 7], 3: [3, -1000, 300, 7]}
# Product of rank r's [r + 1, -1, 2]: np1 [1, -1, 2]; np2 [1*2, 1, 4]; np3 [1*2*3, -1, 8].
PROD = {1: [1, -1, 2], 2: [2, 1, 4], 3: [6, -1, 8]}

sized = pytest.mark.skipif("hvd.size() > 3", reason="expected values worked out for 1-3 ranks")


def _mine():
    r = hvd.rank()
    return torch.tensor([r + 1, -1000 * (r + 1), 300, 7 - 2 * r], dtype=torch.int16)


def _check(got, want, what):
    r = hvd.rank()
    want = torch.tensor(want, dtype=torch.int16).reshape(got.shape) if isinstance(want, list) \
        else want
    assert got.dtype == torch.int16, f"rank {r}: {what}: dtype {got.dtype}"
    assert got.shape == want.shape, f"rank {r}: {what}: shape {tuple(got.shape)}, want " \
        f"{tuple(want.shape)}"
    for i, (g, w) in enumerate(zip(got.reshape(-1).tolist(), want.reshape(-1).tolist())):
        assert g == w, f"rank {r}: {what}: element {i} is {g}, want {w}"


@sized
def test_int16_allreduce_every_op():
    n = hvd.size()
    _check(hvd.allreduce(_mine(), name="i16_sum", op=hvd.Sum), SUM[n], "sum")
    _check(hvd.allreduce(_mine(), name="i16_avg", op=hvd.Average), AVG[n], "average")
    _check(hvd.allreduce(_mine(), name="i16_min", op=hvd.Min), MIN[n], "min")
    _check(hvd.allreduce(_mine(), name="i16_max", op=hvd.Max), MAX[n], "max")
    p = torch.tensor([hvd.rank() + 1, -1, 2], dtype=torch.int16)
    _check(hvd.allreduce(p, name="i16_prod", op=hvd.Product), PROD[n], "product")
    t = _mine()
    hvd.allreduce_(t, name="i16_inplace", op=hvd.Sum)
    _check(t, SUM[n], "in-place sum")


@sized
def test_int16_allgather_broadcast_alltoall_reducescatter():
    n, r = hvd.size(), hvd.rank()
    # Allgather: rank x contributes x + 1 rows of [x, -300 * x]: np 3 gives
    # [[0, 0], [1, -300], [1, -300], [2, -600], [2, -600], [2, -600]].
    rows = torch.tensor([[r, -300 * r]], dtype=torch.int16).repeat(r + 1, 1)
    want = [[x, -300 * x] for x in range(n) for _ in range(x + 1)]
    _check(hvd.allgather(rows, name="i16_ag"), torch.tensor(want, dtype=torch.int16),
           "allgather")
    # Broadcast from the last rank: its [-32768, 32767, n - 1].
    b = torch.tensor([-32768, 32767, r], dtype=torch.int16)
    _check(hvd.broadcast(b, root_rank=n - 1, name="i16_bc"), [-32768, 32767, n - 1],
           "broadcast")
    # Alltoall: rank x sends 1000 * x + y to rank y; rank r receives [1000 * x + r for x].
    send = torch.tensor([1000 * r + y for y in range(n)], dtype=torch.int16)
    _check(hvd.alltoall(send, name="i16_a2a"), [1000 * x + r for x in range(n)], "alltoall")
    # Reducescatter (Sum) of rank x's [[x + 1, -x] for each rank]: rank r gets the row
    # [sum(x + 1), -sum(x)] = [n(n+1)/2, -n(n-1)/2].
    rs = torch.tensor([[r + 1, -r]] * n, dtype=torch.int16)
    _check(hvd.reducescatter(rs, name="i16_rs", op=hvd.Sum),
           [[n * (n + 1) // 2, -(n * (n - 1) // 2)]], "reducescatter")
