"""Elastic training, framework-free part (Horovod's ``horovod.common.elastic``): the state
kept across world changes (``State``, ``ObjectState``) and the retry loop (``run_fn``).

An elastic job (``fhrun --host-discovery-script SCRIPT ...``) forms a new world, in the same
processes, whenever a worker is lost or hosts are added. The training function, wrapped by
``run``, is then restarted from the last commit:

- a collective that fails because a rank is lost raises ``HorovodInternalError``: every
  survivor restores its last commit (``restore()``), the world is re-formed
  (``shutdown()``; ``init()``), and the state is synchronised from the new rank 0 (the
  lowest surviving rank) before the function runs again;
- when the driver reports a change of hosts, ``commit()`` (through ``check_host_updates()``)
  raises ``HostsUpdatedInterrupt`` on every rank at the same commit: the world is re-formed
  without restoring (the state was just committed), and synchronised unless hosts were only
  removed (``skip_sync``: the survivors hold the same state already).

Outside an elastic job (a fixed world: ``fhrun -np N``, torchrun, mpirun...) ``run`` still
works, but a ``HorovodInternalError`` is re-raised: there is no driver to form a world without
the lost rank, so retrying would fail again (or wait for the lost rank until the timeout).
Horovod would retry there; FastHorovod fails at once, with the error that says which rank was
lost. ``check_host_updates()`` is a no-op there (no driver: the hosts never change)."""

import copy
import functools
import sys

from fasthorovod.common import _elastic_core
from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt


class State:
    """State kept in memory across world changes: ``save`` (to host memory), ``restore`` (the
    last save), ``sync`` (from rank 0 to every rank), as subclasses define them.

    ``bcast_object(obj)``: returns rank 0's ``obj`` on every rank (a collective).
    ``get_rank()``: this process's rank."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []
        # The driver's hosts stamp this state has seen; None: the running world's (learned
        # from its assignment at the next check).
        self._last_seen_stamp = None
        self._host_messages = HostMessages(self)

    def register_reset_callbacks(self, callbacks):
        """Adds functions (no arguments) to call after each world change, e.g. to scale the
        learning rate with the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Called by ``run`` after the world was re-formed: ``reset()``, then the callbacks."""
        self._last_seen_stamp = None
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state (the restore point after a failure), then checks for host changes
        (``check_host_updates``, which may raise ``HostsUpdatedInterrupt``). A collective:
        every rank commits at the same point. Saving copies the state, so commit every few
        batches rather than every batch."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` on every rank when the driver reports a change of
        the job's hosts since the last check (rank 0 asks the driver and broadcasts the
        answer, so every rank raises together). A collective in an elastic job; outside one,
        a no-op."""
        if not _elastic_core.enabled():
            return
        seen = self._seen_stamp()
        answer = (seen, seen, False, False)
        if self._rank() == 0:
            stamp, added, removed = _elastic_core.host_updates(seen)
            answer = (seen, max(stamp, seen), added, removed)
        seen, stamp, added, removed = self._bcast_object(answer)
        self._last_seen_stamp = stamp
        if stamp > seen:
            raise HostsUpdatedInterrupt(skip_sync=bool(removed and not added))

    def _seen_stamp(self):
        """The driver's hosts stamp this state has acted on (elastic workers only)."""
        if self._last_seen_stamp is None:
            self._last_seen_stamp = _elastic_core.assignment()[1]
        return self._last_seen_stamp

    def save(self):
        """Saves the state to host memory."""
        raise NotImplementedError(f"{type(self).__name__} must define save()")

    def restore(self):
        """Restores the last saved state, undoing every change made since."""
        raise NotImplementedError(f"{type(self).__name__} must define restore()")

    def sync(self):
        """Makes every rank's state rank 0's (a collective)."""
        raise NotImplementedError(f"{type(self).__name__} must define sync()")

    def reset(self):
        """Adapts the state to a new world, before it is synchronised (no-op here)."""


class HostMessages:
    """``state._host_messages``: the notices of host changes that ``check_host_updates()``
    has not acted on yet. Horovod's is a private ``queue.Queue`` that the driver fills in
    the background and ``check_host_updates()`` empties; scripts copied from Horovod's own
    elastic test wait on its ``empty()`` before they commit. Here the driver is asked when the
    question comes: ``empty()`` is false once the driver has reported a change of the job's
    hosts after the one this state last acted on (a round trip to the driver, no collective:
    any rank may ask); after a re-form it is true again, as Horovod gives the new world a
    fresh queue. Outside an elastic job it is always empty. The changes are merged into one
    notice, so ``qsize()`` is 0 or 1."""

    def __init__(self, state):
        self._state = state

    def empty(self):
        """Whether no change of hosts is waiting for ``check_host_updates()``."""
        if not _elastic_core.enabled():
            return True
        seen = self._state._seen_stamp()
        stamp, _added, _removed = _elastic_core.host_updates(seen)
        return stamp <= seen

    def qsize(self):
        """1 when a change of hosts is waiting for ``check_host_updates()``, else 0."""
        return 0 if self.empty() else 1


def _copy(value):
    """A deep copy of ``value``, or ``value`` itself when it cannot be copied (a lock, a
    file): such an object is kept by reference, as Horovod keeps every object."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - any object may refuse to be copied
        return value


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes
    (``state.epoch``, ``state.batch``...). ``save`` keeps a deep copy of each (so changing a
    list in place after a commit does not change the commit); ``sync`` makes rank 0's values
    every rank's values and restore point, broadcast with ``bcast_object`` (the objects must
    pickle)."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = {k: _copy(v) for k, v in kwargs.items()}
        for attr, value in kwargs.items():
            setattr(self, attr, value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: _copy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        """Makes rank 0's values every rank's values and restore point (a collective), as
        Horovod's does. Rank 0 sends its current values; Horovod's sends its saved ones. They
        are the same after a commit or a restore (where ``run`` synchronises); they differ
        only when rank 0 changed values since its last commit (``check_host_updates()``
        called between commits, a value set before ``run``): then these go with the
        models, which are synchronised as they are in both, where Horovod's went back to
        the commit alone."""
        if self._saved_state:
            current = {attr: getattr(self, attr) for attr in self._saved_state}
            values = self._bcast_object(current)
            self._saved_state = {attr: _copy(value) for attr, value in values.items()}
            self._set_attrs()

    def _set_attrs(self, values=None):
        for attr, value in (self._saved_state if values is None else values).items():
            setattr(self, attr, _copy(value))


def leave(error):
    """Ends this worker cleanly (status 0) after the driver left it out of the new world
    (``WorkerRemovedError``): a one-line note on stderr, then ``sys.exit(0)``."""
    print(f"fasthorovod: this worker leaves the elastic job: {error}", file=sys.stderr,
          flush=True)
    sys.exit(0)


def run_fn(func, reset, agree_sync=None):
    """``func(state, *args, **kwargs)`` run until it returns, re-forming the world with
    ``reset()`` (no arguments) after each failure or host change; see the module's text.

    ``agree_sync(needed)``: whether any rank needs the state synchronised (a collective), so
    that a worker that joined a world formed after hosts were only removed (it was started
    after rank 0's last look at the hosts) is synchronised with the others, not alone (where
    it would wait for them in vain: Horovod's race). Without it each rank decides alone, as
    in Horovod."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                sync = not skip_sync
                if agree_sync is not None:
                    sync = agree_sync(sync)
                if sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                if not _elastic_core.enabled():
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = bool(e.skip_sync)
            try:
                reset()
            except _elastic_core.WorkerRemovedError as e:
                leave(e)
            state.on_reset()

    return wrapper


__all__ = ["State", "ObjectState", "HostMessages", "run_fn", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
