"""CUDA tensors through ``fasthorovod.torch`` on a real GPU, one process.

Skipped, saying why, where there is no GPU, where this build lacks the ``cuda`` feature, or where
``FH_CUDA=1`` is not set. One GPU cannot hold two NCCL ranks, so this runs at ``size() == 1``:
it proves the device path end to end (submission on the current stream, NCCL, completion made
visible to the stream without a host sync), not the arithmetic across ranks, which the CPU suites
cover. Run with ``FH_CUDA=1 python -m pytest fh-torch/tests/gpu -q -s``.
"""

import os
import time

import pytest
import torch

import fasthorovod.torch as hvd

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
    pytest.mark.skipif(not hvd.cuda_built(), reason="this fasthorovod build lacks the `cuda` "
                       "feature (maturin build --features cuda)"),
    pytest.mark.skipif(os.environ.get("FH_CUDA") != "1", reason="FH_CUDA=1 is not set"),
]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    yield
    hvd.shutdown()


def _expect_equal(got, want, what):
    got, want = got.float().cpu(), want.float().cpu()
    bad = (got - want).abs() > 1e-3 * want.abs().clamp(min=1)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"rank {hvd.rank()}: {what}[{i}] = {got.flatten()[i].item()}, "
                             f"want {want.flatten()[i].item()}")


def test_allreduce_on_the_device_with_scale_factors():
    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = hvd.allreduce(t, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5, name="scaled")
    assert out.device.type == "cuda"
    _expect_equal(out, t * 1.5 * hvd.size(), "sum")
    avg = hvd.allreduce(t, name="avg")
    _expect_equal(avg, t, "average")


def test_in_place_and_async_follow_the_current_stream():
    # Work queued on a side stream right before submission must be seen by the collective, and
    # the result must be visible to later work on that stream without a host sync.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.empty(1 << 20, device="cuda")
        t.fill_(2.0)
        for _ in range(20):
            t.mul_(1.0)  # keep the stream busy so that a missing wait would be seen
        h = hvd.allreduce_async_(t, op=hvd.Sum, name="inplace")
        hvd.synchronize(h)
        u = t * 2
    side.synchronize()
    _expect_equal(u, torch.full_like(u, 4.0 * hvd.size()), "in-place sum, then doubled")


def test_grouped_allreduce_of_half_precision_tensors():
    ts = [torch.full((n,), float(i + 1), device="cuda", dtype=dt)
          for i, (n, dt) in enumerate([(17, torch.float16), (4096, torch.bfloat16),
                                       (3, torch.float32)])]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped")
    for i, (o, t) in enumerate(zip(outs, ts)):
        assert o.dtype == t.dtype
        _expect_equal(o, t * hvd.size(), f"grouped[{i}]")


def test_broadcast_from_root():
    t = torch.full((333,), float(hvd.rank() + 7), device="cuda")
    out = hvd.broadcast(t, root_rank=0, name="bcast")
    _expect_equal(out, torch.full_like(t, 7.0), "broadcast")


def test_a_training_step_matches_local_sgd():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).cuda()
    reference = torch.nn.Linear(64, 8).cuda()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(32, 64, device="cuda")
    for m, o in ((model, opt), (reference, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        _expect_equal(p.detach(), q.detach(), name)


def test_throughput_of_a_large_allreduce():
    t = torch.ones(64 << 20, device="cuda")  # 256 MiB of float32
    hvd.allreduce_(t, op=hvd.Sum, name="warm")
    torch.cuda.synchronize()
    steps = 10
    start = time.perf_counter()
    for i in range(steps):
        hvd.allreduce_(t, op=hvd.Sum, name=f"big{i}")
    torch.cuda.synchronize()
    per = (time.perf_counter() - start) / steps
    print(f"\nallreduce of 256 MiB on the device at size {hvd.size()}: {per * 1e3:.2f} ms "
          f"per call ({t.numel() * 4 / per / 1e9:.1f} GB/s)")
    _expect_equal(t[:8], torch.full((8,), float(hvd.size()) ** (steps + 1), device="cuda"),
                  "repeated sum")
