"""``SyncBatchNorm``: batch normalization whose statistics cover the batches of every rank.

In training, the mean and variance of each channel are those of the concatenation of all
ranks' batches (which may differ in size), so the layer computes what ``BatchNorm`` computes
in one process on the whole batch, forward and backward:

- forward: each rank describes its batch per channel by ``(count, mean, M2)`` (``M2``: the
  sum of squared deviations from its own mean); one allgather of these rows (in float64)
  lets every rank combine them exactly as the parallel-variance formula does, without the
  cancellation of ``E[x²] - E[x]²``;
- backward: one allreduce (sum) of the per-channel ``Σ dy`` and ``Σ dy·x̂`` gives every rank
  the terms of the input gradient that depend on the whole batch. The weight and bias
  gradients stay local (this rank's share), as in Horovod: ``DistributedOptimizer`` then
  reduces them like any other parameter's gradient.

Every rank must run the layer's forward and backward the same number of times, in the same
order as its other collectives. In evaluation mode with running statistics (or on a single
rank) it is a plain ``BatchNorm`` on the local batch; without running statistics, evaluation
synchronizes the batch statistics too, as Horovod's does.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fasthorovod import _core
from fasthorovod.torch._ops import Sum, synchronize
from fasthorovod.torch.gather_ops import allgather_async
from fasthorovod.torch.reduce_ops import allreduce_async


def _reduce_dims(x):
    """Every dimension but the channel one (1)."""
    return [0] + list(range(2, x.dim()))


def _channel_view(t, x):
    """A per-channel vector shaped to broadcast against ``x`` (``[1, C, 1, ...]``)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _global_stats(x):
    """``(mean, biased var, unbiased var, count)`` per channel over every rank's batch,
    combined in float64 (one allgather)."""
    channels = x.shape[1]
    dims = _reduce_dims(x)
    n = x.numel() // channels if channels else 0
    if n > 0:
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        var, mean = torch.var_mean(x.detach().to(compute), dim=dims, correction=0)
        mean, m2 = mean.double().cpu(), var.double().cpu() * n
    else:
        mean = torch.zeros(channels, dtype=torch.float64)
        m2 = torch.zeros(channels, dtype=torch.float64)
    row = torch.cat([torch.tensor([float(n)], dtype=torch.float64), mean, m2])
    # Ranks whose inputs differ in channels fail here (the engine's shape check).
    rows = synchronize(allgather_async(row.unsqueeze(0), name=None))
    counts = rows[:, 0]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all "
                         f"ranks' batches, got {int(total)} (input size {list(x.shape)} on "
                         "this rank)")
    means = rows[:, 1:1 + channels]
    m2s = rows[:, 1 + channels:]
    mean_all = (counts.unsqueeze(1) * means).sum(0) / total
    m2_all = (m2s + counts.unsqueeze(1) * (means - mean_all) ** 2).sum(0)
    return (mean_all.to(x.device), (m2_all / total).to(x.device),
            (m2_all / (total - 1)).to(x.device), total)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalizes with statistics already combined over the ranks; the backward pass sums
    the per-channel gradient terms over the ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, total):
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xhat = (x.to(compute) - _channel_view(mean.to(compute), x)) * \
            _channel_view(invstd.to(compute), x)
        y = xhat
        if weight is not None:
            y = y * _channel_view(weight.to(compute), x)
        if bias is not None:
            y = y + _channel_view(bias.to(compute), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        dims = _reduce_dims(x)
        dyc = dy.to(compute)
        xhat = (x.to(compute) - _channel_view(mean.to(compute), x)) * \
            _channel_view(invstd.to(compute), x)
        local_dy = dyc.sum(dims).to(torch.float64)
        local_dy_xhat = (dyc * xhat).sum(dims).to(torch.float64)
        # Every rank takes part, whatever needs a gradient here: the ranks must agree.
        packed = torch.cat([local_dy, local_dy_xhat]).cpu()
        summed = synchronize(allreduce_async(packed, op=Sum, name=None))
        channels = x.shape[1]
        mean_dy = (summed[:channels] / ctx.total).to(x.device, compute)
        mean_dy_xhat = (summed[channels:] / ctx.total).to(x.device, compute)
        grad_x = None
        if ctx.needs_input_grad[0]:
            scale = invstd.to(compute)
            if weight is not None:
                scale = scale * weight.to(compute)
            grad_x = (_channel_view(scale, x) *
                      (dyc - _channel_view(mean_dy, x) - xhat * _channel_view(mean_dy_xhat, x))
                      ).to(x.dtype)
        grad_w = local_dy_xhat.to(weight.dtype) if weight is not None and \
            ctx.needs_input_grad[1] else None
        grad_b = local_dy.to(x.dtype if weight is None else weight.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of all ranks (Horovod's ``hvd.SyncBatchNorm``).

    Takes the place of ``BatchNorm1d``/``2d``/``3d``: input ``[N, C]``, ``[N, C, L]``,
    ``[N, C, H, W]`` or ``[N, C, D, H, W]``. In training, normalizes with the mean and
    (biased) variance of the concatenation of every rank's batch (batch sizes may differ
    per rank) and updates the running statistics with them (unbiased variance; ``momentum=
    None`` keeps a cumulative average), so that the layer behaves as ``BatchNorm`` would in
    one process on the whole batch. Without running statistics, evaluation also normalizes
    with the statistics of every rank's batch (as Horovod's does). In evaluation mode with
    running statistics, or on a single rank, it is a plain local ``BatchNorm``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions "
                             f"([N, C, ...]), got {input.dim()}D input")

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with "
                             f"{input.shape[1]} channels (shape {list(input.shape)})")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or _core.topology()[1] == 1:
            # Evaluation with running statistics (or a single rank): a local BatchNorm.
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch_stats, factor, self.eps)
        # Batch statistics (training; or evaluation without running statistics, which Horovod
        # synchronizes too): those of every rank's batch.
        mean, var, unbiased, total = _global_stats(input)
        if self.training and self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, total)


__all__ = ["SyncBatchNorm"]
