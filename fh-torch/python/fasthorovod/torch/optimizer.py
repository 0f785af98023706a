"""``DistributedOptimizer``: wraps a ``torch.optim`` optimizer so that ``step()`` applies the
gradients reduced over the ranks (averaged by default).

How it works here: the optimizer's parameters are cut into *buckets*, the units that travel
together: one parameter each, or the parameters of one of the ``groups`` given (fused into one
grouped allreduce, as Horovod fuses them). A hook on each parameter counts the backward passes;
once a parameter has had its ``backward_passes_per_step`` passes its bucket is one step closer
to ready, and a ready bucket is submitted to the engine at once, while the backward pass goes
on (its place in the model is its priority). ``synchronize()`` (and ``step()``) submits every
bucket not submitted yet (a parameter without a gradient on this rank sends zeros, so that no
rank waits for it), waits for all of them and writes the results into the gradients.

A gradient travels dense, or sparse when it is a sparse tensor (``nn.Embedding(sparse=True)``)
and ``sparse_as_dense`` is off: then the indices and values of every rank are allgathered
(``sparse_allreduce_async``). Either way ``p.grad`` stays the tensor the user has: dense
gradients are overwritten in place, sparse ones stay sparse. Which way a parameter's gradient
travels must be the same on every rank, even on a rank that computed no gradient for it: the
ranks agree on it (one small allreduce) at the first ``synchronize()`` where some gradient of a
parameter exists; until then that parameter's reduction waits for ``synchronize()`` instead of
starting during the backward pass. Only parameters that travel alone need this (with
``sparse_as_dense`` or in a group, gradients always travel dense).

On a rank outside ``process_set`` the optimizer is a plain local one (no hooks, no reduction),
as Horovod makes it.
"""

import contextlib
import time
import warnings

import torch

from fasthorovod.common.process_sets import ProcessSet, global_process_set
from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.torch._ops import Average, Max, _resolve_op
from fasthorovod.torch import _ops, mpi_ops
from fasthorovod.torch.compression import Compression
from fasthorovod.torch.mpi_ops import (allreduce, allreduce_async_, grouped_allreduce_async_,
                                       synchronize)
from fasthorovod.torch.sparse import sparse_allreduce_async

# What travels for a gradient: the dense gradient itself, a dense copy of a sparse gradient,
# or the sparse gradient (allgathered).
_DENSE, _DENSIFIED, _SPARSE = "dense", "densified", "sparse"

# Codes of a gradient's layout in the agreement (reduced with Max: sparse anywhere wins).
_NO_GRAD, _DENSE_GRAD, _SPARSE_GRAD = 0, 1, 2

# Starts with Horovod's words, which scripts and tests search for.
_STEP_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown: step() reduces the "
    "gradients a second time (with op=Sum, that multiplies them again). Call step() inside "
    "`with optimizer.skip_synchronize():` when your code calls optimizer.synchronize() "
    "itself.")


class _Bucket:
    """Parameters whose gradients are submitted together, under one name."""

    __slots__ = ("params", "name", "ready")

    def __init__(self, params, name):
        self.params = tuple(params)
        self.name = name
        self.ready = 0  # members whose gradient is complete for this step


class _InFlight:
    """A submitted bucket: the engine's handle, and per member what was sent."""

    __slots__ = ("handle", "members", "core")

    def __init__(self, handle, members, core=None):
        self.handle = handle  # a Horovod-style handle for ``synchronize`` (None with ``core``)
        self.members = members  # [(parameter, kind, sent tensor, compression context)]
        self.core = core  # or the engine's own handle of a gradient reduced in its memory

    def poll(self):
        """Whether the reduction has ended (``wait`` will not block)."""
        if self.core is not None:
            return self.core.poll()
        return _ops.poll(self.handle)

    def wait(self):
        """Wait for the reduction; its output (what ``_write_back`` takes)."""
        if self.core is not None:
            _ops._wait_cores([self.core])
            return self.members[0][2]
        return synchronize(self.handle)


def _split(items, n):
    """``items`` in ``n`` contiguous runs whose lengths differ by at most one (the first ones
    longer); no empty run."""
    base, extra = divmod(len(items), n)
    runs, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        if end > start:
            runs.append(items[start:end])
        start = end
    return runs


def _check_groups(groups):
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of lists of "
                         f"torch.Tensor, got {groups!r}")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            if not isinstance(group, (list, tuple)):
                raise ValueError("groups must be a list of lists of parameters, got an item "
                                 f"of type {type(group).__name__}")
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor, got "
                                     f"{type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("a parameter can only appear once in groups")
                seen.add(id(p))


class _DistributedOptimizer:
    """The behaviour added to the wrapped optimizer's class (see ``DistributedOptimizer``,
    which builds ``type(name, (_DistributedOptimizer, OptimizerClass), {})``)."""

    _fh_distributed = True

    # -- set-up ---------------------------------------------------------------------------

    def _fh_setup(self, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"allreduce.noname.{i}.{j}", p)
                     for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [k for k, _ in named]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(dups)}")
        unnamed = {id(p) for p in params} - {id(p) for _, p in named}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model "
                             f"parameters were not named ({len(unnamed)} of them). Pass "
                             "model.named_parameters() for the optimizer's parameters.")
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0, got "
                             f"{backward_passes_per_step}")
        self._compression = compression
        self._names = {p: k for k, p in named}
        # Horovod's attribute (parameter -> name), which scripts and Horovod's tests read.
        self._parameter_names = self._names
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        # Priority = the parameter's place in the model (forward order): under
        # FH_PRIORITY=forward the input layers' gradients go first.
        self._priority = {p: i for i, p in enumerate(params)}
        self._trained = [p for p in params if p.requires_grad]
        self._delay = {p: backward_passes_per_step for p in params}
        self._sparse_dims = {}  # parameter -> sparse_dim of its sparse gradients here
        # parameter -> _DENSE_GRAD or _SPARSE_GRAD, agreed over the ranks of one world (see
        # _layout).
        self._layouts = {}
        self._layouts_world = mpi_ops._basics.world_count
        self._in_flight = []
        # The world (the runtime's ``world_count``) of this step's submissions and pass counts.
        self._step_world = mpi_ops._basics.world_count
        self._submitted = set()  # buckets submitted this step
        self._passes_seen = False  # a backward pass reached a hook since the last reset
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        # A rank outside the process set keeps a plain local optimizer.
        self._active = process_set.included() if process_set is not None else True
        self._bucket_of = {}
        if self._active:
            self._bucket_of = self._make_buckets()
            self._register_hooks()

    def _make_buckets(self):
        """The bucket of every trained parameter. With ``groups``, the ranks first agree on
        the order of the parameters: that of the set's first rank, as Horovod takes rank 0's
        (every rank must train parameters of the same names, else ``ValueError`` on all)."""
        trained = self._trained
        if self._groups is None:
            return {p: _Bucket([p], self._names[p]) for p in trained}
        from fasthorovod.torch.functions import allgather_object

        mine = [self._names[p] for p in trained]
        everyone = allgather_object(mine, name="fasthorovod.optimizer.groups",
                                    process_set=self.process_set)
        for r, theirs in enumerate(everyone):
            if sorted(theirs) != sorted(everyone[0]):
                differ = sorted(set(everyone[0]) ^ set(theirs))
                raise ValueError(
                    "DistributedOptimizer(groups=...): the ranks' optimizers train different "
                    f"parameters (rank {r} of the set differs from its rank 0 in "
                    f"{differ[:3] or 'repeated names'}); every rank must wrap the same model")
        position = {name: i for i, name in enumerate(everyone[0])}
        trained = sorted(trained, key=lambda p: position[self._names[p]])
        if isinstance(self._groups, int):
            runs = _split(trained, self._groups)
        else:
            trained_ids = {id(p) for p in trained}
            runs, grouped = [], set()
            for group in self._groups:
                run = [p for p in group if id(p) in trained_ids]
                grouped.update(id(p) for p in run)
                if run:
                    runs.append(run)
            runs += [[p] for p in trained if id(p) not in grouped]
        buckets = {}
        for run in runs:
            bucket = _Bucket(run, self._names[run[0]])
            for p in run:
                buckets[p] = bucket
        return buckets

    def _register_hooks(self):
        for p in self._trained:
            if hasattr(p, "register_post_accumulate_grad_hook"):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
            else:  # torch < 2.1: a hook on the gradient accumulator
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(self._make_hook(p))
                self._hooks.append(accumulator)

    def _make_hook(self, p):
        def hook(*_ignore):
            self._check_world()
            if self._delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times "
                    "before call to step(). Increase backward_passes_per_step to "
                    "accumulate gradients locally.")
            self._delay[p] -= 1
            self._passes_seen = True
            if self._delay[p] == 0:
                bucket = self._bucket_of[p]
                bucket.ready += 1
                if bucket.ready == len(bucket.params) and not self._undecided(bucket):
                    self._submit(bucket)

        return hook

    # -- reduction ------------------------------------------------------------------------

    @property
    def _layout(self):
        """The layouts agreed in the running world: forgotten after each ``init()`` (an
        elastic job's new world may hold a joining worker's optimizer, which agreed nothing
        yet, so every rank agrees anew)."""
        if self._layouts_world != mpi_ops._basics.world_count:
            self._layouts = {}
            self._layouts_world = mpi_ops._basics.world_count
        return self._layouts

    def _undecided(self, bucket):
        """Whether the bucket's way of travelling is still to be agreed (see the module's
        doc): a lone parameter, without ``sparse_as_dense``, whose layout is not known."""
        return len(bucket.params) == 1 and not self.sparse_as_dense and \
            bucket.params[0] not in self._layout

    def _agree_layouts(self):
        """Agree with the other ranks on how the gradients of the undecided parameters
        travel: sparse if any rank has a sparse one, else dense if any rank has one (a
        parameter without a gradient anywhere stays undecided and sends dense zeros)."""
        undecided = [p for p in self._trained if self._undecided(self._bucket_of[p])]
        if not undecided:
            return
        codes = torch.tensor([_NO_GRAD if p.grad is None else
                              _SPARSE_GRAD if p.grad.is_sparse else _DENSE_GRAD
                              for p in undecided], dtype=torch.int32)
        agreed = allreduce(codes, name="fasthorovod.optimizer.layouts", op=Max,
                           process_set=self.process_set)
        for p, code in zip(undecided, agreed.tolist()):
            if code != _NO_GRAD:
                self._layout[p] = code

    def _gradient_of(self, p):
        """``p.grad``, made zeros when this rank computed none (the other ranks may have
        one): sparse when the parameter's gradients travel sparse, else dense."""
        if p.grad is None:
            if self._layout.get(p) == _SPARSE_GRAD and not self.sparse_as_dense:
                sparse_dim = self._sparse_dims.get(p, min(1, p.dim()))
                p.grad = torch.sparse_coo_tensor(
                    torch.zeros((sparse_dim, 0), dtype=torch.int64, device=p.device),
                    torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype,
                                device=p.device),
                    p.shape, check_invariants=False)
            else:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif p.grad.is_sparse:
            self._sparse_dims[p] = p.grad.sparse_dim()
        return p.grad

    def _scales(self):
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _submit(self, bucket):
        self._submitted.add(bucket)
        if len(bucket.params) == 1 and self._submit_in_place(bucket):
            return
        grads = [self._gradient_of(p) for p in bucket.params]
        if len(bucket.params) == 1 and not self.sparse_as_dense and \
                self._layout.get(bucket.params[0]) == _SPARSE_GRAD:
            grad = grads[0]
            if not grad.is_sparse:  # dense here, sparse elsewhere: travels sparse too
                grad = grad.to_sparse(self._sparse_dims.get(bucket.params[0],
                                                            min(1, grad.dim())))
            handle = sparse_allreduce_async(grad, bucket.name, self.op,
                                            process_set=self.process_set)
            self._in_flight.append(_InFlight(handle, [(bucket.params[0], _SPARSE, None,
                                                       None)]))
            return
        members = []
        for p, grad in zip(bucket.params, grads):
            kind = _DENSIFIED if grad.is_sparse else _DENSE
            sent, ctx = self._compression.compress(grad.to_dense() if grad.is_sparse
                                                   else grad)
            members.append((p, kind, sent, ctx))
        prescale, postscale = self._scales()
        if len(members) == 1:
            p = bucket.params[0]
            handle = allreduce_async_(members[0][2], name=bucket.name, op=self.op,
                                      prescale_factor=prescale, postscale_factor=postscale,
                                      process_set=self.process_set,
                                      _priority=self._priority.get(p, 0))
        else:
            handle = grouped_allreduce_async_([m[2] for m in members], name=bucket.name,
                                              op=self.op, prescale_factor=prescale,
                                              postscale_factor=postscale,
                                              process_set=self.process_set)
        self._in_flight.append(_InFlight(handle, members))

    def _submit_in_place(self, bucket):
        """The common case, submitted straight to the engine: a lone parameter's gradient,
        dense, contiguous and on the CPU, sent as it is (no compression) and reduced in its
        own memory. The public API's checks hold here by construction, and they cost as much
        as the submission (a gradient is submitted from the backward pass, on its critical
        path). False: not that case (the general path submits it)."""
        p = bucket.params[0]
        grad = p.grad
        if grad is None or self._compression is not Compression.none or \
                grad.layout is not torch.strided or not grad.is_cpu or \
                not grad.is_contiguous() or \
                (not self.sparse_as_dense and self._layout.get(p) == _SPARSE_GRAD):
            return False
        prescale, postscale = self._scales()
        ps = _check_process_set(self.process_set)
        core = _ops._allreduce(grad, _ops._op_name("allreduce", bucket.name, ps), self.op,
                               prescale, postscale, self._priority.get(p, 0), ps)
        self._in_flight.append(_InFlight(None, [(p, _DENSE, grad, None)], core))
        return True

    def _write_back(self, flight, output):
        outputs = output if isinstance(output, list) else [output]
        for (p, kind, sent, ctx), out in zip(flight.members, outputs):
            with torch.no_grad():
                if kind == _SPARSE and not p.grad.is_sparse:
                    p.grad.copy_(out.to_dense())
                elif kind == _SPARSE:
                    # Sparse tensors have no set_: empty the user's tensor and add the sum.
                    p.grad.zero_().add_(out)
                elif kind == _DENSIFIED:
                    reduced = self._compression.decompress(out, ctx)
                    p.grad.zero_().add_(reduced.to_sparse(p.grad.sparse_dim()))
                elif sent is not p.grad:
                    p.grad.copy_(self._compression.decompress(out, ctx))

    def _reset_step(self):
        """Forget this step's submissions and pass counts (the handles are dropped)."""
        self._in_flight = []
        self._submitted = set()
        self._passes_seen = False
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for bucket in set(self._bucket_of.values()):
            bucket.ready = 0

    def synchronize(self):
        """Reduce every gradient: submit the buckets not submitted yet (a parameter without a
        gradient on this rank sends zeros), wait for all of them and write the results into
        the gradients."""
        if not self._active:
            self._synchronized = True
            return
        self._check_world()
        t0 = time.monotonic_ns()
        self._agree_layouts()
        for p in self._trained:
            bucket = self._bucket_of[p]
            if bucket not in self._submitted:
                self._submit(bucket)
        flights = self._in_flight
        try:
            error = None
            for flight in flights:  # wait for every one, even after a failure
                try:
                    self._write_back(flight, flight.wait())
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    if error is None:
                        error = e
            if error is not None:
                raise error
        finally:
            self._reset_step()
        # What this step waited for its reductions: its exposed communication.
        _ops._record_step(time.monotonic_ns() - t0)
        self._synchronized = True

    # -- the optimizer's interface ------------------------------------------------------

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes are accumulated locally before the reduction."""
        if passes <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this context ``step()`` does not synchronize (call ``synchronize()``
        yourself first, e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside ``skip_synchronize()``), then step the optimizer."""
        t0 = time.monotonic_ns() if _ops._tracing else 0
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_WARNING)
            self.synchronize()
        self._synchronized = False
        try:
            return super().step(closure)
        finally:
            if t0:
                _ops._span("optimizer.step", f"{len(self._trained)} parameters", t0)

    def _fh_local_step(self, closure=None):
        """The wrapped optimizer's own step: no synchronization (used to make a fresh
        optimizer's state in ``broadcast_optimizer_state``)."""
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        """As the wrapped optimizer's, refused between a backward pass and the reduction of
        its gradients (``step()`` or ``synchronize()``), as Horovod refuses it. A backward
        pass of an earlier world (one cut short by a lost rank, before an elastic job formed
        the running world) is forgotten first."""
        self._check_world()
        if self._passes_seen or self._in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super().zero_grad(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """As the wrapped optimizer's; also drops this step's pending reductions and resets
        the pass counts, as Horovod does. It never raises an error of the engine: an elastic
        job's ``state.restore()`` calls it after a lost rank, while the failed engine still
        holds this step's reductions (see ``_drop_step``)."""
        self._drop_step()
        self._synchronized = False
        self._should_synchronize = True
        return super().load_state_dict(*args, **kwargs)

    def _drop_step(self):
        """Forget this step's submissions and pass counts, and end its reductions in flight
        without writing their results back and without raising their errors.

        A dropped reduction is waited for: on a failed or shut-down engine it has ended
        already (every pending operation fails with the engine), and on a running one it ends
        when the other ranks submit it too, as they do when every rank drops the same step
        (e.g. each loads a checkpoint after ``backward()``). So the engine never writes into
        a gradient after this returns, and the next step can submit the same names (a name
        still in flight would be refused). An error of a dropped reduction is the engine's:
        the next collective reports it."""
        flights = self._in_flight
        self._reset_step()
        for flight in flights:
            try:
                flight.wait()
            except Exception:  # noqa: BLE001 - dropped: its result and its error go unused
                pass

    def _check_world(self):
        """Drop the step of an earlier world: after ``shutdown()``/``init()`` (an elastic
        job's new world, or a script that re-initialises) its reductions died with the old
        engine and its pass counts belong to a backward pass that never finished."""
        if self._step_world != mpi_ops._basics.world_count:
            self._drop_step()
            self._synchronized = False
            self._step_world = mpi_ops._basics.world_count


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over the ranks of
    ``process_set`` (averaged by default).

    Each gradient is submitted the moment it is complete during ``backward()`` (after
    ``backward_passes_per_step`` passes, summed locally); ``step()`` waits for all of them.
    ``groups``: an int (that many groups of consecutive parameters) or a list of lists of
    parameters (the others alone): each group travels as one grouped allreduce.
    ``num_groups`` is the deprecated name of an int ``groups``. Sparse gradients are
    allgathered (``sparse_allreduce_async``), or allreduced densely with
    ``sparse_as_dense=True``; ``p.grad`` stays sparse either way.

    The result is an instance of a subclass of ``optimizer``'s class sharing its parameter
    groups, state and defaults. On a rank outside ``process_set`` it is a plain local
    optimizer.
    """
    _check_process_set_or_outside(process_set)
    op = _resolve_op(op, None)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("DistributedOptimizer(num_groups=...) is deprecated: use groups=...",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    _check_groups(groups)
    base = optimizer.__class__
    if getattr(optimizer, "_fh_distributed", False):
        raise ValueError("this optimizer is a DistributedOptimizer already")
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's data (parameter groups, state, defaults, hooks), not the
    # instance attributes that patch its methods (an LR scheduler's wrapper of its step(),
    # bound to the original, would bypass the reduction).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if not (callable(v) and hasattr(base, k))})
    wrapped._fh_setup(named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped


def _check_process_set_or_outside(process_set):
    """``ValueError`` for what is not a registered process set; a set this rank is not a
    member of is fine (the optimizer is then local)."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.process_set_id not in (None, 0) \
            and not process_set.included():
        return
    _check_process_set(process_set)
