"""The package says which release and wire protocol it is, its metadata states the supported
PyTorch, and an unsupported torch is refused at import with both versions named."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

import fasthorovod
from fasthorovod import _compat


def test_version_is_the_distributions():
    assert isinstance(fasthorovod.__version__, str)
    assert fasthorovod.__version__ == importlib.metadata.version("fasthorovod")
    assert isinstance(fasthorovod.PROTOCOL_VERSION, int) and fasthorovod.PROTOCOL_VERSION >= 5


def test_fhrun_that_started_this_rank_is_of_the_same_release():
    # fhrun tells every rank its release; the runtime refuses another (checked by hvd.init()).
    launched = os.environ.get("FH_FHRUN_VERSION")
    if launched is None:
        pytest.skip("not started by fhrun")
    assert launched == fasthorovod.__version__


def test_metadata_states_the_supported_torch():
    needs = [r for r in importlib.metadata.requires("fasthorovod") or []
             if r.replace(" ", "").startswith("torch>=")]
    minimum = ".".join(map(str, _compat.TORCH_MIN))
    assert needs == [f"torch>={minimum}"], importlib.metadata.requires("fasthorovod")


@pytest.mark.parametrize("version,ok", [
    ("2.1.0", True), ("2.15.0", True), ("2.15.0a0+git1234", True), ("2.5.1+cpu", True),
    ("3.0.0", True), ("custom-build", True),
    ("2.0.1", False), ("1.13.1+cu117", False), ("2.0.0a0+gitabc", False),
])
def test_torch_versions_are_judged_by_major_and_minor(version, ok):
    if ok:
        _compat.check_torch_version(version)
    else:
        with pytest.raises(ImportError, match="supports torch >= 2.1"):
            _compat.check_torch_version(version)


def test_an_unsupported_torch_is_refused_at_import_naming_both(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.0.1"\n')
    code = textwrap.dedent("""
        try:
            import fasthorovod.torch
        except ImportError as e:
            print(e)
        else:
            print("imported")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    said = out.stdout + out.stderr
    assert "torch 2.0.1" in said, said
    assert f"fasthorovod {fasthorovod.__version__} supports torch >= 2.1" in said, said
