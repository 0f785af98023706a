"""Horovod's public exceptions under ``fasthorovod.common.exceptions``: the class the runtime
raises prints and pickles under that module (Horovod's is
``horovod.common.exceptions.HorovodInternalError``), is the one ``fasthorovod.torch`` exports,
and survives a pickle round trip (errors sent from a worker to a parent process)."""

import pickle

import pytest
import torch

import fasthorovod.torch as hvd
import fasthorovod.torch.mpi_ops as mpi_ops
from fasthorovod.common import exceptions
from fasthorovod.common.exceptions import (HorovodInternalError, HorovodVersionMismatchError,
                                           HostsUpdatedInterrupt)


def _raised():
    """A HorovodInternalError raised by the runtime itself, on every rank."""
    if hvd.size() == 1:
        # A single process cannot disagree with itself: the error of a stopped runtime.
        hvd.shutdown()
        try:
            with pytest.raises(HorovodInternalError) as e:
                hvd.allreduce(torch.ones(1), name="exc_after_shutdown")
        finally:
            hvd.init()
        return e.value
    shape = (2,) if hvd.rank() == 0 else (3,)
    with pytest.raises(HorovodInternalError) as e:
        hvd.allreduce(torch.ones(shape), name="exc_shape_mismatch")
    return e.value


def test_internal_error_is_named_and_pickled_under_common_exceptions():
    r = hvd.rank()
    err = _raised()
    cls = type(err)
    assert cls is HorovodInternalError, f"rank {r}: raised {cls!r}"
    assert f"{cls.__module__}.{cls.__qualname__}" == \
        "fasthorovod.common.exceptions.HorovodInternalError", f"rank {r}: {cls!r}"
    assert repr(cls) == "<class 'fasthorovod.common.exceptions.HorovodInternalError'>", repr(cls)
    assert isinstance(err, RuntimeError), f"rank {r}"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is HorovodInternalError and back.args == err.args, \
        f"rank {r}: {back!r} != {err!r}"
    assert str(back) == str(err) and str(err), f"rank {r}"
    # The same class wherever a script imports it from.
    assert hvd.HorovodInternalError is HorovodInternalError
    assert mpi_ops.HorovodInternalError is HorovodInternalError
    assert exceptions.HorovodInternalError is HorovodInternalError


def test_other_public_exceptions_pickle_with_their_fields():
    h = pickle.loads(pickle.dumps(HostsUpdatedInterrupt(skip_sync=True)))
    assert type(h) is HostsUpdatedInterrupt and h.skip_sync is True
    assert isinstance(h, RuntimeError)
    assert HostsUpdatedInterrupt.__module__ == "fasthorovod.common.exceptions"
    assert hvd.HostsUpdatedInterrupt is HostsUpdatedInterrupt
    v = pickle.loads(pickle.dumps(HorovodVersionMismatchError("torch", "2.1.0", "2.0.1")))
    assert type(v) is HorovodVersionMismatchError and isinstance(v, ImportError)
    assert (v.name, v.version, v.installed_version) == ("torch", "2.1.0", "2.0.1")
    assert "2.1.0" in str(v) and "2.0.1" in str(v)
