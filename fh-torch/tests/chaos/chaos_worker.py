"""One rank of a chaos run: a small data-parallel training loop through ``fasthorovod.torch``
in which one rank (the victim) injects a fault into itself at a planned phase and moment.

The plan comes as JSON in ``CHAOS_PLAN`` (see ``chaos_harness.Plan``); the rank's place
comes from the usual ``FH_RANK``/``FH_SIZE``/... environment (set by the harness, or by fhrun).
Run as a script (``python chaos_worker.py``, what fhrun and the harness's ``exec`` mode do) or
through ``run_forked`` (the harness's ``fork`` mode: the child of a process that has already
imported torch, to save the import on a small machine).

Each step: forward/backward through a small MLP under ``DistributedOptimizer`` (a fused group
of gradients, ~200 KB, above the inline limit), two small named tensors submitted
asynchronously and synchronized later (the negotiation phase sits between the two), one
1 MiB tensor above ``FH_PARTITION_BYTES`` (split across channels), and one scalar metric
(a 4-byte inline group). With ``"api": "ddp"`` in the plan the same steps go through
``torch.distributed`` on the ``fasthorovod`` backend instead: DDP (small buckets, several in
flight during backward), async ``all_reduce`` works, and ``destroy_process_group`` at the end.

What a rank prints (stdout, one line each, flushed), for the harness:

- ``CHAOS-START rank=R pid=P t=T``
- ``CHAOS-FAULT rank=R kind=K phase=P where=W t=T`` (victim, just before the fault; the same
  is written to ``<dir>/fault``, fsync'ed, so that a SIGKILL cannot lose it)
- ``CHAOS-ERROR rank=R t=T type=X msg=...`` (a survivor that caught the error)
- ``CHAOS-DONE rank=R t=T`` (a rank that finished every step and shut down)

Exit status: 0 done, 3 an error was caught and printed, 4 an error was caught but the shutdown
after it failed too, 5 the start barrier timed out (not the runtime's fault), 1 an uncaught
exception (the victim's raise: the interpreter's own exit, atexit shutdown included).

Hang diagnostics: ``faulthandler`` dumps every thread's Python stack on SIGUSR1 (the harness
sends it to a rank it is about to kill as hung) and, as a backstop, on its own after
``CHAOS_SELF_DUMP_S`` seconds (set by the harness to well after the hang limit).
"""

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback


class ChaosFault(RuntimeError):
    """The exception a victim raises into its own training loop."""


def _now():
    return time.time()


def _say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Rank:
    def __init__(self, plan):
        self.plan = plan
        self.api = plan.get("api", "hvd")
        self.rank = int(os.environ["FH_RANK"])
        self.size = int(os.environ["FH_SIZE"])
        self.dir = plan["dir"]
        self.victim = self.rank == plan["victim"]
        self.kind = plan["kind"]
        self.phase = plan["phase"]
        self.where = plan["where"]
        self.delay = plan["delay_ms"] / 1000.0
        self.step = plan["step"]
        self.timer = None
        self.fired = threading.Event()

    # -- the fault ------------------------------------------------------------------------
    def _record(self):
        t = _now()
        line = (f"CHAOS-FAULT rank={self.rank} kind={self.kind} phase={self.phase} "
                f"where={self.where} t={t:.6f}")
        fd = os.open(os.path.join(self.dir, "fault"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     0o600)
        try:
            os.write(fd, json.dumps({"t": t, "rank": self.rank, "kind": self.kind,
                                     "phase": self.phase, "where": self.where}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        _say(line)

    def _fire(self):
        self.fired.set()
        self._record()
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            # Only reached if someone sends SIGCONT; the harness never does (it SIGKILLs).
        else:
            raise ChaosFault(f"chaos: rank {self.rank} raises at {self.phase}/{self.where}")

    def maybe_fault(self, phase, where, step=None):
        """The fault point ``phase``/``where`` (at ``step``, for the loop's phases): fire now,
        or arm a timer that fires ``delay_ms`` later (kill and stop only; a raise must come
        from the main thread)."""
        if not self.victim or self.fired.is_set() or self.timer is not None:
            return
        if phase != self.phase or where != self.where:
            return
        if step is not None and step != self.step:
            return
        if self.delay > 0 and self.kind != "raise":
            self.timer = threading.Timer(self.delay, self._fire)
            self.timer.daemon = True
            self.timer.start()
        else:
            self._fire()

    def wait_armed(self):
        """A fault armed on a timer fires before the rank moves on to the next phase."""
        if self.timer is not None:
            self.timer.join(30)

    # -- the start barrier ----------------------------------------------------------------
    def barrier(self):
        """Wait until every rank has imported torch (files in the run's directory), so that
        the import's skew on a loaded machine does not eat into the runtime's timeouts."""
        open(os.path.join(self.dir, f"ready-{self.rank}"), "w").close()
        deadline = _now() + float(os.environ.get("CHAOS_BARRIER_S", "120"))
        while True:
            names = set(os.listdir(self.dir))
            if all(f"ready-{r}" in names for r in range(self.size)):
                return
            if _now() > deadline:
                _say(f"CHAOS-BARRIER-TIMEOUT rank={self.rank}")
                sys.stdout.flush()
                os._exit(5)
            time.sleep(0.01)

    # -- the training loop ----------------------------------------------------------------
    def train(self, hvd, torch):
        F = torch.nn.functional
        plan = self.plan
        torch.manual_seed(1234)
        torch.set_num_threads(1)

        self.maybe_fault("startup", "before-init")
        self.maybe_fault("startup", "during-init")  # a timer: lands inside rendezvous/connect
        hvd.init()
        assert hvd.rank() == self.rank and hvd.size() == self.size
        self.maybe_fault("startup", "after-init")
        self.wait_armed()

        model = torch.nn.Sequential(
            torch.nn.Linear(64, 192), torch.nn.ReLU(),
            torch.nn.Linear(192, 192), torch.nn.ReLU(),
            torch.nn.Linear(192, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        # A fault in the middle of backward: the hook of the middle layer's weight gradient
        # (the output layer's gradients are already submitted, the input layer's not yet).
        state = {"step": -1}
        model[2].weight.register_hook(
            lambda g: (self.maybe_fault("fused", "mid-backward", state["step"]), g)[1])

        big_n = plan["big_elems"]
        g = torch.Generator().manual_seed(self.rank)
        for step in range(plan["steps"]):
            state["step"] = step
            x = torch.randn(16, 64, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            self.maybe_fault("fused", "before-step", step)
            opt.step()  # synchronizes the fused gradient groups

            # Negotiation: two small async submissions, the fault between them or before the
            # synchronize; the survivors' names stay pending on the victim.
            a = torch.full((8,), float(self.rank))
            b = torch.full((8,), float(step))
            ha = hvd.allreduce_async_(a, name="chaos.neg.a", op=hvd.Sum)
            self.maybe_fault("negotiation", "between-submissions", step)
            hb = hvd.allreduce_async_(b, name="chaos.neg.b", op=hvd.Sum)
            self.maybe_fault("negotiation", "before-synchronize", step)
            hvd.synchronize(ha)
            hvd.synchronize(hb)
            expect = float(sum(range(self.size)))
            if a[0].item() != expect or b[0].item() != step * self.size:
                raise AssertionError(f"step {step}: wrong sums {a[0].item()} {b[0].item()}")

            # Partitioned: a tensor above FH_PARTITION_BYTES, split across the channels.
            big = torch.full((big_n,), float(self.rank + 1))
            hbig = hvd.allreduce_async_(big, name="chaos.big", op=hvd.Sum)
            self.maybe_fault("partitioned", "in-flight", step)
            hvd.synchronize(hbig)
            want = float(self.size * (self.size + 1) // 2)
            if big[0].item() != want or big[-1].item() != want:
                raise AssertionError(f"step {step}: partitioned sum {big[0].item()} != {want}")

            # Inline: the metric, one 4-byte tensor (a round of one small group).
            hm = hvd.allreduce_async(loss.detach(), name="chaos.metric")
            self.maybe_fault("inline", "in-flight", step)
            hvd.synchronize(hm)
            self.wait_armed()

        self.maybe_fault("shutdown", "before-shutdown")
        self.maybe_fault("shutdown", "during-shutdown")  # a timer: lands inside shutdown
        hvd.shutdown()
        self.maybe_fault("shutdown", "after-shutdown")
        self.wait_armed()

    def train_ddp(self, hvd, torch):
        """The same phases through ``torch.distributed`` on the ``fasthorovod`` backend: DDP
        (its bucket allreduces in flight during backward), async ``all_reduce`` works, the
        partitioned tensor and the metric; the group destroyed at the end (which stops the
        engine the backend started)."""
        import torch.distributed as dist

        F = torch.nn.functional
        plan = self.plan
        torch.manual_seed(1234)
        torch.set_num_threads(1)

        self.maybe_fault("startup", "before-init")
        self.maybe_fault("startup", "during-init")  # a timer: lands inside rendezvous/connect
        if os.environ.get("MASTER_ADDR"):  # under fhrun: torch's env:// rendezvous
            dist.init_process_group("fasthorovod")
        else:  # from the environment: a store in the run's directory
            store = dist.FileStore(os.path.join(self.dir, "store"), self.size)
            dist.init_process_group("fasthorovod", store=store, rank=self.rank,
                                    world_size=self.size)
        assert dist.get_rank() == self.rank and dist.get_world_size() == self.size
        assert hvd.rank() == self.rank
        self.maybe_fault("startup", "after-init")
        self.wait_armed()

        model = torch.nn.Sequential(
            torch.nn.Linear(64, 192), torch.nn.ReLU(),
            torch.nn.Linear(192, 192), torch.nn.ReLU(),
            torch.nn.Linear(192, 10))
        # Small buckets: several of them in flight when the fault lands mid-backward.
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        state = {"step": -1}
        model[2].weight.register_hook(
            lambda g: (self.maybe_fault("fused", "mid-backward", state["step"]), g)[1])

        big_n = plan["big_elems"]
        g = torch.Generator().manual_seed(self.rank)
        for step in range(plan["steps"]):
            state["step"] = step
            x = torch.randn(16, 64, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # DDP's buckets reduced through the engine
            self.maybe_fault("fused", "before-step", step)
            opt.step()

            a = torch.full((8,), float(self.rank))
            b = torch.full((8,), float(step))
            wa = dist.all_reduce(a, async_op=True)
            self.maybe_fault("negotiation", "between-submissions", step)
            wb = dist.all_reduce(b, async_op=True)
            self.maybe_fault("negotiation", "before-synchronize", step)
            wa.wait()
            wb.wait()
            expect = float(sum(range(self.size)))
            if a[0].item() != expect or b[0].item() != step * self.size:
                raise AssertionError(f"step {step}: wrong sums {a[0].item()} {b[0].item()}")

            big = torch.full((big_n,), float(self.rank + 1))
            wbig = dist.all_reduce(big, async_op=True)
            self.maybe_fault("partitioned", "in-flight", step)
            wbig.wait()
            want = float(self.size * (self.size + 1) // 2)
            if big[0].item() != want or big[-1].item() != want:
                raise AssertionError(f"step {step}: partitioned sum {big[0].item()} != {want}")

            metric = loss.detach().clone()
            wm = dist.all_reduce(metric, op=dist.ReduceOp.AVG, async_op=True)
            self.maybe_fault("inline", "in-flight", step)
            wm.wait()
            self.wait_armed()

        self.maybe_fault("shutdown", "before-shutdown")
        self.maybe_fault("shutdown", "during-shutdown")  # a timer: lands inside shutdown
        dist.destroy_process_group()  # the backend started the engine: this stops it
        hvd.shutdown()
        self.maybe_fault("shutdown", "after-shutdown")
        self.wait_armed()


def main(forked=False):
    """The rank's program. Returns the exit status (the ``fork`` path) or exits."""
    plan = json.loads(os.environ["CHAOS_PLAN"])
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    self_dump = float(os.environ.get("CHAOS_SELF_DUMP_S", "0"))
    if self_dump > 0:
        faulthandler.dump_traceback_later(self_dump, exit=False)
    r = Rank(plan)
    with open(os.path.join(r.dir, f"pid-{r.rank}"), "w") as f:
        f.write(str(os.getpid()))
    _say(f"CHAOS-START rank={r.rank} pid={os.getpid()} t={_now():.6f}")

    import torch  # noqa: E402  (after the fault handler, for a hang inside the import)
    import fasthorovod.torch as hvd
    if r.api == "ddp":
        import fasthorovod.torch.distributed  # noqa: F401 - registers the backend
    r.barrier()
    try:
        if r.api == "ddp":
            r.train_ddp(hvd, torch)
        else:
            r.train(hvd, torch)
    except ChaosFault:
        raise  # the victim's raise: an uncaught exception, as in a real script
    except BaseException as e:  # noqa: BLE001 - a survivor reports whatever stopped it
        msg = " ".join(str(e).split())
        _say(f"CHAOS-ERROR rank={r.rank} t={_now():.6f} type={type(e).__name__} msg={msg}")
        try:
            if r.api == "ddp":
                _destroy_group()
            hvd.shutdown()
        except BaseException as e2:  # noqa: BLE001
            _say(f"CHAOS-SHUTDOWN-ERROR rank={r.rank} t={_now():.6f} "
                 f"type={type(e2).__name__} msg={' '.join(str(e2).split())}")
            return 4
        return 3
    _say(f"CHAOS-DONE rank={r.rank} t={_now():.6f}")
    return 0


def _destroy_group():
    """After a caught error in a DDP run: destroy torch's groups (what a script's clean-up
    does), which stops the engine the backend started."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_forked():
    """The body of a forked child: run the rank like an interpreter would, including the
    atexit shutdown after an uncaught exception, then leave without returning into the
    parent's code."""
    code = 1
    try:
        code = main(forked=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with it
        # The interpreter hands an uncaught exception to sys.excepthook, which
        # fasthorovod.torch wraps (it records why this rank exits and tells fhrun):
        # do the same.
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        sys.stderr.flush()
        code = 1
    finally:
        # The interpreter's exit: atexit would call hvd.shutdown() (bounded or not, that is
        # what a real script does too).
        try:
            mod = sys.modules.get("fasthorovod.torch")
            if mod is not None:
                mod.shutdown()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        # What finalization does next, as far as it concerns the runtime: the garbage
        # collector frees what is left (tensors and handles held for the engine). A fork
        # skips the real finalization (os._exit), so a wait hidden in it shows only in the
        # exec'ed runs and under fhrun.
        try:
            import gc
            sys.last_traceback = sys.last_value = None
            gc.collect()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
