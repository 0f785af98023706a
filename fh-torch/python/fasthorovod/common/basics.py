"""The runtime's lifecycle in one place: ``init``, ``shutdown``, the topology and build queries,
the timeline switches, and the exit handling (the summary line, the notice to the launcher, the
shutdown at interpreter exit or on an uncaught exception), with the state they keep.

A framework adapter makes one ``Basics`` and hands its methods on as its functions
(``fasthorovod.torch.mpi_ops`` does: ``init = _basics.init`` ...); what only the framework can
do (the homogeneity allgather on its tensors, its tracing switch) it passes to the constructor.
"""

import atexit
import faulthandler
import os
import sys

from fasthorovod import _core
from fasthorovod.common import _elastic_core
from fasthorovod.common import elastic as _common_elastic
from fasthorovod.common.exceptions import HorovodInternalError
from fasthorovod.common.process_sets import ProcessSet, _forget_sets, _init_sets

# How many elastic worlds in a row init() may see fail right after they formed.
_WORLD_ATTEMPTS = 10


class Basics:
    """The runtime of this process as a framework adapter sees it.

    ``local_sizes(local_size)``: every rank's ``local_size`` as a list (a collective over the
    world: the framework's allgather), from which ``init`` learns whether the world is
    homogeneous. ``tracing_changed()``: called when the timeline may have started or stopped
    (a new world, ``start_timeline``, ``stop_timeline``)."""

    def __init__(self, local_sizes, tracing_changed):
        self._local_sizes = local_sizes
        self._tracing_changed = tracing_changed
        # Whether every host runs the same number of ranks (found by ``init``).
        self._homogeneous = None
        # How many times init() has started the runtime in this process: a cache agreed over
        # the ranks of one world (DistributedOptimizer's gradient layouts) is dropped when it
        # changes.
        self.world_count = 0
        self._summary_said = False
        # Why this process is exiting, when an uncaught exception ends it ("raised
        # ValueError: boom"); set by the excepthook, and told to the other ranks when the
        # runtime shuts down (else "the process exited").
        self._exit_reason = None
        self._notified = False
        self._previous_excepthook = None

    # -- lifecycle ------------------------------------------------------------------------

    def init(self, comm=None, process_sets=None):
        """Start the runtime (collective: every rank calls it). The world comes from the
        launcher's environment (``fhrun``, ``torchrun``, ``mpirun``, Slurm); alone, a script
        runs as a single rank. Calling it again is a no-op.

        ``process_sets``: a list of ``ProcessSet`` to register now (collectively, in this
        order, with the same ids on every rank), or ``"dynamic"`` to allow
        ``add_process_set`` / ``remove_process_set`` later (as
        ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does).

        In an elastic job (``fhrun --host-discovery-script``) the world is the driver's next
        one; a worker that the driver leaves out of it exits here with status 0 (a line on
        stderr says why)."""
        if comm is not None:
            raise NotImplementedError("init(comm=...) is not supported by FastHorovod: the "
                                      "world is the launcher's (fhrun, torchrun, mpirun, srun)")
        if process_sets is not None and not isinstance(process_sets, str):
            process_sets = list(process_sets)
            for ps in process_sets:
                if not isinstance(ps, ProcessSet):
                    raise ValueError(f"init(process_sets=...) takes ProcessSet objects or "
                                     f"'dynamic', got {ps!r}")
        self.start(process_sets, _core.init)

    def start(self, process_sets, start_engine):
        """``init``'s work once its arguments are checked: start the engine with
        ``start_engine()`` (``_core.init``, or ``fasthorovod.torch.distributed``'s start on a
        world agreed through a torch store), then what every world gets: the homogeneity
        query and the process sets. A no-op when the runtime runs already."""
        if _core.is_initialized():
            return
        _install_stack_dumps()
        attempt = 1
        while True:
            try:
                start_engine()
            except _elastic_core.WorkerRemovedError as e:
                _common_elastic.leave(e)
            self.world_count += 1
            self._tracing_changed()
            try:
                self._start_world(process_sets)
                return
            except HorovodInternalError as e:
                # An elastic world whose member is lost right after it formed fails here on
                # every member; each registers for the next one, which the driver forms
                # without the lost worker (bounded as _core.init bounds the worlds that fail
                # to form).
                if not _elastic_core.enabled() or attempt >= _WORLD_ATTEMPTS:
                    raise
                print(f"fasthorovod: the elastic world failed as it started ({e}); joining "
                      "the next one", file=sys.stderr, flush=True)
                attempt += 1
                _forget_sets()
                try:
                    _core.shutdown("its elastic world failed as it started")
                except Exception:  # noqa: BLE001 - the failed engine is stopped all the same
                    pass

    def _start_world(self, process_sets):
        """What ``init`` does on a world that has formed: learn whether it is homogeneous (an
        allgather) and register the static process sets (collectives)."""
        sizes = list(self._local_sizes(self.local_size()))
        self._homogeneous = all(s == sizes[0] for s in sizes)
        _init_sets(process_sets)

    def shutdown(self):
        """Stop the runtime (every rank should call it; also done at interpreter exit).
        Pending operations fail; on the other ranks, operations that needed this rank fail
        with an error naming it."""
        self._say_summary()
        _forget_sets()
        _core.shutdown("hvd.shutdown() was called")

    def is_initialized(self):
        """Whether ``init()`` has been called (and ``shutdown()`` has not)."""
        return _core.is_initialized()

    def start_timeline(self, file_path, mark_cycles=False):
        """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it; a path
        holding ``{rank}`` names a file per rank, and every rank writes its own)."""
        _core.start_timeline(str(file_path))
        self._tracing_changed()

    def stop_timeline(self):
        """Stop writing the timeline."""
        _core.stop_timeline()
        self._tracing_changed()

    # -- topology -------------------------------------------------------------------------

    def rank(self):
        """This process's rank (0 .. size() - 1)."""
        return _core.topology()[0]

    def size(self):
        """Number of ranks."""
        return _core.topology()[1]

    def local_rank(self):
        """This process's rank among the ranks of its host."""
        return _core.topology()[2]

    def local_size(self):
        """Number of ranks on this host."""
        return _core.topology()[3]

    def cross_rank(self):
        """Index of this process's host among the hosts."""
        return _core.topology()[4]

    def cross_size(self):
        """Number of hosts."""
        return _core.topology()[5]

    def is_homogeneous(self):
        """Whether every host runs the same number of ranks."""
        _core.topology()  # raises when not initialized
        return bool(self._homogeneous)

    def tcp_streams(self):
        """FastHorovod only: the parallel TCP streams each rank uses to every peer on another
        host, and what they were chosen from (the same on every rank), as a dict:
        ``streams``; ``setting`` (``FH_TCP_STREAMS``: ``"auto"`` where the runtime measured,
        else the number set); and what ``auto`` measured at start-up between rank 0 and the
        first rank on another host, ``one_stream_gbps``, ``many_streams_gbps`` (Gbit/s) and
        ``probe_streams`` (``None`` where nothing was measured). ``None`` when no TCP
        connection crosses hosts (one host, shared memory only, MPI)."""
        return _core.tcp_streams()

    # -- build queries --------------------------------------------------------------------

    def mpi_built(self):
        """Whether this build can use MPI as its transport."""
        return _core.mpi_built()

    def mpi_enabled(self):
        """Whether the running job uses MPI as its transport."""
        return _core.backend().startswith("mpi")

    def mpi_threads_supported(self):
        """Whether MPI is in use with multi-threading support (the MPI transport requires
        it)."""
        return self.mpi_enabled()

    def gloo_built(self):
        """FastHorovod has no Gloo: always False."""
        return False

    def gloo_enabled(self):
        """FastHorovod has no Gloo: always False."""
        return False

    def nccl_built(self):
        """Whether NCCL support is compiled in."""
        return _core.nccl_built()

    def cuda_built(self):
        """Whether CUDA support is compiled in."""
        return _core.cuda_built()

    def rocm_built(self):
        """FastHorovod has no ROCm support: always False."""
        return False

    def ddl_built(self):
        """FastHorovod has no IBM DDL support: always False."""
        return False

    def ccl_built(self):
        """FastHorovod has no oneCCL support: always False."""
        return False

    # -- exit handling --------------------------------------------------------------------

    def install_exit_handlers(self):
        """Shut the runtime down at interpreter exit, and on an uncaught exception (telling the
        launcher and the other ranks why). Once per process."""
        atexit.register(self._shutdown_at_exit)
        if getattr(sys.excepthook, "_fasthorovod", False):
            return
        self._previous_excepthook = sys.excepthook

        def excepthook(etype, value, tb):
            self._excepthook(etype, value, tb)

        excepthook._fasthorovod = True
        sys.excepthook = excepthook

    def _say_summary(self):
        """With ``FH_SUMMARY=1`` (fhrun sets it), one line on stderr of what this rank did,
        once, before its runtime stops."""
        if self._summary_said or os.environ.get("FH_SUMMARY", "").strip().lower() not in (
                "1", "true", "yes", "on"):
            return
        try:
            line = _core.summary()
        except Exception:  # noqa: BLE001 - a summary never fails the shutdown
            return
        if line:
            self._summary_said = True
            print(line, file=sys.stderr, flush=True)

    def _shutdown_at_exit(self):
        self._say_summary()
        _forget_sets()
        _core.shutdown(self._exit_reason or "the process exited")

    def _notify_launcher(self, reason):
        """Tell fhrun (its notice pipe, ``FH_NOTICE_FD``) that this rank fails and why, before
        the runtime tells the other ranks: fhrun then blames this rank, not a survivor that
        exits first. Once; nothing here blocks or raises."""
        rank = os.environ.get("FH_RANK", "")
        if self._notified or not rank.isdigit():
            return
        self._notified = True
        try:
            _core.notify_launcher(int(rank), reason)
        except Exception:  # noqa: BLE001 - a notice is best effort
            pass

    def _excepthook(self, etype, value, tb):
        """Records the uncaught exception as the exit reason, prints it through the previous
        hook, tells the launcher this rank is failing (unless the runtime's own error is the
        cause) and shuts the runtime down with that reason."""
        try:
            self._exit_reason = _describe_exception(etype, value)
        except Exception:  # noqa: BLE001 - the traceback must still be printed
            self._exit_reason = f"raised {getattr(etype, '__name__', etype)}"
        try:
            self._previous_excepthook(etype, value, tb)
        finally:
            if not _caused_by_runtime(value):
                self._notify_launcher(self._exit_reason)
            # Shut down at once, telling the other ranks why: they fail now with an error
            # naming this rank, not when this interpreter has finished exiting.
            try:
                if _core.is_initialized():
                    _forget_sets()
                    _core.shutdown(self._exit_reason)
            except Exception:  # noqa: BLE001 - the engine had stopped already: the others know
                pass


def _install_stack_dumps():
    """Let the runtime show where this rank is when a stall names it: ``faulthandler`` writes
    every thread's stack to stderr on the runtime's stack signal (from the engine's thread,
    without the GIL). Best effort: without it the stall warning names the rank alone."""
    try:
        faulthandler.register(_core.stack_signal(), file=2, all_threads=True, chain=False)
    except Exception:  # noqa: BLE001 - no stack dumps, nothing else changes
        return
    _core.enable_stack_dumps()


def _describe_exception(etype, value):
    """One line for an uncaught exception: ``raised ValueError: boom`` (cut at 500 chars)."""
    text = " ".join(str(value).split()) if value is not None else ""
    name = getattr(etype, "__name__", str(etype))
    line = f"raised {name}: {text}" if text else f"raised {name}"
    return line if len(line) <= 500 else line[:497] + "..."


def _caused_by_runtime(value):
    """Whether the exception is (or was raised while handling) an error of the runtime: then
    another rank, or the job as a whole, failed first, and this rank is not the cause."""
    seen = 0
    while value is not None and seen < 32:
        if isinstance(value, HorovodInternalError):
            return True
        value = value.__cause__ or value.__context__
        seen += 1
    return False
