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
  ddp-fasthorovod
           the same DDP run, with its process group on FastHorovod's torch.distributed
           backend: ``import fasthorovod.torch.distributed`` and init_process_group("fasthorovod")
           (the one string changed), FH_TRANSPORT choosing shared memory or TCP.
  ddp-floor
           the ddp run with nothing communicated: torch's no-op DDP communication hook
           (debugging_hooks.noop_hook) hands each bucket back as it is (a completed future,
           no collective, no division), so the step is DDP's own work alone — copying each
           gradient into its bucket during the backward and each bucket back into .grad after
           it. No backend can expose less than this row under DDP: it is the floor of the ddp
           rows (the gradients stay ones, so the check holds).
  horovod  horovod.torch: at each deadline hvd.allreduce_async_(grad_i, name, Average), then
           hvd.synchronize on every handle.
  fasthorovod
           fasthorovod.torch through its DistributedOptimizer, as a Horovod training loop
           uses it: the same emulated module and backward as ddp (so the optimizer's gradient
           hooks fire at the deadlines and submit each gradient the moment autograd
           accumulates it), wrapped by hvd.DistributedOptimizer(SGD(lr=0),
           named_parameters=...); the step is timed to the end of optimizer.synchronize(),
           then optimizer.step() runs under skip_synchronize() (not timed, like the update
           that DDP's run leaves out too); the averaged gradients are handed back as the next
           step's, as in ddp.

Both measure, per step, the time from the start of the backward to the last gradient reduced
on this rank; then the slowest rank per step (all-reduce MAX / allgather). The forward pass and
a barrier come before each step and are not timed. One or more warm-up steps are not timed
either. Each rank also sums the CPU time its process (every thread: the framework's and the
communication library's) used inside the timed steps (``time.process_time``), and of it its
main thread's (``time.thread_time``: the training loop — the backward with the framework's
hooks and submissions, DDP's bucket copies, the wait); rank 0 reports the sums over the
ranks. After the last step every gradient must be the average of ones (one), else the script
fails.

FH_REPLAY_TRACE=1 makes the fasthorovod mode print, per step and rank, when it left the barrier
(wall clock, to see the skew between ranks), how long the backward (the deadlines plus the
optimizer's hooks) and the synchronize after it took (stderr).

Ranks: torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for ddp,
ddp-floor and ddp-fasthorovod (with FH_JOB_TOKEN, FH_TRANSPORT and FH_RENDEZVOUS_ADDR for
the latter); horovodrun's environment for horovod; fhrun's (FH_RANK, FH_SIZE,
FH_RENDEZVOUS_ADDR, FH_JOB_TOKEN, FH_TRANSPORT, ...) for fasthorovod. Rank 0 prints one JSON
line to stdout:

  {"peer": "ddp-gloo", "workload": ..., "np": ..., "backward_ms": ..., "warmup": ...,
   "steps": ..., "step_seconds": [slowest rank per timed step, seconds], "tensors": ...,
   "bytes": ..., "version": "torch x.y", "checked": true,
   "cpu_seconds": [CPU time of all ranks together over the timed steps, seconds],
   "main_thread_cpu_seconds": [of it, their main threads', seconds]}

Only the standard library, torch and (for the horovod and fasthorovod modes) horovod.torch
or fasthorovod.torch are used.
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


def emulated_model(tensors, due):
    """The module whose backward releases the workload's gradients at their deadlines.

    Returns (model, by_index, pending, clock): by_index[i] is the parameter of backward-order
    gradient i; pending[i] is the buffer autograd gets for it (set before each backward);
    clock.t0 is when the backward started."""
    import torch

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
    return model, by_index, pending, clock


def hand_back(tensors, by_index, pending):
    """Last step's averaged gradient (ones) becomes this step's gradient; .grad is cleared."""
    import torch

    for i in range(len(tensors)):
        p = by_index[i]
        g = p.grad if p.grad is not None else torch.ones(tensors[i][1])
        p.grad = None
        pending[i] = g
        del g


def check_ones(tensors, by_index):
    import torch

    for i in range(len(tensors)):
        g = by_index[i].grad
        if g is None or not torch.all(g == 1.0):
            raise SystemExit(f"wrong result for {tensors[i][0]}: the average of ones is not one")


def run_ddp(args, model_name, tensors, due, backend="gloo", floor=False):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if backend == "fasthorovod":
        import fasthorovod.torch.distributed  # noqa: F401 - registers the backend
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))

    model, by_index, pending, clock = emulated_model(tensors, due)
    ddp = DistributedDataParallel(model)
    if floor:
        # torch's own no-op hook: each bucket handed back at once, nothing communicated.
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp.register_comm_hook(None, noop_hook)
    x = torch.zeros(1)
    times, cpu, main = [], 0.0, 0.0
    for step in range(args.warmup + args.steps):
        hand_back(tensors, by_index, pending)
        loss = ddp(x).sum()
        dist.barrier()
        cpu0, main0 = time.process_time(), time.thread_time()
        clock.t0 = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - clock.t0
        if step >= args.warmup:
            times.append(elapsed)
            cpu += time.process_time() - cpu0
            main += time.thread_time() - main0
    check_ones(tensors, by_index)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    every_cpu = torch.tensor([cpu, main], dtype=torch.float64)
    dist.all_reduce(every_cpu, op=dist.ReduceOp.SUM)
    EXTRA["cpu_seconds"] = every_cpu[0].item()
    EXTRA["main_thread_cpu_seconds"] = every_cpu[1].item()
    dist.barrier()
    # DDP (its reducer, and the Python hook it holds) goes before the process group: left to
    # the interpreter's exit, a rank with a Python hook could abort there ("terminate called
    # without an active exception", 3 of 14 runs of the quick suite's ddp-floor row).
    del ddp
    dist.destroy_process_group()
    version = f"torch {torch.__version__}"
    if backend == "fasthorovod":
        import fasthorovod
        version += f", fasthorovod {getattr(fasthorovod, '__version__', '?')}"
    return rank, world, slowest.tolist(), version


def run_horovod(args, model_name, tensors, due):
    import torch
    import horovod
    import horovod.torch as hvd

    hvd.init()
    grads = [torch.ones(shape) for _, shape, _, _ in tensors]
    names = [f"grad.{name}" for name, _, _, _ in tensors]
    average = {"op": hvd.Average} if hasattr(hvd, "Average") else {"average": True}
    times, cpu, main = [], 0.0, 0.0
    for step in range(args.warmup + args.steps):
        hvd.allreduce(torch.zeros(1), name=f"fh.barrier.{step % 2}")
        cpu0, main0 = time.process_time(), time.thread_time()
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
            cpu += time.process_time() - cpu0
            main += time.thread_time() - main0
    for i, g in enumerate(grads):
        if not torch.all(g == 1.0):
            raise SystemExit(f"wrong result for {tensors[i][0]}: the average of ones is not one")
    slowest = gather_times(hvd, times, cpu, main)
    rank, world = hvd.rank(), hvd.size()
    hvd.shutdown()
    return rank, world, slowest, f"torch {torch.__version__}, horovod {horovod.__version__}"


# Facts a run adds to rank 0's result line besides the step times.
EXTRA = {}


def gather_times(hvd, times, cpu, main):
    """Through a Horovod-style API: the slowest rank per timed step, and (into EXTRA) the CPU
    seconds of all ranks together, of the processes and of their main threads, from one
    allgather of every rank's [times..., cpu, main]."""
    import torch

    every = hvd.allgather(torch.tensor([times + [cpu, main]], dtype=torch.float64),
                          name="fh.times")
    EXTRA["cpu_seconds"] = every[:, -2].sum().item()
    EXTRA["main_thread_cpu_seconds"] = every[:, -1].sum().item()
    return every[:, :-2].max(dim=0).values.tolist()


def run_fasthorovod(args, model_name, tensors, due):
    import torch
    import fasthorovod
    import fasthorovod.torch as hvd

    hvd.init()
    trace = os.environ.get("FH_REPLAY_TRACE") == "1"
    model, by_index, pending, clock = emulated_model(tensors, due)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    x = torch.zeros(1)
    times, cpu, main = [], 0.0, 0.0
    for step in range(args.warmup + args.steps):
        hand_back(tensors, by_index, pending)
        loss = model(x).sum()
        hvd.barrier()
        cpu0, main0 = time.process_time(), time.thread_time()
        clock.t0 = time.perf_counter()
        wall_t0 = time.time()
        loss.backward()
        backward_done = time.perf_counter()
        opt.synchronize()
        elapsed = time.perf_counter() - clock.t0
        step_cpu = time.process_time() - cpu0
        step_main = time.thread_time() - main0
        if trace:
            # Where the step goes: the backward (deadlines + hooks) and the wait after it.
            bw = backward_done - clock.t0
            print(f"trace rank {hvd.rank()} step {step}: left the barrier at {wall_t0:.4f} "
                  f"(wall clock), backward {1e3 * bw:.1f} ms (last deadline "
                  f"{1e3 * due[-1]:.1f} ms), synchronize {1e3 * (elapsed - bw):.1f} ms",
                  file=sys.stderr, flush=True)
        if step >= args.warmup:
            times.append(elapsed)
            cpu += step_cpu
            main += step_main
        if step + 1 < args.warmup + args.steps:
            with opt.skip_synchronize():
                opt.step()
    check_ones(tensors, by_index)
    slowest = gather_times(hvd, times, cpu, main)
    rank, world = hvd.rank(), hvd.size()
    # The streams the runtime itself chose to peers on other hosts (None: nothing crosses).
    EXTRA["tcp_streams"] = hvd.tcp_streams()
    hvd.shutdown()
    version = getattr(fasthorovod, "__version__", "?")
    return rank, world, slowest, f"torch {torch.__version__}, fasthorovod {version}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="workload JSON (fh-bench/workloads)")
    ap.add_argument("--backward-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mode", choices=["ddp", "ddp-fasthorovod", "ddp-floor", "horovod",
                                       "fasthorovod"],
                    required=True)
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
    elif args.mode == "ddp-fasthorovod":
        rank, world, slowest, version = run_ddp(args, model, tensors, due, "fasthorovod")
        peer = "ddp-fasthorovod"
    elif args.mode == "ddp-floor":
        rank, world, slowest, version = run_ddp(args, model, tensors, due, floor=True)
        peer = "ddp-floor"
    elif args.mode == "horovod":
        rank, world, slowest, version = run_horovod(args, model, tensors, due)
        peer = "horovod"
    else:
        rank, world, slowest, version = run_fasthorovod(args, model, tensors, due)
        peer = "fasthorovod-torch"
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
            **EXTRA,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
