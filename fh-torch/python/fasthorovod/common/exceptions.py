"""Exceptions, under the names Horovod scripts import them by."""

from fasthorovod._core import HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by Horovod's elastic mode when hosts change. FastHorovod has no elastic mode
    yet; the class exists so that ``except HostsUpdatedInterrupt`` clauses keep working."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
