"""The ``fasthorovod`` backend of ``torch.distributed``: a ``torch._C._distributed_c10d.Backend``
written in Python whose collectives are submissions to the engine.

Each collective is submitted to the group's engine at once (in the tensor's own memory where
the result stays in place: all_reduce, broadcast, the bucket of DDP) and returns a ``Work`` over
a ``torch.futures.Future``. The group's completer thread waits for the engine's handles in
submission order (the GIL released) and completes each future -- with the result, written into
the caller's tensors, or with the engine's error -- so that ``Work.wait()``, ``get_future()``
and the callbacks DDP's communication hooks chain on it behave as on Gloo. Nothing waits
between submissions: DDP's buckets are in flight together, negotiated, fused and dispatched
over the engine's channels.

Names (``_Namer``): a function of the collective's place in the group's sequence and of a
period the members agree on, never of the tensors, so that ranks that disagree on a collective
(its kind, shape, dtype, op or root) meet under one name and fail with the engine's error
naming the ranks on each side; and names come back when the group's sequence of collectives
repeats (DDP's buckets, step after step), so that the engine negotiates them through its
bit-vector cache.
"""

import collections
import functools
import threading

import torch
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from fasthorovod import _core

NAME = "fasthorovod"

_RedOp = torch.distributed.ReduceOp.RedOpType

# torch's reduce ops the engine runs natively, by the engine's names.
_ENGINE_OPS = {
    _RedOp.SUM: "sum",
    _RedOp.AVG: "average",
    _RedOp.PRODUCT: "product",
    _RedOp.MIN: "min",
    _RedOp.MAX: "max",
}

# Bitwise ops: run as an allgather and a local reduction (integer and bool tensors).
_BITWISE = {
    _RedOp.BAND: torch.bitwise_and,
    _RedOp.BOR: torch.bitwise_or,
    _RedOp.BXOR: torch.bitwise_xor,
}


def _refuse(operation, why):
    return NotImplementedError(f"the fasthorovod backend does not support {operation}: {why}")


def _op_type(reduce_op):
    """The ``RedOpType`` of a ``ReduceOp`` object or of a ``RedOpType``."""
    return getattr(reduce_op, "op", reduce_op)


def _check_cpu(operation, tensors):
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fasthorovod backend: {operation} takes tensors, got "
                            f"{type(t).__name__}")
        if t.device.type != "cpu":
            raise _refuse(f"{operation} of {t.device.type} tensors",
                          "it is registered for CPU tensors (move them with .cpu(), or give "
                          "the device its own backend: init_process_group("
                          "'cpu:fasthorovod,cuda:nccl'))")
        if t.is_sparse:
            raise _refuse(f"{operation} of sparse tensors", "use dense tensors (.to_dense())")


def _one(operation, tensors):
    """The single tensor of a per-device tensor list (one device per process here)."""
    if len(tensors) != 1:
        raise _refuse(f"{operation} of {len(tensors)} tensors in one call",
                      "give one tensor per call (one device per process)")
    return tensors[0]


def _flat(t):
    """``t`` as a contiguous 1-D tensor (a view when it is contiguous)."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _wire(t):
    """``t`` (contiguous) as the engine can move it: a complex tensor as its real pairs (a
    trailing dimension of 2, so that rows and splits stay as they were), anything else as it
    is. Results come back as bytes, read with the complex dtype (``_result``)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _engine_view(t):
    """The memory the engine reduces for ``t`` (contiguous, real) and what to copy back after:
    ``(view, writeback)``; ``writeback`` is None when ``view`` shares ``t``'s memory."""
    work = t if t.is_contiguous() else t.contiguous()
    if work.is_complex():
        work = torch.view_as_real(work)
    return work, (None if work.data_ptr() == t.data_ptr() and t.is_contiguous() else work)


def _result(value, dtype):
    """A handle's new tensor (allgather, alltoall, reducescatter) as a torch tensor."""
    data, shape = value
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


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

    __slots__ = ("what", "handles", "finish", "source", "future", "error")

    def __init__(self, what, handles, finish):
        self.what = what
        self.handles = handles
        self.finish = finish
        self.error = None
        self.source = torch.futures.Future()
        self.future = self.source.then(_unwrap)

    def complete(self):
        """Wait for every handle (the GIL released), then complete the source future once."""
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


def _sig(*parts):
    """A collective's signature for the period search: its kind and arguments, tensors by
    dtype and shape."""
    out = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            out.append((str(p.dtype), tuple(p.shape)))
        elif isinstance(p, (list, tuple)):
            out.append(_sig(*p))
        else:
            out.append(p)
    return tuple(out)


class _Namer:
    """The names of a group's collectives, the same on every member.

    torch requires every member to issue a group's collectives in the same order, so the
    ``n``-th collective is the same operation everywhere. Until the members agree on a period
    it is named ``tdist.<n>`` (used once: negotiated through the engine's coordinator). Every
    ``CHECK`` collectives the members agree, with one small allreduce issued at the same ``n``
    everywhere and applied ``CHECK`` collectives later (it is not waited for in between, so the
    collectives after it are not held up behind it), on the period of their sequence of
    signatures up to the ``n`` it was issued at: each takes the ``p`` (up
    to ``LONGEST``) whose repetition reaches furthest back in its history (at least twice; the
    shortest such ``p`` on a tie), so that a step's run of equal collectives (DDP's equal
    buckets, a transformer's layers) does not pass for the period of the whole step; the period
    is taken when every member found the same one. From then on the ``n``-th collective is
    ``tdist.<base>+<P>.<(n - base) mod S>``, ``S`` the smallest multiple of ``P`` of at least
    ``DEPTH``: the names of a training step come back at the next step with the same
    signatures, and the engine negotiates them through its bit-vector cache. A name is a
    function of ``n`` and the agreed period alone, so members that disagree on a collective
    still meet under one name and fail with the engine's error naming them; a sequence that
    stops repeating costs the cache a changed slot, and the next agreement applied falls back
    to names used once. A name is reused only after the collective that last had it has completed on
    this rank (``S`` names apart: at least ``DEPTH`` collectives may be in flight however short
    the period; and a period agreed anew, at ``base``, starts names of its own)."""

    CHECK = 8
    LONGEST = 256
    DEPTH = 4

    def __init__(self, process_set_id):
        self._ps = process_set_id
        self._n = 0
        self._period = 0
        self._span = 0
        self._base = 0
        self._history = collections.deque(maxlen=2 * self.LONGEST)
        self._holders = {}  # reused name -> the _Op that has it now
        self._pending = None  # the last agreement issued: (handle, its tensor)
        self._lock = threading.Lock()

    @property
    def period(self):
        """The agreed period (0: none; names are used once)."""
        return self._period

    def claim(self, sig):
        """The next name, for a collective of signature ``sig``, and the ``_Op`` that had that
        name last (to be complete before the name is submitted again), or None."""
        with self._lock:
            n = self._n
            if n and n % self.CHECK == 0:
                self._agree(n)
            self._n += 1
            self._history.append(sig)
            if not self._period:
                return f"tdist.{n}", None
            name = f"tdist.{self._base}+{self._period}.{(n - self._base) % self._span}"
            return name, self._holders.get(name)

    def hold(self, name, op):
        """``op`` has ``name`` now (names used once are not kept)."""
        if "+" not in name:
            return
        with self._lock:
            self._holders[name] = op

    @classmethod
    def period_of(cls, history):
        """The period of a sequence of signatures: the ``p`` (1 to ``LONGEST``) whose
        repetition covers the longest end of ``history``, at least ``2p`` long (the shortest
        ``p`` among equals); 0 when none repeats."""
        h = list(history)
        size = len(h)
        best, covered = 0, 0
        for p in range(1, min(cls.LONGEST, size // 2) + 1):
            if covered == size:
                break  # nothing can cover more; longer periods only tie
            i = size - 1 - p  # h[i] == h[i + p] for every i above this one
            while i >= 0 and h[i] == h[i + p]:
                i -= 1
            length = size - 1 - i  # the end of the history that repeats with period p
            if length >= 2 * p and length > covered:
                best, covered = p, length
        return best

    def _agree(self, n):
        """At the same ``n`` everywhere: apply the agreement issued ``CHECK`` collectives ago
        (its period starts at ``n``), then issue the next one, on the history up to ``n``."""
        if self._pending is not None:
            handle, both = self._pending
            self._pending = None
            handle.wait()  # issued CHECK collectives ago: done by now, as a rule
            most, least = int(both[0]), -int(both[1])
            agreed = most if most == least else 0
            if agreed != self._period:
                self._period, self._base = agreed, n
                self._span = agreed * -(-self.DEPTH // agreed) if agreed else 0
                self._holders.clear()
        mine = self.period_of(self._history)
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        handle = _core.allreduce(both, name=f"tdist.agree.{n}", op="max",
                                 process_set_id=self._ps)
        self._pending = (handle, both)


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


class ProcessGroupFastHorovod(_C10dBackend):
    """A group's backend: its collectives run on the engine ``process_set_id`` (0: the world
    engine of ``fasthorovod.torch``; else a subgroup's own world). Made by
    ``init_process_group('fasthorovod')`` and ``new_group(..., backend='fasthorovod')``."""

    def __init__(self, rank, size, process_set_id, group_name, owns_engine):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._ps = process_set_id
        self._owns = owns_engine
        self._group_name = group_name
        self._namer = _Namer(process_set_id)
        self._completer = _Completer(f"pg{group_name}")
        self._down = False

    # -- identity ---------------------------------------------------------------------------

    def getBackendName(self):  # noqa: N802 - torch's name
        """``"fasthorovod"``."""
        return NAME

    @property
    def process_set_id(self):
        """The id of the engine that runs this group (0: the world's)."""
        return self._ps

    def stats(self):
        """The counters of this group's engine (completed operations, cache hits, rounds,
        fused groups, data bytes)."""
        return dict(_core.stats(self._ps))

    # -- submission -------------------------------------------------------------------------

    @property
    def period(self):
        """The period of this group's collectives its members agreed on (0: none)."""
        return self._namer.period

    def _submit(self, what, submit, finish, sig):
        """Submit through ``submit(name)`` (returns the engine's handles) under the next name
        (``sig``: the collective's signature) and return the Work whose future
        ``finish(results)`` completes."""
        if self._down:
            raise RuntimeError(f"fasthorovod backend: {what} on a process group that was shut "
                               "down (destroy_process_group)")
        name, holder = self._namer.claim(sig)
        if holder is not None:
            holder.source.wait()  # the name's last collective is complete (the GIL released)
        handles = submit(name)
        op = _Op(what, handles if isinstance(handles, list) else [handles], finish)
        self._namer.hold(name, op)
        self._completer.add(op)
        return _Work(op)

    def _done(self, what, value):
        """A Work completed already (nothing to send)."""
        op = _Op(what, [], lambda _results: value)
        op.complete()
        return _Work(op)

    def _allreduce_one(self, what, t, reduce_op, name):
        """Submit the allreduce of ``t`` under ``name``; returns (handles, finish-of-t)."""
        kind = _op_type(reduce_op)
        if kind in _BITWISE:
            if t.is_floating_point() or t.is_complex():
                raise _refuse(f"{what} with {kind.name} of {t.dtype} tensors",
                              "bitwise ops take integer or bool tensors")
            flat = _flat(t)
            row = flat.reshape(1, -1)
            h = _core.allgather(row, name=name, process_set_id=self._ps)

            def finish_bitwise(result, t=t, fn=_BITWISE[kind]):
                rows = _result(result, t.dtype)
                t.copy_(functools.reduce(fn, rows.unbind(0)).reshape(t.shape))

            return h, finish_bitwise
        prescale = 1.0
        if kind == _RedOp.PREMUL_SUM:
            factor = reduce_op.factor
            if isinstance(factor, torch.Tensor):
                t.mul_(factor.to(t.device))
            else:
                prescale = float(factor)
            op = "sum"
        elif kind in _ENGINE_OPS:
            op = _ENGINE_OPS[kind]
        else:
            raise _refuse(f"{what} with ReduceOp {kind.name}", "use SUM, AVG, PRODUCT, MIN, "
                          "MAX, BAND, BOR, BXOR or PREMUL_SUM")
        if t.is_complex() and op not in ("sum", "average"):
            raise _refuse(f"{what} with {op} of complex tensors", "use SUM or AVG")
        view, writeback = _engine_view(t)
        h = _core.allreduce(view, name=name, op=op, prescale=prescale,
                            process_set_id=self._ps)

        def finish_in_place(_result, t=t, writeback=writeback):
            if writeback is not None:
                t.copy_(torch.view_as_complex(writeback) if t.is_complex() else writeback)

        return h, finish_in_place

    # -- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        """``all_reduce``: every op (SUM, AVG, PRODUCT, MIN, MAX natively; PREMUL_SUM as a
        pre-scaled SUM; BAND, BOR, BXOR through an allgather), in the tensor's memory."""
        what = "all_reduce"
        _check_cpu(what, tensors)
        t = _one(what, tensors)

        fin_box = []

        def submit(name):
            h, fin = self._allreduce_one(what, t, opts.reduceOp, name)
            fin_box.append(fin)
            return h

        def finish(results):
            fin_box[0](results[0])
            return tensors

        return self._submit(what, submit, finish, _sig(what, t, _op_type(opts.reduceOp)))

    def allreduce_coalesced(self, tensors, opts):
        """``all_reduce_coalesced``: the tensors reduced as one grouped allreduce (fused)."""
        what = "all_reduce_coalesced"
        _check_cpu(what, tensors)
        kind = _op_type(opts.reduceOp)
        if kind not in _ENGINE_OPS:
            raise _refuse(f"{what} with ReduceOp {kind.name}",
                          "use SUM, AVG, PRODUCT, MIN or MAX")
        if not tensors:
            return self._done(what, tensors)
        views = [_engine_view(t) for t in tensors]

        def submit(name):
            return _core.grouped_allreduce([v for v, _ in views], name=name,
                                           op=_ENGINE_OPS[kind], process_set_id=self._ps)

        def finish(_results):
            for t, (_, writeback) in zip(tensors, views):
                if writeback is not None:
                    t.copy_(torch.view_as_complex(writeback) if t.is_complex() else writeback)
            return tensors

        return self._submit(what, submit, finish, _sig(what, tensors, kind))

    def allreduce_sparse(self, tensors, opts):
        """Refused: sparse tensors."""
        raise _refuse("all_reduce of sparse tensors", "use dense tensors (.to_dense())")

    def broadcast(self, tensors, opts):
        """``broadcast`` from group rank ``opts.rootRank``, in the tensor's memory."""
        what = "broadcast"
        _check_cpu(what, tensors)
        t = _one(what, tensors)
        if opts.rootTensor != 0:
            raise _refuse(f"{what} with rootTensor {opts.rootTensor}", "one tensor per call")
        view, writeback = _engine_view(t)

        def submit(name):
            return _core.broadcast(view, name=name, root=int(opts.rootRank),
                                   process_set_id=self._ps)

        def finish(_results):
            if writeback is not None:
                t.copy_(torch.view_as_complex(writeback) if t.is_complex() else writeback)
            return tensors

        return self._submit(what, submit, finish, _sig(what, t, opts.rootRank))

    def reduce(self, tensors, opts):
        """``reduce`` to group rank ``opts.rootRank`` (an allreduce whose result only the root
        keeps: the other ranks' tensors are left as they were)."""
        what = "reduce"
        _check_cpu(what, tensors)
        t = _one(what, tensors)
        target = t if self._rank == opts.rootRank else t.clone()
        fin_box = []

        def submit(name):
            h, fin = self._allreduce_one(what, target, opts.reduceOp, name)
            fin_box.append(fin)
            return h

        def finish(results):
            fin_box[0](results[0])
            return tensors

        return self._submit(what, submit, finish,
                            _sig(what, t, _op_type(opts.reduceOp), opts.rootRank))

    def allgather(self, output_tensors, input_tensors, opts):
        """``all_gather``: rank r's tensor into ``output_tensors[0][r]`` (sizes may differ per
        rank; each output must have its rank's number of elements)."""
        what = "all_gather"
        _check_cpu(what, input_tensors)
        t = _one(what, input_tensors)
        outputs = _one(what, output_tensors)
        _check_cpu(what, outputs)
        if len(outputs) != self._size:
            raise ValueError(f"fasthorovod backend: {what} needs {self._size} output tensors "
                             f"(one per rank of the group), got {len(outputs)}")
        flat = _flat(t)

        def submit(name):
            return _core.allgather(_wire(flat), name=name, process_set_id=self._ps)

        def finish(results):
            gathered = _result(results[0], t.dtype)
            _scatter_into(what, gathered, outputs)
            return output_tensors

        return self._submit(what, submit, finish, _sig(what, t, outputs))

    def all_gather_single(self, output, input, opts):  # noqa: A002 - torch's name
        """``all_gather_into_tensor``: the ranks' tensors concatenated into ``output``."""
        what = "all_gather_into_tensor"
        _check_cpu(what, [output, input])
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"fasthorovod backend: {what}: the output has {output.numel()} "
                             f"elements, but {self._size} ranks x {input.numel()} were given")
        flat = _flat(input)

        def submit(name):
            return _core.allgather(_wire(flat), name=name, process_set_id=self._ps)

        def finish(results):
            output.copy_(_result(results[0], input.dtype).reshape(output.shape))
            return [output]

        return self._submit(what, submit, finish, _sig(what, input, output))

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        """``all_gather_coalesced``: one ``all_gather`` per input tensor."""
        return self._each("all_gather_coalesced", [
            functools.partial(self.allgather, [outs], [t], opts)
            for outs, t in zip(output_lists, input_tensors)], output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        """``all_gather_into_tensor_coalesced``: one ``all_gather_into_tensor`` per pair."""
        return self._each("all_gather_into_tensor_coalesced", [
            functools.partial(self.all_gather_single, o, i, opts)
            for o, i in zip(outputs, inputs)], outputs)

    def gather(self, output_tensors, input_tensors, opts):
        """``gather`` to group rank ``opts.rootRank``: an alltoall in which every rank sends its
        tensor to the root only."""
        what = "gather"
        _check_cpu(what, input_tensors)
        t = _one(what, input_tensors)
        root = int(opts.rootRank)
        outputs = output_tensors[0] if output_tensors else []
        if self._rank == root and len(outputs) != self._size:
            raise ValueError(f"fasthorovod backend: {what} needs {self._size} output tensors on "
                             f"the root, got {len(outputs)}")
        flat = _flat(t)
        splits = [flat.numel() if r == root else 0 for r in range(self._size)]

        def submit(name):
            return _core.alltoall(_wire(flat), name=name, splits=splits,
                                  process_set_id=self._ps)

        def finish(results):
            if self._rank == root:
                _scatter_into(what, _result(results[0], t.dtype), outputs)
            return output_tensors

        return self._submit(what, submit, finish, _sig(what, t, root))

    def scatter(self, output_tensors, input_tensors, opts):
        """``scatter`` from group rank ``opts.rootRank``: an alltoall in which only the root
        sends (rank r's part to rank r)."""
        what = "scatter"
        _check_cpu(what, output_tensors)
        out = _one(what, output_tensors)
        root = int(opts.rootRank)
        if self._rank == root:
            parts = _one(what, input_tensors)
            if len(parts) != self._size:
                raise ValueError(f"fasthorovod backend: {what} needs {self._size} input tensors "
                                 f"on the root, got {len(parts)}")
            _check_cpu(what, parts)
            send = torch.cat([_flat(p) for p in parts]) if parts else _flat(out)[:0]
            splits = [p.numel() for p in parts]
        else:
            send = _flat(out)[:0].clone()
            splits = [0] * self._size

        def submit(name):
            return _core.alltoall(_wire(send), name=name, splits=splits,
                                  process_set_id=self._ps)

        def finish(results):
            out.copy_(_result(results[0], out.dtype).reshape(out.shape))
            return output_tensors

        return self._submit(what, submit, finish, _sig(what, out, root, splits))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        """``reduce_scatter``: the reduction of every rank's ``input_tensors[0][r]`` into rank
        r's output (equal sizes)."""
        what = "reduce_scatter"
        out = _one(what, output_tensors)
        parts = _one(what, input_tensors)
        _check_cpu(what, [out, *parts])
        if len(parts) != self._size:
            raise ValueError(f"fasthorovod backend: {what} needs {self._size} input tensors "
                             f"(one per rank of the group), got {len(parts)}")
        if any(p.numel() != out.numel() for p in parts):
            raise _refuse(f"{what} of inputs of different sizes",
                          "every input must have the output's number of elements")
        stacked = torch.stack([_flat(p) for p in parts])
        return self._reduce_scatter_rows(what, out, stacked, opts, output_tensors)

    def reduce_scatter_single(self, output, input, opts):  # noqa: A002 - torch's name
        """``reduce_scatter_tensor``: the reduction of ``input``, rank r getting part r."""
        what = "reduce_scatter_tensor"
        _check_cpu(what, [output, input])
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"fasthorovod backend: {what}: the input has {input.numel()} "
                             f"elements, but {self._size} ranks x {output.numel()} are needed")
        rows = _flat(input).reshape(self._size, -1)
        if rows.data_ptr() == input.data_ptr():
            rows = rows.clone()  # the engine may reduce in place; the input stays as it was
        return self._reduce_scatter_rows(what, output, rows, opts, [output])

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_rows(self, what, out, rows, opts, value):
        kind = _op_type(opts.reduceOp)
        prescale = 1.0
        if kind == _RedOp.PREMUL_SUM and not isinstance(opts.reduceOp.factor, torch.Tensor):
            prescale, op = float(opts.reduceOp.factor), "sum"
        elif kind in _ENGINE_OPS:
            op = _ENGINE_OPS[kind]
        else:
            raise _refuse(f"{what} with ReduceOp {kind.name}",
                          "use SUM, AVG, PRODUCT, MIN, MAX or PREMUL_SUM with a float factor")
        if rows.is_complex():
            raise _refuse(f"{what} of complex tensors", "use real tensors")

        def submit(name):
            return _core.reducescatter(rows, name=name, op=op, prescale=prescale,
                                       process_set_id=self._ps)

        def finish(results):
            out.copy_(_result(results[0], out.dtype).reshape(out.shape))
            return value

        return self._submit(what, submit, finish, _sig(what, rows, kind))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        """``reduce_scatter_tensor_coalesced``: one ``reduce_scatter_tensor`` per pair."""
        return self._each("reduce_scatter_tensor_coalesced", [
            functools.partial(self.reduce_scatter_single, o, i, opts)
            for o, i in zip(outputs, inputs)], outputs)

    def alltoall(self, output_tensors, input_tensors, opts):
        """``all_to_all``: ``input_tensors[r]`` to rank r, rank r's into ``output_tensors[r]``."""
        what = "all_to_all"
        _check_cpu(what, [*output_tensors, *input_tensors])
        if len(input_tensors) != self._size or len(output_tensors) != self._size:
            raise ValueError(f"fasthorovod backend: {what} needs {self._size} input and output "
                             f"tensors, got {len(input_tensors)} and {len(output_tensors)}")
        send = torch.cat([_flat(t) for t in input_tensors])
        splits = [t.numel() for t in input_tensors]

        def submit(name):
            return _core.alltoall(_wire(send), name=name, splits=splits,
                                  process_set_id=self._ps)

        def finish(results):
            _scatter_into(what, _result(results[0], send.dtype), output_tensors)
            return output_tensors

        return self._submit(what, submit, finish, _sig(what, send, splits))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                          opts):
        """``all_to_all_single``: rows of ``input`` (``input_split_sizes[r]`` to rank r, equal
        parts when empty) into ``output``."""
        what = "all_to_all_single"
        _check_cpu(what, [output, input])
        splits = [int(s) for s in input_split_sizes] or None
        send = input if input.is_contiguous() else input.contiguous()
        if send.dim() == 0:
            raise ValueError(f"fasthorovod backend: {what} needs tensors of at least one "
                             "dimension")

        def submit(name):
            return _core.alltoall(_wire(send), name=name, splits=splits,
                                  process_set_id=self._ps)

        def finish(results):
            got = _result(results[0], send.dtype)
            if got.numel() != output.numel():
                raise ValueError(f"fasthorovod backend: {what}: {got.numel()} elements arrived "
                                 f"for an output of {output.numel()} (output_split_sizes "
                                 f"{list(output_split_sizes)})")
            output.copy_(got.reshape(output.shape))
            return [output]

        return self._submit(what, submit, finish, _sig(what, send, splits))

    alltoall_base = all_to_all_single

    def barrier(self, opts):
        """``barrier`` over the group's ranks."""
        return self._submit("barrier", lambda _name: _core.barrier(self._ps),
                            lambda _results: [], ("barrier",))

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """``monitored_barrier``: a barrier (a rank that does not come is named by the engine
        after ``FH_TIMEOUT_SECONDS``, or when it is lost)."""
        self.barrier(opts).wait()

    def send(self, tensors, dst_rank, tag):
        """Refused: point-to-point."""
        raise _refuse("send (point-to-point)", "the engine runs collectives only; use "
                      "all_to_all_single, broadcast or a gloo group for point-to-point")

    def recv(self, tensors, src_rank, tag):
        """Refused: point-to-point."""
        raise _refuse("recv (point-to-point)", "the engine runs collectives only; use "
                      "all_to_all_single, broadcast or a gloo group for point-to-point")

    def recv_anysource(self, tensors, tag):
        """Refused: point-to-point."""
        raise _refuse("recv from any source (point-to-point)", "the engine runs collectives "
                      "only")

    def _each(self, what, starts, value):
        """Run several collectives as one Work (each its own engine operation; the group's
        completer finishes them before this one, which it queues after them)."""
        works = [start() for start in starts]
        op = _Op(what, [_WorkHandle(w) for w in works], lambda _results: value)
        self._completer.add(op)
        return _Work(op)

    # -- lifecycle --------------------------------------------------------------------------

    def shutdown(self):
        """``destroy_process_group``: a subgroup's world closes; the default group's engine
        stops when this backend started it (not when ``hvd.init()`` did)."""
        if self._down:
            return
        self._down = True
        try:
            if self._ps != 0:
                _core.group_close(self._ps, None)
            elif self._owns and _core.is_initialized():
                from fasthorovod.torch.mpi_ops import _basics

                _basics.shutdown()
        except Exception:  # noqa: BLE001 - an engine that failed told its operations why
            pass
        self._completer.close(timeout=5.0)

    def abort(self):
        """``abort``: as ``shutdown``."""
        self.shutdown()


def _scatter_into(what, gathered, outputs):
    """Copy the concatenation ``gathered`` into ``outputs`` in order (each by its number of
    elements)."""
    flat = gathered.reshape(-1)
    need = sum(o.numel() for o in outputs)
    if flat.numel() != need:
        raise ValueError(f"fasthorovod backend: {what}: {flat.numel()} elements arrived for "
                         f"outputs of {need} in all (sizes {[o.numel() for o in outputs]})")
    at = 0
    for o in outputs:
        n = o.numel()
        o.copy_(flat[at:at + n].reshape(o.shape))
        at += n
