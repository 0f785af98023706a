"""Seeing inside a job: a stall names which rank lacks which tensor, and the culprit rank prints
its own Python stack next to the warning."""

import textwrap

from conftest import PYTHON, run

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
