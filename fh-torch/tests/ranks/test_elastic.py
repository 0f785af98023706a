"""``hvd.elastic``: the state (save, restore, sync from rank 0, commit and host updates) and
``run`` (retry after a lost rank, re-forming after a host change, leaving when removed), on
the fixed world of the suite. The driver's answers come from a replaced
``fasthorovod.common._elastic_core``; re-forming the world is a real ``shutdown()``/``init()``
(the same world again)."""

import math

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.common import _elastic_core
from fasthorovod.common import elastic as common_elastic
from fasthorovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt


class FakeDriver:
    """Stands for the driver: ``enabled()`` true, an assignment ``(generation, stamp)``
    bumped at each re-forming, and host updates that rank 0 alone may ask for."""

    def __init__(self, monkeypatch, updates=()):
        self.generation = 0
        self.stamp = 0
        self.asked = []
        # Host changes to report, in order: (stamp, added, removed) at the n-th question.
        self.updates = dict(updates)
        monkeypatch.setattr(_elastic_core, "enabled", lambda: True)
        monkeypatch.setattr(_elastic_core, "assignment", lambda: (self.generation, self.stamp))
        monkeypatch.setattr(_elastic_core, "host_updates", self.host_updates)

    def host_updates(self, since):
        assert hvd.rank() == 0, f"rank {hvd.rank()} asked the driver for host updates"
        self.asked.append(since)
        change = self.updates.get(len(self.asked))
        if change is not None:
            self.stamp = max(self.stamp, change[0])
            return change
        return (max(self.stamp, since), False, False)

    def reset(self):
        """A real re-forming of the (same) world, counted as the next generation."""
        hvd.shutdown()
        hvd.init()
        self.generation += 1


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _rank_values(model, optimizer, r):
    """Makes the model's parameters and the optimizer's momentum depend on rank ``r``."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.full_like(p, 10.0 * r + i))
    for p in model.parameters():
        p.grad = torch.full_like(p, float(r + 1))
    optimizer.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _momentum(optimizer):
    return [optimizer.state[p]["momentum_buffer"].clone()
            for g in optimizer.param_groups for p in g["params"]]


def test_object_state_save_restore_copies_values():
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=1, seen=[1, 2])
    state.seen.append(3)
    state.epoch = 2
    state.save()
    state.seen.append(4)  # after the commit, in place: the commit keeps [1, 2, 3]
    state.epoch = 3
    state.restore()
    assert (state.epoch, state.seen) == (2, [1, 2, 3])
    state.seen.append(5)  # the restored value is a copy: the commit keeps [1, 2, 3]
    state.restore()
    assert state.seen == [1, 2, 3]


def test_torch_state_sync_takes_rank_0s_model_optimizer_and_values():
    r = hvd.rank()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _rank_values(model, optimizer, r)
    state = hvd.elastic.TorchState(model, optimizer, epoch=100 + r, tag=f"rank{r}")
    # What rank 0 holds: the same steps with r = 0.
    want_model, want_opt = _model(), None
    want_opt = torch.optim.SGD(want_model.parameters(), lr=0.1, momentum=0.9)
    _rank_values(want_model, want_opt, 0)
    state.sync()
    for i, (got, want) in enumerate(zip(_params(model), _params(want_model))):
        assert torch.equal(got, want), f"rank {r}: parameter {i} is not rank 0's"
    for i, (got, want) in enumerate(zip(_momentum(optimizer), _momentum(want_opt))):
        assert torch.equal(got, want), f"rank {r}: momentum {i} is not rank 0's"
    assert (state.epoch, state.tag) == (100, "rank0"), f"rank {r}: {state.epoch, state.tag}"
    # Rank 0's state is every rank's restore point now (Horovod's test_elastic_state: a
    # restore after the sync gives rank 0's values, `21 != 20` before issue 33), the
    # models' and optimizers' as well as the plain values.
    _rank_values(model, optimizer, r + 7)
    state.epoch, state.tag = 300 + r, "changed"
    state.restore()
    assert (state.epoch, state.tag) == (100, "rank0"), f"rank {r}: {state.epoch, state.tag}"
    for i, (got, want) in enumerate(zip(_params(model), _params(want_model))):
        assert torch.equal(got, want), f"rank {r}: parameter {i} restored is not rank 0's"
    for i, (got, want) in enumerate(zip(_momentum(optimizer), _momentum(want_opt))):
        assert torch.equal(got, want), f"rank {r}: momentum {i} restored is not rank 0's"
    # Values changed since the last save travel as they are, as the models' do (Horovod's
    # sync sends rank 0's saved values), and become the restore point.
    state.epoch = 200 + r
    state.sync()
    assert state.epoch == 200, f"rank {r}: {state.epoch}"
    state.epoch = 0
    state.restore()
    assert state.epoch == 200, f"rank {r}: {state.epoch}"


def test_object_state_sync_makes_rank_0s_values_every_ranks_restore_point():
    r = hvd.rank()
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, batch=20 + r, seen=[r])
    state.sync()
    assert (state.batch, state.seen) == (20, [0]), f"rank {r}: {state.batch, state.seen}"
    state.batch = 21
    state.seen.append(5)  # in place: the restore point is a copy
    state.restore()
    assert (state.batch, state.seen) == (20, [0]), f"rank {r}: {state.batch, state.seen}"


def test_torch_state_restore_undoes_everything_since_the_commit():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _rank_values(model, optimizer, hvd.rank())
    state = hvd.elastic.TorchState(model, optimizer, epoch=4, batch=7)
    state.commit()  # outside an elastic job: save only, no collective of the host check
    committed = (_params(model), _momentum(optimizer))
    _rank_values(model, optimizer, hvd.rank() + 5)
    state.epoch, state.batch = 5, 0
    state.restore()
    assert (state.epoch, state.batch) == (4, 7)
    for got, want in zip(_params(model), committed[0]):
        assert torch.equal(got, want), "restore left an uncommitted parameter"
    for got, want in zip(_momentum(optimizer), committed[1]):
        assert torch.equal(got, want), "restore left an uncommitted momentum"


def test_a_commit_that_fails_leaves_the_previous_commit_whole(monkeypatch):
    from fasthorovod.torch.elastic import state as state_module

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(range(8))
    # The model first: saved before the sampler's merge, were the save not in two steps.
    state = hvd.elastic.TorchState(net=model, opt=optimizer, sampler=sampler, epoch=1)
    _rank_values(model, optimizer, 1)
    state.commit()
    committed = _params(model)
    _rank_values(model, optimizer, 2)
    state.epoch = 2

    def lost(*args, **kwargs):
        raise HorovodInternalError("simulated: rank 9 lost")

    monkeypatch.setattr(state_module, "allgather_object", lost)
    with pytest.raises(HorovodInternalError):
        state.commit()  # the sampler's merge fails: nothing of this commit is kept
    state.restore()
    assert state.epoch == 1
    for got, want in zip(_params(model), committed):
        assert torch.equal(got, want), "a failed commit kept the model's new values"


def test_schedulers_and_assigned_models_are_handled():
    r = hvd.rank()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler)
    for _ in range(r + 1):
        optimizer.step()
        scheduler.step()
    state.sync()
    assert scheduler.last_epoch == 1, f"rank {r}: the scheduler is not rank 0's"
    state.commit()
    scheduler.step()
    state.restore()
    assert scheduler.last_epoch == 1
    # Assigning a new model saves it: a restore goes back to it, not to the old one.
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(3.0)
    state.model = other
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(4.0)
    state.restore()
    assert state.model is other and all(torch.all(p == 3.0) for p in other.parameters())


@pytest.mark.parametrize("added,removed,skip", [(True, False, False), (False, True, True),
                                                (True, True, False)])
def test_commit_raises_host_update_on_every_rank_together(monkeypatch, added, removed, skip):
    # Only rank 0 asks (FakeDriver fails any other rank that asks); the answer is broadcast.
    driver = FakeDriver(monkeypatch, updates={2: (5, added, removed)})
    driver.stamp = 2
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    state.commit()  # question 1 (rank 0): nothing new since stamp 2
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()  # question 2: stamp 5
    assert info.value.skip_sync is skip
    state.commit()  # seen 5 now: nothing new
    if hvd.rank() == 0:
        assert driver.asked == [2, 2, 5]
    # Every rank raised at the same commit: the next collective meets.
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="elastic.after_update")
    assert total.item() == hvd.size()


def test_host_messages_is_empty_until_the_driver_reports_a_change(monkeypatch):
    # Horovod's elastic test script waits (rank 0) on `state._host_messages.empty()` before
    # the commit that must raise HostsUpdatedInterrupt.
    outside = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    assert outside._host_messages.empty() and outside._host_messages.qsize() == 0
    driver = FakeDriver(monkeypatch, updates={3: (5, True, False)})
    driver.stamp = 2
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    if hvd.rank() == 0:  # FakeDriver refuses the others' questions: they may ask, not here
        assert state._host_messages.empty()  # question 1: nothing after stamp 2
        assert state._host_messages.qsize() == 0  # question 2
        assert not state._host_messages.empty()  # question 3: stamp 5
        assert state._host_messages.qsize() == 1  # still waiting for a check
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    if hvd.rank() == 0:
        assert state._host_messages.empty()  # acted on
        assert driver.asked == [2, 2, 2, 2, 2, 5]
    state.on_reset()  # a new world: what its assignment's stamp covers is not news
    if hvd.rank() == 0:
        assert state._host_messages.empty()
        assert driver.asked[-1] == 5


def test_check_host_updates_outside_an_elastic_job_is_local():
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    assert not _elastic_core.enabled()
    # Rank 0 alone checks: were it a collective, rank 0 would wait for the others here.
    if hvd.rank() == 0:
        for _ in range(3):
            state.check_host_updates()


def test_run_restores_and_reforms_after_a_lost_rank(monkeypatch):
    driver = FakeDriver(monkeypatch)
    r = hvd.rank()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    calls = []

    def train(state):
        calls.append(state.epoch)
        if len(calls) == 1:
            state.epoch = 1
            _rank_values(state.model, state.optimizer, r + 1)
            state.commit()
            state.epoch = 2  # not committed: undone by the failure
            _rank_values(state.model, state.optimizer, r + 7)
            raise HorovodInternalError("simulated: rank 9 lost")
        return state.epoch, _params(state.model)

    epoch, params = common_elastic.run_fn(train, driver.reset)(state)
    assert calls == [0, 1] and epoch == 1 and resets == [hvd.size()]
    assert driver.generation == 1 and hvd.is_initialized()
    # Restored to rank r's commit, then synchronised from rank 0's commit.
    want = _model()
    _rank_values(want, torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9), 1)
    for i, (got, w) in enumerate(zip(params, _params(want))):
        assert torch.equal(got, w), f"rank {r}: parameter {i} is not rank 0's commit"


def test_run_through_a_host_update_skips_the_sync_only_when_hosts_were_removed(monkeypatch):
    FakeDriver(monkeypatch)
    syncs, restores = [], []

    class Counting(hvd.elastic.ObjectState):
        def sync(self):
            syncs.append(1)
            super().sync()

        def restore(self):
            restores.append(1)
            super().restore()

    state = Counting(hvd.broadcast_object, hvd.rank, n=0)
    raised = [HostsUpdatedInterrupt(skip_sync=True), HostsUpdatedInterrupt(skip_sync=False)]

    def train(state):
        state.n += 1
        if raised:
            raise raised.pop(0)
        return state.n

    resets = []
    # n: 1 (raise, no sync), 2 (raise, synchronised as it is), 3.
    assert common_elastic.run_fn(train, lambda: resets.append(1))(state) == 3
    # Sync at the start, none after the removal, one after the addition; never a restore.
    assert (len(syncs), len(restores), len(resets)) == (2, 0, 2)


def test_run_synchronises_every_rank_when_one_needs_it(monkeypatch):
    # The last rank stands for a worker that joined a world formed after hosts were only
    # removed: it needs the sync, the others would skip it; all must sync, or it waits alone.
    FakeDriver(monkeypatch)
    r, n = hvd.rank(), hvd.size()
    syncs = []

    class Counting(hvd.elastic.ObjectState):
        def sync(self):
            syncs.append(1)
            super().sync()

    state = Counting(hvd.broadcast_object, hvd.rank, n=0)
    from fasthorovod.torch import elastic as torch_elastic

    def train(state):
        if len(syncs) == 1:
            raise HostsUpdatedInterrupt(skip_sync=r != n - 1)
        return len(syncs)

    runner = common_elastic.run_fn(train, lambda: None, torch_elastic._agree_sync)
    assert runner(state) == 2, f"rank {r}: {len(syncs)} syncs"


def test_run_outside_an_elastic_job_reraises_a_lost_rank():
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, n=0)
    resets = []

    def train(state):
        raise HorovodInternalError("simulated: rank 9 lost")

    with pytest.raises(HorovodInternalError, match="rank 9 lost"):
        common_elastic.run_fn(train, lambda: resets.append(1))(state)
    assert resets == []


def test_run_leaves_with_status_0_when_the_driver_removes_the_worker(monkeypatch, capsys):
    FakeDriver(monkeypatch)

    class Removed(RuntimeError):
        pass

    monkeypatch.setattr(_elastic_core, "WorkerRemovedError", Removed)
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, n=0)

    def reset():
        raise Removed("host h2 was removed by the discovery script")

    def train(state):
        raise HostsUpdatedInterrupt(skip_sync=True)

    with pytest.raises(SystemExit) as info:
        common_elastic.run_fn(train, reset)(state)
    assert info.value.code == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "host h2 was removed" in err, err


def test_init_leaves_with_status_0_when_the_driver_removes_the_worker(monkeypatch, capsys):
    from fasthorovod import _core

    class Removed(RuntimeError):
        pass

    def removed():
        raise Removed("above --max-np 2")

    hvd.shutdown()
    try:
        monkeypatch.setattr(_elastic_core, "WorkerRemovedError", Removed)
        monkeypatch.setattr(_core, "init", removed)
        with pytest.raises(SystemExit) as info:
            hvd.init()
        assert info.value.code == 0
        assert "above --max-np 2" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        hvd.init()
    assert hvd.is_initialized()


def test_decorated_run_reforms_with_the_real_reset(monkeypatch):
    # hvd.elastic.run's own reset: shutdown() and init() of the (same) world.
    FakeDriver(monkeypatch)
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, n=0)
    seen = []

    @hvd.elastic.run
    def train(state):
        seen.append(hvd.is_initialized())
        if len(seen) == 1:
            raise HostsUpdatedInterrupt(skip_sync=False)
        return hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum, name="elastic.rerun").item()

    assert train(state) == 2.0 * hvd.size()
    assert seen == [True, True]


def _example():
    """``fh-torch/examples/elastic_train.py`` as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"
    spec = importlib.util.spec_from_file_location("elastic_train_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE_ARGS = ["--samples", "30", "--batch-size", "2", "--commit-every", "3"]


def _run_example(example, tmp_path, monkeypatch, epochs):
    log = hvd.broadcast_object(str(tmp_path), name="elastic.example.log")
    monkeypatch.setenv("ELASTIC_LOG", log)
    args = EXAMPLE_ARGS + ["--epochs", str(epochs)]
    assert example.main(args) == 0
    # Every rank has written its final parameters before any reads the logs.
    hvd.allreduce(torch.zeros(1), name="elastic.example.done")
    return example.parse(args + ["--replay", log]), example.read_logs(log)


def test_example_trains_to_the_end_and_replays_on_a_fixed_world(tmp_path, monkeypatch):
    example = _example()
    args, events = _run_example(example, tmp_path, monkeypatch, epochs=2)
    steps = example.committed_steps(events)
    assert len(steps) == 2 * math.ceil(math.ceil(30 / hvd.size()) / 2)
    assert example.check_replay(args) == 0


def test_example_replays_through_a_lost_rank_and_host_changes(tmp_path, monkeypatch):
    # The driver reports hosts added at its 4th question and hosts removed (only) at its 7th;
    # every rank's 5th step fails as a lost rank makes it fail, after an uncommitted step.
    example = _example()
    driver = FakeDriver(monkeypatch, updates={4: (3, True, False), 7: (4, False, True)})
    monkeypatch.setattr(hvd.elastic, "_reset", driver.reset)
    calls = []
    real_step = example.train_step

    def step(*args):
        calls.append(1)
        if len(calls) == 5:
            raise HorovodInternalError("simulated: rank 9 lost")
        return real_step(*args)

    monkeypatch.setattr(example, "train_step", step)
    args, events = _run_example(example, tmp_path, monkeypatch, epochs=4)
    assert driver.generation == 3
    mine = [e for e in events if e["event"] == "step" and e["rank"] == hvd.rank()]
    steps = example.committed_steps(events)
    assert len(mine) == len(steps) + 1, "the step after the failed commit was not undone"
    assert example.check_replay(args) == 0


def test_a_joining_workers_optimizer_meets_the_survivors():
    # In a new world a joining worker's DistributedOptimizer has agreed nothing with the
    # others yet (how each gradient travels), where the survivors' had in the old world:
    # every rank agrees anew after init().
    r, n = hvd.rank(), hvd.size()

    def make():
        torch.manual_seed(5)
        model = torch.nn.Linear(3, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters())
        return model, opt

    def step(model, opt):
        opt.zero_grad()
        model(torch.full((1, 3), float(r + 1))).sum().backward()
        opt.step()

    model, opt = make()
    step(model, opt)
    hvd.shutdown()
    hvd.init()
    if r == n - 1:
        model, opt = make()  # the joining worker (its state would come from the sync)
    before = model.weight.detach().clone()
    step(model, opt)
    # The weight's gradient is the input, (r + 1) everywhere: averaged, (n + 1) / 2.
    assert torch.allclose(before - model.weight.detach(), torch.full((2, 3), (n + 1) / 2))
