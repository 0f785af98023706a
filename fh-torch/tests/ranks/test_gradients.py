"""Gradients of every differentiable collective, against values worked out on paper from
Horovod 0.28's conventions (not read back from the implementation).

Rank r's loss is ``(out * w_r).sum()`` for a weight ``w_r`` chosen per rank and element, so the
incoming gradient on rank r is ``w_r``. Horovod's backward passes then give:

- allreduce(op): the same allreduce (op, prescale, postscale) of the incoming gradients;
- allgather: this rank's rows of the *average* of the incoming gradients (the objective is the
  mean of the ranks' losses);
- broadcast: on the root, the average of the incoming gradients; zero elsewhere;
- alltoall: the incoming gradient sent back along the received splits (each row's gradient is
  the weight of the place it landed in);
- reducescatter(op): for the rows that rank r kept, rank r's incoming gradient times size()
  for Sum (1 for Average), times prescale and postscale.

Every failure names the rank and the element.
"""

import pytest
import torch

import fasthorovod.torch as hvd


def check(got, want, what):
    """Assert ``got == want`` (float tolerance), naming this rank and the first element that
    differs."""
    r = hvd.rank()
    assert got is not None, f"rank {r}: {what}: no gradient"
    assert tuple(got.shape) == tuple(want.shape), \
        f"rank {r}: {what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    close = torch.isclose(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    if not bool(close.all()):
        idx = tuple(int(i) for i in (~close).nonzero()[0])
        raise AssertionError(f"rank {r}: {what}{list(idx)} = {got[idx].item()}, "
                             f"want {want[idx].item()}")


def rows_of(total, n):
    """Reduce-scatter's split of ``total`` rows over n ranks (lowest ranks get the extra)."""
    return [total // n + (1 if q < total % n else 0) for q in range(n)]


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_allreduce_gradient(op):
    n, r = hvd.size(), hvd.rank()
    x = torch.full((2, 3), float(r + 1), dtype=torch.float64, requires_grad=True)
    w = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r
    (hvd.allreduce(x, op=op, prescale_factor=2.0, postscale_factor=0.25) * w).sum().backward()
    # The allreduce of the weights, with the same op and scale factors.
    total = sum(torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * q for q in range(n))
    want = total * 0.5 / (n if op == hvd.Average else 1)
    check(x.grad, want, f"allreduce({op}) grad")


def test_grouped_allreduce_gradient():
    n, r = hvd.size(), hvd.rank()
    xs = [torch.ones(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    ((outs[0] * (r + 1)).sum() + (outs[1] * 2 * (r + 1)).sum()).backward()
    s = n * (n + 1) / 2  # sum of (q + 1) over the ranks
    check(xs[0].grad, torch.full((3,), s), "grouped_allreduce grad[0]")
    check(xs[1].grad, torch.full((2, 2), 2 * s), "grouped_allreduce grad[1]")


def test_allgather_gradient_uneven_rows():
    n, r = hvd.size(), hvd.rank()
    x = torch.ones(r + 1, 2, requires_grad=True)
    out = hvd.allgather(x)
    total = n * (n + 1) // 2
    w = torch.arange(total, dtype=torch.float32).reshape(total, 1).expand(total, 2) + r
    (out * w).sum().backward()
    # Row i of this rank sits at row offset + i of the gathered tensor; the average over the
    # ranks of (offset + i + q) is offset + i + (n - 1) / 2.
    offset = r * (r + 1) // 2
    want = (torch.arange(r + 1, dtype=torch.float32).reshape(r + 1, 1).expand(r + 1, 2)
            + offset + (n - 1) / 2)
    check(x.grad, want, "allgather grad")


def test_grouped_allgather_gradient():
    n, r = hvd.size(), hvd.rank()
    a = torch.ones(r + 1, 2, requires_grad=True)
    b = torch.ones(2, 3, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    total = n * (n + 1) // 2
    assert ga.shape == (total, 2) and gb.shape == (2 * n, 3), (ga.shape, gb.shape)
    wa = torch.arange(total, dtype=torch.float32).reshape(total, 1).expand(total, 2) + r
    wb = torch.full((2 * n, 3), 3.0 * (r + 1))
    ((ga * wa).sum() + (gb * wb).sum()).backward()
    offset = r * (r + 1) // 2
    want_a = (torch.arange(r + 1, dtype=torch.float32).reshape(r + 1, 1).expand(r + 1, 2)
              + offset + (n - 1) / 2)
    check(a.grad, want_a, "grouped_allgather grad[0]")
    # The average of 3 (q + 1) over the ranks.
    check(b.grad, torch.full((2, 3), 3.0 * (n + 1) / 2), "grouped_allgather grad[1]")


def test_broadcast_gradient_goes_to_the_root():
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    x = torch.ones(3, requires_grad=True)
    (hvd.broadcast(x, root_rank=root) * (r + 1)).sum().backward()
    want = torch.full((3,), (n + 1) / 2 if r == root else 0.0)
    check(x.grad, want, "broadcast grad")


def _alltoall_weights(r, received):
    """Rank r's weight of its output rows: 100 r + (the row's index in the output)."""
    rows = int(sum(received))
    return torch.arange(rows, dtype=torch.float64).reshape(rows, 1).expand(rows, 2) + 100 * r


def _alltoall_want(q, sent, every_splits):
    """Rank q's gradient: its k-th row sent to rank d landed on rank d at row
    (rows rank d received from ranks below q) + k, weighted 100 d + that row."""
    n = len(every_splits)
    rows = []
    for d in range(n):
        before = sum(every_splits[p][d] for p in range(q))
        rows += [100 * d + before + k for k in range(sent[d])]
    t = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 1)
    return t.expand(len(rows), 2)


def test_alltoall_gradient_without_splits_uneven_ranks():
    # Rank q has n (q + 1) rows and sends q + 1 of them to every rank: equal splits per rank,
    # but different ones across ranks (Horovod sends the gradient back with the received
    # splits, not with this rank's own).
    n, r = hvd.size(), hvd.rank()
    every = [[q + 1] * n for q in range(n)]
    x = (torch.arange(n * (r + 1), dtype=torch.float64).reshape(-1, 1).expand(-1, 2)
         + 1000 * r).clone().requires_grad_(True)
    out = hvd.alltoall(x)
    received = [every[q][r] for q in range(n)]
    want_out = torch.cat([(torch.arange(r * (q + 1), (r + 1) * (q + 1), dtype=torch.float64)
                           + 1000 * q).reshape(-1, 1).expand(-1, 2) for q in range(n)])
    check(out.detach(), want_out, "alltoall output")
    (out * _alltoall_weights(r, received)).sum().backward()
    check(x.grad, _alltoall_want(r, every[r], every), "alltoall grad")


def test_alltoall_gradient_with_splits():
    n, r = hvd.size(), hvd.rank()
    every = [[(q + 2 * d) % 3 for d in range(n)] for q in range(n)]
    splits = torch.tensor(every[r], dtype=torch.int32)
    rows = sum(every[r])
    x = torch.ones(rows, 2, dtype=torch.float64, requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits)
    assert received.tolist() == [every[q][r] for q in range(n)], \
        f"rank {r}: received splits {received.tolist()}"
    (out * _alltoall_weights(r, received.tolist())).sum().backward()
    check(x.grad, _alltoall_want(r, every[r], every), "alltoall(splits) grad")


def _reducescatter_weights(r, rows):
    """Rank r's weight of its output row i: (r + 1) + i / 10."""
    return (torch.arange(rows, dtype=torch.float64) / 10 + r + 1).reshape(rows, 1).expand(rows, 2)


def _reducescatter_want(n, total, factor):
    """Every rank's gradient: the rows rank q kept get rank q's weights, times factor."""
    return torch.cat([_reducescatter_weights(q, k) for q, k in enumerate(rows_of(total, n))]) \
        * factor


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_reducescatter_gradient(op):
    n, r = hvd.size(), hvd.rank()
    total = 2 * n + 1  # uneven: rank 0 keeps one row more
    x = torch.ones(total, 2, dtype=torch.float64, requires_grad=True)
    out = hvd.reducescatter(x, op=op, prescale_factor=3.0, postscale_factor=0.5)
    mine = rows_of(total, n)[r]
    # Forward: 1.5 times the sum (or average) of n ones.
    check(out.detach(), torch.full((mine, 2), 1.5 * (n if op == hvd.Sum else 1)),
          f"reducescatter({op}) output")
    (out * _reducescatter_weights(r, mine)).sum().backward()
    factor = 1.5 * (n if op == hvd.Sum else 1)
    check(x.grad, _reducescatter_want(n, total, factor), f"reducescatter({op}) grad")


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_grouped_reducescatter_gradient(op):
    n, r = hvd.size(), hvd.rank()
    a = torch.ones(2 * n + 1, 2, dtype=torch.float64, requires_grad=True)
    b = torch.ones(n, 2, dtype=torch.float64, requires_grad=True)
    oa, ob = hvd.grouped_reducescatter([a, b], op=op, postscale_factor=2.0)
    ka, kb = rows_of(2 * n + 1, n)[r], 1
    ((oa * _reducescatter_weights(r, ka)).sum()
     + (ob * 5 * _reducescatter_weights(r, kb)).sum()).backward()
    factor = 2.0 * (n if op == hvd.Sum else 1)
    check(a.grad, _reducescatter_want(n, 2 * n + 1, factor), f"grouped_reducescatter({op}) "
          "grad[0]")
    check(b.grad, _reducescatter_want(n, n, 5 * factor), f"grouped_reducescatter({op}) grad[1]")


@pytest.mark.skipif(hvd.size() < 3 if hvd.is_initialized() else True,
                    reason="needs at least 3 ranks")
def test_gradients_within_a_process_set(monkeypatch):
    # The set {0, 2}: sizes, ranks and offsets are the set's (m = 2, k = its rank in it).
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    ps = hvd.add_process_set([0, 2])
    try:
        if not ps.included():
            return
        m, k = ps.size(), ps.rank()
        total = 2 * m + 1
        x = torch.ones(total, 2, dtype=torch.float64, requires_grad=True)
        out = hvd.reducescatter(x, op=hvd.Sum, process_set=ps)
        (out * _reducescatter_weights(k, rows_of(total, m)[k])).sum().backward()
        check(x.grad, _reducescatter_want(m, total, m), "reducescatter(sum) in a set: grad")

        every = [[q + 1] * m for q in range(m)]
        z = torch.ones(m * (k + 1), 2, dtype=torch.float64, requires_grad=True)
        out = hvd.alltoall(z, process_set=ps)
        (out * _alltoall_weights(k, [every[q][k] for q in range(m)])).sum().backward()
        check(z.grad, _alltoall_want(k, every[k], every), "alltoall in a set: grad")

        a = torch.ones(k + 1, 2, requires_grad=True)
        (ga,) = hvd.grouped_allgather([a], process_set=ps)
        rows = m * (m + 1) // 2
        w = torch.arange(rows, dtype=torch.float32).reshape(rows, 1).expand(rows, 2) + k
        (ga * w).sum().backward()
        offset = k * (k + 1) // 2
        want = (torch.arange(k + 1, dtype=torch.float32).reshape(k + 1, 1).expand(k + 1, 2)
                + offset + (m - 1) / 2)
        check(a.grad, want, "grouped_allgather in a set: grad")
    finally:
        hvd.remove_process_set(ps)


def test_reducescatter_gradient_through_min_is_refused():
    x = torch.ones(2 * hvd.size(), 2, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Min)
    with pytest.raises(NotImplementedError, match="op=hvd.Sum or hvd.Average"):
        out.sum().backward()
