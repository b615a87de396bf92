"""The bias guard (layerbraid.accuracy.BiasGuard, Note [bias guard]): a stalled loss with a
large audited gradient error raises every solve's iterations, then switches to exact solves; a
stall with a small error, or a falling loss, changes nothing; each stall is logged once."""
import pytest
import torch
import torch.nn.functional as F

from layerbraid import MGRITOptions
from layerbraid._engine.parts import ExactSolve, TunedSolve
from layerbraid.accuracy import BiasGuard
from nets import ODEResNet, batch
from transports import WORLD

@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


CHEAP = MGRITOptions(max_levels=2, cfactor=2, max_iters=1, tol=0.0)


def _model():
    torch.manual_seed(0)
    return ODEResNet(WORLD, num_steps=8, forward_options=CHEAP, backward_options=CHEAP)


def _batch(model):
    x, y = batch()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return lambda: F.cross_entropy(model(x), y)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_a_stall_with_a_large_error_raises_the_iterations_then_switches_to_exact():
    model = _model()
    lines = []
    guard = BiasGuard(model, window=2, stall=0.01, max_error=0.0, max_iterations=2,
                      log=lines.append)
    closure = _batch(model)
    assert [guard(1.0, b, closure) for b in range(3)] == [None] * 3  # two windows first
    event = guard(1.0, 3, closure)  # flat: a stall
    assert event.action == "raised" and event.iterations == [(2, 2)] and event.error > 0
    assert model.solve_mode == TunedSolve(2, 2)
    _batch(model)  # the next batches solve at the raised counts
    assert model.forward_stats.iterations == 2 and model.backward_stats.iterations == 2
    assert guard(1.0, 4, closure) is None  # one new window before the next check
    event = guard(1.0, 5, closure)
    assert event.action == "exact" and event.iterations == [None]
    assert isinstance(model.solve_mode, ExactSolve)
    closure = _batch(model)  # the gradients of exact solves
    assert guard(1.0, 6, closure) is None
    later = guard(1.0, 7, closure)  # exact already: nothing left to raise
    assert later.action == "kept" and later.iterations == [None]
    assert later.error < 1e-5  # exact solves: the audit finds round-off only
    assert [e.action for e in guard.events] == ["raised", "exact", "kept"]
    assert len(lines) == (3 if WORLD.rank == 0 else 0)
    if lines:
        assert lines[0].startswith("bias guard, batch 3: the loss stalled (1 -> 1)")
        assert "raised the iterations to 2/2" in lines[0]
        assert "switched to exact solves" in lines[1]


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_a_falling_loss_or_a_small_error_changes_nothing():
    model = _model()
    guard = BiasGuard(model, window=2, stall=0.01, max_error=1e9, log=None)
    closure = _batch(model)
    for b, loss in enumerate([4.0, 3.0, 2.0, 1.0]):
        assert guard(torch.tensor(loss), b, closure) is None  # falling by far more than 1%
    events = [guard(1.0, b, closure) for b in range(4, 8)]
    assert events[:3] == [None] * 3  # 1.5 -> 1 is still falling; then a window of 1s
    assert events[3].action == "kept" and events[3].iterations == [(1, 1)]
    assert model.solve_mode is None


@pytest.mark.parametrize("kw, name", [({"window": 0}, "window"), ({"stall": -1.0}, "stall"),
                                      ({"max_error": "big"}, "max_error"),
                                      ({"max_iterations": 0}, "max_iterations")])
def test_bad_settings_are_refused_naming_them(kw, name):
    with pytest.raises(ValueError, match=name):
        BiasGuard(_model(), **kw)


@pytest.mark.parallel([2])
def test_a_data_group_that_stops_before_the_guards_loss_sum_is_reported(short_timeout):
    """Two data groups of one rank each: the guard sums their losses; a group that never
    comes leaves the other waiting no longer than the deadline, naming what it waited for
    (a job of its own: the stall leaves a collective behind)."""
    import time

    import layerbraid

    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)
    torch.manual_seed(0)
    model = ODEResNet(grid, num_steps=8, forward_options=CHEAP, backward_options=CHEAP)
    guard = BiasGuard(model, window=1, log=None)
    if WORLD.rank == 1:
        return  # stops before the sum
    t0 = time.perf_counter()
    with pytest.raises(layerbraid.StallError, match="the bias guard's loss over the data groups"):
        guard(1.0, 0, lambda: None)
    assert time.perf_counter() - t0 < 2 * short_timeout


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_data_groups_decide_on_the_whole_batchs_loss():
    """Each data group gives its own shard's loss; both see the same mean, so both decide
    alike (here: a stall, since the mean is flat though each group's loss moves)."""
    import layerbraid

    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)
    torch.manual_seed(0)
    model = ODEResNet(grid, num_steps=8, forward_options=CHEAP, backward_options=CHEAP)
    guard = BiasGuard(model, window=1, max_error=1e9, log=None)
    closure = _batch(model)
    own = [1.0, 2.0] if WORLD.rank == 0 else [2.0, 1.0]  # the mean is 1.5 at both batches
    events = [guard(loss, b, closure) for b, loss in enumerate(own)]
    assert events[0] is None and events[1].action == "kept"
    assert events[1].before == events[1].now == 1.5
