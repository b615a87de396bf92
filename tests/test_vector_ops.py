"""The vector operations the MGRIT core asks of states: sums in place into the states the
core alone holds, never into one the application may hold (Note [private states] in
_engine/bridge.py); norms in the state's own precision where that is exact enough (Note [norms in the
state's precision] in _engine/states.py); and the finiteness check of gradients and inputs."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import layerbraid._engine.bridge as bridge
from layerbraid import MGRIT, MGRITOptions
from layerbraid._engine.layer_steps import _parameters, all_finite
from layerbraid._engine.states import _norm, _sum, _sum_into
from layerbraid.nn import ConvBlock

WORLD = MPI.COMM_WORLD


def _pairs():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.complex128):
        yield torch.randn(3, 4, generator=g, dtype=dtype), torch.randn(3, 4, generator=g,
                                                                         dtype=dtype)
    rng = np.random.default_rng(0)
    yield rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    yield (rng.standard_normal(5) + 1j * rng.standard_normal(5),
           rng.standard_normal(5) - 1j * rng.standard_normal(5))


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.0, 1.0), (0.5, 1.0), (-1.0, 2.0)])
def test_sums_in_place_and_out_of_place_equal_the_formula(alpha, beta):
    for x, y in _pairs():
        want = alpha * x + beta * y
        new = _sum(alpha, x, beta, y)
        assert new is not y and new.dtype == y.dtype
        target = y.clone() if isinstance(y, torch.Tensor) else y.copy()
        assert _sum_into(alpha, x, beta, target)
        for got in (new, target):
            diff = abs(got - want).max()
            assert float(diff) <= 1e-6 * float(abs(want).max())  # round-off (float32)


def test_sums_in_place_decline_what_they_cannot_write_exactly():
    x = torch.ones(3)
    assert not _sum_into(1.0, x, 1.0, torch.ones(3, dtype=torch.int64))   # integers
    assert not _sum_into(1.0, x, 1.0, torch.ones(3, dtype=torch.float64))  # another dtype
    assert not _sum_into(1.0, x, 1.0, torch.ones(3, requires_grad=True))   # tracked
    frozen = np.ones(3)
    frozen.flags.writeable = False
    assert not _sum_into(1.0, np.ones(3), 1.0, frozen)
    assert np.all(frozen == 1.0)


def test_norms_in_the_states_precision_are_exact_enough_and_fall_back_at_the_extremes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, generator=g)
    exact = float(torch.linalg.vector_norm(x.double()))
    assert abs(_norm(x) - exact) <= 1e-4 * exact
    # squares that overflow or underflow in float32: the norm is taken in float64
    for scale in (1e30, 1e-25, 3e-23):
        y = x[:1000] * scale
        assert _norm(y) == pytest.approx(float(torch.linalg.vector_norm(y.double())), rel=1e-12)
    z = torch.complex(x[:100], -x[:100])
    assert _norm(z) == pytest.approx(float(torch.linalg.vector_norm(z.to(torch.complex128))),
                                     rel=1e-5)
    assert _norm(torch.arange(5)) == pytest.approx(30 ** 0.5)
    assert _norm(torch.full((4,), 60000.0, dtype=torch.float16)) == pytest.approx(120000.0)
    assert _norm(torch.zeros(7)) == 0.0


def test_the_finiteness_check_finds_every_nan_and_inf_and_no_false_one():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(10, generator=g), torch.randn(5000, generator=g),
               torch.randn(3, 3, generator=g, dtype=torch.float64),
               torch.randn(4, generator=g, dtype=torch.complex64), torch.empty(0)]
    assert all_finite(tensors)
    for k in range(4):
        for bad in (float("nan"), float("inf"), -float("inf")):
            copy = [t.clone() for t in tensors]
            copy[k].view(-1)[-1] = bad
            assert not all_finite(copy)
    # finite values whose sum overflows (float32, float16) are finite
    assert all_finite([torch.full((5000,), 3e38), torch.full((10,), 60000.0,
                                                            dtype=torch.float16)])


def test_the_parameter_walk_is_the_modules_own_order():
    shared = torch.nn.Conv2d(2, 2, 3)
    net = torch.nn.Sequential(ConvBlock(4), torch.nn.Sequential(shared, torch.nn.ReLU(), shared),
                              torch.nn.Linear(3, 3, bias=False), ConvBlock(4))
    net[3].tied = net[0]  # a module reachable twice
    assert [id(p) for p in _parameters(net)] == [id(p) for p in net.parameters()]


# ------------------------------------------------------------------ in a solve, on 1-3 ranks
def _keeping_step(kind, kept):
    """A nonlinear step that keeps every state it is given and every state it returns (with
    a copy of its values), and returns its input itself where the step is the identity."""
    def step(u, t0, t1, level):
        lib = torch if kind == "torch" else np
        out = u if t1 - t0 > 0.3 else u + (t1 - t0) * (lib.sin(u) - 0.5 * u)
        for s in (u, out):
            kept.append((s, s.clone() if kind == "torch" else s.copy()))
        return out
    return step


def _init(kind):
    def init(t):
        rng = np.random.default_rng(0)
        u = rng.standard_normal(6) if t == 0.0 else np.zeros(6)
        return torch.tensor(u, dtype=torch.float32) if kind == "torch" else u
    return init


def _solve(kind, kept, spatial=False):
    opts = MGRITOptions(max_levels=3, cfactor=2, max_iters=4, tol=0.0, nrelax=1,
                        skip_first_downcycle=False)
    extra = {}
    if spatial:  # a transfer that keeps the grid: the solve then calls coarsen and refine
        extra = dict(coarsen=lambda x, level: x * 1.0, refine=lambda e, level: e * 1.0)
    # steps of 1/8 on level 0 and 1/4 on level 1; 1/2 (the identity) on level 2
    return MGRIT(step=_keeping_step(kind, kept), init=_init(kind), num_steps=16, t_start=0.0,
                 t_stop=2.0, options=opts, comm=WORLD, **extra).solve()


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2, 3])
def test_in_place_sums_leave_application_states_alone_and_change_no_bit(monkeypatch):
    for kind in ("numpy", "torch"):
        for spatial in (False, True):
            kept, in_place = [], []
            with monkeypatch.context() as m:  # count the sums done in place
                m.setattr(bridge, "_sum_into", lambda *a: in_place.append(_sum_into(*a)) or
                          in_place[-1])
                fast = _solve(kind, kept, spatial)
            assert sum(in_place) >= 10, (kind, spatial, sum(in_place), len(in_place))
            # every state a step was given or returned still holds the values it had then
            changed = sum(not (bool((s == c).all()) if kind == "torch" else np.array_equal(s, c))
                          for s, c in kept)
            assert changed == 0, f"{changed} of {len(kept)} states changed ({kind})"
            with monkeypatch.context() as m:  # every sum out of place
                m.setattr(bridge, "_sum_into", lambda *a: False)
                slow = _solve(kind, [], spatial)
            assert fast.residual_norms == slow.residual_norms
            assert sorted(fast.states) == sorted(slow.states)
            for i, s in fast.states.items():
                other = slow.states[i]
                assert (bool((s == other).all()) if kind == "torch"
                        else np.array_equal(s, other)), (kind, i)
