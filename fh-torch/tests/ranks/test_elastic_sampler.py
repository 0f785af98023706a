"""``hvd.elastic.ElasticSampler``: the split among ranks (worlds of any size, emulated in one
process by replacing the sampler's view of the world), Horovod 0.28's order and processed
count, what is left after a world change, its state dict, and the merge of the ranks'
recorded indices at a commit (on the real world of the suite)."""

import math
import random

import pytest

import fasthorovod.torch as hvd
from fasthorovod.torch.elastic import sampler as sampler_module

ElasticSampler = hvd.elastic.ElasticSampler


class World:
    """The world an ``ElasticSampler`` sees while it splits (``with World(r, n):``)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.now = (0, 1)
        monkeypatch.setattr(sampler_module, "_world", lambda: self.now)

    def samplers(self, size, dataset, state=None, **kw):
        """One sampler per rank of a world of ``size``, each loaded with ``state``."""
        out = []
        for r in range(size):
            self.now = (r, size)
            s = ElasticSampler(dataset, **kw)
            if state is not None:
                s.load_state_dict(state)
            out.append(s)
        return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("length", [0, 1, 10, 12])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_index_once_per_epoch_padding_aside(monkeypatch, shuffle, length, size):
    world = World(monkeypatch)
    parts = [list(s) for s in world.samplers(size, range(length), shuffle=shuffle, seed=5)]
    share = math.ceil(length / size)
    assert [len(p) for p in parts] == [share] * size
    taken = [i for p in parts for i in p]
    assert set(taken) == set(range(length))
    # Padding repeats an index only to give every rank the same share.
    assert len(taken) - len(set(taken)) == share * size - length
    if length % size == 0:
        assert sorted(taken) == list(range(length))


def test_order_is_the_same_on_every_rank_and_changes_with_the_epoch(monkeypatch):
    world = World(monkeypatch)
    a = world.samplers(2, range(40), seed=9)
    b = world.samplers(2, range(40), seed=9)
    assert [list(s) for s in a] == [list(s) for s in b]
    order = [i for pair in zip(*[list(s) for s in a]) for i in pair]
    assert order != list(range(40)), "shuffle=True kept the data set's order"
    for r, s in enumerate(a):
        world.now = (r, 2)
        s.set_epoch(1)
    assert [i for pair in zip(*[list(s) for s in a]) for i in pair] != order


def test_the_order_is_horovods(monkeypatch):
    # Horovod 0.28: range(len) shuffled in place by random.Random(seed + epoch), the rest
    # after processed_num, rank r taking every size-th index from position r.
    world = World(monkeypatch)
    order = list(range(30))
    random.Random(5 + 2).shuffle(order)
    state = {"epoch": 2, "processed_num": 7}
    parts = [list(s) for s in world.samplers(4, range(30), state=state, seed=5)]
    rest = order[7:] + order[7:8]  # 23 left, padded to 24
    assert parts == [rest[r::4] for r in range(4)]
    [plain] = world.samplers(1, range(5), shuffle=False)
    assert list(plain) == [0, 1, 2, 3, 4]


def test_record_batch_counts_the_batch_of_every_rank(monkeypatch):
    world = World(monkeypatch)
    [a, b, c] = world.samplers(3, range(20), seed=1)
    for s in (a, b, c):
        s.record_batch(0, 2)
        s.record_batch(1, 2)
    assert {s.processed_num for s in (a, b, c)} == {12}
    assert a.state_dict() == {"epoch": 0, "processed_num": 12}


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3), (3, 1), (1, 4)])
def test_processed_samples_are_skipped_in_a_world_of_another_size(monkeypatch, before, after):
    world = World(monkeypatch)
    length, batch = 23, 2
    old = world.samplers(before, range(length), seed=1)
    done = set()
    for r, s in enumerate(old):
        world.now = (r, before)
        mine = list(s)
        for b in range(2):  # two batches, in step on every rank
            done.update(mine[b * batch:(b + 1) * batch])
            s.record_batch(b, batch)
    # Every rank counted the batches of every rank.
    assert {s.processed_num for s in old} == {2 * batch * before}
    new = world.samplers(after, range(length), state=old[0].state_dict(), seed=1)
    left = [i for s in new for i in s]
    assert set(left) == set(range(length)) - done, "an index was skipped or repeated"
    assert len(left) - len(set(left)) == math.ceil(len(set(left)) / after) * after - \
        len(set(left))


def test_state_dict_round_trip(monkeypatch):
    world = World(monkeypatch)
    [a] = world.samplers(1, range(15), seed=2)
    a.set_epoch(3)
    first = list(a)[:4]
    a.record_batch(0, 4)
    state = a.state_dict()
    assert state == {"epoch": 3, "processed_num": 4}
    [b] = world.samplers(1, range(15), state=state, seed=2)
    assert b.state_dict() == state
    assert list(b) == b.remaining_indices
    assert set(b) == set(range(15)) - set(first)
    # The extension: indices this rank recorded alone are left out too, and travel in the
    # state dict (a copy).
    [c] = world.samplers(1, range(15), seed=2)
    c.set_epoch(3)
    c.record_indices([14, 0])
    state = c.state_dict()
    assert state == {"epoch": 3, "processed_num": 0, "processed_indices": {14, 0}}
    [d] = world.samplers(1, range(15), state=state, seed=2)
    assert d.state_dict() == state and set(d) == set(range(1, 14))
    state["processed_indices"].add(99)
    assert 99 not in c.processed_indices and 99 not in d.processed_indices


def test_set_epoch_starts_the_count_again(monkeypatch):
    world = World(monkeypatch)
    [s] = world.samplers(1, range(8), shuffle=False)
    s.record_batch(0, 3)
    assert s.processed_num == 3 and len(s) == 8
    s.reset()
    assert list(s) == [3, 4, 5, 6, 7]
    s.set_epoch(1)
    s.record_indices([7])
    s.reset()
    assert list(s) == [0, 1, 2, 3, 4, 5, 6]
    s.set_epoch(1)
    assert (s.processed_num, s.processed_indices, len(s)) == (0, set(), 8)


def test_get_indices_are_the_batches_of_the_iteration(monkeypatch):
    world = World(monkeypatch)
    [s] = world.samplers(1, range(10), shuffle=False)
    assert s.get_indices(1, 4) == [4, 5, 6, 7] and s.get_indices(2, 4) == [8, 9]


def test_load_state_dict_refuses_a_wrong_dict(monkeypatch):
    World(monkeypatch)
    s = ElasticSampler(range(4))
    with pytest.raises(ValueError, match="processed_num"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=">= 0"):
        s.load_state_dict({"epoch": 0, "processed_num": -1})


def test_commit_merges_the_indices_each_rank_recorded(monkeypatch):
    n, r = hvd.size(), hvd.rank()
    sampler = ElasticSampler(range(10 * n), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    sampler.record_indices([10 * r + 1])
    state.commit()
    merged = {10 * q + 1 for q in range(n)}
    assert sampler.processed_indices == merged, f"rank {r}: {sampler.processed_indices}"
    # A restore goes back to the merged commit; the split after the next sync leaves them out.
    sampler.record_indices([10 * r + 2])
    state.restore()
    assert sampler.processed_indices == merged
    state.sync()
    assert not merged & set(sampler), f"rank {r}: a processed index is split again"
    everyone = hvd.allgather_object(sorted(sampler))
    assert sorted(i for part in everyone for i in part) == sorted(set(range(10 * n)) - merged)


def test_sync_splits_rank_0s_progress_among_the_ranks():
    n, r = hvd.size(), hvd.rank()
    sampler = ElasticSampler(range(6 * n + 1), seed=4)
    state = hvd.elastic.TorchState(sampler=sampler)
    if r == 0:
        sampler.set_epoch(2)
        list(sampler)
        sampler.record_batch(0, 2)
    state.sync()
    assert (sampler.epoch, sampler.processed_num) == (2, 2 * n), f"rank {r}"
    order = list(range(6 * n + 1))
    random.Random(4 + 2).shuffle(order)
    parts = hvd.allgather_object(list(sampler))
    assert set(i for p in parts for i in p) == set(order[2 * n:])
    assert all(len(p) == math.ceil((4 * n + 1) / n) for p in parts)
