"""MG/Opt (layerbraid.depth.mgopt): the coherence term makes each coarse objective's gradient at the
restricted point the restricted fine gradient; the layer-parallel cycle equals the one-rank
cycle; the corrections lower the loss; bad options and a failing rank are clear errors."""
import time

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import layerbraid
from layerbraid.depth.mgopt import MGOpt
from nets import ODEResNet, batch
from transports import WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def hierarchy(comm, depths, seed=0):
    """Networks of ``depths`` steps, finest first, the same weights on any communicator."""
    out = []
    for k, n in enumerate(depths):
        torch.manual_seed(seed + k)
        whole = ODEResNet(MPI.COMM_SELF, num_steps=n).to_serial()
        out.append(layerbraid.from_serial(whole, comm=comm))
    return out


def loss_on(x, y):
    return lambda model: F.cross_entropy(model(x), y)


def sgd(models, lr=0.05):
    return [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("grad_restrict", ["adjoint", "injection", "average"])
def test_the_coarse_gradient_is_the_restricted_fine_gradient(grad_restrict):
    models = hierarchy(WORLD, [12, 6, 3])
    mg = MGOpt(models, sgd(models), grad_restrict=grad_restrict, check_coherence=True)
    for k in range(2):  # at the initial and at a trained point
        mg.step(loss_on(*batch(seed=k)))
        assert mg.stats.coherence_gap is not None
        assert mg.stats.coherence_gap < 1e-12, (k, mg.stats.coherence_gap)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("line_search, state", [("backtracking", "restrict"),
                                                ("alphas", "keep"), ("none", "reset")])
def test_the_layer_parallel_cycle_equals_the_one_rank_cycle(line_search, state):
    """Three cycles of a 3-level hierarchy (12, 6, 3 steps: blocks move between ranks) with
    Adam on 2 and 3 ranks equal the same cycles on one rank, weights and line searches."""

    def run(comm):
        models = hierarchy(comm, [12, 6, 3])
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
        mg = MGOpt(models, opts, line_search=line_search, state=state)
        alphas = []
        for k in range(3):
            mg.step(loss_on(*batch(seed=k)))
            alphas.append(list(mg.stats.alphas))
        return models[0].to_serial().state_dict(), alphas

    (got, got_alphas), (want, want_alphas) = run(WORLD), run(MPI.COMM_SELF)
    assert got_alphas == want_alphas
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-11, atol=1e-13, msg=k)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2])
def test_cycles_lower_the_fine_loss_on_a_batch():
    """On one batch, repeated cycles drive the fine loss down, and the backtracking line
    search takes coarse corrections (alpha > 0) along the way."""
    models = hierarchy(WORLD, [8, 4])
    mg = MGOpt(models, sgd(models, lr=0.02))
    x, y = batch(n=12, seed=3)
    first = mg.step(loss_on(x, y))
    taken = 0
    for _ in range(6):
        last = mg.step(loss_on(x, y))
        taken += mg.stats.alphas[0] > 0
    assert last < 0.7 * first, (first, last)
    assert taken >= 1


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 4])
@pytest.mark.parametrize("line_search", ["backtracking", "alphas"])
def test_data_parallel_cycles_equal_the_full_batch_cycles(line_search):
    """MG/Opt on a 2 x 1 grid (2 ranks) or a 2 x 2 grid (4 ranks), each data group given half
    of each batch, equals MG/Opt on the whole batch without data parallelism on one layer
    group: the objective it reports, every line search's choice and the weights after four
    cycles of a 3-level hierarchy with Adam.  (Before the groups agreed on the objective, each
    searched on its own half's loss.)"""
    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)

    def run(comm, shard):
        models = hierarchy(comm, [12, 6, 3])
        opts = [torch.optim.Adam(m.parameters(), lr=3e-2) for m in models]
        mg = MGOpt(models, opts, line_search=line_search, alphas=(2.0, 1.0, 0.5, 0.25))
        losses, alphas = [], []
        for k in range(4):
            x, y = batch(n=8, seed=k)
            losses.append(mg.step(loss_on(shard(x), shard(y))))
            alphas.append(list(mg.stats.alphas))
        return models[0].to_serial().state_dict(), losses, alphas

    got, got_losses, got_alphas = run(grid, lambda t: t.chunk(2)[grid.data_rank])
    want, want_losses, want_alphas = run(grid.layer_comm, lambda t: t)
    assert got_alphas == want_alphas
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-12, atol=0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-11, atol=1e-13, msg=k)
    grid.free()


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_levels_with_different_data_parallelism_are_refused_on_every_rank():
    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)
    models = [hierarchy(grid, [4])[0], hierarchy(MPI.COMM_SELF, [2])[0]]
    with pytest.raises(ValueError, match=r"the same number of data groups: \[2, 1\]"):
        MGOpt(models, sgd(models))
    grid.free()


@pytest.mark.parallel([1])
def test_backtracking_refuses_a_correction_that_is_not_a_descent_direction():
    """A correction whose slope along the fine gradient is not negative is refused (step 0,
    the weights as they were) without evaluating the objective; a descent direction is
    searched as before."""
    models = hierarchy(MPI.COMM_SELF, [4, 2])
    mg = MGOpt(models, sgd(models))
    calls = []
    x, y = batch(seed=0)

    def loss(model):
        calls.append(1)
        return F.cross_entropy(model(x), y)

    before = {k: v.clone() for k, v in models[0].state_dict().items()}
    e = {p: torch.ones_like(p) for p in models[0].parameters()}
    for slope in (0.0, 1e-3):
        assert mg._search(0, None, loss, e, old=1.0, slope=slope) == 0.0
    assert calls == []
    for k, v in models[0].state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert mg._search(0, None, loss, e, old=float("inf"), slope=-1.0) == 1.0 and calls


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
def test_the_correction_through_the_optimizer_is_its_step_along_the_correction():
    """line_search="optimizer" (TorchBraid's tb_adam_no_ls) hands -e to the fine optimizer
    as its gradient: with plain SGD at lr 1 that is x + e, the cycle of line_search="none" at
    alpha 1, to round-off; with Adam it is one more Adam step per cycle (its step count is
    pre + 1 + post), and the weights differ from x + e."""
    def run(search, make):
        models = hierarchy(WORLD, [8, 4])
        opts = [make(m) for m in models]
        mg = MGOpt(models, opts, line_search=search, alpha=1.0, state="reset")
        for k in range(2):
            mg.step(loss_on(*batch(seed=k)))
        return models[0].to_serial().state_dict(), opts[0], mg.stats.alphas

    plain = lambda m: torch.optim.SGD(m.parameters(), lr=1.0)  # noqa: E731
    (got, _, alphas), (want, _, _) = run("optimizer", plain), run("none", plain)
    assert alphas == [1.0]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731
    (got, opt, _), (want, _, _) = run("optimizer", adam), run("none", adam)
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {2 * 3.0}, steps  # two cycles of pre, correction, post
    assert any(not torch.allclose(got[k], want[k]) for k in want)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("rule", ["full_weighting", "injection"])
def test_torchbraids_restrictions_keep_the_coarse_gradient_coherent(rule):
    """The full-weighting stencil and injection, for the weights and for the gradient (as
    TorchBraid's MG/Opt offers them): the coherence term still makes the coarse gradient at the
    restricted point the restricted fine gradient."""
    models = hierarchy(WORLD, [8, 4])
    mg = MGOpt(models, sgd(models), restrict=rule, grad_restrict=rule, check_coherence=True)
    for k in range(2):
        mg.step(loss_on(*batch(seed=k)))
        assert mg.stats.coherence_gap < 1e-12, (k, mg.stats.coherence_gap)


@pytest.mark.parallel([1])
def test_several_cycles_per_batch_stop_at_the_tolerance():
    """cycles=K runs K V-cycles on the batch, each lowering the loss here; with tol, the
    cycles stop once the fine loss is at most tol."""
    models = hierarchy(MPI.COMM_SELF, [8, 4])
    x, y = batch(n=12, seed=3)
    mg = MGOpt(models, sgd(models, lr=0.02), cycles=3)
    first = mg.step(loss_on(x, y))
    assert mg.stats.cycles == 3
    with torch.no_grad():
        after = float(F.cross_entropy(models[0](x), y))
    assert after < first
    models = hierarchy(MPI.COMM_SELF, [8, 4])
    mg = MGOpt(models, sgd(models, lr=0.02), cycles=5, tol=1e9)  # met after the first
    mg.step(loss_on(x, y))
    assert mg.stats.cycles == 1


@pytest.mark.parallel([1])
def test_options_per_level_are_each_pairs_own():
    """A sequence gives each coarse level its own option: three levels, two line searches."""
    models = hierarchy(MPI.COMM_SELF, [12, 6, 3])
    mg = MGOpt(models, sgd(models), line_search=["none", "backtracking"],
               restrict=["full_weighting", "injection"], grad_restrict=["injection", "adjoint"],
               alpha=0.5)
    mg.step(loss_on(*batch(seed=0)))
    assert mg.stats.alphas[0] == 0.5  # "none": alpha itself
    assert mg.line_searches == ["none", "backtracking"]
    with pytest.raises(ValueError, match="line_search takes one value or one per coarse "
                                         "level \\(2\\), got 3"):
        MGOpt(models, sgd(models), line_search=["none"] * 3)
    with pytest.raises(ValueError, match="restrict must be one of .*got 'cubic'"):
        MGOpt(models, sgd(models), restrict=["injection", "cubic"])
    with pytest.raises(ValueError, match="cycles must be an int >= 1, got 0"):
        MGOpt(models, sgd(models), cycles=0)


@pytest.mark.parallel([1])
def test_bad_options_are_clear_errors():
    models = hierarchy(MPI.COMM_SELF, [4, 2])
    opts = sgd(models)
    with pytest.raises(ValueError, match="at least two models and one optimizer per model"):
        MGOpt(models[:1], opts[:1])
    with pytest.raises(ValueError, match="line_search must be one of .*got 'wolfe'"):
        MGOpt(models, opts, line_search="wolfe")
    with pytest.raises(ValueError, match="grad_restrict must be one of .*got 'linear'"):
        MGOpt(models, opts, grad_restrict="linear")
    with pytest.raises(ValueError, match="pre_relax must be an int >= 0, got -1"):
        MGOpt(models, opts, pre_relax=-1)
    with pytest.raises(ValueError, match="alpha and alphas must be > 0"):
        MGOpt(models, opts, alphas=())
    with pytest.raises(ValueError, match="3 steps are not a multiple of the coarse network's 2"):
        MGOpt(hierarchy(MPI.COMM_SELF, [3, 2]), opts)


@pytest.mark.parallel([2])
def test_a_rank_that_fails_on_the_coarse_level_does_not_hang_the_other(short_timeout):
    """Rank 1's loss raises on the coarse network; rank 0, waiting for it in the coarse
    solve, raises StallError after the timeout instead of waiting forever."""
    layerbraid.set_timeout(120)
    models = hierarchy(WORLD, [4, 2])
    mg = MGOpt(models, sgd(models))
    layerbraid.set_timeout(short_timeout)
    x, y = batch(seed=0)

    def loss(model):
        if model is models[1] and WORLD.rank == 1:
            raise RuntimeError("rank 1 fails on the coarse level")
        return F.cross_entropy(model(x), y)

    if WORLD.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(layerbraid.StallError):
            mg.step(loss)
        assert time.monotonic() - t0 < short_timeout + 30
    else:
        with pytest.raises(RuntimeError, match="rank 1 fails on the coarse level"):
            mg.step(loss)
        time.sleep(short_timeout + 3)  # still running when rank 0 gives up


@pytest.mark.parallel([2])
def test_a_data_group_that_fails_before_the_loss_agreement_does_not_hang_the_other(
        short_timeout):
    """2 data groups: rank 1 fails after its backward, just before the groups agree on the
    objective; rank 0, waiting in that agreement, raises StallError naming it."""
    layerbraid.set_timeout(120)
    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)
    models = hierarchy(grid, [4, 2])
    mg = MGOpt(models, sgd(models))
    layerbraid.set_timeout(short_timeout)
    x, y = batch(seed=0)
    if WORLD.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(layerbraid.StallError, match="every data group's MG/Opt loss"):
            mg.step(loss_on(x, y))
        assert time.monotonic() - t0 < short_timeout + 30
    else:
        def fail(*args):
            raise RuntimeError("rank 1 fails before the data groups agree on the loss")

        mg._value = fail
        with pytest.raises(RuntimeError, match="rank 1 fails before"):
            mg.step(loss_on(x, y))
        time.sleep(short_timeout + 3)  # still running when rank 0 gives up
