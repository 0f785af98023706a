"""Launching jobs: a single process, fhrun, torchrun; a killed rank; the training examples."""

import json
import os
import secrets
import signal
import subprocess
import textwrap
import time

import pytest
import torch

from conftest import EXAMPLES, PYTHON, free_port, run


def test_single_process_needs_no_launcher():
    code, out = run([PYTHON, "-c", textwrap.dedent("""
        import torch, fasthorovod.torch as hvd
        hvd.init()
        assert (hvd.rank(), hvd.size(), hvd.local_size()) == (0, 1, 1)
        assert torch.equal(hvd.allreduce(torch.ones(3)), torch.ones(3))
        assert hvd.join() == 0
        hvd.shutdown()
        print("single ok")
    """)], timeout=120)
    assert code == 0, out
    assert "single ok" in out


def test_calls_before_init_say_to_call_init():
    code, out = run([PYTHON, "-c", textwrap.dedent("""
        import torch, fasthorovod.torch as hvd
        for f in (hvd.rank, hvd.size, lambda: hvd.allreduce(torch.ones(1))):
            try:
                f()
            except ValueError as e:
                assert "hvd.init()" in str(e), e
            else:
                raise SystemExit("no error before init")
        hvd.init(); hvd.shutdown()
        try:
            hvd.allreduce(torch.ones(1))
        except RuntimeError as e:
            assert "shut down" in str(e), e
            print("after shutdown:", e)
        else:
            raise SystemExit("no error after shutdown")
    """)], timeout=120)
    assert code == 0, out
    assert "after shutdown" in out


@pytest.mark.parametrize("env,coloured", [
    ({}, False),
    ({"FH_LOG_COLOR": "always", "NO_COLOR": "1"}, False),
    ({"FH_LOG_COLOR": "always"}, True),
])
def test_log_lines_through_a_pipe_carry_no_colour(env, coloured):
    # Output to a pipe (as through fhrun, or into a CI log) stays plain text; NO_COLOR wins.
    script = ("import torch, fasthorovod.torch as hvd; hvd.init(); "
              "hvd.allreduce(torch.ones(2)); hvd.shutdown()")
    base = {"NO_COLOR": "", "FH_LOG_COLOR": "", "FH_LOG_LEVEL": "debug"}
    code, out = run([PYTHON, "-c", script], env={**base, **env}, timeout=120)
    assert code == 0, out
    assert "DEBUG" in out, out
    assert ("\x1b[" in out) == coloured, out


def test_horovod_variables_are_honoured_and_bad_ones_named():
    code, out = run([PYTHON, "-c", "import fasthorovod.torch as hvd; hvd.init()"],
                    env={"HOROVOD_CACHE_CAPACITY": "lots"}, timeout=120)
    assert code != 0
    assert "HOROVOD_CACHE_CAPACITY" in out, out


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import fasthorovod.torch as hvd
    from fasthorovod.common.exceptions import HorovodInternalError
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warmup")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pending = hvd.allreduce_async(torch.ones(1 << 20), name="big")
    try:
        hvd.synchronize(pending)
    except HorovodInternalError as e:
        print("pending failed:", e, flush=True)
    else:
        sys.exit("the pending operation succeeded")
    try:
        hvd.allreduce(torch.ones(1), name="after")
    except RuntimeError as e:
        print("new op failed:", e, flush=True)
    else:
        sys.exit("a new operation succeeded")
""")


def run_ranks(script, n, transport, timeout, args=()):
    """Run ``script`` as ``n`` ranks on this host (the FH_* environment a launcher gives);
    returns the processes and their outputs. Every wait is bounded; leftovers are killed."""
    port = free_port()
    token = secrets.token_hex(16)
    procs = []
    for r in range(n):
        env = dict(os.environ, FH_RANK=str(r), FH_SIZE=str(n), FH_LOCAL_RANK=str(r),
                   FH_LOCAL_SIZE=str(n), FH_CROSS_RANK="0", FH_CROSS_SIZE="1",
                   FH_RENDEZVOUS_ADDR=f"127.0.0.1:{port}", FH_JOB_TOKEN=token,
                   FH_TRANSPORT=transport, FH_TIMEOUT_SECONDS="20")
        procs.append(subprocess.Popen([PYTHON, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return procs, outs


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_killed_rank_fails_the_others_naming_it(tmp_path, transport):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    procs, outs = run_ranks(script, 2, transport, timeout=60)
    out0 = outs[0]
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 0, out0
    assert "pending failed" in out0 and "rank 1" in out0, out0
    assert "new op failed" in out0, out0


def test_example_trains_to_identical_parameters(fhrun, tmp_path):
    example = str(EXAMPLES / "train_synthetic_cnn.py")
    save = str(tmp_path / "params-{rank}.pt")
    code, out = run([fhrun, "-np", "2", "--timeout", "200", PYTHON, example, "--steps", "25",
                     "--save", save], timeout=240)
    assert code == 0, out
    ref = str(tmp_path / "ref.pt")
    code, out_ref = run([PYTHON, example, "--steps", "25", "--concat-ranks", "2", "--save", ref],
                        timeout=240)
    assert code == 0, out_ref
    p0 = torch.load(save.format(rank=0))
    p1 = torch.load(save.format(rank=1))
    pref = torch.load(ref)
    assert p0.keys() == p1.keys() == pref.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), f"{k} differs between the ranks"
        assert torch.allclose(p0[k], pref[k], rtol=1e-4, atol=1e-5), \
            f"{k}: 2 ranks and one process on the concatenated batch differ"
    # It learns.
    losses = [float(line.split()[-1]) for line in out.splitlines() if "loss" in line]
    assert losses and losses[-1] < losses[0], out


def test_elastic_example_on_a_fixed_world_matches_its_replay(fhrun, tmp_path):
    # The elastic example on `fhrun -np 3` (a fixed world: one generation), then its replay.
    example = str(EXAMPLES / "elastic_train.py")
    log = str(tmp_path / "log")
    args = ["--epochs", "2", "--samples", "40"]
    code, out = run([fhrun, "-np", "3", "--timeout", "200", PYTHON, example, *args],
                    env={"ELASTIC_LOG": log}, timeout=240)
    assert code == 0, out
    logs = [n for n in os.listdir(log) if n.endswith(".jsonl")]
    assert len(logs) == 3, os.listdir(log)
    code, out = run([PYTHON, example, *args, "--replay", log], timeout=240)
    assert code == 0 and "3 workers' final parameters compared" in out, out


def test_torchrun_launches_it(tmp_path):
    example = str(EXAMPLES / "train_synthetic_cnn.py")
    port = free_port()
    code, out = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_addr", "127.0.0.1", "--master_port", str(port),
                     example, "--steps", "3"],
                    env={"FH_JOB_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"},
                    timeout=240)
    assert code == 0, out
    assert "step    2" in out, out


SETS_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import fasthorovod.torch as hvd
    from fasthorovod.common.exceptions import HorovodInternalError
    a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([3, 2])
    hvd.init(process_sets=[a, b])
    assert (a.process_set_id, b.process_set_id) == (1, 2), (a, b)
    mine = a if hvd.rank() < 2 else b
    x = hvd.allreduce(torch.ones(4), name="warmup", op=hvd.Sum, process_set=mine)
    assert torch.equal(x, torch.full((4,), 2.0)), x
    if hvd.rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if hvd.rank() == 2:
        try:
            hvd.allreduce(torch.ones(1 << 16), name="big", process_set=b)
        except HorovodInternalError as e:
            print("set b failed:", e, flush=True)
        else:
            sys.exit("set b went on without rank 3")
    else:
        time.sleep(2.5)  # well after rank 3 is gone
        for i in range(20):
            y = hvd.allreduce(torch.full((3,), float(i)), name=f"after{i}", op=hvd.Sum,
                              process_set=a)
            assert torch.equal(y, torch.full((3,), 2.0 * i)), y
        print("set a ok", flush=True)
""")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_static_process_sets_and_a_killed_member(tmp_path, transport):
    """init(process_sets=[...]); a set that loses a member fails naming it, while a disjoint
    set goes on working."""
    script = tmp_path / "sets.py"
    script.write_text(SETS_KILL_SCRIPT)
    procs, outs = run_ranks(script, 4, transport, timeout=90)
    assert procs[3].returncode == -signal.SIGKILL
    for r in range(3):
        assert procs[r].returncode == 0, outs[r]
    assert "set a ok" in outs[0] and "set a ok" in outs[1], outs[:2]
    assert "set b failed" in outs[2] and "rank 3" in outs[2], outs[2]


RAISE_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import fasthorovod.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warmup")
    if hvd.rank() == 1:
        print(f"T_RAISE={time.time():.6f}", flush=True)
        raise ValueError("boom")
    hvd.allreduce(torch.ones(1 << 16), name="after")
    sys.exit("the allreduce went on without rank 1")
""")


@pytest.mark.parametrize("transport", ["shm", "tcp", "shm"])
def test_fhrun_names_the_rank_that_raised_within_2s(fhrun, tmp_path, transport):
    """Rank 1 of 3 raises before an allreduce: fhrun names rank 1 and its exception (not a
    survivor that exited first with the runtime's error) and exits within 2 s of the raise."""
    script = tmp_path / "raise.py"
    script.write_text(RAISE_SCRIPT)
    env = dict(os.environ, FH_TIMEOUT_SECONDS="20", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([fhrun, "-np", "3", "--transport", transport, "--timeout", "120",
                             PYTHON, str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"fhrun did not finish in 150 s:\n{out}")
    ended = time.time()
    assert proc.returncode == 1, out
    raised = [float(line.split("T_RAISE=")[1]) for line in out.splitlines()
              if line.startswith("[1]<stdout>:T_RAISE=")]
    assert raised, out
    blamed = [line for line in out.splitlines() if line.startswith("fhrun: rank ")]
    assert blamed and blamed[0].startswith("fhrun: rank 1 (pid "), out
    assert "raised ValueError: boom" in blamed[0], out
    assert not any(line.startswith(("fhrun: rank 0 (", "fhrun: rank 2 (")) for line in blamed), out
    took = ended - raised[0]
    assert took < 2.0, f"fhrun exited {took:.2f} s after rank 1 raised:\n{out}"


NOTICE_SCRIPT = textwrap.dedent("""
    import sys
    import fasthorovod.torch as hvd
    from fasthorovod.common.exceptions import HorovodInternalError
    def own():
        raise KeyError("x")
    def caused():
        try:
            raise HorovodInternalError("rank 2 is gone")
        except HorovodInternalError:
            raise RuntimeError("training failed")
    {"own": own, "caused": caused}[sys.argv[1]]()
""")


@pytest.mark.parametrize("case", ["own", "caused", "stale"])
def test_an_uncaught_exception_is_noticed_only_when_the_rank_is_its_cause(tmp_path, case):
    """fasthorovod.torch's excepthook writes ``RANK raised T: msg`` to fhrun's notice pipe
    (FH_NOTICE_FD=FD:INODE) after the usual traceback; not when the runtime's error caused the
    exception, and not into a descriptor that is not that pipe."""
    script = tmp_path / "notice.py"
    script.write_text(NOTICE_SCRIPT)
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        ino = os.fstat(w).st_ino + (1 if case == "stale" else 0)
        env = dict(os.environ, FH_RANK="3", FH_NOTICE_FD=f"{w}:{ino}")
        p = subprocess.run([PYTHON, str(script), "own" if case == "stale" else case],
                           env=env, pass_fds=(w,), capture_output=True, text=True, timeout=120)
        try:
            said = os.read(r, 65536).decode()
        except BlockingIOError:
            said = ""
    finally:
        os.close(r)
        os.close(w)
    assert p.returncode == 1, p.stderr
    assert "Traceback" in p.stderr, p.stderr  # the previous hook still runs
    if case == "own":
        assert said == "3 raised KeyError: 'x'\n", (said, p.stderr)
    else:
        assert said == "", said


STREAMS_SCRIPT = textwrap.dedent("""
    import json, torch
    import fasthorovod.torch as hvd
    hvd.init()
    x = hvd.allreduce(torch.ones(1 << 16), name="across", op=hvd.Sum)
    assert torch.equal(x, torch.full((1 << 16,), float(hvd.size()))), x
    print("streams", hvd.rank(), json.dumps(hvd.tcp_streams()), flush=True)
    hvd.shutdown()
""")


@pytest.mark.parametrize("hosts", [1, 2])
def test_tcp_streams_says_what_crosses_hosts(tmp_path, hosts):
    """``hvd.tcp_streams()`` is the runtime's own choice of streams to peers on other hosts,
    the same on every rank: two ranks that say they are on two hosts (``FH_HOST_ID``) with
    ``FH_TCP_STREAMS=2`` report 2 streams, set (no rates); on one host, nothing crosses."""
    script = tmp_path / "streams.py"
    script.write_text(STREAMS_SCRIPT)
    port, token = free_port(), secrets.token_hex(16)
    procs = []
    for r in range(2):
        env = dict(os.environ, FH_RANK=str(r), FH_SIZE="2",
                   FH_RENDEZVOUS_ADDR=f"127.0.0.1:{port}", FH_JOB_TOKEN=token,
                   FH_TRANSPORT="tcp", FH_TCP_STREAMS="2", FH_TIMEOUT_SECONDS="20",
                   FH_HOST_ID=f"fh-test-host-{r if hosts == 2 else 0}")
        procs.append(subprocess.Popen([PYTHON, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    want = None if hosts == 1 else {"streams": 2, "setting": "2", "one_stream_gbps": None,
                                     "many_streams_gbps": None, "probe_streams": None}
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        line = next(l for l in out.splitlines() if l.startswith(f"streams {r} "))
        assert json.loads(line.split(" ", 2)[2]) == want, out
