"""Elastic training (Horovod's ``horovod.torch.elastic``): a job whose world shrinks when a
host is lost and grows when one is added, in the same processes, launched with
``fhrun --host-discovery-script SCRIPT [--min-np N] [--max-np N] python train.py``.

As in Horovod::

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...            # every few batches: state.commit()

    train(state)

``run`` restarts the training function from the last commit after a lost rank
(``HorovodInternalError``) and after a change of hosts (``HostsUpdatedInterrupt``), with the
state synchronised from the new rank 0; see ``fasthorovod.common.elastic`` for the rules,
and for what happens outside an elastic job."""

from fasthorovod.common.elastic import ObjectState, State, run_fn
from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from fasthorovod.torch.elastic.sampler import ElasticSampler
from fasthorovod.torch.elastic.state import TorchState


def run(func):
    """Decorator: ``func(state, *args, **kwargs)`` is run with ``state`` synchronised from
    rank 0 first, and run again from the last commit whenever the world changes, until it
    returns (its value is returned). ``state`` must be a ``State`` (e.g. ``TorchState``).

    ``func`` must not begin with a collective of its own outside ``state``: a new worker
    synchronises the state while the others do, and must meet them there. A worker that the
    driver leaves out of the new world exits with status 0 (a line on stderr says why)."""
    return run_fn(func, _reset, _agree_sync)


def _agree_sync(needed):
    """Whether any rank needs the state synchronised (a Max allreduce)."""
    import torch

    from fasthorovod.torch.mpi_ops import Max, allreduce

    flag = torch.tensor([1 if needed else 0], dtype=torch.int32)
    return bool(allreduce(flag, op=Max, name="fasthorovod.elastic.sync_needed").item())


def _reset():
    """Re-forms the world: ``shutdown()``, then ``init()`` (which asks the driver for the
    next world)."""
    from fasthorovod.torch.mpi_ops import _basics

    try:
        _basics.shutdown()
    except Exception:  # noqa: BLE001 - reported by the failed engine, stopped all the same
        # The engine had failed (the error that brought us here): its close reports it.
        pass
    _basics.init()


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
