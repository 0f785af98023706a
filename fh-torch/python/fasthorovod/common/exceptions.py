"""Exceptions, under the names Horovod scripts import them by.

Each class lives here by name: it prints as ``fasthorovod.common.exceptions.<Name>`` and
pickles by that path (a pickled error raised on one rank unpickles on another, or in a parent
process, as the same class). ``HorovodInternalError`` is the class the runtime raises (defined
by the extension module under this module's name)."""

from fasthorovod._core import HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in an elastic job by ``State.commit()`` (``check_host_updates()``), on every
    rank at the same commit, when the driver reports that the job's hosts changed;
    ``hvd.elastic.run`` catches it and re-forms the world. ``skip_sync``: hosts were only
    removed, so the survivors, which hold the same committed state, need not synchronise it
    (as in Horovod)."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync

    def __reduce__(self):
        return (type(self), (self.skip_sync,))


class HorovodVersionMismatchError(ImportError):
    """A framework's version at run time differs from the one the library was built for
    (Horovod's error of that name; FastHorovod builds against no framework's C++ ABI and
    never raises it, the class exists for ``except`` clauses)."""

    def __init__(self, name, version, installed_version):
        super().__init__(
            f"Framework {name} installed with version {installed_version} but found version "
            f"{version}; reinstall FastHorovod against the framework version in use")
        self.name = name
        self.version = version
        self.installed_version = installed_version

    def __reduce__(self):
        return (type(self), (self.name, self.version, self.installed_version))


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError"]
