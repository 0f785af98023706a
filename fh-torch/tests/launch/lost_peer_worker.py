"""Worker of test_elastic_lost_peer.py: an elastic training in which one worker dies while
the others are half-way through the same backward pass, with gradient reductions in flight.

The model is 2 * HALF linear layers (one bucket per parameter). At step KILL_STEP the victim
(the worker on VICTIM_HOST) stops as its backward pass starts (it submits nothing), until
every other worker has submitted the second half's gradients (a file each in SIGNAL_DIR),
then SIGKILLs itself; every other worker waits until the engine has failed those reductions
(the victim is lost), then lets the backward pass go on: the first half's submissions meet
the failed engine, with the second half's still held by the optimizer. The survivors must restore, re-form without the victim
and finish: each prints ``DONE worker=W size=S step=N backend=B params=HASH`` (B: the first world's transport)."""

import hashlib
import os
import signal
import sys
import time

import torch

import fasthorovod.torch as hvd
from fasthorovod import _core

HALF, WIDTH, STEPS, KILL_STEP = 4, 64, 6, 2
VICTIM_HOST = os.environ["LOST_PEER_VICTIM"]
SIGNAL_DIR = os.environ["LOST_PEER_DIR"]
worker = os.environ["FH_ELASTIC_WORKER"]
victim = worker.split(":")[0] == VICTIM_HOST

hvd.init()
first_backend = _core.backend()  # the transport of the world that loses the victim
torch.manual_seed(0)
layers = []
for _ in range(2 * HALF):
    layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
model = torch.nn.Sequential(*layers)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
first_world = True


def wait(what, done):
    deadline = time.monotonic() + 60
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"lost_peer_worker: {what} within 60 s")
        time.sleep(0.01)


def at_output(grad):
    if victim and state.step == KILL_STEP:
        wait("the others did not submit",
             lambda: len(os.listdir(SIGNAL_DIR)) >= hvd.size() - 1)
        os.kill(os.getpid(), signal.SIGKILL)
    return grad


def half_way(grad):
    if first_world and not victim and state.step == KILL_STEP:
        # The second half's reductions are in flight and wait for the victim: wait until
        # the engine fails them (bounded), so that the rest of this pass meets a failed
        # engine with reductions in flight.
        flights = list(opt._in_flight)
        if not flights:
            sys.exit("lost_peer_worker: no reduction in flight half-way through backward")
        with open(os.path.join(SIGNAL_DIR, worker.replace(":", "_")), "w"):
            pass
        wait("the engine did not fail the reductions",
             lambda: all(f.poll() for f in flights))
    return grad


def on_reset():
    global first_world
    first_world = False


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(state.step * 100
                                                                           + hvd.rank()))
        h = model[:2 * HALF](x)
        h.register_hook(half_way)
        out = model[2 * HALF:](h)
        out.register_hook(at_output)
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        state.commit()


train(state)
digest = hashlib.sha256(repr([p.detach().tolist() for p in model.parameters()])
                        .encode()).hexdigest()[:16]
print(f"DONE worker={worker} size={hvd.size()} step={state.step} backend={first_backend} "
      f"params={digest}", flush=True)
