"""Process sets (Horovod's API): collectives over a subset of the ranks.

A ``ProcessSet`` lists world ranks. It becomes usable once registered, either at start-up
(``hvd.init(process_sets=[...])``) or later with ``hvd.add_process_set`` when dynamic process
sets are enabled (``HOROVOD_DYNAMIC_PROCESS_SETS=1``, or ``hvd.init(process_sets="dynamic")``).
Registering and removing are collective: every rank calls them, in the same order, with the
same ranks; ids are the same on every rank. Each set runs its own engine (its own negotiation
and channels), so sets never hold each other up.

Every collective takes ``process_set=``; a rank outside the set, an unregistered or removed
set raise ``ValueError``. ``root_rank`` of a broadcast is a world rank that must belong to
the set.
"""

import os

from fasthorovod import _core

_TRUE = ("1", "true", "yes", "on")

# Registered sets by id (0 is the global set).
_registry = {}
_dynamic = False


class ProcessSet:
    """A set of ranks that runs collectives among themselves (Horovod's ``ProcessSet``)."""

    def __init__(self, ranks_or_comm=None):
        if ranks_or_comm is None:
            self.ranks = None
        else:
            try:
                self.ranks = sorted(int(r) for r in ranks_or_comm)
            except TypeError:
                raise NotImplementedError(
                    "ProcessSet from an MPI communicator is not supported by FastHorovod; "
                    "give a list of ranks"
                ) from None
            if len(set(self.ranks)) != len(self.ranks):
                raise ValueError(f"a process set lists a rank twice: {ranks_or_comm}")
        self.process_set_id = 0 if ranks_or_comm is None else None

    def _is_global(self):
        if self.ranks is None:
            return True
        if not _core.is_initialized():
            return False
        return self.ranks == list(range(_core.topology()[1]))

    def _members(self):
        if self.ranks is None:
            return list(range(_core.topology()[1]))
        return self.ranks

    def size(self):
        """Number of ranks in the set."""
        return len(self._members())

    def rank(self):
        """This process's rank within the set (-1 when not a member)."""
        me = _core.topology()[0]
        members = self._members()
        return members.index(me) if me in members else -1

    def included(self):
        """Whether this process belongs to the set."""
        return self.rank() >= 0

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and (
            (self._is_global() and other._is_global()) or self.ranks == other.ranks
        )

    def __hash__(self):
        return hash(None if self._is_global() else tuple(self.ranks))

    def __repr__(self):
        if self.ranks is None:
            return "ProcessSet(global)"
        return f"ProcessSet({self.ranks}, id={self.process_set_id})"


global_process_set = ProcessSet(None)


def _check(process_set):
    """The id of the engine that runs ``process_set`` on this rank (0: the global one).
    ``ValueError`` when it is not a ProcessSet, not registered, or this rank is outside it."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        if process_set._is_global():
            return 0
        raise ValueError(
            f"{process_set!r} is not registered (or was removed): pass it to "
            "hvd.init(process_sets=[...]) or call hvd.add_process_set first")
    if process_set.process_set_id != 0 and not process_set.included():
        raise ValueError(f"this rank ({_core.topology()[0]}) is not a member of {process_set!r}")
    return process_set.process_set_id


def _root_in_set(process_set, root_rank):
    """``root_rank`` (a world rank) as a rank within ``process_set``."""
    if process_set is None or process_set is global_process_set or \
            process_set.process_set_id in (0, None):
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not a member of {process_set!r}")
    return process_set.ranks.index(root_rank)


def _size_of(process_set):
    if process_set is None:
        return _core.topology()[1]
    return process_set.size()


def _rank_of(process_set):
    if process_set is None:
        return _core.topology()[0]
    return process_set.rank()


def _dynamic_enabled():
    env = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "")
    return _dynamic or env.strip().lower() in _TRUE


def _register(process_set):
    if isinstance(process_set, ProcessSet):
        ps = process_set
    else:
        ps = ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("the global process set is always registered")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is registered already")
    ps.process_set_id = _core.add_process_set(list(ps.ranks))
    _registry[ps.process_set_id] = ps
    return ps


def _init_sets(process_sets):
    """Called by ``hvd.init`` once the runtime runs: register the static sets."""
    global _dynamic
    _registry.clear()
    _registry[0] = global_process_set
    _dynamic = False
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got "
                             f"{process_sets!r}")
        _dynamic = True
        return
    for ps in process_sets:
        _register(ps)


def _forget_sets():
    """Called by ``hvd.shutdown``: the sets are gone with the runtime."""
    for ps in _registry.values():
        if ps is not global_process_set:
            ps.process_set_id = None
    _registry.clear()


def add_process_set(process_set):
    """Register a process set (a ``ProcessSet`` or a list of ranks) after ``init``; collective
    (every rank calls it with the same ranks). Needs dynamic process sets
    (``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``). Returns the
    registered ``ProcessSet``."""
    if not _core.is_initialized():
        raise ValueError("FastHorovod has not been initialized; call hvd.init() first")
    if not _dynamic_enabled():
        raise ValueError("adding a process set after hvd.init() needs dynamic process sets: "
                         "set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic'); or pass the sets to "
                         "hvd.init(process_sets=[...])")
    return _register(process_set)


def remove_process_set(process_set):
    """Unregister a process set added with ``add_process_set``; collective. Returns True."""
    if not _core.is_initialized():
        raise ValueError("FastHorovod has not been initialized; call hvd.init() first")
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"remove_process_set takes a ProcessSet, got "
                         f"{type(process_set).__name__}")
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed")
    if not _dynamic_enabled():
        raise ValueError("removing a process set needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic')")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered (or was removed already)")
    _core.remove_process_set(process_set.process_set_id)
    _registry.pop(process_set.process_set_id, None)
    process_set.process_set_id = None
    return True
