"""Autograd through the collectives, DistributedOptimizer and the broadcast helpers."""

import pytest
import torch

import fasthorovod.torch as hvd


def test_allreduce_gradient():
    x = torch.full((3,), float(hvd.rank() + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    y.sum().backward()
    # d/dx of sum_r x_r summed: the allreduce of the incoming gradient (ones) = size.
    assert torch.equal(x.grad, torch.full((3,), float(hvd.size())))


def test_allgather_gradient_averages():
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(r + 1, 2, requires_grad=True)
    y = hvd.allgather(x)
    # Each rank weights the gathered rows differently; the gradient is the average.
    w = torch.arange(y.shape[0], dtype=torch.float32).unsqueeze(1) * (r + 1)
    (y * w).sum().backward()
    offset = sum(q + 1 for q in range(r))
    mean_scale = sum(q + 1 for q in range(n)) / n
    want = (torch.arange(offset, offset + r + 1, dtype=torch.float32).unsqueeze(1)
            * mean_scale).expand(r + 1, 2)
    assert torch.allclose(x.grad, want)


def test_broadcast_gradient():
    x = torch.ones(2, requires_grad=True)
    hvd.broadcast(x, root_rank=0).sum().backward()
    want = 1.0 if hvd.rank() == 0 else 0.0
    assert torch.equal(x.grad, torch.full((2,), want))


def test_reducescatter_and_alltoall_gradients():
    n = hvd.size()
    x = torch.ones(2 * n, 2, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    # Horovod's convention: the allgather of the incoming gradients (ones) times size() for
    # Sum (test_gradients.py has the full cases).
    assert torch.equal(x.grad, torch.full((2 * n, 2), float(n)))
    z = torch.ones(n, 2, requires_grad=True)
    (hvd.alltoall(z) * 3).sum().backward()
    assert torch.equal(z.grad, torch.full((n, 2), 3.0))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_distributed_optimizer_equals_big_batch():
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(42)
    data = torch.randn(4 * n, 4)
    target = torch.randn(4 * n, 1)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        mine = slice(4 * r, 4 * r + 4)
        torch.nn.functional.mse_loss(model(data[mine]), target[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(data), target).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p, q)
    # Identical on every rank, bit for bit.
    for p in model.parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0))
        assert all(torch.equal(gathered[0], g) for g in gathered)


def test_unused_parameter_on_one_rank_does_not_hang():
    model = _model()
    extra = torch.nn.Linear(4, 1)
    params = list(model.named_parameters()) + [("extra." + k, v)
                                               for k, v in extra.named_parameters()]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    x = torch.ones(2, 4)
    loss = model(x).sum()
    if hvd.rank() == 0:
        loss = loss + extra(x).sum()  # only rank 0 uses `extra`
    loss.backward()
    opt.step()
    # rank 0's gradient averaged with zeros from the others
    w = extra.weight.detach().clone()
    gathered = hvd.allgather(w.unsqueeze(0))
    assert all(torch.equal(gathered[0], g) for g in gathered)


@pytest.mark.parametrize("passes", [1, 2])
def test_backward_passes_per_step_sums_locally(passes):
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   backward_passes_per_step=passes, op=hvd.Sum)
    for _ in range(passes):
        (w * (hvd.rank() + 1)).sum().backward()
    opt.synchronize()
    # Summed locally over the passes (not divided), then summed over ranks.
    want = passes * sum(q + 1 for q in range(hvd.size()))
    assert torch.equal(w.grad, torch.full((3,), float(want)))
    with opt.skip_synchronize():
        opt.step()
    assert torch.equal(w.detach(), torch.full((3,), -float(want)))


def test_compression_and_predivide_in_optimizer():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   compression=hvd.Compression.fp16,
                                   gradient_predivide_factor=2.0)
    (w * float(hvd.rank() + 1)).sum().backward()
    opt.step()
    mean = sum(q + 1 for q in range(hvd.size())) / hvd.size()
    assert torch.allclose(w.detach(), torch.full((4,), -mean), atol=1e-3)
    assert w.grad.dtype == torch.float32


def test_zero_grad_between_backward_and_step_is_refused():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("zw", w)])
    w.sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()


def test_broadcast_optimizer_state():
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    if hvd.rank() == 0:
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for p in model.parameters():
        st = opt.state[p]
        gathered = hvd.allgather(st["exp_avg"].unsqueeze(0))
        assert all(torch.equal(gathered[0], g) for g in gathered)
        assert float(st["step"]) == 1.0
    if hvd.rank() != 0:
        # Making the state did not move the parameters.
        for b, p in zip(before, model.parameters()):
            assert torch.equal(b, p.detach())


def test_broadcast_parameters_list_form():
    t = torch.full((3,), float(hvd.rank()))
    hvd.broadcast_parameters([("t", t)], root_rank=hvd.size() - 1)
    assert torch.equal(t, torch.full((3,), float(hvd.size() - 1)))
