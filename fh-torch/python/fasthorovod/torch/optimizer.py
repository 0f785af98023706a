"""``DistributedOptimizer``: wraps a ``torch.optim`` optimizer so that every gradient is
averaged across ranks while the backward pass is still running."""

import contextlib
import warnings

import torch

from fasthorovod.common.process_sets import _check as _check_process_set
from fasthorovod.common.process_sets import global_process_set
from fasthorovod.torch.compression import Compression
from fasthorovod.torch._ops import _resolve_op
from fasthorovod.torch.mpi_ops import Average, allreduce_async_, synchronize


class _DistributedOptimizer(torch.optim.Optimizer):
    # The methods below are copied onto a subclass of the wrapped optimizer's class (see
    # DistributedOptimizer), so `super(self.__class__, self)` is the wrapped optimizer's class.

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=global_process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) or len(p) != 2 for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(dups)}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = all_ids - named_ids
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model "
                             f"parameters were not named ({len(unnamed)} of them). Pass "
                             "model.named_parameters() for the optimizer's parameters.")
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0, got "
                             f"{backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        # Priority = the parameter's place in the model (forward order): under
        # FH_PRIORITY=forward the input layers' gradients go first.
        order = [v for group in self.param_groups for v in group["params"]]
        self._priority = {v: i for i, v in enumerate(order)}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for v in order}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._handles = {}
        self._hooks = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        self._register_hooks()

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes are accumulated locally before the allreduce."""
        if passes <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                self._requires_update.add(p)
                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
                else:  # torch < 2.1: a hook on the gradient accumulator
                    p_tmp = p.expand_as(p)
                    grad_acc = p_tmp.grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_hook(p))
                    self._hooks.append(grad_acc)

    def _make_hook(self, p):
        def hook(*_ignore):
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times "
                        "before call to step(). Increase backward_passes_per_step to "
                        "accumulate gradients locally.")
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)

        return hook

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # No gradient on this rank (unused in this pass), but other ranks may have one:
            # reduce zeros so that nobody waits for this name.
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise NotImplementedError(
                    "sparse gradients are not supported by FastHorovod; pass "
                    "sparse_as_dense=True to DistributedOptimizer")
            p.grad = p.grad.to_dense()
        name = self._parameter_names.get(p)
        prescale, postscale = 1.0, 1.0
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor
        compressed, ctx = self._compression.compress(p.grad)
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=prescale,
                                  postscale_factor=postscale, process_set=self.process_set,
                                  _priority=self._priority.get(p, 0))
        return handle, (ctx, compressed)

    def synchronize(self):
        """Wait for every gradient's allreduce (starting those not started yet, e.g. for
        parameters that got no gradient on this rank)."""
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        try:
            for p, (handle, (ctx, compressed)) in self._handles.items():
                output = synchronize(handle)
                self._allreduce_delay[p] = self.backward_passes_per_step
                if compressed is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(self._compression.decompress(output, ctx))
        finally:
            self._handles.clear()
        self._synchronized = True

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
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without a preceding "
                              "optimizer.synchronize() after it was called explicitly: use "
                              "`with optimizer.skip_synchronize():` around step().")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    Each parameter's gradient is submitted for reduction the moment it is accumulated during
    ``backward()`` (with its place in the model as priority); ``step()`` waits for all of them.
    ``num_groups``/``groups`` are accepted for compatibility: fusion is the engine's job, and
    the results are the same.
    """
    _check_process_set(process_set)
    op = _resolve_op(op, None)
    if num_groups and groups:
        raise ValueError("give num_groups or groups, not both")
    if groups is not None:
        if not (isinstance(groups, list) and all(isinstance(g, list) for g in groups)):
            raise ValueError("groups must be a list of lists of parameters")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    cls._fh_distributed = True
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
