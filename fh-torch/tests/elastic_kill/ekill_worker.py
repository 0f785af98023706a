"""A worker of the random-kill elastic stage: ``fh-torch/examples/elastic_train.py`` (its own
``main``, model, log and replay), with a SIGKILL of this process planned at one moment.

The plan is ``EKILL_PLAN`` (JSON, the same for every worker of a run): ``{"kills": [...]}``
(and optionally ``"slow_start": {"HOST:SLOT": seconds}``, a worker whose start is delayed),
each kill ``{"worker": "HOST:SLOT", "phase": ..., "nth": N, "point": ..., "delay_ms": D,
"param": J}``. The kill whose ``worker`` is ``FH_ELASTIC_WORKER`` is this process's (a
process started again for the same worker has none). Counting in this process:

- ``backward``: in the backward pass of its N-th training step: a gradient hook of parameter
  J kills it (``delay_ms`` > 0: a timer started there).
- ``step``: a timer started as its N-th training step starts (forward, backward, the
  reduction or the optimizer's step).
- ``commit``: its N-th commit, at ``point``: ``entry``, ``prepare`` (after the sampler's
  merge, before anything is kept), ``check`` (saved, before the check for host changes) or
  ``timer`` (``delay_ms`` after the entry).
- ``reform``: its N-th re-forming of the world (``hvd.elastic.run`` after a lost worker or a
  host change), at ``point``: ``entry`` (before the shutdown), ``shutdown`` (after it),
  ``timer`` (``delay_ms`` after the entry: the shutdown, the next world's rendezvous),
  ``start`` (the new world's first collectives, in ``init``), ``agree`` (deciding to
  synchronise) or ``sync`` (``delay_ms`` into the state's synchronisation).
- ``join``: a worker started after the first world: ``delay_ms`` after its first ``init``
  begins (its registration, the rendezvous, the synchronisation that follows).

Before the kill it writes ``$EKILL_DIR/kills/<worker>.json`` (the time, the phase and the
generation it was in), so the harness knows when it died. SIGUSR1 dumps
every thread's stack (the harness sends it to a hung run before killing it)."""

import faulthandler
import json
import os
import signal
import sys
import threading
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)

# A plan may delay a worker's start ("slow_start": {"HOST:SLOT": seconds}): a newcomer that
# arrives late, after a kill during the re-forming that waits for it.
_delay = json.loads(os.environ.get("EKILL_PLAN") or "{}").get("slow_start", {}).get(
    os.environ.get("FH_ELASTIC_WORKER", ""))
if _delay:
    time.sleep(float(_delay))

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import elastic_train  # noqa: E402

import fasthorovod.torch as hvd  # noqa: E402
from fasthorovod.common import _elastic_core  # noqa: E402
from fasthorovod.common import elastic as common_elastic  # noqa: E402
from fasthorovod.torch import elastic as torch_elastic  # noqa: E402
from fasthorovod.torch import mpi_ops  # noqa: E402
from fasthorovod.torch.elastic import state as torch_state  # noqa: E402

WORKER = os.environ["FH_ELASTIC_WORKER"]
KILL_DIR = os.path.join(os.environ["EKILL_DIR"], "kills")


def _mine():
    plan = json.loads(os.environ.get("EKILL_PLAN") or "{}")
    kills = [k for k in plan.get("kills", []) if k["worker"] == WORKER]
    if not kills:
        return None
    path = os.path.join(KILL_DIR, WORKER.replace(":", "_") + ".json")
    if os.path.exists(path):
        return None  # this worker's kill happened: a process started again has none
    return kills[0]


KILL = _mine()


def _generation():
    try:
        return _elastic_core.assignment()[0] if hvd.is_initialized() else None
    except Exception:  # noqa: BLE001 - between worlds
        return None


# Set once this worker logged its final parameters: a kill planned by a timer that fires
# after the training (fast steps) is not a kill during the training: it is dropped.
_finished = threading.Event()


def die(where):
    """Record the kill, then SIGKILL this process."""
    if _finished.is_set():
        print(f"EKILL worker={WORKER} where={where}: dropped, the training is over",
              flush=True)
        return
    path = os.path.join(KILL_DIR, WORKER.replace(":", "_") + ".json")
    record = dict(worker=WORKER, time=time.time(), where=where, generation=_generation(),
                  **{k: KILL[k] for k in ("phase", "nth")})
    # No fsync: the harness reads it once this process is dead (the page cache has it), and
    # on a loaded disk an fsync takes long enough for the training to end first.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, json.dumps(record).encode())
    os.close(fd)
    print(f"EKILL worker={WORKER} where={where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_later(where, delay_ms):
    t = threading.Timer(delay_ms / 1000.0, die, args=(f"{where}+{delay_ms}ms",))
    t.daemon = True
    t.start()


def _count(kind):
    """The number of this ``kind`` of moment, counted from 1 in this process."""
    _counts[kind] = _counts.get(kind, 0) + 1
    return _counts[kind]


_counts = {}


def _due(phase):
    return KILL is not None and KILL["phase"] == phase and _count(phase) == KILL["nth"]


def install():
    """Patch the moments of this worker's kill (nothing without one)."""
    if KILL is None:
        return
    event = elastic_train.Log.event

    def logged(self, kind, **fields):
        if kind == "final":
            _finished.set()
        return event(self, kind, **fields)

    elastic_train.Log.event = logged
    phase, point, delay = KILL["phase"], KILL.get("point"), KILL.get("delay_ms", 0)

    if phase in ("backward", "step"):
        train_step = elastic_train.train_step

        def counted_step(model, optimizer, x, y):
            if _due(phase):
                if phase == "step":
                    die_later("step", delay)
                else:
                    params = list(model.parameters())
                    p = params[KILL.get("param", 0) % len(params)]

                    def hook(grad):
                        if delay:
                            die_later("backward", delay)
                        else:
                            die("backward")
                        return grad

                    handle = p.register_hook(hook)
                    try:
                        return train_step(model, optimizer, x, y)
                    finally:
                        handle.remove()
            return train_step(model, optimizer, x, y)

        elastic_train.train_step = counted_step

    elif phase == "commit":
        commit = common_elastic.State.commit
        prepare = torch_state.SamplerStateHandler.prepare_save
        check = common_elastic.State.check_host_updates
        armed = {}

        def counted_commit(self):
            if _due("commit"):
                if point == "entry":
                    die("commit entry")
                elif point == "timer":
                    die_later("commit", delay)
                else:
                    armed[point] = True
            return commit(self)

        def prepare_then(self):
            out = prepare(self)
            if armed.pop("prepare", False):
                die("commit prepared")
            return out

        def check_then(self):
            if armed.pop("check", False):
                die("commit saved")
            return check(self)

        common_elastic.State.commit = counted_commit
        torch_state.SamplerStateHandler.prepare_save = prepare_then
        common_elastic.State.check_host_updates = check_then

    elif phase == "reform":
        reset = torch_elastic._reset
        # The runtime object's methods: elastic's reset calls them through it.
        basics = mpi_ops._basics
        shutdown = basics.shutdown
        start_world = basics._start_world
        agree = torch_elastic._agree_sync
        sync = torch_state.TorchState.sync
        armed = {}

        def counted_reset():
            if _due("reform"):
                if point == "entry":
                    die("reform entry")
                elif point == "timer":
                    die_later("reform", delay)
                else:
                    armed[point] = True
            return reset()

        def shutdown_then():
            try:
                shutdown()  # raises the failed engine's error
            finally:
                if armed.pop("shutdown", False):
                    die("reform shut down")

        def start_then(process_sets):
            if armed.pop("start", False):
                die("reform start")
            return start_world(process_sets)

        def agree_then(needed):
            if armed.pop("agree", False):
                die("reform agree")
            return agree(needed)

        def sync_then(self):
            if armed.pop("sync", False):
                die_later("reform sync", delay)
            return sync(self)

        torch_elastic._reset = counted_reset
        basics.shutdown = shutdown_then
        basics._start_world = start_then
        torch_elastic._agree_sync = agree_then
        torch_state.TorchState.sync = sync_then

    elif phase == "join":
        init = hvd.init

        def init_then(*args, **kwargs):
            if _due("join"):
                die_later("join", delay)
            return init(*args, **kwargs)

        hvd.init = init_then


if __name__ == "__main__":
    install()
    sys.exit(elastic_train.main(sys.argv[1:]))
