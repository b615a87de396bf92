"""Error estimates, relative tolerances, adaptive iterations and warm starts, against serial."""

import pytest
import torch
from mpi4py import MPI

from layerbraid import MGRITOptions
from nets import ODEResNet
from tolerances import RAW_ESTIMATE_FACTOR

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def opts(iters, **kw):
    kw.setdefault("skip_first_downcycle", True)
    return MGRITOptions(max_levels=kw.pop("levels", 2), cfactor=4, max_iters=iters, tol=0.0,
                        nrelax=kw.pop("nrelax", 0), **kw)


class Chain(ODEResNet):
    """ODEResNet without its open and close layers: the output is the chain's last state, and
    the input gradient the adjoint's last state."""

    def __init__(self, comm, steps, options, t_final=2.0, backward=None, **kw):
        super().__init__(comm, num_steps=steps, forward_options=options,
                         backward_options=backward or options, **kw)
        self.open = self.close = None
        self.t_final, self.dt = t_final, t_final / steps


def errors(model, x, w):
    """(relative output error, relative input-gradient error) against serial, on every rank."""
    serial = model.to_serial()
    xp = x.clone().requires_grad_(True)
    out = model(xp)
    (out * w).sum().backward()
    xs = x.clone().requires_grad_(True)
    ref = serial(xs)
    (ref * w).sum().backward()
    err_out = float((out - ref).detach().norm() / ref.detach().norm())
    err_in = float((xp.grad - xs.grad).norm() / xs.grad.norm()) if WORLD.rank == 0 else None
    return err_out, WORLD.bcast(err_in, root=0)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("steps, levels, nrelax", [(32, 2, 0), (64, 3, 1)])
def test_error_estimate_tracks_the_true_error(steps, levels, nrelax):
    for solve in ("forward", "adjoint"):  # one job for both
        # The other solve exact: the adjoint's error then is its own solve's alone (with an
        # approximate forward, the adjoint is also linearized at slightly wrong states).
        for iters in (1, 3):
            multilevel = opts(iters, levels=levels, nrelax=nrelax)
            exact = MGRITOptions(max_levels=1)
            torch.manual_seed(0)
            model = Chain(WORLD, steps, multilevel if solve == "forward" else exact,
                          backward=multilevel if solve == "adjoint" else exact)
            model.double()
            x, w = inputs()
            err_out, err_in = errors(model, x, w)
            stats, true = ((model.forward_stats, err_out) if solve == "forward"
                           else (model.backward_stats, err_in))
            est = stats.error_estimate
            assert est is not None and stats.final_residual is not None
            # the sum of the residuals' norms bounds their vector sum: an upper estimate here
            assert true <= est <= true * RAW_ESTIMATE_FACTOR, (iters, est, true)
            assert est == stats.raw_error_estimate  # no audit, no calibration
            assert est == WORLD.allreduce(est, op=MPI.MAX)  # the same on every rank
            model.free()


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_one_level_estimates_zero_error():
    torch.manual_seed(0)
    model = Chain(WORLD, 8, MGRITOptions(max_levels=1))
    model.double()
    errors(model, *inputs())
    assert model.forward_stats.error_estimate == 0.0
    assert model.backward_stats.error_estimate == 0.0
    assert model.forward_stats.final_residual is None
    assert model.gradient_error_estimate() == 0.0


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_rtol_stops_at_the_first_residual_below_it():
    for rtol in (1e-3, 1e-6):  # one job for both
        torch.manual_seed(0)
        model = Chain(WORLD, 32, opts(30, rtol=rtol))
        model.double()
        x, _ = inputs()
        with torch.no_grad():
            model(x)
        stats = model.forward_stats
        norms, ref = stats.residual_norms, stats.state_norm
        # the state norm moves by far less than 1% between the last iterations
        assert norms[-1] < rtol * ref * 1.01
        assert all(r >= rtol * ref * 0.99 for r in norms[:-1]), (norms, rtol * ref)
        assert stats.iterations < 30


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_adaptive_iterations_meet_their_target():
    for target in (1e-2, 1e-4, 1e-7):  # one job for the three (each job costs seconds to start)
        torch.manual_seed(0)
        model = Chain(WORLD, 32, opts(20), target_error=target)
        model.double()
        x, w = inputs()
        iterations = []
        for seed in range(3):  # the first solve has no measured contraction yet
            x, w = inputs(seed)
            err_out, err_in = errors(model, x, w)
            for stats, true in ((model.forward_stats, err_out), (model.backward_stats, err_in)):
                # each solve aims at its share of the target from the last solve's contraction:
                # a prediction, met to within a factor 2
                assert stats.error_estimate <= target, (stats.error_estimate, target)
                assert true <= 2 * target, (true, target)
                iterations.append(stats.iterations)
        assert max(iterations) < 20
        if target == 1e-7:
            assert min(iterations) > 2  # not met by the cheapest setting: the target decides
        est = model.gradient_error_estimate()
        assert est == model.backward_stats.error_estimate + 5 * model.forward_stats.error_estimate
        model.free()


def test_target_error_is_checked():
    for bad in (0, 1.5, -1e-3, "1e-2", True):
        with pytest.raises(ValueError, match="target_error"):
            Chain(MPI.COMM_SELF, 8, opts(2), target_error=bad)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_warm_start_with_skip_lowers_the_error_on_a_repeated_batch():
    torch.manual_seed(0)
    model = Chain(WORLD, 32, opts(2), warm_start=True)
    model.double()
    cold = Chain(WORLD, 32, opts(2))
    cold.load_state_dict(model.to_serial().state_dict())
    cold.double()
    x, w = inputs()
    warm = [errors(model, x, w) for _ in range(4)]
    # Without a warm start every pass leaves the same error (about 5e-3 here).
    first = errors(cold, x, w)
    assert errors(cold, x, w) == pytest.approx(first, rel=1e-9)
    assert warm[0] == pytest.approx(first, rel=1e-9)  # no guess yet: the same solve
    assert first[0] > 1e-3 and first[1] > 1e-3
    # Each warm pass starts from the last one's states: the forward gains about 3 orders of
    # magnitude per pass; the adjoint less at first, as its guess was linearized at the last
    # pass's less accurate forward states.
    assert warm[1][0] < first[0] / 100
    for k in range(1, 4):
        assert warm[k][1] < warm[k - 1][1] / 5 or warm[k][1] < 1e-12
    assert warm[3][0] < 1e-12 and warm[3][1] < 1e-7
