"""The random-kill elastic harness's plans: its configuration (from flags or ``FH_EKILL_*``)
and each run's plan -- scenario, transport, world sizes, kills -- a function of the seed and
the run's index alone, so that any run can be replayed. See README.md in this directory.
"""

import dataclasses
import os
import random

HOSTS = ["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"]
# The training of every run: 26 parameters (26 buckets) in float64.
TRAIN = ["--epochs", "2", "--samples", "48", "--batch-size", "2", "--commit-every", "2",
         "--hidden-layers", "12", "--width", "8", "--seed", "11"]
# Where a kill may land (see ekill_worker.py): the scenarios and their shares.
SCENARIOS = {"backward": 0.3, "step": 0.15, "commit": 0.2, "reform": 0.2, "join": 0.1,
             "below-min": 0.05}
COMMIT_POINTS = ("entry", "prepare", "check", "timer")
REFORM_POINTS = ("entry", "shutdown", "timer", "start", "agree", "sync")


def _env_float(name, default):
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


def _env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


@dataclasses.dataclass
class Config:
    runs: int = 50
    seed: int = 0
    only: list = None            # replay these run indices of the seed
    jobs: int = 2                # runs at once
    timeout_s: int = 10          # FH_TIMEOUT_SECONDS given to the workers
    elastic_timeout_s: int = 30  # fhrun --elastic-timeout (below-min runs: 5)
    bound_s: float = 120.0       # a run still going after this is a hang
    slow_s: float = 60.0         # a run longer than this keeps its files (and is listed)
    scenarios: tuple = tuple(SCENARIOS)
    transports: tuple = ("tcp", "shm")
    cooldown_share: float = 0.3  # runs whose lost hosts come back (--blacklist-cooldown-range)
    keep: str = None             # keep every run's files here
    report: str = None           # write the summary as JSON here

    @classmethod
    def from_env(cls):
        c = cls()
        c.runs = _env_int("FH_EKILL_RUNS", c.runs)
        seed = os.environ.get("FH_EKILL_SEED")
        c.seed = int(seed) if seed else int.from_bytes(os.urandom(4), "little")
        only = os.environ.get("FH_EKILL_ONLY")
        c.only = [int(i) for i in only.split(",") if i.strip()] if only else None
        c.jobs = max(1, _env_int("FH_EKILL_JOBS", c.jobs))
        c.timeout_s = _env_int("FH_EKILL_TIMEOUT", c.timeout_s)
        c.bound_s = _env_float("FH_EKILL_BOUND", c.bound_s)
        c.slow_s = _env_float("FH_EKILL_SLOW", c.slow_s)
        if os.environ.get("FH_EKILL_SCENARIOS"):
            c.scenarios = tuple(s.strip() for s in os.environ["FH_EKILL_SCENARIOS"].split(",")
                                if s.strip())
            unknown = set(c.scenarios) - set(SCENARIOS)
            if unknown:
                raise ValueError(f"FH_EKILL_SCENARIOS: unknown {sorted(unknown)}; known: "
                                 f"{', '.join(SCENARIOS)}")
        if os.environ.get("FH_EKILL_TRANSPORTS"):
            c.transports = tuple(t.strip() for t in
                                 os.environ["FH_EKILL_TRANSPORTS"].split(",") if t.strip())
        c.cooldown_share = _env_float("FH_EKILL_COOLDOWN_SHARE", c.cooldown_share)
        c.keep = os.environ.get("FH_EKILL_KEEP") or None
        c.report = os.environ.get("FH_EKILL_REPORT") or None
        return c


@dataclasses.dataclass
class Plan:
    index: int
    seed: int
    scenario: str
    transport: str
    np: int
    min_np: int
    max_np: int
    kills: list                 # for EKILL_PLAN
    add_host_after: int = None  # commits of the first world before 127.0.0.3 is added
    cooldown: tuple = None      # --blacklist-cooldown-range, or None (blacklisted for good)
    slow_start: dict = None     # worker -> seconds its start is delayed

    @property
    def expect_failure(self):
        return self.scenario == "below-min"

    def describe(self):
        kills = "; ".join(
            f"{k['worker']} {k['phase']}#{k['nth']}"
            + (f" {k['point']}" if k.get("point") else "")
            + (f" param {k['param']}" if "param" in k else "")
            + (f" +{k['delay_ms']}ms" if k.get("delay_ms") else "") for k in self.kills)
        extra = ""
        if self.add_host_after is not None:
            extra += f", {HOSTS[self.np]} added after {self.add_host_after} commits"
        if self.cooldown:
            extra += f", cooldown {self.cooldown[0]}-{self.cooldown[1]} s"
        for worker, delay in (self.slow_start or {}).items():
            extra += f", {worker} starts {delay} s late"
        return (f"run {self.index} (seed {self.seed}): {self.scenario} over {self.transport}, "
                f"-np {self.np} --min-np {self.min_np} --max-np {self.max_np}{extra}: "
                f"kill {kills}")

    def replay_line(self):
        return f"FH_EKILL_SEED={self.seed} FH_EKILL_ONLY={self.index}"


def _first_kill(rng, worker, phase=None):
    phase = phase or rng.choice(["backward", "step", "commit"])
    kill = {"worker": worker, "phase": phase}
    if phase == "backward":
        kill.update(nth=rng.randint(1, 10), param=rng.randrange(26),
                    delay_ms=rng.choice([0, 0, rng.randint(1, 20)]))
    elif phase == "step":
        kill.update(nth=rng.randint(1, 10), delay_ms=rng.randint(0, 40))
    else:
        kill.update(nth=rng.randint(1, 6), point=rng.choice(COMMIT_POINTS),
                    delay_ms=rng.randint(0, 15))
    return kill


def _reform_kill(rng, worker):
    return {"worker": worker, "phase": "reform", "nth": 1,
            "point": rng.choice(REFORM_POINTS), "delay_ms": rng.randint(0, 300)}


def plan_run(cfg, index):
    """Run ``index`` of seed ``cfg.seed``: a function of the two alone (replayable)."""
    rng = random.Random(f"fh-ekill/{cfg.seed}/{index}")
    names = [s for s in SCENARIOS if s in cfg.scenarios]
    scenario = rng.choices(names, weights=[SCENARIOS[s] for s in names])[0]
    transport = rng.choice(list(cfg.transports))
    cooldown = (1, 2) if rng.random() < cfg.cooldown_share else None
    add_host_after = None
    slow_start = None
    if scenario == "below-min":
        np_, min_np, max_np = 2, 2, 2
        kills = [_first_kill(rng, f"{rng.choice(HOSTS[:2])}:0")]
        cooldown = None
    elif scenario == "reform":
        np_, min_np, max_np = 3, 1, 3
        first, second = rng.sample(HOSTS[:3], 2)
        kills = [_first_kill(rng, f"{first}:0"), _reform_kill(rng, f"{second}:0")]
    elif scenario == "join":
        np_ = rng.choice([2, 3])
        min_np, max_np = 1, np_ + 1
        add_host_after = rng.randint(1, 3)
        joiner = HOSTS[np_]
        # Sometimes the newcomer starts late (a slow host): the re-forming waits for it.
        slow = rng.choice([0, 0, round(rng.uniform(1, 4), 1)])
        slow_start = {f"{joiner}:0": slow} if slow else None
        if rng.random() < 0.5:
            kills = [{"worker": f"{joiner}:0", "phase": "join", "nth": 1,
                      "delay_ms": rng.randint(0, 2500)}]
        else:
            kills = [_reform_kill(rng, f"{rng.choice(HOSTS[:np_])}:0")]
    else:
        np_ = rng.choice([2, 3])
        min_np, max_np = 1, np_
        kills = [_first_kill(rng, f"{rng.choice(HOSTS[:np_])}:0", scenario)]
    return Plan(index, cfg.seed, scenario, transport, np_, min_np, max_np, kills,
                add_host_after, cooldown, slow_start)
