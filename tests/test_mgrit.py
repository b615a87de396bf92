"""MGRIT against sequential stepping and against XBraid, on 1 to 4 ranks."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import layerbraid
from layerbraid import MGRIT, MGRITOptions
from problems import (dahlquist_init, dahlquist_step, heat_init_factory, heat_step_factory,
                      nonlinear_init, nonlinear_step, oscillator_init, oscillator_step,
                      sequential)
from tolerances import CONVERGED, ROUNDOFF, XBRAID_RTOL

RANKS = [1, 2, 3, 4]
WORLD = MPI.COMM_WORLD

# XBraid's printed residual histories for u' = -u, backward Euler, dt = 0.5, u(0) = 1, guess 0.456,
# 64 steps, 2 levels, cfactor 2, FCF, tol 1e-10.
XBRAID_NO_SKIP = [6.167164e-01, 2.854921e-02, 1.316826e-03, 6.022961e-05, 2.720571e-06,
                  1.206605e-07, 5.203614e-09, 2.144607e-10, 8.192404e-12]
XBRAID_SKIP = [2.851112e-02, 1.049429e-03, 4.437913e-05, 1.990483e-06, 9.174721e-08,
               4.293365e-09, 2.028374e-10, 9.635472e-12]


# XBraid's defaults, which these tests (and the XBraid outputs they compare with) were written
# for; layerbraid's own defaults are the training settings (F-relaxation, skip, cfactor 4).
XBRAID_DEFAULTS = dict(cfactor=2, nrelax=1, skip_first_downcycle=False)


def solve(step, init, n, t0, t1, comm=WORLD, trace=False, **opts):
    return MGRIT(step=step, init=init, num_steps=n, t_start=t0, t_stop=t1,
                 options=MGRITOptions(**{**XBRAID_DEFAULTS, **opts}), comm=comm,
                 trace=trace).solve()


def max_error(states, reference):
    err = max((float(np.max(np.abs(u - reference[i]))) for i, u in states.items()), default=0.0)
    return WORLD.allreduce(err, op=MPI.MAX)


def owned_everything(states, n):
    """Every fine point is owned by exactly one rank."""
    owned = WORLD.allgather(sorted(states))
    flat = sorted(i for block in owned for i in block)
    assert flat == list(range(n + 1))
    # contiguous blocks in rank order
    assert all(b == sorted(b) and (not b or b[-1] - b[0] + 1 == len(b)) for b in owned)


# Note: each parallel test is one mpiexec launch per rank count, so cases loop inside a test.


@pytest.mark.shared_job
@pytest.mark.parallel(RANKS)
def test_xbraid_residual_history():
    for skip, expected in [(False, XBRAID_NO_SKIP), (True, XBRAID_SKIP)]:
        _check_xbraid(skip, expected)


def _check_xbraid(skip, expected):
    r = solve(dahlquist_step, dahlquist_init, 64, 0.0, 32.0, max_levels=2, cfactor=2, nrelax=1,
              tol=1e-10, max_iters=100, skip_first_downcycle=skip)
    assert r.iterations == 9
    np.testing.assert_allclose(r.residual_norms, expected, rtol=XBRAID_RTOL)
    # identical on all ranks
    assert WORLD.allgather(r.residual_norms) == [r.residual_norms] * WORLD.size


@pytest.mark.shared_job
@pytest.mark.parallel(RANKS)
def test_one_level_is_sequential_stepping_exactly():
    for n in (17, 64):
        _check_one_level(n)


def _check_one_level(n):
    ref = sequential(nonlinear_step, nonlinear_init, n, 0.0, 2.0)
    r = solve(nonlinear_step, nonlinear_init, n, 0.0, 2.0, max_levels=1)
    assert r.iterations == 0 and r.residual_norms == [] and r.num_levels == 1
    owned_everything(r.states, n)
    for i, u in r.states.items():
        assert np.array_equal(u, ref[i])  # bit for bit: the same operations in the same order


@pytest.mark.shared_job
@pytest.mark.parallel(RANKS)
def test_multilevel_converges_to_sequential():
    for opts in [
        dict(skip_first_downcycle=False, max_levels=2, cfactor=2, nrelax=1),
        dict(skip_first_downcycle=False, max_levels=3, cfactor=4, nrelax=0),
        dict(skip_first_downcycle=False, max_levels=4, cfactor=(2, 3, 2),
             nrelax=(0, 1, 1), cycle="F"),
        dict(max_levels=3, cfactor=2, nrelax=1, skip_first_downcycle=True, final_fc_relax=True),
    ]:
        for n in (48, 61):  # 61: levels that do not divide evenly
            _check_converges(opts, n)


def _check_converges(opts, n):
    ref = sequential(nonlinear_step, nonlinear_init, n, 0.0, 3.0)
    r = solve(nonlinear_step, nonlinear_init, n, 0.0, 3.0, tol=1e-13, max_iters=60, **opts)
    assert r.num_levels > 1
    assert r.residual_norms[-1] < 1e-13 < r.residual_norms[0]
    assert max_error(r.states, ref) < ROUNDOFF
    owned_everything(r.states, n)


@pytest.mark.shared_job
@pytest.mark.parallel(RANKS)
def test_two_level_mgrit_is_exact_after_theoretical_iterations():
    for n, cf, nrelax in [(32, 4, 1), (64, 8, 1), (32, 8, 0)]:
        _check_exact_after(n, cf, nrelax)


def _check_exact_after(n, cf, nrelax):
    """Two-level MGRIT is exact (to round-off) after N / cf iterations with F-relaxation and
    N / (2 cf) with FCF, while one iteration fewer is visibly inexact (a problem that the coarse
    steps capture badly, so that convergence alone cannot explain it)."""
    t1 = n * 0.25
    ref = sequential(oscillator_step, oscillator_init, n, 0.0, t1)
    k = n // (cf * (2 if nrelax else 1))
    opts = dict(skip_first_downcycle=False, max_levels=2, cfactor=cf, nrelax=nrelax, tol=0.0, min_coarse=1)
    exact = solve(oscillator_step, oscillator_init, n, 0.0, t1, max_iters=k, **opts)
    assert exact.iterations == k
    assert max_error(exact.states, ref) < ROUNDOFF
    early = solve(oscillator_step, oscillator_init, n, 0.0, t1, max_iters=k - 1, **opts)
    assert max_error(early.states, ref) > 1e-3


@pytest.mark.shared_job
@pytest.mark.parallel([2, 3, 4])
def test_same_answer_on_any_number_of_ranks():
    for opts in [
        dict(skip_first_downcycle=False, max_levels=3, cfactor=2, nrelax=1, max_iters=4),
        dict(max_levels=3, cfactor=(4, 2), nrelax=(0, 1), cycle="F", max_iters=3,
             skip_first_downcycle=True, final_fc_relax=True),
    ]:
        _check_same_answer(opts)


def _check_same_answer(opts):
    """A few iterations (not converged) give the same states on P ranks as on one."""
    n = 45
    par = solve(nonlinear_step, nonlinear_init, n, 0.0, 3.0, tol=0.0, trace=True, **opts)
    ser = solve(nonlinear_step, nonlinear_init, n, 0.0, 3.0, tol=0.0, comm=MPI.COMM_SELF,
                trace=True, **opts)
    assert par.iterations == ser.iterations
    np.testing.assert_allclose(par.residual_norms, ser.residual_norms, rtol=ROUNDOFF)
    for i, u in par.states.items():
        np.testing.assert_allclose(u, ser.states[i], rtol=0, atol=ROUNDOFF)
    # The same work, split over ranks: the multiset of steps over all ranks equals the serial one.
    steps = ("fstep", "cstep", "rstep", "gstep", "seqstep")
    mine = [(e.level, e.op, e.index, e.done) for e in par.trace if e.op in steps]
    everyone = sorted(x for block in WORLD.allgather(mine) for x in block)
    assert everyone == sorted((e.level, e.op, e.index, e.done) for e in ser.trace if e.op in steps)
    # Messages pair up: every send has its receive.
    sends = [(WORLD.rank, e.peer, e.level, e.index) for e in par.trace if e.op == "send"]
    recvs = [(e.peer, WORLD.rank, e.level, e.index) for e in par.trace if e.op == "recv"]
    all_sends = sorted(x for b in WORLD.allgather(sends) for x in b)
    all_recvs = sorted(x for b in WORLD.allgather(recvs) for x in b)
    assert all_sends == all_recvs and all_sends


def test_final_fc_runs_every_fine_step_exactly_once_with_done():
    r = solve(nonlinear_step, nonlinear_init, 30, 0.0, 1.0, max_levels=3, cfactor=2, nrelax=1,
              max_iters=2, tol=0.0, final_fc_relax=True, trace=True)
    done = sorted(e.index for e in r.trace if e.done)
    assert done == list(range(1, 31))
    assert all(e.level == 0 for e in r.trace if e.done)


def test_schedule_of_one_two_level_iteration():
    """The schedule is data: 8 steps, cfactor 2, F-relaxation, one iteration (no allreduce
    between it and the final sweep: Note [deferred status] in cycle.c)."""
    r = solve(nonlinear_step, nonlinear_init, 8, 0.0, 1.0, max_levels=2, cfactor=2, nrelax=0,
              min_coarse=1, max_iters=1, tol=0.0, trace=True)
    ops = [(e.level, e.op, e.index) for e in r.trace if e.op not in ("init",)]
    expected = ([(0, "fstep", i) for i in (1, 3, 5, 7)]       # F-sweep inside the restriction
                + [(0, "rstep", c) for c in (2, 4, 6, 8)]     # residuals at C-points >= cf
                + [(1, "gstep", k) for k in (1, 2, 3, 4)]     # coarse steps for the FAS rhs
                + [(1, "seqstep", k) for k in (1, 2, 3, 4)]   # coarsest solve
                + [(1, "correct", k) for k in (1, 2, 3, 4)]
                + [(0, "fstep", i) for i in (1, 3, 5, 7)])    # final F-sweep
    assert ops == expected


def test_an_allreduce_only_where_an_iteration_decides_whether_to_stop():
    """Note [deferred status]: a residual allreduce follows an iteration only where the solve
    has a stopping test and the iteration is not the last allowed one."""
    for tol, norms in [(0.0, []), (1e-300, [0, 1])]:
        r = solve(nonlinear_step, nonlinear_init, 8, 0.0, 1.0, max_levels=2, cfactor=2,
                  nrelax=0, min_coarse=1, max_iters=3, tol=tol, trace=True)
        assert [e.index for e in r.trace if e.op == "norm"] == norms, tol
        assert r.iterations == 3 and len(r.residual_norms) == 3


@pytest.mark.parallel([1, 2, 3])
def test_deferred_residuals_equal_those_reduced_after_each_iteration():
    """A fixed-count solve reduces its iterations' residuals at its end (Note [deferred
    status]); they, the final residual, the iterations and the states are those of the same
    solve with an allreduce after every iteration (a stopping test that never stops), on any
    number of ranks."""
    for final_fc, skip in [(False, True), (True, False), (True, True)]:
        solvers = [MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=32, t_start=0.0,
                         t_stop=1.0, options=MGRITOptions(
                             max_levels=3, cfactor=2, nrelax=1, max_iters=4, tol=tol,
                             skip_first_downcycle=skip, final_fc_relax=final_fc),
                         comm=WORLD) for tol in (0.0, 1e-300)]
        deferred, reduced = (m.solve() for m in solvers)
        assert deferred.iterations == reduced.iterations == 4
        assert deferred.residual_norms == reduced.residual_norms
        assert len(deferred.residual_norms) == 4 - skip
        finals = [m._core.final_residual() for m in solvers]
        assert finals[0] == finals[1] and (finals[0][0] is not None) == final_fc
        assert sorted(deferred.states) == sorted(reduced.states)
        for i, u in deferred.states.items():
            assert np.array_equal(u, reduced.states[i])


def test_only_one_level_forms():
    r = solve(nonlinear_step, nonlinear_init, 3, 0.0, 1.0, max_levels=4, cfactor=4)
    assert r.num_levels == 1 and r.iterations == 1 and r.residual_norms == [0.0]


def test_level_count_follows_min_coarse():
    r = solve(nonlinear_step, nonlinear_init, 64, 0.0, 1.0, max_levels=4, cfactor=4, max_iters=1)
    assert r.num_levels == 3  # 64 -> 16 -> 4; 4 / 4 = 1 < min_coarse = 2


@pytest.mark.parallel([1, 2])
def test_heat_equation_converges_with_bounded_factor():
    nx, n = 31, 64
    step, init = heat_step_factory(nx), heat_init_factory(nx)
    ref = sequential(step, init, n, 0.0, 0.5)
    r = solve(step, init, n, 0.0, 0.5, max_levels=3, cfactor=4, nrelax=1, tol=1e-10,
              max_iters=30)
    norms = r.residual_norms
    factors = [b / a for a, b in zip(norms, norms[1:])]
    assert norms[-1] < 1e-10 and len(norms) <= 10
    assert max(factors) < 0.2, factors
    assert max_error(r.states, ref) < CONVERGED


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_float64_torch_and_float32_states_keep_their_dtype():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float64, torch.float32):
        x0 = torch.linspace(-1, 1, 7, dtype=dtype)

        def step(u, t0, t1, level):
            return u + (t1 - t0) * torch.tanh(u)

        def init(t):
            return x0.clone() if t == 0.0 else torch.zeros_like(x0)
        ref = sequential(step, init, 20, 0.0, 1.0)
        r = solve(step, init, 20, 0.0, 1.0, max_levels=2, cfactor=2, tol=0.0, max_iters=20)
        for i, u in r.states.items():
            assert u.dtype == dtype
            tol = ROUNDOFF if dtype == torch.float64 else 1e-6
            torch.testing.assert_close(u, ref[i], rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- errors


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_steps"):
        MGRIT(step=dahlquist_step, init=dahlquist_init, num_steps=0)
    with pytest.raises(ValueError, match="t_stop"):
        MGRIT(step=dahlquist_step, init=dahlquist_init, num_steps=4, t_start=1.0, t_stop=1.0)
    with pytest.raises(TypeError, match="MGRITOptions"):
        MGRIT(step=dahlquist_step, init=dahlquist_init, num_steps=4, options={"max_levels": 2})


@pytest.mark.parallel([2, 3])
def test_fewer_steps_than_ranks():
    with pytest.raises(ValueError, match="num_steps=1 is smaller than the number of ranks"):
        solve(dahlquist_step, dahlquist_init, 1, 0.0, 1.0)


@pytest.mark.parallel([2, 3])
def test_options_that_differ_between_ranks():
    with pytest.raises(ValueError, match="max_iters ranges from 3 to"):
        solve(dahlquist_step, dahlquist_init, 16, 0.0, 1.0, max_iters=3 + WORLD.rank)


class Boom(KeyError):
    pass


@pytest.mark.parallel([1, 3])
def test_exception_on_one_rank_reaches_every_rank():
    # tol 0: the status is reduced once, at the end; a stopping test: after each iteration
    for tol in (0.0, 1e-300):
        for where in ("fine", "coarse", "final"):
            _check_exception(where, tol)


def _check_exception(where, tol):
    """The rank that raised gets its own exception back; the others a RemoteRankError; no hang."""
    bad = WORLD.size - 1
    opts = dict(nrelax=1, skip_first_downcycle=False, max_levels=2, cfactor=2, max_iters=3,
                tol=tol, trace=True)

    def init(t):
        return np.array([1.0, 2.0])
    # How many steps this rank runs before the final relaxation, from a healthy solve.
    healthy = solve(lambda u, *a: u * 0.9, init, 40, 0.0, 1.0, **opts)
    before_final = sum(1 for e in healthy.trace if e.op.endswith("step") and not e.done)
    calls = {"n": 0}

    def step(u, t0, t1, level):
        calls["n"] += 1
        if WORLD.rank == bad and (
                (where == "fine" and level == 0)
                or (where == "coarse" and level == 1)
                or (where == "final" and calls["n"] > before_final)):
            raise Boom("step failed here")
        return u * 0.9
    try:
        solve(step, init, 40, 0.0, 1.0, **opts)
    except Boom as e:
        assert WORLD.rank == bad and "step failed here" in str(e)
    except layerbraid.RemoteRankError as e:
        assert WORLD.rank != bad and e.rank == bad and f"rank {bad}" in str(e)
        assert "Boom: 'step failed here'" in str(e)  # the failing rank's own message
    else:
        pytest.fail("no exception")


@pytest.mark.parallel([2])
def test_a_rank_that_never_reaches_the_end_of_a_fixed_count_solve_is_reported(short_timeout):
    """A fixed-count solve has one allreduce, at its end (Note [deferred status]): rank 1 never
    starts the solve, so rank 0, which receives nothing from it, runs all its iterations and
    then raises StallError naming that allreduce after the timeout instead of waiting forever."""
    solver = MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=32, t_start=0.0,
                   t_stop=1.0, options=MGRITOptions(max_levels=3, max_iters=4, tol=0.0),
                   comm=WORLD)
    solver.solve()  # a healthy solve first: construction and setup are behind both ranks
    if WORLD.rank == 0:
        t0 = time.perf_counter()
        with pytest.raises(layerbraid.StallError, match="rank 0 waited .* in the residual "
                                                        "allreduce"):
            solver.solve()
        assert time.perf_counter() - t0 < short_timeout + 5
    # rank 1 stops here: it never starts the second solve


@pytest.mark.parallel([1, 2])
def test_nan_residual_stops_with_a_clear_error():
    def step(u, t0, t1, level):
        return u * np.nan if level == 1 else u * 0.5
    for tol in (0.0, 1e-300):  # reported at the end of the solve, or after the iteration
        with pytest.raises(layerbraid.DivergenceError,
                           match="residual norm is nan at iteration 1"):
            solve(step, lambda t: np.array([1.0]), 16, 0.0, 1.0, max_levels=2, max_iters=5,
                  tol=tol)


@pytest.mark.parallel([1, 2])
def test_step_that_changes_shape_or_dtype():
    # Every rank's step is wrong: a rank raises its own error, or, where another rank's message
    # reached it first, RemoteRankError carrying that rank's message.  Either names the fault.
    with pytest.raises((ValueError, layerbraid.RemoteRankError)) as info:
        solve(lambda u, *a: np.concatenate([u, u]), lambda t: np.ones(3), 8, 0.0, 1.0,
              max_levels=1)
    assert "shape (6,)" in str(info.value) and "shape (3,)" in str(info.value), info.value
    with pytest.raises((TypeError, layerbraid.RemoteRankError)) as info:
        solve(lambda u, *a: u.astype(np.float32), lambda t: np.ones(3), 8, 0.0, 1.0)
    assert "float32" in str(info.value), info.value


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_storing_only_what_the_cycles_need():
    """store_all=False keeps the C-points, the points just before them and each rank's last
    point, with the same values as a solve that stores everything."""
    n, cf = 40, 4
    opts = dict(skip_first_downcycle=False, max_levels=3, cfactor=cf, nrelax=1, max_iters=3, tol=0.0)
    full = MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=n,
                 options=MGRITOptions(**opts), comm=WORLD).solve()
    lean = MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=n,
                 options=MGRITOptions(**opts), comm=WORLD, store_all=False).solve()
    last = max(full.states)
    expected = {i for i in full.states if i % cf == 0 or (i + 1) % cf == 0 or i == last}
    assert set(lean.states) == expected and len(expected) < len(full.states)
    for i, u in lean.states.items():
        assert np.array_equal(u, full.states[i])
    assert lean.residual_norms == full.residual_norms


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_fused_intervals_give_the_same_solve():
    """A step_interval callback (Note [fused intervals]) replaces runs of steps without changing
    the solve: the same states, residuals and schedule as one step per call; with
    store_all=False it is asked only for each run's last state."""
    n = 45
    for opts in [dict(max_levels=1),
                 dict(skip_first_downcycle=False, max_levels=3,
                      cfactor=(4, 2), nrelax=1, max_iters=3, tol=0.0),
                 dict(max_levels=2, cfactor=5, nrelax=0, max_iters=2, tol=0.0,
                      skip_first_downcycle=True, final_fc_relax=True)]:
        for store_all in (True, False):
            calls = []

            def step_interval(u, times, level, keep):
                calls.append((level, len(times) - 1, keep))
                out = []
                for t0, t1 in zip(times[:-1], times[1:]):
                    u = nonlinear_step(u, t0, t1, level)
                    out.append(u)
                return out if keep else [None] * (len(out) - 1) + out[-1:]

            def run(**fused):
                return MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=n, t_stop=3.0,
                             options=MGRITOptions(**opts), comm=WORLD, trace=True,
                             store_all=store_all, **fused).solve()

            per_step, fused = run(), run(step_interval=step_interval)
            assert calls and all(m >= 2 for _, m, _ in calls)
            assert all(keep == (store_all or level > 0) for level, _, keep in calls)
            assert fused.residual_norms == per_step.residual_norms
            assert set(fused.states) == set(per_step.states)
            for i, u in fused.states.items():
                assert np.array_equal(u, per_step.states[i])
            assert fused.trace == per_step.trace
            if opts.get("skip_first_downcycle"):
                # the coarsest solve before the first restriction has no right-hand side
                assert any(level == 1 for level, _, _ in calls)


def test_fused_interval_that_leaves_out_states():
    def short(u, times, level, keep):
        return [u] * (len(times) - 2)

    def missing(u, times, level, keep):
        return [None] * (len(times) - 1)

    for step_interval, says in ((short, "states for"), (missing, "no state")):
        with pytest.raises((ValueError, layerbraid.RemoteRankError)) as info:
            MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=12, comm=WORLD,
                  options=MGRITOptions(max_levels=1), step_interval=step_interval).solve()
        assert says in str(info.value), info.value  # its own error, or another rank's


@pytest.mark.parallel([1, 2, 3])
def test_without_spatial_transfers_a_correction_moves_the_coarse_value_up(monkeypatch):
    """Note [injected correction]: without spatial transfers a C-point's restricted value is
    its fine value itself, so the correction u_c + (u_k - v_k) is the coarse value u_k: the
    C-point takes the coarse level's state as it is, with no sum over the states and no
    round-off.  One iteration that skips the first down-cycle and no final C-relaxation leave
    every fine C-point at the state the coarse sequential solve made for it."""
    import layerbraid._engine.bridge as bridge

    made, sums = {}, []

    def step(u, t0, t1, level):
        out = u + (t1 - t0) * np.sin(u)
        made[id(out)] = (level, out)  # the reference keeps the id from being reused
        return out

    for name in ("_sum", "_sum_into"):
        real = getattr(bridge, name)
        monkeypatch.setattr(bridge, name, lambda *a, _f=real, _n=name: sums.append(_n) or _f(*a))
    res = MGRIT(step=step, init=lambda t: np.full(3, 0.5) if t == 0 else np.zeros(3),
                num_steps=24, t_start=0.0, t_stop=2.0, comm=WORLD,
                options=MGRITOptions(max_levels=2, cfactor=4, max_iters=1, tol=0.0,
                                     skip_first_downcycle=True, final_fc_relax=False)).solve()
    c_points = [i for i in res.states if i > 0 and i % 4 == 0]
    assert c_points, "every rank of 1-3 owns a C-point of 24 steps"
    for i in c_points:
        assert id(res.states[i]) in made and made[id(res.states[i])][0] == 1, i
    assert sums == []
    # the coarse solve itself: sequential steps of 4 dt from u(0), between the core's times
    u, t = np.full(3, 0.5), lambda k: 2.0 * (4 * k / 24) if k < 6 else 2.0
    for k in range(1, 7):
        u = u + (t(k) - t(k - 1)) * np.sin(u)
        if 4 * k in res.states:
            assert np.array_equal(res.states[4 * k], u), k
