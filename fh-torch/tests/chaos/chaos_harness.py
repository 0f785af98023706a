"""The chaos harness: plans runs from a seed, starts 4 ranks of ``chaos_worker.py`` (from the
environment, or under ``fhrun -np 4``), watches them with bounded waits, judges each run and
sums the runs up.

Invariant checked ("No rank ever waits forever"): after a rank is SIGKILLed, SIGSTOPped or
raises, every survivor ends -- a non-zero exit with a caught error that it prints -- naming
the faulty rank (``rank V``), within ``FH_TIMEOUT_SECONDS + 2 s`` of the fault (the victim
logs the fault time). Under fhrun, fhrun itself exits naming the failed rank within 2 s of a
kill or a raise. See README.md in this directory for the knobs.

Usable from pytest (``test_chaos.py``) or alone::

    python fh-torch/tests/chaos/chaos_harness.py --runs 60 --seed 7
    python fh-torch/tests/chaos/chaos_harness.py --seed 7 --only 17     # replay run 17
"""

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "chaos_worker.py"
NP = 4

KINDS = ("kill", "stop", "raise")
# phase -> fault points (``where``) in chaos_worker.Rank.train, with the range of the random
# delay (ms) after the point for the faults a timer can deliver (kill, stop). A raise comes
# from the main thread at the point itself, so timer-only points map to a synchronous one.
PHASES = {
    "startup": {"before-init": (0, 0), "during-init": (1, 400), "after-init": (0, 30)},
    "negotiation": {"between-submissions": (0, 2), "before-synchronize": (0, 2)},
    "inline": {"in-flight": (0, 3)},
    "fused": {"mid-backward": (0, 3), "before-step": (0, 5)},
    "partitioned": {"in-flight": (0, 12)},
    "shutdown": {"before-shutdown": (0, 0), "during-shutdown": (1, 60), "after-shutdown": (0, 0)},
}
RAISE_INSTEAD = {"during-init": "before-init", "during-shutdown": "before-shutdown"}
STEPS = 5               # training steps of a run; the fault's step is one of the first three
BIG_ELEMS = 1 << 18     # the partitioned tensor: 1 MiB of float32 ...
PARTITION_BYTES = 1 << 18   # ... above FH_PARTITION_BYTES (256 KiB): 4 parts over the channels
FHRUN_NOTICE_S = 1.0    # fhrun gives the others 1 s to report a lost peer ...
FHRUN_KILL_GRACE_S = 2.0  # ... then SIGTERM, SIGKILL after --kill-grace (default 2) ...
FHRUN_DRAIN_S = 2.0     # ... and waits up to 2 s for the ranks' output to drain


def _env_float(name, default):
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


def _env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


@dataclasses.dataclass
class Config:
    runs: int = 60
    seed: int = 0
    only: list = None           # replay these run indices of the seed
    timeout_s: float = 5.0      # FH_TIMEOUT_SECONDS given to the ranks
    slack_s: float = 2.0        # the promise: every survivor ends within timeout + 2 s
    margin_s: float = 3.0       # extra allowance for a loaded 2-core machine before "hang"
    jobs: int = 2               # runs at once
    fhrun_share: float = 0.15   # share of runs under fhrun -np 4 (real interpreters)
    ddp_share: float = 0.25     # share of kill and raise runs training DDP on the fasthorovod
    #                             backend of torch.distributed instead of DistributedOptimizer
    exec_share: float = 0.1     # share of direct runs started as fresh interpreters, not forks
    transports: tuple = ("shm", "tcp")
    kinds: tuple = KINDS
    phases: tuple = tuple(PHASES)
    keep: str = None            # directory that keeps the runs' files (failed runs always)
    report: str = None          # JSON summary path
    strict_time: bool = False   # count "late" (within the margin) as a failure
    spawn: str = None           # force "fork" or "exec" for the direct runs (replays)
    fhrun: str = None
    python: str = sys.executable

    @classmethod
    def from_env(cls, **over):
        c = cls()
        c.runs = _env_int("FH_CHAOS_RUNS", c.runs)
        seed = os.environ.get("FH_CHAOS_SEED")
        c.seed = int(seed) if seed else int.from_bytes(os.urandom(4), "little")
        only = os.environ.get("FH_CHAOS_ONLY")
        c.only = [int(x) for x in only.split(",") if x.strip()] if only else None
        c.timeout_s = _env_float("FH_CHAOS_TIMEOUT", c.timeout_s)
        c.margin_s = _env_float("FH_CHAOS_MARGIN", c.margin_s)
        c.jobs = _env_int("FH_CHAOS_JOBS", c.jobs)
        c.fhrun_share = _env_float("FH_CHAOS_FHRUN_SHARE", c.fhrun_share)
        c.exec_share = _env_float("FH_CHAOS_EXEC_SHARE", c.exec_share)
        c.ddp_share = _env_float("FH_CHAOS_DDP_SHARE", c.ddp_share)
        for field, var, allowed in (("transports", "FH_CHAOS_TRANSPORTS", ("shm", "tcp")),
                                    ("kinds", "FH_CHAOS_KINDS", KINDS),
                                    ("phases", "FH_CHAOS_PHASES", tuple(PHASES))):
            v = os.environ.get(var)
            if v:
                vals = tuple(x.strip() for x in v.split(",") if x.strip())
                bad = [x for x in vals if x not in allowed]
                if bad:
                    raise ValueError(f"{var}: unknown {bad}; allowed: {allowed}")
                setattr(c, field, vals)
        c.keep = os.environ.get("FH_CHAOS_KEEP") or None
        c.spawn = os.environ.get("FH_CHAOS_SPAWN") or None
        if c.spawn not in (None, "fork", "exec"):
            raise ValueError("FH_CHAOS_SPAWN: fork or exec")
        c.report = os.environ.get("FH_CHAOS_REPORT") or None
        c.strict_time = os.environ.get("FH_CHAOS_STRICT_TIME", "") == "1"
        c.fhrun = find_fhrun()
        for k, v in over.items():
            setattr(c, k, v)
        return c


def find_fhrun():
    for cand in (os.environ.get("FH_FHRUN"), ROOT / "target" / "debug" / "fhrun",
                 ROOT / "target" / "release" / "fhrun", shutil.which("fhrun")):
        if cand and pathlib.Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


# ---------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    index: int
    seed: int
    launcher: str      # "direct" (ranks from the environment) or "fhrun"
    spawn: str         # "fork" (from this process, torch already imported) or "exec"
    transport: str
    victim: int
    kind: str
    phase: str
    where: str
    step: int
    delay_ms: float
    api: str = "hvd"   # "hvd" (DistributedOptimizer) or "ddp" (DDP, torch.distributed backend)

    def describe(self):
        how = self.launcher if self.launcher == "fhrun" else f"direct/{self.spawn}"
        at = f" step={self.step}" if self.phase not in ("startup", "shutdown") else ""
        api = " DDP on the fasthorovod backend," if self.api == "ddp" else ""
        return (f"run {self.index} (seed {self.seed}): {how} {self.transport} np={NP}{api} "
                f"victim=rank {self.victim} {self.kind} at {self.phase}/{self.where}{at} "
                f"delay={self.delay_ms:.1f}ms")

    def replay(self):
        return f"FH_CHAOS_SEED={self.seed} FH_CHAOS_ONLY={self.index}"


def make_plan(cfg, index):
    """Run ``index`` of seed ``cfg.seed``: a function of the two alone (replayable)."""
    rng = random.Random(f"fh-chaos/{cfg.seed}/{index}")
    transport = rng.choice(cfg.transports)
    kind = rng.choice(cfg.kinds)
    phase = rng.choice(cfg.phases)
    where = rng.choice(sorted(PHASES[phase]))
    lo, hi = PHASES[phase][where]
    delay = rng.uniform(lo, hi)
    if kind == "raise":
        where = RAISE_INSTEAD.get(where, where)
        delay = 0.0
    u_launcher = rng.random()  # drawn even without fhrun, so that the later draws stay put
    launcher = "fhrun" if (cfg.fhrun and u_launcher < cfg.fhrun_share) else "direct"
    if launcher == "fhrun" and kind == "stop" and phase == "shutdown":
        # Survivors that finish their own shutdown exit 0, and fhrun rightly waits for the
        # stopped rank (nothing in the job can tell a stopped process from a slow one): no
        # bound to check there. Run it from the environment instead.
        launcher = "direct"
    spawn = "exec" if launcher == "fhrun" or rng.random() < cfg.exec_share else "fork"
    if launcher == "direct" and cfg.spawn:
        spawn = cfg.spawn
    victim = rng.randrange(NP)
    step = rng.randrange(3)
    # Drawn last, so that the other draws of a seed stay what they were before it existed.
    api = "ddp" if kind in ("kill", "raise") and rng.random() < cfg.ddp_share else "hvd"
    return Plan(index, cfg.seed, launcher, spawn, transport, victim, kind, phase, where, step,
                round(delay, 2), api)


# ---------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in a session (process group) of its own: a forked rank, or an exec'ed one.

    A thread of its own waits for it, so that its exit status and time are exact however long
    the harness's loop is busy elsewhere (another run's 1 s stack dump or its clean-up), and so
    that its pid is known to be ours for exactly as long as it is not reaped: after that the
    number may belong to anyone (pid_max is 32768 on the 2-core VM, and the ranks' threads
    use pids up fast)."""

    def __init__(self, pid, popen=None, out_path=None):
        self.pid = pid
        self.popen = popen
        self.out_path = out_path
        self.code = None      # exit status: >= 0 exit code, < 0 killed by that signal
        self.t_exit = None
        self.killed_by_harness = False
        self.reaped = threading.Event()
        threading.Thread(target=self._reap, name=f"reap-{pid}", daemon=True).start()

    def _reap(self):
        if self.popen is not None:
            c = self.popen.wait()
        else:
            while True:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    c = os.waitstatus_to_exitcode(status)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:  # not expected: only this thread reaps it
                    c = 0
                    break
        self.t_exit = time.time()
        self.code = c
        self.reaped.set()

    def poll(self):
        return self.code

    def signal(self, sig):
        """Signal the process itself, while it is ours (not reaped)."""
        if self.code is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def signal_group(self, sig):
        """Signal its process group: through the leader's id while the leader is not reaped,
        else each remaining member (a member's pid differs from the group id; a new process
        that reuses the id as its own group's leader does not)."""
        if self.code is None:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            return
        for pid in group_members(self.pid):
            if pid != self.pid:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def kill_and_reap(self):
        if self.code is None:
            self.killed_by_harness = True
            self.signal_group(signal.SIGKILL)
            self.reaped.wait(10)
        # Whatever it left in its group goes too.
        self.signal_group(signal.SIGKILL)

    def output(self):
        try:
            return pathlib.Path(self.out_path).read_text(errors="replace")
        except OSError:
            return ""


def group_members(pgid):
    """The live processes whose process group is ``pgid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            out.append(int(name))
    return out


def fork_rank(env, out_path):
    """Fork a rank from this process (torch and fasthorovod already imported here), in a
    session of its own, its stdout and stderr to ``out_path``."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.setsid()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.environ.clear()
            os.environ.update(env)
            sys.path.insert(0, str(HERE))
            import chaos_worker
            chaos_worker.run_forked()
        finally:
            os._exit(70)
    os.close(fd)
    return Proc(pid, out_path=out_path)


def exec_cmd(cmd, env, out_path):
    with open(out_path, "wb") as out:
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(p.pid, popen=p, out_path=out_path)


def pid_alive(pid):
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def pid_of_run(pid, run_dir):
    """Whether ``pid`` is a live process started for this run (its environment at exec names
    the run's directory): a pid read from a file may have been reused by anything since."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return os.fsencode(str(run_dir)) in f.read()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------

RANK_RE = re.compile(r"\brank (\d+)\b")
RANK_LIST_RE = re.compile(r"\branks?(?:\(s\))? \[([\d, ]+)\]")


def named_ranks(text):
    """The ranks a message names: ``rank 2``, or a list as in ``rank(s) [1, 2]``."""
    found = set(RANK_RE.findall(text))
    for m in RANK_LIST_RE.finditer(text):
        found |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return found


def names_rank(text, victim):
    return str(victim) in named_ranks(text)


def parse_lines(text, tag):
    """``CHAOS-<tag> k=v ... msg=...`` lines (``msg`` takes the rest of the line)."""
    out = []
    for line in text.splitlines():
        i = line.find(f"CHAOS-{tag} ")
        if i < 0:
            continue
        rest = line[i + len(tag) + 7:]
        d = {}
        if " msg=" in rest or rest.startswith("msg="):
            rest, _, d["msg"] = rest.partition("msg=")
        for kv in rest.split():
            k, _, v = kv.partition("=")
            d[k] = v
        out.append(d)
    return out


class Run:
    def __init__(self, cfg, plan, base):
        self.cfg = cfg
        self.plan = plan
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"run{plan.index:04d}-", dir=base))
        self.procs = {}      # rank -> Proc (direct)
        self.fhrun = None    # Proc (fhrun)
        self.t_start = None
        self.t_fault = None
        self.fault = None
        self.done = False
        self.result = None
        self.hung = {}       # rank (or "fhrun") -> output at the hang
        self.t_hang_check = None

    # bounds ---------------------------------------------------------------------------
    def survivor_bound(self):
        return self.cfg.timeout_s + self.cfg.slack_s

    def fhrun_bound(self):
        if self.plan.kind == "stop":
            # The survivors time out (timeout + 2), fhrun gives the others its 1 s notice,
            # then SIGTERM and, for the stopped rank, SIGKILL after the kill grace.
            # Then it drains the ranks' output (bounded).
            return (self.cfg.timeout_s + self.cfg.slack_s + FHRUN_NOTICE_S + FHRUN_KILL_GRACE_S
                    + FHRUN_DRAIN_S)
        return self.cfg.slack_s  # kill, raise: fhrun exits within 2 s of the fault

    def start_limit(self):
        # Before the fault: imports (exec'ed interpreters on a loaded machine), the barrier,
        # init and the steps. Generous; only a run that never reaches its fault trips it.
        return 150.0 if self.plan.spawn == "exec" else 60.0

    # start ----------------------------------------------------------------------------
    def env_common(self):
        c = self.cfg
        p = self.plan
        worker_plan = {"dir": str(self.dir), "victim": p.victim, "kind": p.kind,
                       "phase": p.phase, "where": p.where, "step": p.step,
                       "delay_ms": p.delay_ms, "steps": STEPS, "big_elems": BIG_ELEMS,
                       "api": p.api}
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FH_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST")}
        env.update(
            OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            CHAOS_PLAN=json.dumps(worker_plan),
            CHAOS_SELF_DUMP_S=str(self.start_limit() + c.timeout_s + 30),
            FH_PARTITION_BYTES=str(PARTITION_BYTES),
        )
        return env

    def start(self):
        p = self.plan
        self.t_start = time.time()
        env = self.env_common()
        if p.launcher == "fhrun":
            env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE),
                                                            os.environ.get("PYTHONPATH")) if x)
            cmd = [self.cfg.fhrun, "-np", str(NP), "--verbose", "--transport", p.transport,
                   "--timeout-seconds", f"{self.cfg.timeout_s:g}",
                   "--timeout", "300",  # fhrun's own backstop; the harness acts far earlier
                   self.cfg.python, str(WORKER)]
            self.fhrun = exec_cmd(cmd, env, str(self.dir / "fhrun.out"))
            return
        port = free_port()
        token = secrets.token_hex(16)
        for r in range(NP):
            e = dict(env, FH_RANK=str(r), FH_SIZE=str(NP), FH_LOCAL_RANK=str(r),
                     FH_LOCAL_SIZE=str(NP), FH_CROSS_RANK="0", FH_CROSS_SIZE="1",
                     FH_RENDEZVOUS_ADDR=f"127.0.0.1:{port}", FH_JOB_TOKEN=token,
                     FH_TRANSPORT=p.transport, FH_TIMEOUT_SECONDS=f"{self.cfg.timeout_s:g}")
            out = str(self.dir / f"rank{r}.out")
            if p.spawn == "fork":
                self.procs[r] = fork_rank(e, out)
            else:
                self.procs[r] = exec_cmd([self.cfg.python, str(WORKER)], e, out)

    # watch ----------------------------------------------------------------------------
    def read_fault(self):
        if self.t_fault is None:
            try:
                self.fault = json.loads((self.dir / "fault").read_text())
                self.t_fault = self.fault["t"]
            except (OSError, ValueError, KeyError):
                pass
        return self.t_fault

    def rank_pids(self):
        pids = {}
        for r in range(NP):
            try:
                pids[r] = int((self.dir / f"pid-{r}").read_text())
            except (OSError, ValueError):
                pass
        return pids

    def survivors(self):
        return [r for r in range(NP) if r != self.plan.victim]

    def poll(self, now):
        """Advance the run; True when it is over (judged and cleaned up)."""
        if self.done:
            return True
        self.read_fault()
        limit = (self.t_fault + self.limit_after_fault() if self.t_fault is not None
                 else self.t_start + self.start_limit() + self.limit_after_fault())
        if self.fhrun is not None:
            self.track_fhrun_ranks(now)
            if self.fhrun.poll() is None and now < limit:
                return False
            if self.fhrun.poll() is None:
                self.dump_and_kill_fhrun()
        else:
            p = self.plan
            waiting = [r for r, pr in self.procs.items()
                       if pr.poll() is None and not (r == p.victim and p.kind == "stop")]
            if waiting and now < limit:
                return False
            for r in waiting:
                self.hung[r] = None
            if waiting:
                self.dump_and_kill([self.procs[r] for r in waiting])
                for r in waiting:
                    self.hung[r] = self.procs[r].output()
        self.finish()
        return True

    def track_fhrun_ranks(self, now):
        """Under fhrun the ranks are fhrun's children: note when each one is seen gone."""
        if not hasattr(self, "rank_exit"):
            self.rank_exit, self.rank_pid = {}, {}
        if len(self.rank_pid) < NP:
            self.rank_pid.update(self.rank_pids())
        for r, pid in self.rank_pid.items():
            if r not in self.rank_exit and not pid_of_run(pid, self.dir):
                self.rank_exit[r] = now

    def limit_after_fault(self):
        b = self.fhrun_bound() if self.fhrun is not None else self.survivor_bound()
        return b + self.cfg.margin_s

    def dump_and_kill(self, procs):
        """Hung ranks: their Python stacks (faulthandler on SIGUSR1), then SIGKILL."""
        for pr in procs:
            pr.signal(signal.SIGUSR1)
        time.sleep(1.0)
        for pr in procs:
            pr.kill_and_reap()

    def dump_and_kill_fhrun(self):
        # The ranks are fhrun's children, known by their pid files: only those that are still
        # this run's processes are signalled.
        pids = {r: pid for r, pid in self.rank_pids().items() if pid_of_run(pid, self.dir)}
        for r, pid in pids.items():
            if pid_of_run(pid, self.dir):
                self.hung[r] = None
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        self.hung["fhrun"] = None
        time.sleep(1.0)
        self.fhrun.kill_and_reap()
        for pid in pids.values():
            if pid_of_run(pid, self.dir):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    # judge ----------------------------------------------------------------------------
    def finish(self):
        p = self.plan
        # The stopped victim (and any straggler) is killed; every group is cleaned up.
        for pr in self.procs.values():
            pr.kill_and_reap()
        if self.fhrun is not None:
            self.fhrun.kill_and_reap()
        leftovers = self.leftovers()
        self.done = True
        self.result = self.judge(leftovers)
        keep_all = self.cfg.keep is not None
        if self.result["ok"] and not keep_all:
            shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self):
        """Processes of this run still alive after the clean-up (each is then killed): our own
        children not reaped, and ranks (fhrun's children, by their pid files) whose environment
        still names this run; a pid is never trusted on its number alone."""
        deadline = time.time() + 3  # fhrun reaps its ranks as it exits; give it a moment
        mine = list(self.procs.values()) + ([self.fhrun] if self.fhrun is not None else [])
        while True:
            left = sorted({pr.pid for pr in mine if pr.poll() is None}
                          | {pid for pid in self.rank_pids().values()
                             if pid_of_run(pid, self.dir)})
            if not left or time.time() > deadline:
                break
            time.sleep(0.05)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pr in mine:
            pr.kill_and_reap()
        return left

    def judge(self, leftovers):
        p = self.plan
        c = self.cfg
        res = {"index": p.index, "plan": dataclasses.asdict(p), "describe": p.describe(),
               "replay": p.replay(), "dir": str(self.dir), "faults": [], "ok": True,
               "fault_t": self.t_fault, "survivors": {}, "fhrun": None}

        def fail(kind, detail):
            res["ok"] = False
            res["faults"].append({"kind": kind, "detail": detail})

        if self.fhrun is not None:
            return self.judge_fhrun(res, fail, leftovers)

        outs = {r: pr.output() for r, pr in self.procs.items()}
        if any("CHAOS-BARRIER-TIMEOUT" in o for o in outs.values()):
            fail("setup", "a rank timed out in the start barrier (the harness's, not the "
                          "runtime's): the machine is too loaded")
        if self.t_fault is None:
            fail("no-fault", "the victim never reached its fault point: "
                 + self.explain_no_fault(outs))
        bound = self.survivor_bound()
        times_err, times_exit = [], []
        for r in self.survivors():
            pr = self.procs[r]
            o = outs[r]
            errs = parse_lines(o, "ERROR")
            done = parse_lines(o, "DONE")
            s = {"code": pr.code, "t_exit": pr.t_exit, "error": errs[0] if errs else None,
                 "done": bool(done), "verdict": None}
            res["survivors"][r] = s
            if r in self.hung:
                s["verdict"] = "hang"
                said = "its error" if errs else ("that it was done" if done else None)
                if said:
                    # It reported (maybe even naming the rank) but its process did not end:
                    # stuck in shutdown or in the interpreter's exit.
                    s["verdict"] = "hang-at-exit"
                    if errs and not names_rank(errs[0].get("msg", ""), p.victim):
                        fail("misnamed", f"rank {r} does not name rank {p.victim}: "
                                         f"{errs[0].get('msg', '')[:600]}")
                fail(s["verdict"], f"rank {r} still running "
                     f"{self.limit_after_fault():.1f} s after "
                     + (f"printing {said}, " if said else "")
                     + f"the fault (timeout {c.timeout_s:g} + {c.slack_s:g} s + margin "
                     f"{c.margin_s:g} s); killed. Its output (stacks from SIGUSR1):\n"
                     + tail(self.hung[r]))
                continue
            if self.t_fault is None:
                continue
            dt_exit = pr.t_exit - self.t_fault
            s["dt_exit"] = round(dt_exit, 3)
            if errs:
                s["dt_error"] = round(float(errs[0]["t"]) - self.t_fault, 3)
            text = errs[0].get("msg", "") if errs else ""
            if pr.code == 0 and done:
                if p.phase == "shutdown":
                    s["verdict"] = "clean"  # its own shutdown completed: nothing to report
                    continue
                s["verdict"] = "no-error"
                fail("no-error", f"rank {r} finished without an error although rank "
                                 f"{p.victim} failed\n" + tail(o))
                continue
            if not errs:
                # Ended without printing a caught error (a crash, a signal, a Rust abort):
                # judge what it printed at all.
                text = o
                s["verdict"] = "crash"
            times_exit.append(dt_exit)
            times_err.append(s.get("dt_error", dt_exit))
            if not names_rank(text, p.victim):
                named = sorted(named_ranks(text) - {str(r)})
                s["verdict"] = "misnamed"
                fail("misnamed", f"rank {r} (exit {pr.code}) does not name rank {p.victim}"
                     f" (names: {named or 'none'}): {text.strip()[-600:]}")
            elif s["verdict"] is None:
                s["verdict"] = "named"
            if s["verdict"] == "crash":
                fail("crash", f"rank {r} ended with {pr.code} without a caught error:\n"
                     + tail(o))
            if dt_exit > bound:
                s["late"] = True
                res.setdefault("late", []).append(r)
                if c.strict_time:
                    fail("late", f"rank {r} ended {dt_exit:.2f} s after the fault (> {bound:g} s)")
        # The victim: a raise must let its own interpreter end in time too.
        v = self.procs[p.victim]
        res["victim"] = {"code": v.code, "killed_by_harness": v.killed_by_harness}
        if p.kind == "raise" and self.t_fault is not None:
            if v.killed_by_harness:
                fail("victim-hang", f"the victim (rank {p.victim}) raised but did not exit "
                     f"within {self.limit_after_fault():.1f} s:\n" + tail(outs[p.victim]))
            elif v.t_exit is not None:
                res["victim"]["dt_exit"] = round(v.t_exit - self.t_fault, 3)
        if p.kind == "kill" and v.code not in (-signal.SIGKILL, None):
            if self.t_fault is not None:
                fail("harness", f"the victim ended with {v.code}, not SIGKILL")
        if leftovers:
            fail("leftover", f"processes left after the clean-up: {leftovers}")
        if times_err:
            res["dt_last_error"] = round(max(times_err), 3)
            res["dt_last_exit"] = round(max(times_exit), 3)
        return res

    def judge_fhrun(self, res, fail, leftovers):
        p = self.plan
        c = self.cfg
        pr = self.fhrun
        o = pr.output()
        res["fhrun"] = {"code": pr.code}
        if "CHAOS-BARRIER-TIMEOUT" in o:
            fail("setup", "a rank timed out in the start barrier: the machine is too loaded")
        if self.t_fault is None:
            fail("no-fault", "the victim never reached its fault point:\n" + tail(o))
        if "fhrun" in self.hung:
            said = {int(m) for m in re.findall(r"\[(\d+)\]<stdout>:CHAOS-(?:ERROR|DONE) ", o)}
            alive = sorted(r for r in self.hung if r != "fhrun")
            brief = "\n".join(line for line in o.splitlines()
                              if not line.startswith("fhrun: rank ") or " env " not in line)
            fail("hang", f"ranks {alive} still alive (of which {sorted(set(alive) & said)} "
                         f"had printed their error or done line); "
                         f"fhrun still running {self.limit_after_fault():.1f} s after the "
                         f"fault (bound {self.fhrun_bound():g} s + margin {c.margin_s:g} s); "
                         "killed (a rank 'killed by signal 10' was the harness's SIGUSR1 for its "
                         "stacks, fatal while the interpreter exits). Output:\n"
                         + tail(brief, 6000))
        blamed = re.findall(r"fhrun: rank (\d+) \(pid \d+\) ([^;\n]*)", o)
        res["fhrun"]["blamed"] = blamed[:1]
        if self.t_fault is not None:
            res["fhrun"]["rank_gone_after_fault_s"] = {
                r: round(t - self.t_fault, 3)
                for r, t in sorted(getattr(self, "rank_exit", {}).items())}
        if self.t_fault is not None and "fhrun" not in self.hung:
            dt = pr.t_exit - self.t_fault
            res["fhrun"]["dt_exit"] = round(dt, 3)
            res["dt_last_exit"] = round(dt, 3)
            if p.kind in ("kill", "raise") and not (p.phase == "shutdown" and pr.code == 0):
                if not blamed or blamed[0][0] != str(p.victim):
                    fail("fhrun-misnamed", f"fhrun (exit {pr.code}) blames "
                         f"{'rank ' + blamed[0][0] if blamed else 'no rank'}, not rank "
                         f"{p.victim}:\n" + tail(o))
            # Survivors that printed an error before fhrun stopped them must name the victim.
            errs_by_rank = {}
            for line in o.splitlines():
                m = re.match(r"\[(\d+)\]<std\w+>:(.*)", line)
                if m and "CHAOS-ERROR " in m.group(2):
                    errs_by_rank.setdefault(int(m.group(1)), parse_lines(m.group(2), "ERROR")[0])
            res["fhrun"]["survivor_errors"] = {r: e.get("msg", "")[:300]
                                               for r, e in errs_by_rank.items()}
            dts = [float(e["t"]) - self.t_fault for r, e in errs_by_rank.items()
                   if r != p.victim and "t" in e]
            if dts:
                res["dt_last_error"] = round(max(dts), 3)
            for r, e in errs_by_rank.items():
                if r != p.victim and not names_rank(e.get("msg", ""), p.victim):
                    fail("misnamed", f"rank {r} (under fhrun) does not name rank {p.victim}: "
                                     f"{e.get('msg', '')[:600]}")
            # A survivor's report may also reach fhrun through the notice pipe first; fhrun then
            # names the victim with that report ("rank V ... was lost (rank R reports: ...)")
            # and stops the survivors, maybe before they print their own error.
            reported_to_fhrun = bool(blamed) and blamed[0][0] == str(p.victim) and bool(
                re.search(r"\(rank \d+ reports: ", blamed[0][1]))
            if p.kind == "stop" and not any(r != p.victim for r in errs_by_rank):
                if pr.code != 0 and not reported_to_fhrun:
                    fail("misnamed", f"no survivor reported the stopped rank {p.victim}; fhrun "
                                     f"exit {pr.code}:\n" + tail(o))
            if dt > self.fhrun_bound():
                res["late"] = ["fhrun"]
                if c.strict_time:
                    fail("late", f"fhrun ended {dt:.2f} s after the fault "
                                 f"(> {self.fhrun_bound():g} s)")
        if leftovers:
            fail("leftover", f"processes left after fhrun ended: {leftovers}")
        return res

    def explain_no_fault(self, outs):
        return "; ".join(f"rank {r}: exit {self.procs[r].code}, "
                         f"{(parse_lines(o, 'ERROR') or [{'msg': tail(o, 300)}])[0].get('msg')}"
                         for r, o in outs.items())


_PARENT_FRAMES = ("/_pytest/", "/pluggy/", "<frozen runpy>", "/pytest/__main__.py",
                  "chaos_harness.py", "test_chaos.py", "in run_forked")


def strip_parent_frames(text):
    """A forked rank's stacks go on into the frames of the process it was forked from (this
    harness, pytest): leave those out."""
    return "\n".join(line for line in (text or "").splitlines()
                     if not (line.lstrip().startswith("File ") and
                             any(f in line for f in _PARENT_FRAMES)))


def tail(text, n=3000):
    text = strip_parent_frames(text)
    return text if len(text) <= n else "...\n" + text[-n:]


# ---------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------

def prepare_fork_parent():
    """Fork mode: import torch and fasthorovod once here, so that each rank is a fork (the
    import costs seconds of CPU per rank on this 2-core machine). Nothing may have started
    threads or the runtime in this process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401
    import fasthorovod.torch as hvd
    import fasthorovod.torch.distributed  # noqa: F401 - the DDP runs' backend
    if hvd.is_initialized():
        raise RuntimeError("fork mode needs a process in which hvd.init() was never called")
    torch.set_num_threads(1)


def shm_names():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def run_suite(cfg, log=print):
    indices = cfg.only if cfg.only else list(range(cfg.runs))
    plans = [make_plan(cfg, i) for i in indices]
    if any(p.launcher == "fhrun" for p in plans) and not cfg.fhrun:
        raise RuntimeError("fhrun is not built (FH_FHRUN, target/debug/fhrun)")
    if any(p.spawn == "fork" for p in plans):
        prepare_fork_parent()
    base = cfg.keep or tempfile.mkdtemp(prefix="fh-chaos-")
    os.makedirs(base, exist_ok=True)
    log(f"fh-chaos: seed {cfg.seed}, {len(plans)} runs, np {NP}, FH_TIMEOUT_SECONDS "
        f"{cfg.timeout_s:g}, bound timeout+{cfg.slack_s:g} s, hang after +{cfg.margin_s:g} s "
        f"margin, {cfg.jobs} at once, files under {base}")
    shm_before = shm_names()
    t0 = time.time()
    pending = list(plans)
    active = []
    results = []
    while pending or active:
        while pending and len(active) < cfg.jobs:
            p = pending.pop(0)
            log("  start " + p.describe())
            r = Run(cfg, p, base)
            try:
                r.start()
            except BaseException:
                for pr in r.procs.values():
                    pr.kill_and_reap()
                if r.fhrun:
                    r.fhrun.kill_and_reap()
                raise
            active.append(r)
        now = time.time()
        for r in list(active):
            if r.poll(now):
                active.remove(r)
                results.append(r.result)
                log("  " + verdict_line(r.result))
        time.sleep(0.01)
    wall = time.time() - t0
    results.sort(key=lambda x: x["index"])
    time.sleep(0.5)
    shm_left = sorted(shm_names() - shm_before)
    summary = summarize(cfg, results, wall, shm_left)
    if cfg.report:
        pathlib.Path(cfg.report).write_text(json.dumps(summary, indent=1, default=str))
    if not cfg.keep and all(r["ok"] for r in results):
        shutil.rmtree(base, ignore_errors=True)
    return summary


def verdict_line(res):
    what = "ok  " if res["ok"] else "FAIL"
    dt = res.get("dt_last_error")
    dts = f" last survivor error {dt:.2f}s" if dt is not None else ""
    dte = res.get("dt_last_exit")
    dts += f", exit {dte:.2f}s after the fault" if dte is not None else ""
    late = " (late)" if res.get("late") else ""
    kinds = ",".join(sorted({f["kind"] for f in res["faults"]}))
    return f"{what} run {res['index']}{dts}{late}{' ' + kinds if kinds else ''}"


def summarize(cfg, results, wall, shm_left):
    by_kind = {}
    for r in results:
        for f in r["faults"]:
            by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    groups = {}
    for r in results:
        p = r["plan"]
        key = f"{p['launcher']}/{p['transport']}/{p['kind']}"
        if p.get("api") == "ddp":
            key += "/ddp"
        g = groups.setdefault(key, {"runs": 0, "failed": 0, "err": [], "exit": []})
        g["runs"] += 1
        g["failed"] += 0 if r["ok"] else 1
        if r.get("dt_last_error") is not None:
            g["err"].append(r["dt_last_error"])
        if r.get("dt_last_exit") is not None:
            g["exit"].append(r["dt_last_exit"])
    table = {}
    for key, g in sorted(groups.items()):
        table[key] = {"runs": g["runs"], "failed": g["failed"],
                      "last_error_median_s": _med(g["err"]), "last_error_worst_s": _max(g["err"]),
                      "last_exit_median_s": _med(g["exit"]), "last_exit_worst_s": _max(g["exit"])}
    by_phase = {}
    for r in results:
        p = r["plan"]
        g = by_phase.setdefault(p["phase"], {"runs": 0, "failed": 0})
        g["runs"] += 1
        g["failed"] += 0 if r["ok"] else 1
    failed = [r for r in results if not r["ok"]]
    return {
        "seed": cfg.seed, "runs": len(results), "wall_s": round(wall, 1),
        "timeout_s": cfg.timeout_s, "bound_s": cfg.timeout_s + cfg.slack_s,
        "margin_s": cfg.margin_s,
        "hangs": sum(by_kind.get(k, 0) for k in ("hang", "hang-at-exit", "victim-hang")),
        "hang_runs": sum(1 for r in results if any(
            f["kind"] in ("hang", "hang-at-exit", "victim-hang") for f in r["faults"])),
        "misnamed_runs": sum(1 for r in results if any(
            f["kind"] in ("misnamed", "fhrun-misnamed") for f in r["faults"])),
        "failed_runs": len(failed),
        "failures_by_kind": by_kind,
        "late_runs": sum(1 for r in results if r.get("late")),
        "by_launcher_transport_kind": table,
        "by_phase": by_phase,
        "shm_names_left": shm_left,
        "failed": [{"index": r["index"], "describe": r["describe"], "replay": r["replay"],
                    "dir": r["dir"], "faults": r["faults"]} for r in failed],
        "results": results,
    }


def _med(xs):
    return round(statistics.median(xs), 3) if xs else None


def _max(xs):
    return round(max(xs), 3) if xs else None


def format_summary(s, details=True):
    lines = [f"fh-chaos summary: seed {s['seed']}: {s['runs']} runs in {s['wall_s']} s; "
             f"runs with a hang {s['hang_runs']} ({s['hangs']} processes); runs with a "
             f"misnamed rank {s['misnamed_runs']}; failed runs {s['failed_runs']}; late "
             f"(tolerated) {s['late_runs']}; bound {s['bound_s']:g} s + margin "
             f"{s['margin_s']:g} s",
             f"  failures by kind: {s['failures_by_kind'] or 'none'}",
             "  time from the fault to the last survivor's error / exit (s), "
             "launcher/transport/kind:"]
    for key, g in s["by_launcher_transport_kind"].items():
        lines.append(f"    {key:<26} runs {g['runs']:>3} failed {g['failed']:>3}  error "
                     f"median {_fmt(g['last_error_median_s'])} worst "
                     f"{_fmt(g['last_error_worst_s'])}  exit median "
                     f"{_fmt(g['last_exit_median_s'])} worst {_fmt(g['last_exit_worst_s'])}")
    lines.append("  by phase: " + ", ".join(f"{k} {v['failed']}/{v['runs']} failed"
                                            for k, v in sorted(s["by_phase"].items())))
    if s["shm_names_left"]:
        lines.append(f"  /dev/shm names that appeared during the suite and are still there "
                     f"(other jobs on this machine may own them): {s['shm_names_left']}")
    if details:
        for f in s["failed"]:
            lines.append(f"  FAILED {f['describe']}\n    replay: {f['replay']}; files: {f['dir']}")
            for x in f["faults"]:
                d = x["detail"].replace("\n", "\n      ")
                lines.append(f"    [{x['kind']}] {d}")
    return "\n".join(lines)


def _fmt(x):
    return "   -  " if x is None else f"{x:6.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--only", help="comma-separated run indices to replay")
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--brief", action="store_true", help="no failure details in the summary")
    a = ap.parse_args(argv)
    over = {k: v for k, v in (("runs", a.runs), ("seed", a.seed), ("jobs", a.jobs)) if v}
    if a.only:
        over["only"] = [int(x) for x in a.only.split(",")]
    cfg = Config.from_env(**over)
    s = run_suite(cfg, log=lambda m: print(m, flush=True))
    print(format_summary(s, details=not a.brief), flush=True)
    return 0 if s["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
