"""Seeing inside a job: a stall names which rank lacks which tensor, the culprit rank prints
its own Python stack next to the warning, every rank's flight record explains a stall and a
mismatch, and ``fhrun --timeline-filename`` gives one timeline of every rank."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import textwrap
import threading
import time

import pytest

from conftest import PYTHON, free_port, run


def flight_dir(out):
    """The directory fhrun names for the ranks' flight records."""
    m = re.search(r"fhrun: flight records of \d+ ranks \([\d, ]+\) are in (\S+);", out)
    assert m, out
    return m.group(1)


def remove_job_dir(out):
    """Remove the job directory fhrun kept for its flight records (a test leaves nothing)."""
    job = pathlib.Path(flight_dir(out)).parent
    if job.name.startswith("fhrun-"):
        shutil.rmtree(job, ignore_errors=True)


def explain_both_ways(fhrun, directory):
    """``fhrun --explain DIR`` and ``python -m fasthorovod.explain DIR``: the same report."""
    code, by_fhrun = run([fhrun, "--explain", directory], timeout=60)
    assert code == 0, by_fhrun
    code, by_python = run([PYTHON, "-m", "fasthorovod.explain", directory], timeout=60)
    assert code == 0, by_python
    assert by_fhrun == by_python
    return by_fhrun

STALL_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import fasthorovod.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(2), name="warmup")

    def waiting_for_the_data_loader():
        # Long enough for a stall warning (FH_STALL_CHECK_SECONDS=1) and the stack after it.
        time.sleep(6)

    if hvd.rank() == 2:
        waiting_for_the_data_loader()
    out = hvd.allreduce(torch.ones(3), name="grad.after_loader")
    assert out.tolist() == [1.0] * 3, out
    print("done", flush=True)
""")


def test_a_stall_names_the_rank_that_lacks_the_tensor_and_shows_its_stack(fhrun, tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT)
    code, out = run([fhrun, "-np", "3", "--stall-check-seconds", "1", "--timeout", "120",
                     PYTHON, str(script)], timeout=150)
    assert code == 0, out
    assert out.count("done") == 3, out
    lines = out.splitlines()
    # Rank 0's warning names rank 2 and the tensor it lacks.
    warn = [ln for ln in lines if ln.startswith("[0]<stderr>:") and "stall: rank 2 has not "
            "submitted [\"allreduce.grad.after_loader\"]" in ln]
    assert warn, out
    # Rank 2 says so itself, and its stack shows where it is: the sleeping function.
    own = [i for i, ln in enumerate(lines) if ln.startswith("[2]<stderr>:")
           and "this rank (2) has not submitted [\"allreduce.grad.after_loader\"]" in ln]
    assert own, out
    stack = [ln for ln in lines[own[0]:] if ln.startswith("[2]<stderr>:")]
    assert any("waiting_for_the_data_loader" in ln for ln in stack), out
    assert any("Thread 0x" in ln or "Current thread 0x" in ln for ln in stack), out
    # Only the culprit prints a stack, once.
    assert not any(ln.startswith(("[0]<stderr>:", "[1]<stderr>:")) and "File \"" in ln
                   for ln in lines), out
    assert sum("waiting_for_the_data_loader" in ln for ln in lines) == 1, out
    # Every rank wrote its flight record at the warning; fhrun says where, and the records
    # name the rank that never submitted the tensor and the last collective all completed.
    report = explain_both_ways(fhrun, flight_dir(out))
    assert "flight records of ranks 0-2 (of 3 ranks)" in report, report
    assert ("first divergence: rank 2 has never submitted \"allreduce.grad.after_loader\" "
            "(allreduce f32 [3]), which ranks 0 and 1 submitted and wait on") in report, report
    assert "last collective every rank completed: \"allreduce.warmup\"" in report, report
    remove_job_dir(out)


MISMATCH_SCRIPT = textwrap.dedent("""
    import sys, torch
    import fasthorovod.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(2), name="warmup")
    side = 18 if hvd.rank() == 1 else 17
    hvd.allreduce(torch.ones(side), name="layer3.weight.grad")
""")


def test_the_flight_records_name_the_rank_that_sent_a_different_shape(fhrun, tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    code, out = run([fhrun, "-np", "3", "--timeout", "120", PYTHON, str(script)], timeout=150)
    assert code != 0, out
    # The job failed: fhrun prints what the records show.
    assert ("fhrun: first divergence: rank 1 sent \"allreduce.layer3.weight.grad\" with shape "
            "[18] where ranks 0 and 2 sent [17]") in out, out
    report = explain_both_ways(fhrun, flight_dir(out))
    assert "rank 1 sent \"allreduce.layer3.weight.grad\" with shape [18]" in report, report
    assert "last collective every rank completed: \"allreduce.warmup\"" in report, report
    remove_job_dir(out)


SET_STALL_SCRIPT = textwrap.dedent("""
    import time, torch
    import fasthorovod.torch as hvd
    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    hvd.allreduce(torch.ones(2), name="warmup")
    if hvd.rank() in (0, 2):
        hvd.allreduce(torch.ones(2), name="set.warmup", process_set=ps)
        if hvd.rank() == 2:
            time.sleep(6)
        out = hvd.allreduce(torch.ones(3), name="set.grad", process_set=ps)
        assert out.tolist() == [1.0] * 3, out
    print("done", flush=True)
""")


def test_a_process_sets_stall_leaves_its_own_records_named_in_world_ranks(fhrun, tmp_path):
    """A stall inside a process set: its engine's records go to the set's own directory
    (``set-0.2``), name world ranks, and ``--explain`` reads them with the world's."""
    script = tmp_path / "set_stall.py"
    script.write_text(SET_STALL_SCRIPT)
    code, out = run([fhrun, "-np", "3", "--stall-check-seconds", "1", "--timeout", "120",
                     PYTHON, str(script)], timeout=150)
    assert code == 0, out
    assert out.count("done") == 3, out
    # The warning names world ranks: rank 2 (the set's second member) lacks the tensor.
    assert "stall: rank 2 has not submitted [\"allreduce.set.grad\"]" in out, out
    m = re.search(r"fhrun: flight records of process set \{0, 2\} \(2 ranks: 0, 2\) are in "
                  r"(\S+); `fhrun --explain (\S+)`", out)
    assert m, out
    assert m.group(1).endswith("/set-0.2"), out
    report = explain_both_ways(fhrun, m.group(2))
    assert "flight records of ranks 0 and 2 (of the process set of ranks 0 and 2)" in report, \
        report
    assert ("first divergence: rank 2 has never submitted \"allreduce.set.grad\" "
            "(allreduce f32 [3]), which rank 0 submitted and waits on") in report, report
    assert "last collective every rank completed: \"allreduce.set.warmup\"" in report, report
    shutil.rmtree(pathlib.Path(m.group(2)).parent, ignore_errors=True)


TIMELINE_SCRIPT = textwrap.dedent("""
    import torch
    import fasthorovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    hvd.allreduce(torch.ones(4), name="last")
""")


def test_fhrun_merges_every_rank_timeline_into_one(fhrun, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TIMELINE_SCRIPT)
    out_file = tmp_path / "timeline.json"
    code, out = run([fhrun, "-np", "2", "--timeline-filename", str(out_file), "--timeout", "120",
                     PYTHON, str(script)], timeout=150)
    assert code == 0, out
    assert f"timeline of 2 ranks" in out and str(out_file) in out, out
    events = json.loads(out_file.read_text())
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank]
        names = {e["name"] for e in mine}
        assert {"submit", "synchronize", "optimizer.step"} <= names, (rank, sorted(names))
        lanes = {e["args"]["name"] for e in mine if e["name"] == "thread_name"}
        assert {"negotiation", "channel 0", "python"} <= lanes, (rank, lanes)
        assert any(e["name"] == "queued" and e.get("args", {}).get("tensor") == "allreduce.last"
                   for e in mine), rank
        assert any("gb_per_s" in e.get("args", {}) for e in mine), rank
    # One clock: both ranks' spans of the same step overlap in time.
    steps = {r: [e for e in events if e.get("pid") == r and e["name"] == "optimizer.step"]
             for r in (0, 1)}
    first = [steps[r][0] for r in (0, 1)]
    assert abs(first[0]["ts"] - first[1]["ts"]) < 5e6, first


def test_an_mpi_job_keeps_and_explains_the_records_and_merges_every_timeline(fhrun, tmp_path):
    """``fhrun --mpi``: mpirun runs as fhrun's child, the ranks write into fhrun's job
    directory (passed with ``-x``), and when mpirun ends fhrun merges every rank's timeline
    and keeps and explains the failed job's flight records, as for a job it starts itself."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun")
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    out_file = tmp_path / "timeline.json"
    code, out = run([fhrun, "-np", "3", "--mpi", "--timeline-filename", str(out_file),
                     "--timeout", "120", PYTHON, str(script)], timeout=150,
                    env={"TMPDIR": str(tmp_path)})
    assert code != 0, out
    assert "flight records of 3 ranks (0, 1, 2) are in" in out, out
    assert ("fhrun: first divergence: rank 1 sent \"allreduce.layer3.weight.grad\" with shape "
            "[18] where ranks 0 and 2 sent [17]") in out, out
    assert "timeline of 3 ranks" in out, out
    events = json.loads(out_file.read_text())
    for rank in range(3):
        names = {e["name"] for e in events if e.get("pid") == rank}
        assert "submit" in names, (rank, sorted(names))


def far_host(tmp_path):
    """A job over two "hosts" on this machine: this one, and ``fh-far-host``, whose remote
    fhrun an rsh agent runs in a mount namespace of its own where fhrun's temporary directory
    (``near``) is an empty tmpfs — as on another host, fhrun's job directory is not there — with
    ``TMPDIR=far`` and ``FH_HOST_ID=fh-far-host``. Returns fhrun's arguments for it, fhrun's
    environment and ``far``."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs `unshare -m` (root) to hide fhrun's directory from the far host")
    near, far = tmp_path / "near", tmp_path / "far"
    near.mkdir()
    far.mkdir()
    agent = tmp_path / "agent.sh"
    agent.write_text("#!/bin/bash\nshift\nexec unshare -m sh -c 'mount -t tmpfs fh-far \"$0\" && "
                     f"TMPDIR=\"$1\" FH_HOST_ID=fh-far-host exec sh -c \"$2\"' '{near}' '{far}' "
                     "\"$*\"\n")
    agent.chmod(0o755)
    args = ["--rsh-agent", str(agent), "--rendezvous-addr", f"127.0.0.1:{free_port()}"]
    # Each "host" its own name, as the ranks' host facts (one machine) cannot tell them apart.
    return args, {"TMPDIR": str(near), "FH_HOST_ID": "fh-near-host"}, far


def test_the_timeline_of_a_rank_on_another_host_comes_back(fhrun, tmp_path):
    """A rank on another host writes its timeline there; its fhrun sends it back, and the
    merged timeline has its track."""
    args, env, far = far_host(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TIMELINE_SCRIPT)
    out_file = tmp_path / "timeline.json"
    code, out = run([fhrun, "-np", "2", "-H", "localhost:1,fh-far-host:1", *args,
                     "--timeline-filename", str(out_file), "--timeout", "120", PYTHON,
                     str(script)], timeout=150, env=env)
    assert code == 0, out
    assert "timeline of 2 ranks" in out, out
    events = json.loads(out_file.read_text())
    for rank in (0, 1):
        names = {e["name"] for e in events if e.get("pid") == rank}
        assert {"submit", "synchronize", "optimizer.step"} <= names, (rank, sorted(names))
    assert not list(far.glob("fhrun-part-*")), list(far.iterdir())


def test_a_failed_job_explains_the_records_of_every_host(fhrun, tmp_path):
    """The mismatch above, rank 1 (the odd one) and rank 2 on another host: fhrun keeps and
    explains the records of every host's ranks."""
    args, env, far = far_host(tmp_path)
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    code, out = run([fhrun, "-np", "3", "-H", "localhost:1,fh-far-host:2", *args, "--timeout",
                     "120", PYTHON, str(script)], timeout=150, env=env)
    assert code != 0, out
    assert "fhrun: flight records of 3 ranks (0, 1, 2) are in" in out, out
    assert ("fhrun: first divergence: rank 1 sent \"allreduce.layer3.weight.grad\" with shape "
            "[18] where ranks 0 and 2 sent [17]") in out, out
    assert not list(far.glob("fhrun-part-*")), list(far.iterdir())
    remove_job_dir(out)


TIMEOUT_SCRIPT = textwrap.dedent("""
    import time, torch
    import fasthorovod.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(2), name="warmup")

    def stuck_in_user_code():
        time.sleep(120)

    if hvd.rank() == 1:
        stuck_in_user_code()
    hvd.allreduce(torch.ones(5), name="grad")
""")


def test_at_its_timeout_fhrun_gathers_every_rank_record_and_stack(fhrun, tmp_path):
    """--timeout: fhrun sends SIGUSR1 first; every rank writes its flight record and prints
    its stacks; fhrun then stops the job and prints what the records show."""
    script = tmp_path / "stuck.py"
    script.write_text(TIMEOUT_SCRIPT)
    code, out = run([fhrun, "-np", "3", "--no-stall-check", "--timeout", "10", PYTHON,
                     str(script)], timeout=120)
    assert code == 124, out
    assert "timed out" in out, out
    assert ("fhrun: first divergence: rank 1 has never submitted \"allreduce.grad\" "
            "(allreduce f32 [5]), which ranks 0 and 2 submitted and wait on") in out, out
    assert "written by ranks 0-2 for: SIGUSR1" in out, out
    assert any(ln.startswith("[1]<stderr>:") and "stuck_in_user_code" in ln
               for ln in out.splitlines()), out
    remove_job_dir(out)


STUCK_UNTIL_TOLD_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    import fasthorovod.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(2), name="warmup")
    print("ready", flush=True)

    def stuck_in_user_code():
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.1)

    if hvd.rank() == 1:
        stuck_in_user_code()
    out = hvd.allreduce(torch.ones(5), name="grad")
    assert out.tolist() == [1.0] * 5, out  # the average
    print("done", flush=True)
""")


def test_sigusr1_brings_the_far_hosts_records_while_the_job_is_stuck(fhrun, tmp_path):
    """SIGUSR1 to fhrun while a job over two hosts is stuck (rank 0 waits in an allreduce that
    rank 1, on the far host, never joins): the far rank's flight record reaches fhrun's job
    directory, and fhrun says where, while the job still runs; its explanation names rank 1.
    Then rank 1 is let go and the job ends well."""
    args, env, far = far_host(tmp_path)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_UNTIL_TOLD_SCRIPT)
    go = tmp_path / "go"
    full_env = dict(os.environ, FH_TIMEOUT_SECONDS="60", **env)
    proc = subprocess.Popen([fhrun, "-np", "2", "-H", "localhost:1,fh-far-host:1", *args,
                             "--no-stall-check", "--timeout", "120", PYTHON, str(script),
                             str(go)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()

    def wait_for(cond, what, limit=90):
        deadline = time.monotonic() + limit
        while not cond("".join(lines)):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{what} (fhrun ended: {proc.poll()}):\n" + "".join(lines)
            time.sleep(0.05)
        return "".join(lines)

    said = "fhrun: rank 1 on fh-far-host sent the flight records of rank 1: they are in "
    try:
        wait_for(lambda out: out.count("<stdout>:ready") == 2, "both ranks ready")
        proc.send_signal(signal.SIGUSR1)
        out = wait_for(lambda out: said in out, "fhrun names the far record")
        assert proc.poll() is None, out
        flight = re.search(re.escape(said) + r"(\S+);", out).group(1)
        assert flight.startswith(str(tmp_path / "near")), out
        record = json.loads((pathlib.Path(flight) / "rank-1.json").read_text())
        assert record["reason"] == "SIGUSR1", record["reason"]
        # Every host's records are there while the job is stuck: the explanation names rank 1.
        code, report = run([fhrun, "--explain", flight], timeout=60)
        assert code == 0, report
        assert ("first divergence: rank 1 has never submitted \"allreduce.grad\" "
                "(allreduce f32 [5]), which rank 0 submitted and waits on") in report, report
        assert proc.poll() is None, "".join(lines)
        go.touch()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    out = "".join(lines)
    assert code == 0, out
    assert out.count("<stdout>:done") == 2, out
    assert out.count(said) == 1, out
    assert "fhrun: flight records of 2 ranks (0, 1) are in" in out, out
    assert not list(far.glob("fhrun-part-*")), list(far.iterdir())
    remove_job_dir(out)


METRICS_SCRIPT = textwrap.dedent("""
    import sys, urllib.request, torch
    import fasthorovod.torch as hvd
    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    port = int(sys.argv[1]) + hvd.local_rank()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    r = hvd.rank()
    assert f'fasthorovod_steps_total{{rank="{r}"}} 3' in text, text
    assert f'fasthorovod_channel_bytes_total{{rank="{r}",channel="0"}}' in text, text
    assert f'fasthorovod_fused_group_bytes_count{{rank="{r}"}}' in text, text
    print("metrics ok", flush=True)
""")


def test_each_rank_serves_its_figures_and_says_what_it_did(fhrun, tmp_path):
    """FH_METRICS_ADDR: each rank serves Prometheus text on the port plus its local rank; at
    the end each rank prints one summary line (fhrun sets FH_SUMMARY=1)."""
    from conftest import free_port
    script = tmp_path / "metrics.py"
    script.write_text(METRICS_SCRIPT)
    port = free_port()
    code, out = run([fhrun, "-np", "2", "-x", f"FH_METRICS_ADDR=:{port}", "--timeout", "120",
                     PYTHON, str(script), str(port)], timeout=150)
    assert code == 0, out
    assert out.count("metrics ok") == 2, out
    for r in (0, 1):
        line = [ln for ln in out.splitlines()
                if ln.startswith(f"[{r}]<stderr>:fasthorovod rank {r}: ")]
        assert len(line) == 1, out
        assert "negotiation rounds" in line[0] and "over 3 steps" in line[0], line
