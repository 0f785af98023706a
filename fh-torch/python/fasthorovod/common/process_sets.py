"""Process sets. Only the global set (every rank) is supported so far: any other set raises
``NotImplementedError`` when it is used, naming what is missing."""

from fasthorovod import _core

_NOT_YET = (
    "process sets other than the global one are not supported by FastHorovod yet; "
    "pass process_set=global_process_set (the default)"
)


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

    def size(self):
        """Number of ranks in the set."""
        if self._is_global():
            return _core.topology()[1]
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set (-1 when not a member)."""
        me = _core.topology()[0]
        if self._is_global():
            return me
        return self.ranks.index(me) if me in self.ranks else -1

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
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet(None)


def _check(process_set):
    """Raise unless ``process_set`` is the global set."""
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if not process_set._is_global():
        raise NotImplementedError(_NOT_YET + f" (got {process_set!r})")


def add_process_set(process_set):
    """Horovod's ``add_process_set``: not supported yet."""
    raise NotImplementedError(_NOT_YET)


def remove_process_set(process_set):
    """Horovod's ``remove_process_set``: not supported yet."""
    raise NotImplementedError(_NOT_YET)
