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

Names: see ``_names`` (a function of the collective's place in the sequence and of an agreed
period, so that they come back step after step and hit the engine's cache).
"""

import functools

import torch
from torch._C._distributed_c10d import Backend as _C10dBackend

from fasthorovod import _core
from fasthorovod.torch.distributed._names import _Namer, _sig
from fasthorovod.torch.distributed._work import _Completer, _Op, _Work, _WorkHandle

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
            holder.wait()  # the name's last collective is complete (the GIL released)
        handles = submit(name)
        op = _Op(what, handles if isinstance(handles, list) else [handles], finish)
        self._namer.hold(name, op.done)
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
