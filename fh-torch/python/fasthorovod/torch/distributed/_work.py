"""The ``fasthorovod`` backend's asynchronous work: each collective's ``_Op`` (its engine
handles and futures), the ``Work`` torch hands out for it, and the group's completer thread,
which waits for the handles in submission order and completes each future.
"""

import collections
import threading

import torch
from torch._C._distributed_c10d import Work as _C10dWork


class _Failed:
    """What a failed collective's source future holds: the error, raised by ``_unwrap``."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _unwrap(source):
    """The callback between a collective's source future and the future it hands out: an
    error raised here completes that future *with an error* in C++, which is what DDP's
    reducer and chained callbacks see (``Future.set_exception`` would complete it with the
    exception as its value)."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _Op:
    """A submitted collective: its engine handles, how to turn their results into its value,
    and its futures: ``source``, completed once by the completer thread, and ``future``
    (chained on it), which the Work hands out."""

    __slots__ = ("what", "handles", "finish", "source", "future", "error", "done")

    def __init__(self, what, handles, finish):
        self.what = what
        self.handles = handles
        self.finish = finish
        self.error = None
        self.source = torch.futures.Future()
        self.future = self.source.then(_unwrap)
        # Set once the op is complete: what the group keeps while the op's name may come back
        # (``_Namer.hold``), so that it keeps no tensor of the op alive.
        self.done = threading.Event()

    def complete(self):
        """Wait for every handle (the GIL released), then complete the source future once."""
        try:
            self._complete()
        finally:
            self.done.set()

    def _complete(self):
        results, error = [], None
        for h in self.handles:
            try:
                results.append(h.wait())
            except BaseException as e:  # noqa: BLE001 - every member is waited for
                error = error or e
                results.append(None)
        if error is None:
            try:
                value = self.finish(results)
            except BaseException as e:  # noqa: BLE001 - the error goes to the future
                error = e
        if error is not None:
            if not isinstance(error, Exception):
                error = RuntimeError(f"fasthorovod backend: {self.what}: {error!r}")
            self.error = error
            self.source.set_result(_Failed(error))
        else:
            self.source.set_result(value)


class _Work(_C10dWork):
    """A collective's ``Work``: ``wait()`` waits for it (the GIL released) and raises its
    error as the engine gave it (``HorovodInternalError`` naming the ranks); ``get_future()``
    is the future DDP's communication hooks chain on (failed with a ``RuntimeError`` of the
    same text). (torch's ``_create_work_from_future`` would do, but its ``wait()`` swallows
    the error.)"""

    def __init__(self, op):
        super().__init__()
        self._op = op

    def wait(self, timeout=None):
        """Wait for completion; raises the collective's error."""
        self._op.source.wait()
        if self._op.error is not None:
            raise self._op.error
        self._op.future.wait()
        return True

    def get_future(self):
        """The future completed with the collective's result (the output tensors)."""
        return self._op.future


class _WorkHandle:
    """A Work waited for like an engine handle (see ``_each``)."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work

    def wait(self):
        self._work.wait()


class _Completer:
    """One thread per group completing its collectives' futures in submission order. Within
    a group every member submits in the same order, so waiting in that order never waits on
    a collective that another member can only submit after a later one completes."""

    def __init__(self, label):
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"fasthorovod-{label}",
                                        daemon=True)
        self._thread.start()

    def add(self, op):
        with self._cv:
            if self._closed:
                raise RuntimeError(f"fasthorovod backend: {op.what} on a process group that "
                                   "was shut down (destroy_process_group)")
            self._queue.append(op)
            self._cv.notify()

    def _run(self):
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                op = self._queue.popleft()
            op.complete()

    def close(self, timeout):
        """Stop once the queued collectives are complete (bounded by ``timeout`` seconds;
        their handles fail when the engine stops, which completes them)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
