"""Collectives against reference values, on every rank, for every dtype and 0-3 dimensions."""

import itertools
import os

import pytest
import torch

import fasthorovod.torch as hvd

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.float32, torch.float64]
SHAPES = [(), (3,), (2, 5), (2, 3, 4)]
INTS = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def rank_tensor(r, shape, dtype):
    """Rank r's input: small values so that sums fit every dtype."""
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64).reshape(shape) % 5
    return (base + r).to(dtype)


def all_inputs(shape, dtype):
    return [rank_tensor(r, shape, dtype) for r in range(hvd.size())]


def assert_same(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype in (torch.float16,):
        assert torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3), (got, want)
    elif want.dtype.is_floating_point:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got, want)
    else:
        assert torch.equal(got, want), (got, want)


def reference(inputs, op):
    stack = torch.stack([t.to(torch.float64) for t in inputs])
    dtype = inputs[0].dtype
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Average:
        out = stack.sum(0)
        if dtype in INTS:  # integer Average truncates toward zero
            return torch.trunc(out / len(inputs)).to(dtype)
        out = out / len(inputs)
    elif op == hvd.Min:
        out = stack.min(0).values
    elif op == hvd.Max:
        out = stack.max(0).values
    elif op == hvd.Product:
        out = stack.prod(0)
    return out.to(dtype)


@pytest.mark.parametrize("dtype,shape", list(itertools.product(DTYPES, SHAPES)))
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce(dtype, shape, op):
    inputs = all_inputs(shape, dtype)
    mine = inputs[hvd.rank()]
    before = mine.clone()
    out = hvd.allreduce(mine, op=op)
    assert_same(out, reference(inputs, op))
    assert torch.equal(mine, before), "allreduce must not change its input"
    inplace = mine.clone()
    ret = hvd.allreduce_(inplace, op=op)
    assert ret is inplace
    assert_same(inplace, reference(inputs, op))


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_scale_factors_and_average_flag(dtype):
    if dtype in INTS:
        pytest.skip("scale factors are for floating-point tensors")
    inputs = all_inputs((4,), dtype)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=2.0,
                        postscale_factor=0.5)
    assert_same(out, reference(inputs, hvd.Sum))
    avg = hvd.allreduce(inputs[hvd.rank()], average=True)
    assert_same(avg, reference(inputs, hvd.Average))
    total = hvd.allreduce(inputs[hvd.rank()], average=False)
    assert_same(total, reference(inputs, hvd.Sum))


def test_allreduce_non_contiguous_in_place():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + hvd.rank()
    view = base.t()  # not contiguous
    assert not view.is_contiguous()
    want = sum(torch.arange(12, dtype=torch.float32).reshape(3, 4) + r
               for r in range(hvd.size())).t()
    hvd.allreduce_(view, op=hvd.Sum)
    assert torch.equal(view, want)
    assert torch.equal(base, want.t())


def test_allreduce_is_zero_copy_for_contiguous_in_place():
    t = torch.ones(1000) * (hvd.rank() + 1)
    ptr = t.data_ptr()
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="zero_copy")
    out = hvd.synchronize(h)
    assert out is t and out.data_ptr() == ptr
    assert torch.all(t == sum(range(1, hvd.size() + 1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compression_fp16(dtype):
    inputs = all_inputs((5,), dtype)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == dtype
    assert_same(out.to(torch.float64).to(dtype), reference(inputs, hvd.Sum))


@pytest.mark.parametrize("dtype,shape", list(itertools.product(DTYPES, SHAPES)))
def test_allgather(dtype, shape):
    # The first dimension differs per rank.
    r = hvd.rank()
    if len(shape) == 0:
        mine = rank_tensor(r, (), dtype)
        want = torch.stack([rank_tensor(q, (), dtype) for q in range(hvd.size())])
    else:
        rows = lambda q: shape[0] + q  # noqa: E731
        mine = rank_tensor(r, (rows(r),) + shape[1:], dtype)
        want = torch.cat([rank_tensor(q, (rows(q),) + shape[1:], dtype)
                          for q in range(hvd.size())])
    assert_same(hvd.allgather(mine), want)


def test_grouped_allgather_and_empty_rank():
    r = hvd.rank()
    a = torch.full((r,), float(r))  # rank 0 sends nothing
    b = torch.full((2, 2), r, dtype=torch.int32)
    ga, gb = hvd.grouped_allgather([a, b])
    assert torch.equal(ga, torch.cat([torch.full((q,), float(q)) for q in range(hvd.size())]))
    assert torch.equal(gb, torch.cat([torch.full((2, 2), q, dtype=torch.int32)
                                      for q in range(hvd.size())]))


@pytest.mark.parametrize("dtype,shape", list(itertools.product(DTYPES, SHAPES)))
def test_broadcast(dtype, shape):
    root = hvd.size() - 1
    inputs = all_inputs(shape, dtype)
    mine = inputs[hvd.rank()]
    before = mine.clone()
    assert_same(hvd.broadcast(mine, root), inputs[root])
    assert torch.equal(mine, before)
    hvd.broadcast_(mine, root)
    assert_same(mine, inputs[root])


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_equal_and_uneven(dtype):
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(2 * n, dtype=torch.int64).to(dtype).reshape(2 * n, 1) + r
    out = hvd.alltoall(x)
    want = torch.cat([(torch.arange(2 * n, dtype=torch.int64).to(dtype).reshape(2 * n, 1)
                       + q)[2 * r:2 * r + 2] for q in range(n)])
    assert_same(out, want)
    # Uneven: rank q sends q + d rows to rank d.
    splits = torch.tensor([q + d for d in range(n) for q in [r]], dtype=torch.int32)
    rows = int(splits.sum())
    x = torch.full((rows, 3), r, dtype=torch.int64).to(dtype)
    out, received = hvd.alltoall(x, splits=splits)
    assert received.dtype == torch.int32
    assert received.tolist() == [q + r for q in range(n)]
    want = torch.cat([torch.full((q + r, 3), q, dtype=torch.int64).to(dtype) for q in range(n)])
    assert_same(out, want)
    h = hvd.alltoall_async(x, splits=splits)
    out2, received2 = hvd.synchronize(h)
    assert_same(out2, want)
    assert torch.equal(received2, received)


@pytest.mark.parametrize("dtype,shape", list(itertools.product(DTYPES, SHAPES[1:])))
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_reducescatter(dtype, shape, op):
    n, r = hvd.size(), hvd.rank()
    inputs = all_inputs(shape, dtype)
    full = reference(inputs, op)
    rows = [shape[0] // n + (1 if q < shape[0] % n else 0) for q in range(n)]
    start = sum(rows[:r])
    want = full[start:start + rows[r]]
    assert_same(hvd.reducescatter(inputs[r], op=op), want)


def test_grouped_allreduce_forms():
    n, r = hvd.size(), hvd.rank()
    xs = [torch.full((3,), float(r)), torch.full((2, 2), r, dtype=torch.int32),
          torch.full((1,), float(r + 1), dtype=torch.float64)]
    want = [torch.full((3,), float(sum(range(n)))),
            torch.full((2, 2), sum(range(n)), dtype=torch.int32),
            torch.full((1,), float(sum(range(1, n + 1))), dtype=torch.float64)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    for o, w in zip(outs, want):
        assert_same(o, w)
    assert xs[0][0].item() == float(r), "grouped_allreduce must not change its inputs"
    h = hvd.grouped_allreduce_async_(xs, op=hvd.Sum, name="grouped")
    got = hvd.synchronize(h)
    for o, x, w in zip(got, xs, want):
        assert o is x
        assert_same(x, w)


def test_grouped_reducescatter():
    n = hvd.size()
    x = torch.ones(n * 2, 3)
    (a,) = hvd.grouped_reducescatter([x], op=hvd.Sum)
    assert torch.equal(a, torch.full((2, 3), float(n)))


def test_poll_sees_an_unfinished_operation():
    # Rank 0 submits first and polls before the others have submitted: the operation cannot
    # have finished. The others submit only after rank 0 says (through a barrier) it polled.
    # Alone, rank 0 needs nobody else: its operation may be done by the time it polls.
    t = torch.ones(4)
    if hvd.rank() == 0:
        h = hvd.allreduce_async(t, name="poll_me", op=hvd.Sum)
        if hvd.size() > 1:
            assert hvd.poll(h) is False
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(t, name="poll_me", op=hvd.Sum)
    out = hvd.synchronize(h)
    assert torch.equal(out, torch.full((4,), float(hvd.size())))
    with pytest.raises(ValueError):
        hvd.poll(h)  # already synchronized


def test_barrier_and_topology():
    hvd.barrier()
    assert 0 <= hvd.rank() < hvd.size()
    assert hvd.local_size() == hvd.size()  # one host
    assert hvd.local_rank() == hvd.rank()
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.is_homogeneous()
    assert hvd.is_initialized()
    assert hvd.gloo_built() is False
    # Both true exactly in a `cuda` build (FH_EXPECT_CUDA_BUILD=1 says which one is tested).
    cuda = os.environ.get("FH_EXPECT_CUDA_BUILD") == "1"
    assert hvd.nccl_built() is cuda and hvd.cuda_built() is cuda
    assert hvd.mpi_enabled() is False


def test_objects():
    r = hvd.rank()
    obj = {"rank": r, "payload": list(range(r + 1))}
    got = hvd.broadcast_object(obj, root_rank=hvd.size() - 1)
    assert got == {"rank": hvd.size() - 1, "payload": list(range(hvd.size()))}
    gathered = hvd.allgather_object(obj)
    assert gathered == [{"rank": q, "payload": list(range(q + 1))} for q in range(hvd.size())]


def test_timeline(tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tl{hvd.rank()}") / "timeline.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(torch.ones(8), name="timeline_tensor")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        import json

        events = json.loads(path.read_text())
        assert isinstance(events, list) and events
    else:
        assert not path.exists()


def test_join_returns_the_last_rank():
    # Every rank but the last joins at once; the last reduces alone first (joined ranks count
    # as zeros), then joins.
    n, r = hvd.size(), hvd.rank()
    if r == n - 1:
        out = hvd.allreduce(torch.ones(3), name="alone", op=hvd.Sum)
        assert torch.equal(out, torch.ones(3))
        # Horovod's average divides by size(): the joined ranks count as zeros.
        avg = hvd.allreduce(torch.full((3,), 6.0), name="alone_avg")
        assert torch.allclose(avg, torch.full((3,), 6.0 / n)), f"rank {r}: {avg}"
    last = hvd.join()
    assert last == n - 1


def test_small_named_allreduces_ride_in_the_negotiation_round():
    """A small named allreduce in a loop (a metric, a loss) is cached after its first step and
    then rides in the negotiation round itself (FH_EAGER_BYTES): the same results, in place and
    not, every op and a scale factor."""
    from fasthorovod import _core
    n = hvd.size()
    before = dict(_core.stats())
    for step in range(6):
        loss = torch.tensor([float(hvd.rank() + step), 1.0])
        got = hvd.allreduce(loss, name="ride.loss", op=hvd.Average)
        assert_same(got, torch.tensor([(n - 1) / 2 + step, 1.0]))
        count = torch.tensor([hvd.rank() + step], dtype=torch.int64)
        hvd.allreduce_(count, name="ride.count", op=hvd.Sum)
        assert count.tolist() == [n * (n - 1) // 2 + n * step]
        worst = hvd.allreduce(torch.tensor([float(-hvd.rank())]), name="ride.min", op=hvd.Min)
        assert worst.tolist() == [float(-(n - 1))]
        scaled = hvd.allreduce(torch.ones(3, dtype=torch.float64), name="ride.scaled",
                               op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        assert scaled.tolist() == [n * 0.5] * 3
    rode = dict(_core.stats())["eager_tensors"] - before["eager_tensors"]
    riding = os.environ.get("FH_TRANSPORT", "auto").split("+")[0] in ("auto", "tcp", "shm", "hier")
    if n > 1 and riding and os.environ.get("FH_EAGER_BYTES", "") != "0":
        # Steps 1-5 of the four names, at the least: every cached one rides.
        assert rode >= 4 * 5, rode
