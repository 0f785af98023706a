"""DistributedOptimizer, the broadcast helpers and sparse gradients as Horovod 0.28 has them:
a rank outside the optimizer's process set, the zero gradients broadcast_optimizer_state
leaves, signatures, sparse reduction (``sparse_allreduce_async``, ``nn.Embedding(sparse=True)``
with and without ``sparse_as_dense``), ``groups``, ``load_state_dict`` and the step() warning.

Expected values come from one process computing on the concatenation of every rank's batch
(or from sums worked out here), never from the code under test."""

import inspect
import warnings

import pytest
import torch

import fasthorovod.torch as hvd
from _checks import assert_close
from fasthorovod.torch import optimizer as fh_optimizer

needs3 = pytest.mark.skipif(hvd.size() < 3 if hvd.is_initialized() else True,
                            reason="needs at least 3 ranks")




@pytest.fixture
def dynamic(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


# ---------------------------------------------------------------------------------------------
# 1. A rank outside the optimizer's process set


@needs3
def test_optimizer_outside_its_process_set_is_local(dynamic):
    members = [0, 2]
    ps = hvd.add_process_set(members)
    try:
        me = hvd.rank()
        w = torch.nn.Parameter(torch.zeros(3))
        # No ValueError on rank 1: it gets a plain local optimizer.
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                       named_parameters=[("w", w)], process_set=ps)
        assert isinstance(opt, torch.optim.SGD), f"rank {me}: not an SGD"
        if ps.included():
            # The members' broadcast must not wait for the non-member.
            hvd.broadcast_parameters([("w", w)], root_rank=0, process_set=ps)
        (w * float((me + 1) ** 2)).sum().backward()
        opt.step()
        if ps.included():
            # Averaged over ranks 0 and 2: (1 + 9) / 2.
            want = torch.full((3,), -5.0)
        else:
            want = torch.full((3,), -4.0)  # rank 1's own gradient, not reduced
        assert_close(w, want, "parameter after step")
        # The set's members still reduce among themselves afterwards.
        if ps.included():
            got = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=ps)
            assert_close(got, torch.tensor([2.0]), "allreduce in the set")
    finally:
        hvd.remove_process_set(ps)


# ---------------------------------------------------------------------------------------------
# 2. broadcast_optimizer_state and the helpers' signatures


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize("distributed", [False, True])
def test_broadcast_optimizer_state_leaves_zero_gradients(distributed):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for (name, p), b in zip(model.named_parameters(), before):
        assert p.grad is not None, f"rank {hvd.rank()}: {name}.grad is None"
        assert not p.grad.is_sparse
        assert_close(p.grad, torch.zeros_like(p), f"{name}.grad")
        assert_close(p, b, f"{name} (must not move)")
        assert float(opt.state[p]["step"]) == 1.0


def test_broadcast_optimizer_state_model_makes_sparse_zero_gradients():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, 0, model=model)
    emb, lin = model[0].weight, model[1].weight
    assert emb.grad is not None and emb.grad.is_sparse, f"rank {hvd.rank()}: {emb.grad}"
    assert_close(emb.grad, torch.zeros(10, 3), "embedding grad")
    assert lin.grad is not None and not lin.grad.is_sparse
    # SparseAdam: every zero gradient is sparse (its step refuses dense ones).
    emb2 = torch.nn.Embedding(6, 2, sparse=True)
    sparse_adam = torch.optim.SparseAdam(emb2.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(sparse_adam, root_rank=0)
    assert emb2.weight.grad.is_sparse
    assert "exp_avg" in sparse_adam.state[emb2.weight]


def _params(f):
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]


def test_helper_signatures_are_horovods():
    empty = inspect.Parameter.empty
    gps = hvd.global_process_set
    assert _params(hvd.broadcast_parameters) == [
        ("params", empty), ("root_rank", empty), ("process_set", gps)]
    assert _params(hvd.broadcast_optimizer_state) == [
        ("optimizer", empty), ("root_rank", empty), ("model", None), ("process_set", gps)]
    assert _params(hvd.broadcast_object) == [
        ("obj", empty), ("root_rank", 0), ("name", None), ("process_set", gps)]
    assert _params(hvd.allgather_object) == [
        ("obj", empty), ("name", None), ("process_set", gps)]
    assert _params(hvd.sparse_allreduce_async) == [
        ("tensor", empty), ("name", empty), ("op", empty), ("process_set", gps)]
    assert _params(hvd.DistributedOptimizer) == [
        ("optimizer", empty), ("named_parameters", None), ("compression", hvd.Compression.none),
        ("backward_passes_per_step", 1), ("op", hvd.Average),
        ("gradient_predivide_factor", 1.0), ("num_groups", 0), ("groups", None),
        ("sparse_as_dense", False), ("process_set", gps)]
    assert _params(hvd.SyncBatchNorm) == [
        ("num_features", empty), ("eps", 1e-5), ("momentum", 0.1), ("affine", True),
        ("track_running_stats", True)]
    assert hvd.mpi_ops.sparse_allreduce_async is hvd.sparse_allreduce_async


# ---------------------------------------------------------------------------------------------
# 3. Sparse gradients


def _rank_sparse(r, shape=(7, 3)):
    """Rank r's sparse tensor: rows r and r + 2 (shared with rank r + 2), values from r; the
    last rank of three sends no entry at all."""
    if r == 2:
        return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64),
                                       torch.zeros((0, shape[1])), shape, check_invariants=True)
    rows = torch.tensor([[r, r + 2, r]])  # row r twice: uncoalesced on purpose
    values = torch.stack([torch.full((shape[1],), float(r + 1)),
                          torch.arange(shape[1], dtype=torch.float32) + 10 * r,
                          torch.full((shape[1],), 0.5)])
    return torch.sparse_coo_tensor(rows, values, shape, check_invariants=True)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_sparse_allreduce_async(op):
    n, me = hvd.size(), hvd.rank()
    want = sum(_rank_sparse(r).to_dense() for r in range(n))
    if op == hvd.Average:
        want = want / n
    handle = hvd.sparse_allreduce_async(_rank_sparse(me), f"sparse_test.{op}", op)
    got = hvd.synchronize(handle)
    assert got.is_sparse and got.is_coalesced(), f"rank {me}: {got.layout}"
    assert_close(got, want, f"sparse allreduce ({op})")
    # Horovod's optimizer calls its sparse handles: that works too.
    h2 = hvd.sparse_allreduce_async(_rank_sparse(me), f"sparse_test2.{op}", op)
    assert_close(h2(), want, f"sparse allreduce via handle() ({op})")
    # Integers: summed, then divided once, truncating toward zero (as a dense Average).
    ints = [(_rank_sparse(r) * 3).to(torch.int64) for r in range(n)]
    want_int = sum(t.to_dense() for t in ints)
    if op == hvd.Average:
        want_int = torch.div(want_int, n, rounding_mode="trunc")
    got_int = hvd.synchronize(hvd.sparse_allreduce_async(ints[me], f"sparse_int.{op}", op))
    assert got_int.dtype == torch.int64, f"rank {me}: {got_int.dtype}"
    assert_close(got_int, want_int, f"integer sparse allreduce ({op})", atol=0, rtol=0)
    if n > 1:
        # Tensors of different sizes: an error on every rank (not indices out of range).
        odd = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3),
                                      (7 + me, 3), check_invariants=True)
        with pytest.raises(ValueError, match="differ in shape"):
            hvd.synchronize(hvd.sparse_allreduce_async(odd, f"sparse_odd.{op}", op))
    with pytest.raises(ValueError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(3), "dense", op)
    with pytest.raises(ValueError, match="Sum or hvd.Average"):
        hvd.sparse_allreduce_async(_rank_sparse(me), "max", hvd.Max)


class _EmbeddingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(12, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, idx):
        return self.head(self.emb(idx).sum(1))


def _embedding_batches(steps, per_rank):
    """The concatenated batch of every step (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    n = hvd.size()
    return [(torch.randint(0, 12, (per_rank * n, 3), generator=g),
             torch.randn(per_rank * n, 1, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_under_distributed_optimizer(sparse_as_dense):
    n, me = hvd.size(), hvd.rank()
    per_rank = 3
    model, ref = _EmbeddingModel(), _EmbeddingModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step, (idx, target) in enumerate(_embedding_batches(3, per_rank)):
        mine = slice(per_rank * me, per_rank * (me + 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(idx[mine]), target[mine]).backward()
        grad_before = model.emb.weight.grad
        assert grad_before.is_sparse
        opt.synchronize()
        # The user's tensor is kept, and stays sparse (with or without sparse_as_dense).
        assert model.emb.weight.grad is grad_before, f"rank {me}: p.grad replaced"
        assert model.emb.weight.grad.is_sparse, f"rank {me}: p.grad densified"
        ref_opt.zero_grad()
        # One process, the whole batch: the mean of the ranks' mean losses.
        torch.nn.functional.mse_loss(ref(idx), target).backward()
        assert_close(model.emb.weight.grad, ref.emb.weight.grad, f"step {step} embedding grad")
        assert_close(model.head.weight.grad, ref.head.weight.grad, f"step {step} head grad")
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
        assert_close(model.emb.weight, ref.emb.weight, f"step {step} embedding weight")
    if n > 1 and not sparse_as_dense:
        # A rank whose batch touches no row of the embedding still takes part.
        opt.zero_grad()
        if me == 0:
            torch.nn.functional.mse_loss(model(idx[:1]), target[:1]).backward()
        else:
            model.head(torch.ones(1, 4)).sum().backward()  # no embedding gradient
        opt.step()
        gathered = hvd.allgather(model.emb.weight.detach().unsqueeze(0))
        for r in range(n):
            assert_close(gathered[r], gathered[0], f"embedding weight of rank {r} vs rank 0")


# ---------------------------------------------------------------------------------------------
# 5. The step() warning


def test_step_after_synchronize_warns_with_horovods_words():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("ww", w)])
    w.sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning) as record:
        opt.step()
    words = ("optimizer.step() called without optimizer.skip_synchronize() context after "
             "optimizer.synchronize(). This can cause training slowdown")
    assert any(str(w.message).startswith(words) for w in record), \
        f"rank {hvd.rank()}: {[str(w.message) for w in record]}"
    # Inside skip_synchronize: no warning.
    w.sum().backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


# ---------------------------------------------------------------------------------------------
# 6. groups and load_state_dict


@pytest.fixture
def recorded(monkeypatch):
    """Records the optimizer's submissions: ("grouped", n tensors) or ("single", 1) through the
    public API, ("direct", 1) straight to the engine (a lone dense gradient)."""
    calls = []
    real_grouped, real_single, real_direct = fh_optimizer.grouped_allreduce_async_, \
        fh_optimizer.allreduce_async_, fh_optimizer._ops._allreduce

    def grouped(tensors, *args, **kwargs):
        calls.append(("grouped", len(tensors)))
        return real_grouped(tensors, *args, **kwargs)

    def single(tensor, *args, **kwargs):
        calls.append(("single", 1))
        return real_single(tensor, *args, **kwargs)

    def direct(tensor, *args, **kwargs):
        calls.append(("direct", 1))
        return real_direct(tensor, *args, **kwargs)

    monkeypatch.setattr(fh_optimizer, "grouped_allreduce_async_", grouped)
    monkeypatch.setattr(fh_optimizer, "allreduce_async_", single)
    # The optimizer's own path; the public API calls the one it imported (not this).
    monkeypatch.setattr(fh_optimizer._ops, "_allreduce", direct)
    return calls


def _train_once(groups, num_groups=0):
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(11)
    data, target = torch.randn(2 * n, 4), torch.randn(2 * n, 1)
    model, ref = _model(), _model()
    params = list(model.parameters())
    if groups == "list":
        groups = [[params[0], params[2]]]  # the two weights together, the biases alone
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   num_groups=num_groups, groups=groups)
    mine = slice(2 * me, 2 * me + 2)
    torch.nn.functional.mse_loss(model(data[mine]), target[mine]).backward()
    opt.synchronize()
    torch.nn.functional.mse_loss(ref(data), target).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"{name}.grad")


def test_groups_int_fuses_each_group(recorded):
    _train_once(groups=2)
    # 4 parameters in model order, in 2 groups: each one grouped allreduce of 2 tensors.
    assert sorted(recorded) == [("grouped", 2), ("grouped", 2)], f"rank {hvd.rank()}: {recorded}"


def test_groups_list_fuses_listed_parameters(recorded):
    _train_once(groups="list")
    assert sorted(recorded) == [("direct", 1), ("direct", 1), ("grouped", 2)], \
        f"rank {hvd.rank()}: {recorded}"


def _lone_parameter_step(grad):
    """One synchronize() of a lone parameter whose gradient this rank sets to ``grad``; the
    gradient tensor the optimizer left in place."""
    w = torch.nn.Parameter(torch.zeros(grad.shape))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)])
    w.grad = grad
    opt.synchronize()
    return w.grad


def test_a_lone_dense_gradient_is_reduced_straight_in_its_memory(recorded):
    n, me = hvd.size(), hvd.rank()
    grad = torch.arange(6, dtype=torch.float32).reshape(3, 2) * (me + 1)
    where = grad.data_ptr()
    out = _lone_parameter_step(grad)
    assert recorded == [("direct", 1)], f"rank {me}: {recorded}"
    assert out is grad and out.data_ptr() == where
    mean = sum(r + 1 for r in range(n)) / n
    assert_close(out, torch.arange(6, dtype=torch.float32).reshape(3, 2) * mean, "w.grad")


def test_a_non_contiguous_gradient_takes_the_general_path(recorded):
    n, me = hvd.size(), hvd.rank()
    grad = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * (me + 1)).t()
    assert not grad.is_contiguous()
    out = _lone_parameter_step(grad)
    assert recorded == [("single", 1)], f"rank {me}: {recorded}"
    mean = sum(r + 1 for r in range(n)) / n
    assert out is grad
    assert_close(out, torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * mean, "w.grad")


def test_a_compressed_gradient_takes_the_general_path(recorded):
    n, me = hvd.size(), hvd.rank()
    w = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                   compression=hvd.Compression.fp16)
    w.grad = torch.full((4,), float(me + 1))
    opt.synchronize()
    assert recorded == [("single", 1)], f"rank {me}: {recorded}"
    assert_close(w.grad, torch.full((4,), sum(r + 1 for r in range(n)) / n), "w.grad")


def test_num_groups_is_deprecated_for_groups(recorded):
    with pytest.warns(DeprecationWarning, match="groups"):
        _train_once(groups=None, num_groups=2)
    assert sorted(recorded) == [("grouped", 2)] * 2, f"rank {hvd.rank()}: {recorded}"


def test_groups_checked():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("g", w)],
                                 groups=[[w, w]])
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("g", w)],
                                 groups=[["not a tensor"]])


def test_unused_parameter_in_a_group_does_not_hang():
    me, n = hvd.rank(), hvd.size()
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0),
                                   named_parameters=[("ga", a), ("gb", b)], groups=[[a, b]],
                                   op=hvd.Sum)
    loss = a.sum() * (me + 1)
    if me == 0:
        loss = loss + b.sum()  # only rank 0 uses b: its group completes only there
    loss.backward()
    opt.step()
    assert_close(a, torch.full((2,), -float(sum(r + 1 for r in range(n)))), "a")
    assert_close(b, torch.full((2,), -1.0), "b")


def test_load_state_dict_resets_pending_reductions_and_passes():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("lw", w)],
                                   backward_passes_per_step=2, op=hvd.Sum)
    (w * 100.0).sum().backward()  # one pass of two: nothing submitted yet
    state = opt.state_dict()
    opt.load_state_dict(state)
    opt.zero_grad()
    # Two passes again: with the count not reset, the second would be "more than
    # backward_passes_per_step" (an AssertionError).
    for _ in range(2):
        (w * float(hvd.rank() + 1)).sum().backward()
    opt.synchronize()
    assert_close(w.grad, torch.full((3,), 2.0 * sum(r + 1 for r in range(hvd.size()))),
                 "w.grad after two passes")
    with opt.skip_synchronize():
        opt.step()
    # A reduction in flight when load_state_dict comes is dropped: zero_grad is then allowed.
    opt.set_backward_passes_per_step(1)
    w.sum().backward()
    opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    (w * 2.0).sum().backward()
    opt.step()
    assert_close(w.grad, torch.full((3,), 2.0 * hvd.size()), "w.grad after reload")


def test_load_state_dict_after_the_engine_failed_drops_the_reductions_silently():
    # An elastic job's state.restore() calls load_state_dict with this step's reductions
    # still held by a failed engine: it must not raise their error (issue 33, item 1). Each
    # rank names the parameter differently, so that its reduction cannot complete (size > 1)
    # and is still in flight when the engine stops (sparse_as_dense: submitted during
    # backward, with no layout to agree first).
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0, momentum=0.9),
                                   named_parameters=[(f"alone{hvd.rank()}", w)],
                                   sparse_as_dense=True)
    w.sum().backward()
    assert len(opt._in_flight) == 1
    saved = opt.state_dict()
    hvd.shutdown()
    try:
        opt.load_state_dict(saved)  # the reduction failed with the engine: dropped, no error
    finally:
        hvd.init()
    assert not opt._in_flight and not opt._passes_seen
    opt.zero_grad()


def test_a_step_cut_short_in_an_earlier_world_is_forgotten():
    # A backward pass whose world ended before its step (an elastic re-form, without the
    # optimizer in the state): the next world starts from a clean step.
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("cut", w)],
                                   backward_passes_per_step=2, op=hvd.Sum,
                                   sparse_as_dense=True)
    w.sum().backward()  # one pass of two, nothing submitted
    (w * 2.0).sum().backward()  # the second: submitted
    hvd.shutdown()
    hvd.init()
    opt.zero_grad()
    for _ in range(2):
        (w * float(hvd.rank() + 1)).sum().backward()
    opt.step()
    assert_close(w, torch.full((3,), -2.0 * sum(r + 1 for r in range(hvd.size()))),
                 "w after a step in the new world")


def test_wrapping_keeps_the_optimizers_state():
    w = torch.nn.Parameter(torch.ones(2))
    base = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.sum().backward()
    base.step()  # momentum buffer made
    opt = hvd.DistributedOptimizer(base, named_parameters=[("kw", w)])
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.ones(2))
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(opt, named_parameters=[("kw", w)])


def test_wrapping_after_an_lr_scheduler_still_reduces():
    w = torch.nn.Parameter(torch.zeros(2))
    base = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # patches base.step
    opt = hvd.DistributedOptimizer(base, named_parameters=[("sw", w)], op=hvd.Sum)
    (w * float(hvd.rank() + 1)).sum().backward()
    opt.step()
    assert_close(w, torch.full((2,), -float(sum(r + 1 for r in range(hvd.size())))),
                 "w after a step of the wrapper")
    with warnings.catch_warnings():
        # The scheduler watches the wrapped optimizer's step(), not the wrapper's (as with
        # Horovod, whose wrapper is a new object too): it warns about the order.
        warnings.simplefilter("ignore")
        sched.step()  # the shared parameter groups see the new rate
    assert opt.param_groups[0]["lr"] == 0.5


def test_groups_agree_on_the_parameter_order():
    me, n = hvd.rank(), hvd.size()
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    # The ranks list the parameters in different orders: the set's first rank's order wins,
    # so that the grouped allreduce's members line up (a with a, b with b).
    params = [a, b] if me % 2 == 0 else [b, a]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0),
                                   named_parameters=[("oa", a), ("ob", b)], groups=1,
                                   op=hvd.Sum)
    (a.sum() * (me + 1) + b.sum() * 10 * (me + 1)).backward()
    opt.synchronize()
    total = float(sum(r + 1 for r in range(n)))
    assert_close(a.grad, torch.full((2,), total), "a.grad")
    assert_close(b.grad, torch.full((3,), 10 * total), "b.grad")


def test_groups_with_different_parameters_on_the_ranks_fail_on_every_rank():
    w = torch.nn.Parameter(torch.zeros(2))
    name = "same" if hvd.rank() == 0 else f"other{hvd.rank()}"
    if hvd.size() == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(ValueError, match="train different parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[(name, w)],
                                 groups=1)


def test_sparse_gradient_on_some_ranks_only_in_the_first_step():
    # Rank 0 alone has a gradient for the embedding in the first step: the others must not
    # send dense zeros where rank 0 allgathers sparse entries (that would never meet).
    me, n = hvd.rank(), hvd.size()
    torch.manual_seed(5)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    w0 = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=emb.named_parameters(), op=hvd.Sum)
    if me == 0:
        emb(torch.tensor([1, 4, 1])).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse, f"rank {me}: {emb.weight.grad.layout}"
    want = w0.clone()
    want[1] -= 2.0  # row 1 looked up twice, once per unit of the sum
    want[4] -= 1.0
    assert_close(emb.weight, want, "embedding after the first step")
    # Later steps: every rank looks up row r, reduced sparse.
    opt.zero_grad()
    emb(torch.tensor([me % 6])).sum().backward()
    opt.step()
    for r in range(n):
        want[r % 6] -= 1.0
    assert_close(emb.weight, want, "embedding after the second step")


def test_zero_grad_between_accumulated_passes_is_refused():
    # As Horovod: once a backward pass has reached the optimizer, zero_grad() before step()
    # or synchronize() is refused, also while passes are being accumulated.
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("zz", w)],
                                   backward_passes_per_step=2)
    w.sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    w.sum().backward()
    opt.step()
    opt.zero_grad()  # allowed again


def test_parameter_names_as_horovods_without_and_with_named_parameters():
    """Horovod's ``_parameter_names`` (parameter -> name), as its
    test_optimizer_no_named_parameters reads it: one distinct name per parameter, the same
    names on every rank; with named_parameters, those names."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.001))
    names = opt._parameter_names
    assert set(names) == set(model.parameters()) and len(set(names.values())) == len(names)
    every = hvd.allgather_object(sorted(names.values()))
    assert len(every) == hvd.size() and all(n == every[0] for n in every)
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: k for k, p in model.named_parameters()}

