"""``ElasticSampler``: Horovod's sampler that splits a data set among the ranks and, after a
world change, splits what is left of the epoch among the new ranks."""

import math

import torch
import torch.utils.data

from fasthorovod.torch import mpi_ops


def _world():
    """``(rank, size)`` of the running world (tests replace it)."""
    return mpi_ops.rank(), mpi_ops.size()


class ElasticSampler(torch.utils.data.Sampler):
    """Gives each rank its share of ``dataset``'s indices, as ``DistributedSampler`` does, and
    remembers which indices the epoch has processed, so that after a world change the indices
    left are split among the new ranks (none is processed twice, none skipped).

    Use it as Horovod's: put it in the ``TorchState`` (which commits, restores and
    synchronises it), call ``record_batch(batch_idx, batch_size)`` after each batch, and
    ``set_epoch(epoch + 1)`` at the *end* of each epoch (which forgets the processed indices).

    The epoch's order: ``range(len(dataset))``, shuffled (``shuffle=True``) by a generator
    seeded with ``seed + epoch`` (the same on every rank), less the processed indices; it is
    padded with its own first indices to a multiple of ``size()``, and rank ``r`` takes every
    ``size()``-th index from position ``r``. ``dataset`` must keep its length.

    ``record_batch`` marks the indices of the batch that every rank has just processed (the
    next ``batch_size`` of each rank's share, counted from the start of the iteration; ranks
    process their batches in step, so every rank marks the same indices, and ``batch_idx`` is
    not needed). ``record_indices`` marks indices this rank alone processed (e.g. a batch of
    its own size); the ranks' recorded indices are merged at the next commit."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.num_samples = 0
        self.total_size = 0
        self.indices = []
        self._padded = []
        self._consumed = 0
        # Indices recorded by record_indices since the last commit (this rank's own).
        self._local = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch``: forgets the processed indices and splits the whole data set
        again (in the epoch's order). Call it at the end of an epoch, with the next epoch's
        number, so that a failure in the middle of an epoch does not repeat its samples."""
        self.epoch = epoch
        self.processed_indices = set()
        self._local = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Marks as processed the next ``batch_size`` indices of every rank's share (the batch
        every rank has just processed). ``batch_idx`` is accepted for Horovod's signature."""
        n = self.num_replicas
        start, end = self._consumed * n, (self._consumed + batch_size) * n
        self.processed_indices.update(self._padded[start:end])
        self._consumed += batch_size

    def record_indices(self, indices):
        """Marks ``indices`` (dataset indices this rank processed) as processed."""
        new = {int(i) for i in indices}
        self.processed_indices.update(new)
        self._local.update(new)

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of batch ``batch_idx`` (of ``batch_size``) of the current
        iteration."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self):
        """``{"epoch", "processed_indices"}`` (a copy)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict):
        """Takes the epoch and processed indices of ``state_dict`` and splits what is left
        among the ranks of the running world."""
        self._load(state_dict)
        self.reset()

    def _load(self, state_dict):
        try:
            epoch = int(state_dict["epoch"])
            processed = {int(i) for i in state_dict["processed_indices"]}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ElasticSampler.load_state_dict takes a dict with 'epoch' (an "
                             f"int) and 'processed_indices' (ints), as state_dict() returns; "
                             f"got {state_dict!r:.200}") from e
        self.epoch = epoch
        self.processed_indices = processed
        self._local = set()

    def _merge_local(self, merged):
        """Adds the indices every rank recorded with ``record_indices`` (merged at a commit)."""
        self.processed_indices.update(merged)
        self._local = set()

    def reset(self):
        """Splits the epoch's unprocessed indices among the ranks of the running world."""
        self.rank, self.num_replicas = _world()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=g).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        n = self.num_replicas
        self.num_samples = int(math.ceil(len(self.remaining_indices) / n))
        self.total_size = self.num_samples * n
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:
            padded += self.remaining_indices[:self.total_size - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank:self.total_size:n]
        self._consumed = 0

    def __iter__(self):
        self._consumed = 0
        return iter(list(self.indices))

    def __len__(self):
        return self.num_samples
