#!/usr/bin/env python3
"""Workload replay through a peer's own Python API, for fh-bench's replay suite.

Modes:

  ddp      PyTorch DistributedDataParallel on the Gloo backend, unmodified: a module whose
           parameters have the workload's shapes (registered in forward order, the reverse of
           the workload's backward order), wrapped in torch.nn.parallel.DistributedDataParallel
           with its defaults (25 MiB buckets, 1 MiB first bucket, buckets rebuilt after the
           first step). The backward pass is emulated: the forward chains one autograd node per
           parameter; in the backward, the node of gradient i sleeps until
           B x (share_0 + ... + share_i) after the backward started (fixed deadlines) and then
           hands its gradient (all ones) to autograd, which fires DDP's hooks exactly as a real
           backward would. The gradient buffer of the previous step is handed back, so autograd
           can take it without a copy. loss.backward() returns once DDP has reduced every
           bucket and written the averages back into .grad.
  horovod  horovod.torch: at each deadline hvd.allreduce_async_(grad_i, name, Average), then
           hvd.synchronize on every handle.

Both measure, per step, the time from the start of the backward to the last gradient reduced
on this rank; then the slowest rank per step (all-reduce MAX / allgather). The forward pass and
a barrier come before each step and are not timed. One or more warm-up steps are not timed
either. After the last step every gradient must be the average of ones (one), else the script
fails.

Ranks: torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for ddp;
horovodrun's environment for horovod. Rank 0 prints one JSON line to stdout:

  {"peer": "ddp-gloo", "workload": ..., "np": ..., "backward_ms": ..., "warmup": ...,
   "steps": ..., "step_seconds": [slowest rank per timed step, seconds], "tensors": ...,
   "bytes": ..., "version": "torch x.y", "checked": true}

Only the standard library, torch and (for the horovod mode) horovod.torch are used.
"""

import argparse
import datetime
import json
import os
import sys
import time


def load_workload(path):
    with open(path, encoding="utf-8") as f:
        w = json.load(f)
    if w.get("dtype", "float32") not in ("float32", "f32"):
        raise SystemExit(f"{path}: only float32 workloads are supported, not {w.get('dtype')}")
    tensors = []
    for t in w["tensors"]:
        tensors.append((t["name"], [int(d) for d in t["shape"]], int(t["elements"]),
                        float(t["compute_share"])))
    return w["model"], tensors


def deadlines(tensors, backward_s):
    """Seconds after the backward starts when each gradient is ready (as fh-bench computes)."""
    out, cum = [], 0.0
    for _, _, _, share in tensors:
        cum += share
        out.append(backward_s * min(cum, 1.0))
    return out


def sleep_until(t):
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def run_ddp(args, model_name, tensors, due):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))

    class Clock:
        t0 = 0.0

    clock = Clock()
    # Backward-order index i -> the gradient buffer autograd gets at deadline i.
    pending = [None] * len(tensors)

    class Release(torch.autograd.Function):
        """Identity on x in the forward; in the backward, releases one parameter's gradient at
        its deadline."""

        @staticmethod
        def forward(ctx, x, param, index):
            ctx.index = index
            return x.clone()

        @staticmethod
        def backward(ctx, grad_x):
            i = ctx.index
            sleep_until(clock.t0 + due[i])
            g = pending[i]
            pending[i] = None  # the only reference left is the one returned: no copy needed
            return grad_x, g, None

    class Emulated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # Forward order = reverse of the workload's backward order.
            self.order = list(reversed(range(len(tensors))))
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(tensors[i][1])) for i in self.order])

        def forward(self, x):
            for p, i in zip(self.params, self.order):
                x = Release.apply(x, p, i)
            return x

    model = Emulated()
    by_index = {i: p for p, i in zip(model.params, model.order)}
    ddp = DistributedDataParallel(model)
    x = torch.zeros(1)
    times = []
    for step in range(args.warmup + args.steps):
        for i in range(len(tensors)):
            p = by_index[i]
            # Last step's averaged gradient (ones) is this step's gradient again.
            g = p.grad if p.grad is not None else torch.ones(tensors[i][1])
            p.grad = None
            pending[i] = g
            del g
        loss = ddp(x).sum()
        dist.barrier()
        clock.t0 = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - clock.t0
        if step >= args.warmup:
            times.append(elapsed)
    for i in range(len(tensors)):
        g = by_index[i].grad
        if g is None or not torch.all(g == 1.0):
            raise SystemExit(f"wrong result for {tensors[i][0]}: the average of ones is not one")
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.barrier()
    dist.destroy_process_group()
    return rank, world, slowest.tolist(), f"torch {torch.__version__}"


def run_horovod(args, model_name, tensors, due):
    import torch
    import horovod
    import horovod.torch as hvd

    hvd.init()
    grads = [torch.ones(shape) for _, shape, _, _ in tensors]
    names = [f"grad.{name}" for name, _, _, _ in tensors]
    average = {"op": hvd.Average} if hasattr(hvd, "Average") else {"average": True}
    times = []
    for step in range(args.warmup + args.steps):
        hvd.allreduce(torch.zeros(1), name=f"fh.barrier.{step % 2}")
        t0 = time.perf_counter()
        handles = []
        for i, g in enumerate(grads):
            sleep_until(t0 + due[i])
            handles.append(hvd.allreduce_async_(g, name=names[i], **average))
        for h in handles:
            hvd.synchronize(h)
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
    for i, g in enumerate(grads):
        if not torch.all(g == 1.0):
            raise SystemExit(f"wrong result for {tensors[i][0]}: the average of ones is not one")
    every = hvd.allgather(torch.tensor([times], dtype=torch.float64), name="fh.times")
    slowest = every.max(dim=0).values.tolist()
    rank, world = hvd.rank(), hvd.size()
    hvd.shutdown()
    return rank, world, slowest, f"torch {torch.__version__}, horovod {horovod.__version__}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="workload JSON (fh-bench/workloads)")
    ap.add_argument("--backward-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mode", choices=["ddp", "horovod"], required=True)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a collective may wait for a peer (ddp)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.backward_ms < 0:
        raise SystemExit("--steps must be >= 1, --warmup and --backward-ms >= 0")
    model, tensors = load_workload(args.workload)
    due = deadlines(tensors, args.backward_ms / 1e3)
    if args.mode == "ddp":
        rank, world, slowest, version = run_ddp(args, model, tensors, due)
        peer = "ddp-gloo"
    else:
        rank, world, slowest, version = run_horovod(args, model, tensors, due)
        peer = "horovod"
    if rank == 0:
        print(json.dumps({
            "peer": peer,
            "workload": model,
            "np": world,
            "backward_ms": args.backward_ms,
            "warmup": args.warmup,
            "steps": args.steps,
            "step_seconds": slowest,
            "tensors": len(tensors),
            "bytes": 4 * sum(n for _, _, n, _ in tensors),
            "version": version,
            "checked": True,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
