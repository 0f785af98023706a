"""The random-kill elastic harness: plans runs from a seed, starts each as an elastic job of
``fhrun --host-discovery-script`` on loopback "hosts" (``localhost``, ``127.0.0.1``,
``127.0.0.2``, ``127.0.0.3``: one machine, distinct hosts to fhrun), whose workers run
``fh-torch/examples/elastic_train.py`` (a perceptron of many small layers: many buckets)
through ``ekill_worker.py``, which SIGKILLs a worker at the planned moment; then judges the
run and sums the runs up. See README.md in this directory.

Invariant checked: every run either finishes -- ``fhrun`` exits 0, and every worker of the
last world logged final parameters equal to the one-process replay of the committed worlds
(``elastic_train.check_replay``), with no world formed after them (a finished job never runs
again) -- or, where the plan leaves fewer than ``--min-np`` workers, fails with fhrun naming
that cause. Nothing may outlive its bound (a hang's stacks are dumped, then everything is
killed) or be left running.

Usable from pytest (``test_elastic_kill.py``) or alone::

    python fh-torch/tests/elastic_kill/ekill_harness.py --runs 50 --seed 7
    python fh-torch/tests/elastic_kill/ekill_harness.py --seed 7 --only 17   # replay run 17
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "ekill_worker.py"
EXAMPLES = ROOT / "fh-torch" / "examples"
sys.path.insert(0, str(EXAMPLES))

import elastic_train  # noqa: E402  (its log reader and replay: one source of truth)

from ekill_plan import HOSTS, SCENARIOS, TRAIN, Config, Plan, plan_run  # noqa: E402


# -------------------------------------------------------------------------------------------
# running one


@dataclasses.dataclass
class Result:
    plan: Plan
    outcome: str = ""           # finished | failed-as-planned | a failure kind
    detail: str = ""
    wall_s: float = 0.0
    recoveries: list = dataclasses.field(default_factory=list)  # kill -> training again (s)
    missed: list = dataclasses.field(default_factory=list)      # planned kills not done
    generations: int = 0
    rc: int = None

    @property
    def ok(self):
        return self.outcome in ("finished", "failed-as-planned")


def _fhrun():
    for cand in (os.environ.get("FH_FHRUN"), ROOT / "target" / "debug" / "fhrun",
                 ROOT / "target" / "release" / "fhrun", shutil.which("fhrun")):
        if cand and pathlib.Path(cand).is_file():
            return str(cand)
    raise FileNotFoundError("fhrun is not built: run `cargo build -p fh-launch`")


def _processes_of(run_dir, workers_only=False):
    """Pids of the processes whose environment names this run's directory (fhrun, its parts
    and its workers; ``workers_only``: the Python workers)."""
    marker = f"EKILL_DIR={run_dir}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            if workers_only:
                # The interpreter running the worker script (fhrun's own command line names
                # the script too).
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if argv[0] != sys.executable.encode() or str(WORKER).encode() not in argv:
                    continue
            pids.append(int(pid))
        except OSError:
            continue
    return pids


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _progress(log_dir):
    """Every progress line: (kind, time, generation, rank, size, host)."""
    out = []
    if not os.path.isdir(log_dir):
        return out
    for name in os.listdir(log_dir):
        if name.endswith(".progress"):
            with open(os.path.join(log_dir, name), encoding="utf-8") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 6:
                        try:
                            out.append((parts[0], float(parts[1]), int(parts[2]),
                                        int(parts[3]), int(parts[4]), parts[5]))
                        except ValueError:
                            pass  # a line cut short by a kill
    return out


def _train_args(plan):
    # A joining worker needs seconds to start (torch's import): slow the steps down so that
    # the training is still going when it arrives.
    return TRAIN + (["--step-delay", "0.15"] if plan.add_host_after is not None else [])


def _command(plan, fhrun, run_dir, script):
    cmd = [fhrun, "-np", str(plan.np), "--min-np", str(plan.min_np), "--max-np",
           str(plan.max_np), "--host-discovery-script", str(script),
           "--elastic-timeout", str(5 if plan.expect_failure else 30),
           "--timeout", "110"]
    if os.environ.get("FH_EKILL_VERBOSE"):
        # The driver's every step (sessions, registrations, parts started), for a failure
        # that does not replay.
        cmd += ["--verbose"]
    if plan.cooldown:
        cmd += ["--blacklist-cooldown-range", str(plan.cooldown[0]), str(plan.cooldown[1])]
    if plan.transport == "tcp":
        # The loopback "hosts" are one machine: by default the workers use shared memory.
        cmd += ["--transport", "tcp"]
    for var in ("EKILL_PLAN", "EKILL_DIR", "ELASTIC_LOG", "OMP_NUM_THREADS",
                "FH_TIMEOUT_SECONDS", "PYTHONDONTWRITEBYTECODE"):
        cmd += ["-x", var]
    return cmd + [sys.executable, "-W", "ignore", str(WORKER), *_train_args(plan)]


def execute(plan, cfg, fhrun, base):
    run_dir = pathlib.Path(base) / f"run{plan.index:03d}"
    (run_dir / "kills").mkdir(parents=True)
    log_dir = run_dir / "log"
    hosts = run_dir / "hosts"
    hosts.write_text("".join(f"{h}:1\n" for h in HOSTS[:plan.np]))
    script = run_dir / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat '{hosts}'\n")
    script.chmod(0o755)
    env = dict(os.environ, EKILL_PLAN=json.dumps({"kills": plan.kills,
                                                  "slow_start": plan.slow_start or {}}),
               EKILL_DIR=str(run_dir), ELASTIC_LOG=str(log_dir), OMP_NUM_THREADS="1",
               FH_TIMEOUT_SECONDS=str(cfg.timeout_s), PYTHONDONTWRITEBYTECODE="1",
               # fhrun's job directory (a lost generation's flight records stay in it) goes
               # with the run's directory.
               TMPDIR=str(run_dir))
    result = Result(plan)
    started = time.monotonic()
    out_path = run_dir / "fhrun.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(_command(plan, fhrun, run_dir, script), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=run_dir)
    added = plan.add_host_after is None
    hung = False
    try:
        while proc.poll() is None:
            if time.monotonic() - started > cfg.bound_s:
                hung = True
                break
            if not added:
                commits = sum(1 for p in _progress(log_dir)
                              if p[0] == "commit" and p[2] == 0 and p[3] == 0)
                if commits >= plan.add_host_after:
                    with open(hosts, "a") as f:
                        f.write(f"{HOSTS[plan.np]}:1\n")
                    added = True
            time.sleep(0.05)
    finally:
        if hung or proc.poll() is None:
            # The workers' stacks first (faulthandler on SIGUSR1; fhrun, which would die of
            # it, still relays them), then everything of the run is killed.
            dumped = _processes_of(run_dir, workers_only=True)
            _signal_all(dumped, signal.SIGUSR1)
            with open(out_path, "a") as out:
                out.write(f"ekill harness: run still going after {cfg.bound_s:.0f} s; its "
                          f"workers' stacks (SIGUSR1 to pids {dumped}) follow\n")
            time.sleep(2.0)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _signal_all(_processes_of(run_dir), signal.SIGKILL)
        proc.wait()
    result.wall_s = time.monotonic() - started
    result.rc = proc.returncode
    # Nothing of the run may outlive fhrun (bounded: its workers get its kill grace).
    deadline = time.monotonic() + 5
    while _processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = _processes_of(run_dir)
    _signal_all(leftover, signal.SIGKILL)
    output = out_path.read_text(errors="replace")
    judge(result, cfg, run_dir, output, hung, leftover)
    return result


def _cause(output):
    """What fhrun (or a worker) said about the end of a failed job."""
    lines = output.splitlines()
    for line in reversed(lines):
        if "elastic job failed" in line or "job timed out" in line:
            return line.strip()
    errors = [line for line in lines if re.search(r"(Error|Exception)\b.*:", line)
              and "Traceback" not in line]
    fhrun = [line for line in lines if line.startswith("fhrun:")]
    return " | ".join(x.strip() for x in (errors[-1:] + fhrun[-1:])) or "no cause named"


def _kills_done(run_dir):
    out = []
    for path in sorted((run_dir / "kills").glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return out


def _recoveries(kills, progress):
    """Per kill: seconds from it to the next training step of a later world."""
    out = []
    for k in kills:
        t = k["time"]
        before = [p[2] for p in progress if p[1] <= t]
        gen = max(before) if before else -1
        if k.get("generation") is not None:
            gen = max(gen, k["generation"])
        later = [p[1] for p in progress if p[0] == "step" and p[1] > t and p[2] > gen]
        if later:
            out.append(min(later) - t)
    return out


# Held while a replay's prints are captured (a process-wide redirection) and while the suite
# prints, so that the runs of two threads never mix their output.
_output_lock = threading.Lock()


def judge(result, cfg, run_dir, output, hung, leftover):
    plan = result.plan
    # A kill counts once its record is written and fhrun saw the worker die of it.
    kills = [k for k in _kills_done(run_dir)
             if re.search(rf"worker {re.escape(k['worker'])} \(pid \d+\) was killed by signal 9",
                          output)]
    done = {k["worker"] for k in kills}
    result.missed = [k["worker"] for k in plan.kills if k["worker"] not in done]
    log_dir = run_dir / "log"
    progress = _progress(log_dir)
    result.generations = len({p[2] for p in progress})
    # The runtime's own log lines (every survivor's view of the loss) make the tail long.
    kept = [line for line in output.splitlines()
            if not re.search(r"<stderr>:\d{4}-\d\d-\d\dT\S+ +(ERROR|WARN|INFO) fh_", line)]
    tail = "\n".join(kept[-40:])
    if hung:
        result.outcome = "hang"
        result.detail = f"still running after {cfg.bound_s:.0f} s; fhrun's output:\n" + tail
        return
    if leftover:
        result.outcome = "leftover"
        result.detail = f"pids {leftover} outlived fhrun by 5 s"
        return
    if plan.expect_failure:
        if result.rc == 0:
            result.outcome = "no-failure"
            result.detail = "fhrun exited 0 with fewer than --min-np workers left:\n" + tail
        elif re.search(r"elastic job failed: .*fewer than --min-np", output):
            result.outcome = "failed-as-planned"
            result.detail = _cause(output)
        else:
            result.outcome = "unnamed-failure"
            result.detail = f"fhrun exited {result.rc} without naming --min-np:\n" + tail
        return
    if result.rc != 0:
        result.outcome = "job-failed"
        result.detail = f"fhrun exited {result.rc}: {_cause(output)}\n" + tail
        return
    try:
        events = elastic_train.read_logs(str(log_dir))
    except ValueError as e:
        result.outcome = "no-log"
        result.detail = str(e)
        return
    finals = [e for e in events if e["event"] == "final"]
    last = max(e["generation"] for e in events)
    members = {e["worker"] for e in events if e["event"] == "world" and e["generation"] == last}
    problems = []
    if not finals:
        problems.append("no worker logged final parameters")
    elif {e["generation"] for e in finals} != {last}:
        problems.append(f"final parameters logged in generations "
                        f"{sorted({e['generation'] for e in finals})}, the last world is "
                        f"{last}: a world trained after the job had finished")
    if {e["worker"] for e in finals} != members:
        problems.append(f"workers of the last world {sorted(members)} but final parameters "
                        f"from {sorted(e['worker'] for e in finals)}")
    if problems:
        result.outcome = "finals"
        result.detail = "; ".join(problems) + "\n" + tail
        return
    args = elastic_train.parse(TRAIN + ["--replay", str(log_dir)])
    said = io.StringIO()
    # check_replay prints; sys.stdout is the process's: no other thread prints meanwhile.
    with _output_lock, contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            rc = elastic_train.check_replay(args)
        except ValueError as e:  # an inconsistent committed sequence
            print(f"replay: {e}")
            rc = 1
    if rc != 0:
        result.outcome = "replay"
        result.detail = said.getvalue().strip()
        return
    result.outcome = "finished"
    result.recoveries = _recoveries(kills, progress)


# -------------------------------------------------------------------------------------------
# the suite


def run_suite(cfg, log=print):
    printer = log

    def log(message):
        with _output_lock:
            printer(message)

    fhrun = _fhrun()
    indices = cfg.only if cfg.only else list(range(cfg.runs))
    plans = [plan_run(cfg, i) for i in indices]
    log(f"fh-ekill: seed {cfg.seed}, {len(plans)} runs, {cfg.jobs} at once, "
        f"FH_TIMEOUT_SECONDS {cfg.timeout_s}, bound {cfg.bound_s:.0f} s "
        f"(replay: FH_EKILL_SEED={cfg.seed} FH_EKILL_ONLY=i)")
    base = cfg.keep or tempfile.mkdtemp(prefix="fh-ekill-")
    os.makedirs(base, exist_ok=True)
    results = []
    lock = threading.Lock()
    queue = list(plans)
    started = time.monotonic()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                plan = queue.pop(0)
            r = execute(plan, cfg, fhrun, base)
            with lock:
                results.append(r)
                n = len(results)
            mark = "ok" if r.ok else "FAILED"
            rec = f", back to training in {max(r.recoveries):.1f} s" if r.recoveries else ""
            log(f"[{n}/{len(plans)}] {mark} {r.outcome} in {r.wall_s:.1f} s, "
                f"trained in {r.generations} worlds{rec}: {plan.describe()}"
                + (f"; missed kills {r.missed}" if r.missed else ""))
            if not r.ok:
                log(f"    {plan.replay_line()}\n    " + r.detail.replace("\n", "\n    "))

    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    threads = [threading.Thread(target=worker) for _ in range(min(cfg.jobs, len(plans)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (used.ru_utime - cpu.ru_utime) + (used.ru_stime - cpu.ru_stime)
    results.sort(key=lambda r: r.plan.index)
    failed = [r for r in results if not r.ok]
    slow = [r for r in results if r.ok and r.wall_s > cfg.slow_s]
    kept = failed + slow
    if not cfg.keep:
        if kept:
            for r in results:
                if r not in kept:
                    shutil.rmtree(pathlib.Path(base) / f"run{r.plan.index:03d}",
                                  ignore_errors=True)
        else:
            shutil.rmtree(base, ignore_errors=True)
    recoveries = [x for r in results for x in r.recoveries]
    by = {}
    for r in results:
        by.setdefault(r.outcome, 0)
        by[r.outcome] += 1
    summary = {
        "seed": cfg.seed, "runs": len(results), "wall_s": round(wall, 1),
        "cpu_s": round(cpu_s, 1),
        "finished": by.get("finished", 0), "failed_as_planned": by.get("failed-as-planned", 0),
        "failed_runs": len(failed), "outcomes": by,
        "kills": sum(len(r.plan.kills) - len(r.missed) for r in results),
        "missed_kills": sum(len(r.missed) for r in results),
        "recovery_s": {"count": len(recoveries),
                       "median": round(statistics.median(recoveries), 2) if recoveries
                       else None,
                       "worst": round(max(recoveries), 2) if recoveries else None},
        "by_scenario": {s: sum(1 for r in results if r.plan.scenario == s)
                        for s in SCENARIOS},
        "failures": [{"run": r.plan.index, "outcome": r.outcome, "plan": r.plan.describe(),
                      "replay": r.plan.replay_line(), "detail": r.detail[:4000]}
                     for r in failed],
        "slow": [{"run": r.plan.index, "wall_s": round(r.wall_s, 1), "plan": r.plan.describe()}
                 for r in slow],
        "kept": base if (cfg.keep or kept) else None,
    }
    if cfg.report:
        with open(cfg.report, "w") as f:
            json.dump(dict(summary, results=[
                {"run": r.plan.index, "plan": r.plan.describe(), "outcome": r.outcome,
                 "wall_s": round(r.wall_s, 2), "recoveries_s": [round(x, 3)
                                                                for x in r.recoveries],
                 "missed": r.missed} for r in results]), f, indent=1)
    return summary


def format_summary(s, details=True):
    rec = s["recovery_s"]
    lines = [f"fh-ekill summary: seed {s['seed']}: {s['runs']} runs in {s['wall_s']} s "
             f"({s['cpu_s']} s of CPU); "
             f"{s['finished']} finished (replay equal), {s['failed_as_planned']} failed as "
             f"planned (fewer than --min-np, cause named), {s['failed_runs']} failed; "
             f"{s['kills']} kills ({s['missed_kills']} planned kills not reached); "
             f"kill to training again: median {rec['median']} s, worst {rec['worst']} s "
             f"over {rec['count']} kills",
             f"outcomes: {s['outcomes']}; scenarios: {s['by_scenario']}"]
    for r in s["slow"]:
        lines.append(f"slow (over FH_EKILL_SLOW, files kept): {r['wall_s']} s: {r['plan']}")
    if s["kept"]:
        lines.append(f"files kept in {s['kept']}")
    if details:
        for f in s["failures"]:
            lines.append(f"- {f['outcome']}: {f['plan']}\n  {f['replay']}\n  "
                         + f["detail"].replace("\n", "\n  "))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--only", help="comma-separated run indices to replay")
    ap.add_argument("--jobs", type=int)
    a = ap.parse_args(argv)
    cfg = Config.from_env()
    if a.runs:
        cfg.runs = a.runs
    if a.seed is not None:
        cfg.seed = a.seed
    if a.only:
        cfg.only = [int(i) for i in a.only.split(",")]
    if a.jobs:
        cfg.jobs = a.jobs
    summary = run_suite(cfg)
    print(format_summary(summary), flush=True)
    return 1 if summary["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
