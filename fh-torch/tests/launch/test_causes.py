"""A rank that leaves is named, with its reason, in the others' errors: an uncaught exception,
``hvd.shutdown()`` on one rank only. Ranks started from the environment (no launcher)."""

import textwrap

import pytest

from test_launch import run_ranks

LEAVE_SCRIPT = textwrap.dedent("""
    import sys, torch
    import fasthorovod.torch as hvd
    from fasthorovod.common.exceptions import HorovodInternalError
    how = sys.argv[1]
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warmup")
    if hvd.rank() == 1:
        if how == "raise":
            raise ValueError("bad batch 7")
        hvd.shutdown()
        sys.exit(0)
    try:
        hvd.allreduce(torch.ones(1 << 16), name="next")
    except HorovodInternalError as e:
        print("next failed:", e, flush=True)
        sys.exit(3)
    sys.exit("the allreduce succeeded without rank 1")
""")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("how,reason", [
    ("raise", "rank 1 shut down: raised ValueError: bad batch 7"),
    ("shutdown", "rank 1 shut down: hvd.shutdown() was called"),
])
def test_a_rank_that_leaves_is_named_with_its_reason(tmp_path, transport, how, reason):
    script = tmp_path / "leave.py"
    script.write_text(LEAVE_SCRIPT)
    procs, outs = run_ranks(script, 3, transport, timeout=60, args=[how])
    for r in (0, 2):
        assert procs[r].returncode == 3, outs[r]
        assert reason in outs[r], outs[r]
    if how == "raise":
        assert procs[1].returncode == 1, outs[1]
        assert "ValueError: bad batch 7" in outs[1], outs[1]
    else:
        assert procs[1].returncode == 0, outs[1]
