"""`fasthorovod.torch.elastic` under the real elastic driver (`fhrun
--host-discovery-script`), on one machine: the "hosts" are loopback names of this machine
(`localhost`, `127.0.0.1`, `127.0.0.2`, `127.0.0.3`), which fhrun starts directly and treats
as distinct hosts (its blacklist, its generations). The emulated-cluster check of `cargo xtask
multihost` runs the same example across network namespaces."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import EXAMPLES, PYTHON

LIMIT = 120
ARGS = ["--epochs", "100000", "--samples", "48", "--step-delay", "0.05"]


def progress(log):
    """Every progress line of every worker: (kind, time, generation, rank, size, host)."""
    out = []
    for name in os.listdir(log) if os.path.isdir(log) else []:
        if name.endswith(".progress"):
            with open(os.path.join(log, name), encoding="utf-8") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 6:
                        out.append((parts[0], float(parts[1]), int(parts[2]), int(parts[3]),
                                    int(parts[4]), parts[5]))
    return out


def wait_for(proc, what, done):
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        if done():
            return
        if proc.poll() is not None:
            pytest.fail(f"fhrun ended ({proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {LIMIT} s")


def worker_pid(worker):
    """The pid of the Python worker `worker` (FH_ELASTIC_WORKER) of this test's job."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"elastic_train.py" in cmd and f"FH_ELASTIC_WORKER={worker}".encode() in env:
            return int(pid)
    return None


def test_rank_0_lost_and_a_host_added_then_the_replay_agrees(fhrun, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n127.0.0.1\n127.0.0.2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat '{hosts}'\n")
    script.chmod(0o755)
    log, stop = str(tmp_path / "log"), str(tmp_path / "stop")
    env = dict(os.environ, ELASTIC_LOG=log, OMP_NUM_THREADS="1", FH_TIMEOUT_SECONDS="10")
    out_path = tmp_path / "fhrun.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [fhrun, "-np", "3", "--min-np", "2", "--max-np", "3", "--slots", "1",
             "--host-discovery-script", str(script), "--elastic-timeout", "60",
             "--timeout", "300", "-x", "ELASTIC_LOG", "-x", "OMP_NUM_THREADS",
             "-x", "FH_TIMEOUT_SECONDS", PYTHON, str(EXAMPLES / "elastic_train.py"), *ARGS,
             "--stop-file", stop],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        def commits(gen, n):
            return sum(1 for p in progress(log) if p[0] == "commit" and p[2] == gen
                       and p[3] == 0) >= n

        wait_for(proc, "two commits of 3 ranks", lambda: commits(0, 2))
        first = progress(log)
        assert {p[5] for p in first if p[2] == 0 and p[3] == 0} == {"localhost"}, first
        victim = worker_pid("localhost:0")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        wait_for(proc, "two commits of 2 ranks",
                 lambda: any(p[4] == 2 and p[1] > killed for p in progress(log))
                 and commits(1, 2))
        hosts.write_text("localhost\n127.0.0.1\n127.0.0.2\n127.0.0.3\n")
        wait_for(proc, "two commits with 127.0.0.3",
                 lambda: any(p[5] == "127.0.0.3" for p in progress(log)) and commits(2, 2))
        with open(stop, "w"):
            pass
        proc.wait(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = out_path.read_text()
    assert proc.returncode == 0, said
    assert "generation 1: 2 ranks on 127.0.0.1, 127.0.0.2 (lost localhost: rank 0 killed by " \
        "SIGKILL)" in said, said
    assert "generation 2: 3 ranks on 127.0.0.1, 127.0.0.2, 127.0.0.3" in said, said
    # The survivors are the processes of the first world: their logs go on past the loss.
    with open(os.path.join(log, "127.0.0.1_0.jsonl"), encoding="utf-8") as f:
        gens = {json.loads(line)["generation"] for line in f if line.strip()}
    assert gens == {0, 1, 2}, gens
    replay = subprocess.run([PYTHON, str(EXAMPLES / "elastic_train.py"), *ARGS, "--replay", log],
                            capture_output=True, text=True, timeout=LIMIT)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "(0, 3), (1, 2), (2, 3)" in replay.stdout, replay.stdout
