"""``TorchState``: the elastic state of a PyTorch training (models, optimizers, learning-rate
schedulers and ``ElasticSampler``s through their handlers; plain values as ``ObjectState``)."""

import copy

import torch

from fasthorovod.common.elastic import ObjectState
from fasthorovod.torch import mpi_ops
from fasthorovod.torch.elastic.sampler import ElasticSampler
from fasthorovod.torch.functions import (allgather_object, broadcast_object,
                                         broadcast_optimizer_state, broadcast_parameters)


class StateHandler:
    """Saves, restores and synchronises one object of ``TorchState``.

    ``save`` is in two steps so that a commit is all or nothing: ``prepare_save()`` runs the
    collectives and returns what to keep (it changes nothing, so a failure there leaves the
    last commit whole), ``apply_save(prepared)`` keeps it (local, cannot fail on a lost
    rank)."""

    def __init__(self, name, value):
        self.name = name
        self.value = value

    def prepare_save(self):
        """What ``apply_save`` keeps; may run collectives (default: none)."""
        return None

    def apply_save(self, prepared):
        """Keeps the value's state as the restore point."""
        raise NotImplementedError(f"{type(self).__name__} must define apply_save()")

    def save(self):
        """Both steps of a save."""
        self.apply_save(self.prepare_save())

    def restore(self):
        """Puts the last saved state back into the value (local: no collective)."""
        raise NotImplementedError(f"{type(self).__name__} must define restore()")

    def sync(self):
        """Makes every rank's value rank 0's (a collective)."""
        raise NotImplementedError(f"{type(self).__name__} must define sync()")

    def reset(self):
        """Adapts the value to a new world (before ``sync``); default: nothing."""

    def set_value(self, value):
        """Replaces the value (``state.model = other``) and saves it (locally: an assignment
        runs no collective)."""
        self.value = value
        self.apply_save(None)


class _StateDictHandler(StateHandler):
    """A value with ``state_dict()``/``load_state_dict()``: saved as a deep copy of its state
    dict."""

    def __init__(self, name, value):
        super().__init__(name, value)
        self._saved = copy.deepcopy(value.state_dict())

    def apply_save(self, prepared):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: parameters and buffers; synchronised by
    ``broadcast_parameters`` from rank 0."""

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer`` (also a ``DistributedOptimizer``): its state and options;
    synchronised by ``broadcast_optimizer_state`` from rank 0."""

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    """A learning-rate scheduler: its state dict, synchronised by ``broadcast_object``."""

    def sync(self):
        state = broadcast_object(self.value.state_dict(), root_rank=0,
                                 name=f"elastic.scheduler.{self.name}")
        self.value.load_state_dict(state)


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: its ``state_dict()`` (epoch and processed count). A save also
    merges the indices each rank recorded alone (``record_indices``: an allgather) into
    every rank's processed indices, so every rank keeps the same commit, whichever survives;
    ``sync`` loads rank 0's state and splits what is left among the new ranks; ``reset``
    splits among the new ranks without a sync (when hosts were only removed)."""

    def __init__(self, name, value):
        super().__init__(name, value)
        self._saved = value.state_dict()

    def prepare_save(self):
        gathered = allgather_object(sorted(self.value._local),
                                    name=f"elastic.sampler.{self.name}.save")
        return set().union(*gathered)

    def apply_save(self, prepared):
        if prepared:
            self.value._merge_local(prepared)
        self._saved = self.value.state_dict()

    def restore(self):
        # No split here: the world may be down; reset() and sync() split after it re-forms.
        self.value._load(self._saved)

    def sync(self):
        state = broadcast_object(self.value.state_dict(), root_rank=0,
                                 name=f"elastic.sampler.{self.name}.sync")
        self.value.load_state_dict(state)

    def reset(self):
        self.value.reset()


def _scheduler_types():
    lr = torch.optim.lr_scheduler
    return tuple({getattr(lr, n) for n in ("LRScheduler", "_LRScheduler") if hasattr(lr, n)})


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (_scheduler_types(), LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    """The ``(type, handler class)`` pairs ``TorchState`` picks a handler from (first match)."""
    return _handler_registry


def set_handler_registry(registry):
    """Replaces the handler registry (a list of ``(type, handler class)``; a handler class
    is called with ``(name, value)``)."""
    global _handler_registry
    _handler_registry = list(registry)


def _handler_for(name, value):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(name, value)
    return None


def _bcast_state(obj):
    return broadcast_object(obj, root_rank=0, name="elastic.state")


class TorchState(ObjectState):
    """The state of a PyTorch training, kept across world changes (Horovod's ``TorchState``).

    ``model``, ``optimizer`` and every other keyword become attributes (``state.model``,
    ``state.epoch``...). Models, optimizers, learning-rate schedulers and ``ElasticSampler``s
    (in any keyword) are handled by their state dicts: ``commit()`` copies them, ``restore()``
    loads the copy back, ``sync()`` broadcasts them from rank 0 (and keeps the result as
    every rank's restore point). Other values are plain
    objects (``ObjectState``: deep-copied, synchronised with ``broadcast_object``). Assigning a
    new model/optimizer/sampler to its attribute saves it at once."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(name, value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=_bcast_state, get_rank=mpi_ops.rank, **plain)

    def save(self):
        # Every collective first: a failure in one leaves the previous commit whole.
        prepared = [(h, h.prepare_save()) for h in self._handlers.values()]
        for handler, p in prepared:
            handler.apply_save(p)
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        """Makes every rank's state rank 0's: the handled objects (rank 0's current models,
        optimizers...), the plain values, and the restore point. Each rank then keeps the
        synchronised state as its restore point (a local save, no collective), so that a
        worker that joined in this world, or a survivor, restores what every rank restores,
        whichever becomes rank 0 next (in Horovod a joined worker restores its own initial
        models)."""
        for handler in self._handlers.values():
            handler.sync()
        for handler in self._handlers.values():
            handler.apply_save(None)
        super().sync()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
