"""The extension's elastic functions, in one place: the elastic Python code calls them only
through this module (tests replace its functions to act as a driver).

``fasthorovod._core`` gives an elastic worker (started by ``fhrun --host-discovery-script``,
with ``FH_ELASTIC_ADDR`` set) ``elastic_enabled``, ``elastic_assignment``,
``elastic_host_updates`` and ``WorkerRemovedError``. An extension built without them is never
elastic: ``enabled()`` is false there, and asking it for an assignment or host updates raises
a ``RuntimeError`` saying so."""

from fasthorovod import _core


class _NeverRaised(RuntimeError):
    """Stands for ``_core.WorkerRemovedError`` in an extension that lacks it (and so never
    raises it)."""


#: Raised by ``init()`` in an elastic worker that the driver left out of the new world.
WorkerRemovedError = getattr(_core, "WorkerRemovedError", _NeverRaised)


def _binding(name):
    fn = getattr(_core, name, None)
    if fn is None:
        raise RuntimeError(f"fasthorovod._core has no {name}: this build of the extension "
                           "lacks elastic training; rebuild fasthorovod from a source tree "
                           "with elastic support")
    return fn


def enabled():
    """Whether this process is a worker of an elastic job (``fhrun
    --host-discovery-script``)."""
    fn = getattr(_core, "elastic_enabled", None)
    return bool(fn()) if fn is not None else False


def assignment():
    """``(generation, hosts_stamp)`` of the running world (elastic workers only)."""
    generation, stamp = _binding("elastic_assignment")()
    return int(generation), int(stamp)


def host_updates(since):
    """``(stamp, added, removed)``: the driver's host-set changes after stamp ``since``."""
    stamp, added, removed = _binding("elastic_host_updates")(int(since))
    return int(stamp), bool(added), bool(removed)
