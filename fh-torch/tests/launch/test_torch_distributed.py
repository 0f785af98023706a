"""The ``fasthorovod`` backend of ``torch.distributed`` launched three ways -- torchrun, fhrun,
and ``init_process_group(store=..., rank=..., world_size=...)`` with no launcher -- training
DDP to the parameters DDP on Gloo reaches in the same processes; and a rank killed in the
middle of DDP's backward, which every survivor names."""

import os
import secrets
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import PYTHON, free_port, run

DDP_SCRIPT = textwrap.dedent("""
    import datetime, os, signal, sys, time
    import torch
    import torch.distributed as dist
    import fasthorovod.torch.distributed  # noqa: F401 - registers the backend
    import fasthorovod.torch as hvd
    from fasthorovod import _core

    mode = sys.argv[1]
    kw = {}
    if mode == "store":  # no launcher: an explicit store, rank and world size
        rank, size, port = (int(a) for a in sys.argv[2:5])
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0,
                              timeout=datetime.timedelta(seconds=60))
        kw = dict(store=store, rank=rank, world_size=size)
    kill = int(os.environ.get("KILL_RANK", "-1"))
    theirs = None
    for rnd in range(int(os.environ.get("ROUNDS", "1"))):
        # Later rounds reuse the store as it is (the backend's keys count the worlds formed
        # on it); Gloo's would collide there (torch restarts its group names), so Gloo runs
        # in the first round only and the later rounds compare with its parameters.
        dist.init_process_group("fasthorovod", **kw)
        me, n = dist.get_rank(), dist.get_world_size()
        assert (hvd.rank(), hvd.size()) == (me, n), (hvd.rank(), hvd.size(), me, n)
        gloo = dist.new_group(backend="gloo") if rnd == 0 else None

        def train(pg):
            torch.manual_seed(3)
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 4))
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                            bucket_cap_mb=0.01)
            if pg is None and me == kill:
                # Killed in the middle of the backward, with buckets in flight.
                def die(grad):
                    print(f"T_KILL={time.time():.6f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                model[2].weight.register_hook(die)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(10 + me)
            for step in range(4):
                opt.zero_grad()
                ddp(torch.randn(8, 16, generator=gen)).square().mean().backward()
                opt.step()
            return [p.detach() for p in model.parameters()]

        try:
            ours = train(None)
        except Exception as e:
            print(f"T_FAIL={time.time():.6f} rank {me} failed: "
                  f"{' '.join(str(e).split())[:400]}", flush=True)
            sys.exit(3)
        if rnd == 0:
            theirs = train(gloo)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        print(f"rank {me} of {n} round {rnd}: DDP over fasthorovod = DDP over gloo "
              f"({_core.backend()})", flush=True)
        dist.destroy_process_group()
        assert not hvd.is_initialized(), "the backend started the engine: it stops it"
    print(f"rank {me} done", flush=True)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "ddp.py"
    path.write_text(DDP_SCRIPT)
    return path


def test_torchrun_ddp_matches_gloo(script):
    code, out = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                     str(script), "env"],
                    env={"FH_JOB_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"},
                    timeout=240)
    assert code == 0, out
    for r in range(2):
        assert f"rank {r} of 2 round 0: DDP over fasthorovod = DDP over gloo (shm)" in out, out


def test_fhrun_ddp_matches_gloo(fhrun, script):
    # fhrun exports MASTER_ADDR and MASTER_PORT; the import exports RANK, WORLD_SIZE, ...
    code, out = run([fhrun, "-np", "3", "--timeout", "200", PYTHON, str(script), "env"],
                    env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert code == 0, out
    for r in range(3):
        assert f"rank {r} of 3 round 0: DDP over fasthorovod = DDP over gloo" in out, out


def _store_ranks(script, n, env, timeout):
    """``n`` ranks of ``script`` in store mode: no launcher variables at all."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("FH_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT")}
    clean.update(OMP_NUM_THREADS="1", FH_TIMEOUT_SECONDS="20", **env)
    procs = [subprocess.Popen([PYTHON, str(script), "store", str(r), str(n), str(port)],
                              env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for r in range(n)]
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


def test_explicit_store_without_launcher_and_again(script):
    """Three ranks that know only a TCPStore: the world is agreed through it (rank 0 draws the
    token, no FH_JOB_TOKEN), twice in the same processes (init, destroy, init)."""
    procs, outs = _store_ranks(script, 3, {"ROUNDS": "2"}, timeout=240)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        for rnd in range(2):
            assert f"rank {r} of 3 round {rnd}: DDP over fasthorovod = DDP over gloo" in out, out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_killed_in_ddp_backward_is_named_by_every_survivor(script, transport):
    start = time.time()
    procs, outs = _store_ranks(script, 3, {"KILL_RANK": "1", "FH_TRANSPORT": transport,
                                           "FH_JOB_TOKEN": secrets.token_hex(16)},
                               timeout=120)
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    t_kill = float(outs[1].split("T_KILL=")[1].split()[0])
    for r in (0, 2):
        assert procs[r].returncode == 3, outs[r]
        line = next((ln for ln in outs[r].splitlines() if f"rank {r} failed" in ln), None)
        assert line is not None and "rank 1" in line.split("failed:")[1], outs[r]
        took = float(line.split("T_FAIL=")[1].split()[0]) - t_kill
        assert took < 20 + 2, f"rank {r} failed {took:.2f} s after the kill: {line}"
    assert time.time() - start < 120
