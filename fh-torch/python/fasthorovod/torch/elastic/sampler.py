"""``ElasticSampler``: Horovod's sampler that splits a data set among the ranks and, after a
world change, splits what is left of the epoch among the new ranks."""

import math
import random

import torch
import torch.utils.data

from fasthorovod.torch import mpi_ops


def _world():
    """``(rank, size)`` of the running world (tests replace it)."""
    return mpi_ops.rank(), mpi_ops.size()


class ElasticSampler(torch.utils.data.Sampler):
    """Gives each rank its share of ``dataset``'s indices, as ``DistributedSampler`` does, and
    counts how much of the epoch has been processed, so that after a world change what is
    left is split among the new ranks (none processed twice, none skipped). Horovod 0.28's
    sampler: the same order, state and split.

    Use it as Horovod's: put it in the ``TorchState`` (which commits, restores and
    synchronises it), call ``record_batch(batch_idx, batch_size)`` after each batch, and
    ``set_epoch(epoch + 1)`` at the *end* of each epoch (which starts the count again).

    The epoch's order: ``range(len(dataset))``, shuffled (``shuffle=True``) by
    ``random.Random(seed + epoch)`` (the same on every rank). ``processed_num`` counts the
    processed indices from the start of that order: the ones left are the rest of it; they
    are padded with their own first indices to a multiple of ``size()``, and rank ``r`` takes
    every ``size()``-th index from position ``r``. ``record_batch`` adds the batch of every
    rank (``batch_size * size()``): the ranks process their batches in step, so the
    processed indices stay the order's first ``processed_num``. ``dataset`` must keep its
    length. ``state_dict()`` is ``{"epoch", "processed_num"}``.

    An extension of FastHorovod (Horovod has none of it; using it changes nothing else):
    ``record_indices(indices)`` marks indices that this rank alone processed (e.g. a last
    batch of its own size); the ranks' recorded indices are merged at the next commit into
    ``processed_indices``, which are left out of the order's rest as well, and then appear in
    ``state_dict()`` as ``"processed_indices"``. Use either ``record_batch`` or
    ``record_indices`` within an epoch (a count from the order's start and a set of indices
    do not describe one mixed progress). ``get_indices(batch_idx, batch_size)``: this rank's
    indices of a batch of the iteration."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        # Indices recorded with record_indices and merged over the ranks (the extension).
        self.processed_indices = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.num_samples = 0
        self.total_size = 0
        self.indices = []
        # Indices recorded by record_indices since the last commit (this rank's own).
        self._local = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch``: the processed count (and indices) start again and the whole
        data set is split again, in the epoch's order. Call it at the end of an epoch, with
        the next epoch's number, so that a failure in the middle of an epoch does not repeat
        its samples."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self._local = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Counts the batch that every rank has just processed: ``batch_size * size()`` more
        of the epoch's order. ``batch_idx`` is accepted for Horovod's signature."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices):
        """Marks ``indices`` (dataset indices this rank processed) as processed (an extension
        of FastHorovod: see the class's documentation)."""
        new = {int(i) for i in indices}
        self.processed_indices.update(new)
        self._local.update(new)

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of batch ``batch_idx`` (of ``batch_size``) of the current
        iteration."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self):
        """``{"epoch", "processed_num"}``, as Horovod's; with ``"processed_indices"`` (a copy)
        too once ``record_indices`` has marked some."""
        state = {"epoch": self.epoch, "processed_num": self.processed_num}
        if self.processed_indices:
            state["processed_indices"] = set(self.processed_indices)
        return state

    def load_state_dict(self, state_dict):
        """Takes the epoch and progress of ``state_dict`` and splits what is left among the
        ranks of the running world."""
        self._load(state_dict)
        self.reset()

    def _load(self, state_dict):
        try:
            epoch = int(state_dict["epoch"])
            processed_num = int(state_dict["processed_num"])
            processed = {int(i) for i in state_dict.get("processed_indices", ())}
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ElasticSampler.load_state_dict takes a dict with 'epoch' and "
                             f"'processed_num' (ints; and optionally 'processed_indices'), "
                             f"as state_dict() returns; got {state_dict!r:.200}") from e
        if processed_num < 0:
            raise ValueError(f"ElasticSampler.load_state_dict: 'processed_num' must be >= 0, "
                             f"got {processed_num}")
        self.epoch = epoch
        self.processed_num = processed_num
        self.processed_indices = processed
        self._local = set()

    def _merge_local(self, merged):
        """Adds the indices every rank recorded with ``record_indices`` (merged at a commit)."""
        self.processed_indices.update(merged)
        self._local = set()

    def reset(self):
        """Splits the rest of the epoch's order among the ranks of the running world."""
        self.rank, self.num_replicas = _world()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        rest = order[self.processed_num:]
        if self.processed_indices:
            rest = [i for i in rest if i not in self.processed_indices]
        self.remaining_indices = rest
        n = self.num_replicas
        self.num_samples = int(math.ceil(len(rest) / n))
        self.total_size = self.num_samples * n
        padded = list(rest)
        while len(padded) < self.total_size:
            padded += rest[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:n]

    def __iter__(self):
        return iter(list(self.indices))

    def __len__(self):
        return self.num_samples
