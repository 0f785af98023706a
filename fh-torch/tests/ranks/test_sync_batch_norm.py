"""hvd.SyncBatchNorm against torch's BatchNorm run in one process on the concatenation of every
rank's batch: forward, input gradient, weight and bias gradients, running statistics, train
and eval, uneven batch sizes per rank, momentum=None, 2D to 5D inputs."""

import pytest
import torch

import fasthorovod.torch as hvd
from _checks import assert_close

_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
       5: torch.nn.BatchNorm3d}
_SPATIAL = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}
C = 3




def _sizes():
    """Uneven batch sizes: rank r has r + 2 samples."""
    return [r + 2 for r in range(hvd.size())]


def _mine(full):
    sizes = _sizes()
    start = sum(sizes[:hvd.rank()])
    return full[start:start + sizes[hvd.rank()]]


def _pair(dim, momentum=0.1, affine=True, track=True):
    """A SyncBatchNorm and the reference BatchNorm with the same (random) affine parameters."""
    sync = hvd.SyncBatchNorm(C, momentum=momentum, affine=affine, track_running_stats=track)
    ref = _BN[dim](C, momentum=momentum, affine=affine, track_running_stats=track)
    if affine:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            w, b = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
            sync.weight.copy_(w), sync.bias.copy_(b)
            ref.weight.copy_(w), ref.bias.copy_(b)
    return sync, ref


def _batch(dim, step):
    """The concatenated batch of a step and the weights of the loss (same on every rank)."""
    g = torch.Generator().manual_seed(100 * dim + step)
    shape = (sum(_sizes()), C) + _SPATIAL[dim]
    x = torch.randn(shape, generator=g) * 2.0 + torch.arange(C).reshape(
        [1, C] + [1] * (dim - 2)).float()
    return x, torch.randn(shape, generator=g)


@pytest.mark.parametrize("dim", [2, 3, 4, 5])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(dim, momentum):
    sync, ref = _pair(dim, momentum)
    for step in range(3):
        full, weights = _batch(dim, step)
        # Reference: one process, the whole batch; the objective is the sum of the ranks'
        # losses, each rank's loss being sum(y * weights) over its own samples.
        x_ref = full.clone().requires_grad_(True)
        y_ref = ref(x_ref)
        # This rank's loss alone gives its share of the weight and bias gradients.
        mine_loss = (_mine(y_ref) * _mine(weights)).sum()
        w_mine, b_mine = torch.autograd.grad(mine_loss, [ref.weight, ref.bias],
                                             retain_graph=True)
        (y_ref * weights).sum().backward()

        x = _mine(full).clone().requires_grad_(True)
        sync.weight.grad = sync.bias.grad = None
        y = sync(x)
        (y * _mine(weights)).sum().backward()

        assert_close(y, _mine(y_ref), f"{dim}D step {step} output")
        assert_close(x.grad, _mine(x_ref.grad), f"{dim}D step {step} input grad")
        assert_close(sync.weight.grad, w_mine, f"{dim}D step {step} weight grad (this rank)")
        assert_close(sync.bias.grad, b_mine, f"{dim}D step {step} bias grad (this rank)")
        # Summed over the ranks: the whole batch's.
        assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad,
                     f"{dim}D step {step} weight grad summed")
        assert_close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), ref.bias.grad,
                     f"{dim}D step {step} bias grad summed")
        ref.weight.grad = ref.bias.grad = None
        assert_close(sync.running_mean, ref.running_mean, f"{dim}D step {step} running_mean")
        assert_close(sync.running_var, ref.running_var, f"{dim}D step {step} running_var")
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
    # Evaluation: the running statistics, on the local batch.
    sync.eval(), ref.eval()
    full, _ = _batch(dim, 99)
    assert_close(sync(_mine(full)), ref(_mine(full)), f"{dim}D eval output")


def test_sync_batch_norm_without_affine_or_running_stats():
    sync, ref = _pair(4, affine=False, track=False)
    assert sync.running_mean is None and sync.weight is None
    full, weights = _batch(4, 0)
    x_ref = full.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * weights).sum().backward()
    x = _mine(full).clone().requires_grad_(True)
    y = sync(x)
    (y * _mine(weights)).sum().backward()
    assert_close(y, _mine(y_ref), "output")
    assert_close(x.grad, _mine(x_ref.grad), "input grad")
    # Without running statistics, evaluation normalizes with the statistics of every rank's
    # batch too (Horovod's SyncBatchNorm synchronizes there as well): BatchNorm on the whole.
    sync.eval(), ref.eval()
    assert_close(sync(_mine(full)), _mine(ref(full)), "eval output")


def test_sync_batch_norm_trains_under_distributed_optimizer():
    torch.manual_seed(21)
    net = torch.nn.Sequential(torch.nn.Linear(4, C), hvd.SyncBatchNorm(C), torch.nn.ReLU(),
                              torch.nn.Linear(C, 1))
    torch.manual_seed(21)
    ref = torch.nn.Sequential(torch.nn.Linear(4, C), torch.nn.BatchNorm1d(C), torch.nn.ReLU(),
                              torch.nn.Linear(C, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), op=hvd.Sum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        data = torch.randn(sum(_sizes()), 4, generator=g)
        target = torch.randn(sum(_sizes()), 1, generator=g)
        opt.zero_grad()
        # Sum of squared errors: with op=Sum the ranks' gradients add up to the whole batch's.
        ((net(_mine(data)) - _mine(target)) ** 2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ((ref(data) - target) ** 2).sum().backward()
        ref_opt.step()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert_close(p, q, f"step {step} {name}", atol=1e-5)


def test_sync_batch_norm_input_checks():
    sync = hvd.SyncBatchNorm(C)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sync(torch.ones(C))
    with pytest.raises(ValueError, match="channels"):
        sync(torch.ones(4, C + 1))
    # One value per channel over all ranks together: refused on every rank (as BatchNorm
    # refuses it in one process).
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.ones(1 if hvd.rank() == 0 else 0, C))


def test_sync_batch_norm_with_an_empty_batch_on_the_last_rank():
    n, me = hvd.size(), hvd.rank()
    sizes = [3] * (n - 1) + [0] if n > 1 else [4]
    sync, ref = _pair(4)
    g = torch.Generator().manual_seed(8)
    full = torch.randn(sum(sizes), C, 2, 2, generator=g)
    weights = torch.randn(full.shape, generator=g)
    start = sum(sizes[:me])
    mine = slice(start, start + sizes[me])
    x_ref = full.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * weights).sum().backward()
    x = full[mine].clone().requires_grad_(True)
    y = sync(x)
    (y * weights[mine]).sum().backward()
    assert_close(y, y_ref[mine], "output")
    assert_close(x.grad, x_ref.grad[mine], "input grad")
    assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad,
                 "weight grad summed")
    assert_close(sync.running_var, ref.running_var, "running_var")
