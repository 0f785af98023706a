"""Tests that launch jobs (fhrun, torchrun, plain processes) from a single pytest process."""

import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "fh-torch" / "examples"


def _fhrun():
    for cand in (os.environ.get("FH_FHRUN"), ROOT / "target" / "debug" / "fhrun",
                 ROOT / "target" / "release" / "fhrun", shutil.which("fhrun")):
        if cand and pathlib.Path(cand).is_file():
            return str(cand)
    pytest.skip("fhrun is not built: run `cargo build -p fh-launch` (cargo xtask test does)")


@pytest.fixture
def fhrun():
    return _fhrun()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=240, env=None, **kw):
    """Run a command with a bound wait; the whole process group is killed on timeout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("FH_TIMEOUT_SECONDS", "20")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} did not finish in {timeout} s:\n{out}")
    return proc.returncode, out


PYTHON = sys.executable
