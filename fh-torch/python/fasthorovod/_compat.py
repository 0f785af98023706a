"""Which PyTorch this FastHorovod supports; ``fasthorovod.torch`` checks it on import.

FastHorovod does not link libtorch (tensors come in through their data pointers) and its
extension is built for CPython's stable ABI, so one wheel serves every supported torch and
every CPython from 3.9 on. The package metadata states the same range (``torch>=2.1``).
"""

import re

#: The oldest PyTorch supported, as (major, minor).
TORCH_MIN = (2, 1)


def torch_version_tuple(version):
    """``(major, minor)`` of a torch version string (``"2.5.1"``, ``"2.5.1+cpu"``,
    ``"2.15.0a0+git1234"``), or ``None`` when it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _min_text():
    return ".".join(map(str, TORCH_MIN))


def missing_torch_message():
    """What ``fasthorovod.torch`` says when PyTorch is not installed."""
    return (f"fasthorovod.torch needs PyTorch >= {_min_text()}: install the torch build for "
            f"your machine first (`pip install torch`)")


def check_torch_version(version, location="torch"):
    """Raise ``ImportError`` naming both versions and the fix when ``version`` is older than
    :data:`TORCH_MIN`. A version that does not parse (a custom build) is let through."""
    got = torch_version_tuple(version)
    if got is not None and got < TORCH_MIN:
        from fasthorovod._core import __version__

        need = _min_text()
        raise ImportError(
            f"fasthorovod {__version__} supports torch >= {need}, but this environment has "
            f"torch {version} ({location}): upgrade PyTorch (`pip install 'torch>={need}'`, "
            f"the build for your machine) or use an older FastHorovod")
