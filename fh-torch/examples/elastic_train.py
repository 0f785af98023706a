#!/usr/bin/env python3
"""Elastic training of a small model on synthetic data with FastHorovod.

Horovod's elastic recipe (``hvd.elastic.TorchState``, ``ElasticSampler``, ``state.commit()``
every few batches, ``@hvd.elastic.run``): apart from its import, and the optional log below,
this is a Horovod elastic script. Run it under the elastic driver::

    fhrun --host-discovery-script ./discover.sh --min-np 2 --max-np 4 \\
        python elastic_train.py --epochs 3

or on a fixed world (``fhrun -np 2 python elastic_train.py``), or alone.

The data downloads nothing: sample ``i`` of epoch ``e`` is made from ``(seed, e, i)`` alone, so
a run can be checked. With ``ELASTIC_LOG=DIR`` each worker writes ``DIR/<worker>.jsonl``, one
JSON object a line: ``world`` (at each start of the training function, after the state was
synchronised: generation, rank, size, step), ``step`` (generation, rank, size, epoch, batch,
step, the sample indices it trained on), ``commit``, ``reset`` and, at the end, ``final`` (the
parameters). ``--replay DIR`` then recomputes, in one process, the committed sequence of
worlds (a generation's steps after its last commit are undone by the next generation, which
starts from the committed step) and compares the result with every worker's final
parameters::

    ELASTIC_LOG=/tmp/elog fhrun ... python elastic_train.py --epochs 3
    python elastic_train.py --epochs 3 --replay /tmp/elog

It exits 1, saying what differs, when the workers' final parameters are not bit-identical or
not the replay's (to 1e-9), or when an epoch did not train on every sample.
"""

import argparse
import glob
import json
import os
import socket
import sys
import time

import torch

import fasthorovod.torch as hvd

DIM = 6


class Net(torch.nn.Module):
    """A perceptron in float64 (so that the replay matches to ~1e-12): ``DIM`` inputs,
    ``hidden_layers`` layers of ``width`` units (tanh), one output. Each parameter is a
    bucket of ``DistributedOptimizer``: more layers, more reductions in flight during
    ``backward()``."""

    def __init__(self, hidden_layers=1, width=8):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, width).double()
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(width, width).double()
                                          for _ in range(hidden_layers - 1))
        self.fc2 = torch.nn.Linear(width, 1).double()

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.fc2(h).squeeze(-1)


class Indices(torch.utils.data.Dataset):
    """The data set as the loader sees it: sample ``i`` is ``i`` (made into tensors by
    ``batch_tensors`` from the epoch and the indices)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def batch_tensors(seed, epoch, indices):
    """The samples ``indices`` of epoch ``epoch``: ``x`` from ``(seed, index)``, the target a
    fixed function of ``x`` plus noise from ``(seed, epoch, index)``."""
    xs, ys = [], []
    for i in indices:
        x = torch.randn(DIM, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
        noise = torch.randn(1, dtype=torch.float64, generator=torch.Generator().manual_seed(
            seed * 1_000_003 + (epoch + 1) * 7_919 * 100_003 + i))
        xs.append(x)
        ys.append(torch.sin(x[:3].sum()) + 0.5 * x[3] * x[4] + 0.05 * noise[0])
    return torch.stack(xs), torch.stack(ys)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def build(args):
    """The model and the plain optimizer, the same in every process (seeded)."""
    torch.manual_seed(args.seed)
    model = Net(args.hidden_layers, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    return model, optimizer


def flat_params(model):
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


class Log:
    """The JSON-lines log of this worker (``ELASTIC_LOG=DIR``), or nothing."""

    def __init__(self, directory):
        self.f = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            worker = os.environ.get("FH_ELASTIC_WORKER") or \
                f"rank{os.environ.get('FH_RANK', hvd.rank())}-pid{os.getpid()}"
            name = "".join(c if c.isalnum() or c in "-." else "_" for c in worker)
            self.f = open(os.path.join(directory, f"{name}.jsonl"), "a", encoding="utf-8")
            self.progress = open(os.path.join(directory, f"{name}.progress"), "a",
                                 encoding="utf-8")

    def event(self, kind, **fields):
        if self.f is not None:
            g = generation()
            self.f.write(json.dumps(dict(event=kind, generation=g, **fields)) + "\n")
            self.f.flush()
            if kind in ("step", "commit"):
                # One text line a step or commit in <worker>.progress, for a test that watches
                # the job: `step|commit UNIX_TIME GENERATION RANK SIZE HOST`.
                host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
                self.progress.write(f"{kind} {time.time():.3f} {g} {fields['rank']} "
                                    f"{hvd.size()} {host}\n")
                self.progress.flush()

    def close(self):
        if self.f is not None:
            self.f.close()
            self.progress.close()


def generation():
    """The running world's generation (elastic jobs; 0 on a fixed world). FastHorovod only:
    it is for the log."""
    from fasthorovod.common import _elastic_core
    return _elastic_core.assignment()[0] if _elastic_core.enabled() else 0


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    optimizer.step()
    return loss.item()


# The arguments a replay must share with the run.
REPLAYED = ["epochs", "samples", "lr", "momentum", "seed", "hidden_layers", "width"]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96, help="samples in the data set")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--commit-every", type=int, default=3, help="batches between commits")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--hidden-layers", type=int, default=1,
                   help="hidden layers of the perceptron (each adds two buckets)")
    p.add_argument("--width", type=int, default=8, help="units of each hidden layer")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep after each step (to give a test time to act)")
    p.add_argument("--stop-file", metavar="PATH",
                   help="end the training at the first commit after PATH exists (rank 0 "
                        "looks, every rank stops at the same commit)")
    p.add_argument("--replay", metavar="DIR", help="replay the logs in DIR and compare")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.replay:
        return check_replay(args)
    hvd.init()
    model, optimizer = build(args)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    dataset = Indices(args.samples)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, step=0)
    log = Log(os.environ.get("ELASTIC_LOG"))
    log.event("config", rank=hvd.rank(), **{k: getattr(args, k) for k in REPLAYED})
    state.register_reset_callbacks([lambda: log.event("reset", rank=hvd.rank(),
                                                      size=hvd.size())])

    def commit():
        try:
            state.commit()
        except hvd.HostsUpdatedInterrupt:
            # Saved; the world changes now.
            log.event("commit", rank=hvd.rank(), step=state.step, hosts_updated=True)
            raise
        log.event("commit", rank=hvd.rank(), step=state.step)

    def stop_requested():
        """Whether rank 0 sees the stop file (broadcast: every rank stops at this commit)."""
        if not args.stop_file:
            return False
        seen = hvd.rank() == 0 and os.path.exists(args.stop_file)
        flag = torch.tensor([1 if seen else 0], dtype=torch.int32)
        return bool(hvd.broadcast(flag, root_rank=0, name="elastic_train.stop").item())

    @hvd.elastic.run
    def train(state):
        log.event("world", rank=hvd.rank(), size=hvd.size(), step=state.step,
                  epoch=state.epoch)
        while state.epoch < args.epochs:
            for idx in loader:
                indices = [int(i) for i in idx]
                x, y = batch_tensors(args.seed, state.epoch, indices)
                loss = train_step(state.model, state.optimizer, x, y)
                log.event("step", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch,
                          batch=state.batch, step=state.step, indices=indices, loss=loss)
                state.step += 1
                state.batch += 1
                state.sampler.record_batch(state.batch, len(indices))
                if args.step_delay:
                    time.sleep(args.step_delay)
                if state.batch % args.commit_every == 0:
                    commit()
                    if stop_requested():
                        return True
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            commit()
            if stop_requested():
                return True
        return False

    stopped = train(state)
    log.event("final", rank=hvd.rank(), size=hvd.size(), step=state.step, stopped=stopped,
              epoch=state.epoch,
              params=flat_params(state.model))
    log.close()
    if hvd.rank() == 0:
        print(f"elastic_train: {state.step} steps, {state.epoch} epochs done, final world of "
              f"{hvd.size()}", flush=True)
    return 0


def read_logs(directory):
    """Every worker's events; a last line cut short (a worker killed while writing it) is
    left out."""
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line.strip()]
        for n, line in enumerate(lines):
            try:
                events.append(dict(json.loads(line), worker=os.path.basename(path)))
            except json.JSONDecodeError:
                if n != len(lines) - 1:
                    raise ValueError(f"{path}: line {n + 1} is not JSON: {line[:100]!r}")
    if not events:
        raise ValueError(f"no *.jsonl logs in {directory}")
    return events


def committed_steps(events):
    """The committed sequence: ``[(step, [per-rank records of that step])]``, in step order.
    Generation by generation, a generation's start (its ``world`` events: the step its state
    was synchronised to) undoes every later step of the generations before it."""
    steps = {}
    for g in sorted({e["generation"] for e in events}):
        mine = [e for e in events if e["generation"] == g]
        starts = {e["step"] for e in mine if e["event"] == "world"}
        if len(starts) > 1:
            raise ValueError(f"generation {g} started at different steps {sorted(starts)}")
        if starts:
            start = starts.pop()
            steps = {s: r for s, r in steps.items() if s < start}
        fresh = {}
        for e in mine:
            if e["event"] == "step":
                fresh.setdefault(e["step"], {})[e["rank"]] = e
        steps.update(fresh)
    out = []
    for s in sorted(steps):
        records = [steps[s][r] for r in sorted(steps[s])]
        size = records[0]["size"]
        if [r["rank"] for r in records] != list(range(size)):
            raise ValueError(f"step {s} (generation {records[0]['generation']}): records of "
                             f"ranks {[r['rank'] for r in records]}, want 0..{size - 1}")
        out.append((s, records))
    if [s for s, _ in out] != list(range(len(out))):
        raise ValueError(f"the committed steps are not 0..{len(out) - 1}: "
                         f"{[s for s, _ in out][:20]}...")
    return out


def replay(args, events):
    """The final parameters of the committed sequence, trained in this process: each step's
    gradient is the average of the ranks' gradients on their own batches (as
    DistributedOptimizer computes it)."""
    model, optimizer = build(args)
    for _, records in committed_steps(events):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in records:
            model.zero_grad()
            x, y = batch_tensors(args.seed, r["epoch"], r["indices"])
            loss_of(model, x, y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(records)
        optimizer.step()
    return flat_params(model)


def check_replay(args):
    events = read_logs(args.replay)
    problems = []
    for e in events:
        if e["event"] == "config":
            differ = [f"--{k.replace('_', '-')} {e[k]}" for k in REPLAYED
                      if e[k] != getattr(args, k)]
            if differ:
                print(f"replay: {e['worker']} ran with {', '.join(differ)}: replay with the "
                      "run's arguments", file=sys.stderr, flush=True)
                return 1
    seq = committed_steps(events)
    trained = {}
    for _, records in seq:
        for r in records:
            trained.setdefault(r["epoch"], set()).update(r["indices"])
    # Every epoch before the last is complete; the last is too unless the stop file ended it.
    finals = [e for e in events if e["event"] == "final"]
    stopped = any(e.get("stopped") for e in finals)
    complete = max((e["epoch"] for e in finals), default=0) if stopped else args.epochs
    for epoch in range(complete):
        missing = set(range(args.samples)) - trained.get(epoch, set())
        if missing:
            problems.append(f"epoch {epoch} never trained on samples {sorted(missing)[:10]}")
    want = replay(args, events)
    if not finals:
        problems.append("no worker logged its final parameters")
    for e in finals[1:]:
        if e["params"] != finals[0]["params"]:
            problems.append(f"{e['worker']} and {finals[0]['worker']} ended with different "
                            "parameters (the ranks of a world must be bit-identical)")
    for e in finals:
        diff = max(abs(a - b) for a, b in zip(e["params"], want))
        if len(e["params"]) != len(want) or diff > 1e-9:
            problems.append(f"{e['worker']} (rank {e['rank']}): final parameters differ from "
                            f"the replay by {diff:.3g}")
    worlds = sorted({(r[0]["generation"], r[0]["size"]) for _, r in seq})
    print(f"replay: {len(seq)} committed steps over worlds (generation, size) {worlds}; "
          f"{len(finals)} workers' final parameters compared", flush=True)
    for p in problems:
        print(f"replay: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
