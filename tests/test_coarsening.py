"""Spatial coarsening on coarse MGRIT levels."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from layerbraid import LayerParallelModule, MGRITOptions, SpatialCoarsening
from layerbraid.nn import ConvBlock
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD



@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def inner(a, b):
    return float((a * b).sum())


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_transfers_are_adjoint_as_documented(dims):
    sp = SpatialCoarsening(levels=[1])
    g = torch.Generator().manual_seed(dims)
    fine = (2, 3) + (8,) * dims
    coarse = (2, 3) + (4,) * dims
    x, y = torch.randn(fine, generator=g), torch.randn(coarse, generator=g)
    # full weighting is 2^-d times the transpose of (bi/tri)linear interpolation
    assert inner(sp.restrict(x, 0), y) == pytest.approx(inner(x, sp.interpolate(y, 1)) / 2 ** dims,
                                                         rel=ROUNDOFF)
    # the adjoint solve's transfers are the transposes of the forward ones
    assert inner(sp.interpolate(y, 1), x) == pytest.approx(inner(y, sp.restrict_adjoint(x, 0)),
                                                           rel=ROUNDOFF)
    assert inner(sp.restrict(x, 0), y) == pytest.approx(inner(x, sp.interpolate_adjoint(y, 1)),
                                                        rel=ROUNDOFF)
    # restriction keeps constants, interpolation too
    ones = torch.ones(fine)
    torch.testing.assert_close(sp.restrict(ones, 0), torch.ones(coarse))
    torch.testing.assert_close(sp.interpolate(torch.ones(coarse), 1), ones)


@pytest.mark.parametrize("spatial", [(8,), (8, 6), (8, 6, 4)])
def test_full_weighting_is_the_scaled_transpose_of_linear_interpolation(spatial):
    """The stencil implementation equals 2^-d P^T computed by autograd through F.interpolate."""
    d = len(spatial)
    x = torch.randn((2, 3) + spatial, generator=torch.Generator().manual_seed(d))
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[d]
    z = torch.zeros((2, 3) + tuple(n // 2 for n in spatial), requires_grad=True)
    up = F.interpolate(z, scale_factor=2, mode=mode, align_corners=False)
    expected, = torch.autograd.grad(up, z, x)
    torch.testing.assert_close(SpatialCoarsening(levels=[1]).restrict(x, 0), expected / 2 ** d,
                               rtol=ROUNDOFF, atol=ROUNDOFF)


def test_branch_step_computes_the_increment_on_the_coarse_grid():
    """mode="branch": x + P^k (step(R^k x) - R^k x) on levels coarse in space, step(x) elsewhere."""
    sp = SpatialCoarsening(levels=[1, 3], mode="branch")
    assert SpatialCoarsening(levels=[1]).mode == "branch"  # the default
    x = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(0))

    def step(v):
        return 0.5 * v + v.roll(1, -1) ** 2

    def R(v, lv):
        return sp.restrict(v, lv)

    def P(e, lv):
        return sp.interpolate(e, lv)

    x1 = R(x, 0)
    torch.testing.assert_close(sp.branch_step(step, x, 1), x + P(step(x1) - x1, 1),
                               rtol=ROUNDOFF, atol=ROUNDOFF)
    torch.testing.assert_close(sp.branch_step(step, x, 2), x + P(step(x1) - x1, 1),
                               rtol=ROUNDOFF, atol=ROUNDOFF)  # level 2 keeps level 1's grid
    x3 = R(R(x1, 1), 2)
    assert x3.shape[2:] == (4, 2)
    torch.testing.assert_close(sp.branch_step(step, x, 3),
                               x + P(P(P(step(x3) - x3, 3), 2), 1), rtol=ROUNDOFF, atol=ROUNDOFF)
    torch.testing.assert_close(SpatialCoarsening(levels=[2], mode="branch").branch_step(step, x, 1),
                               step(x), rtol=0, atol=0)


@pytest.mark.parametrize("transfers", [("full-weighting", "linear"), ("average", "nearest"),
                                       ("inject", "linear")])
def test_branch_adjoint_is_the_transpose_of_the_branch_step(transfers):
    """The adjoint step (explicit for the transfer pairs with R = 2^-d P^T, autograd otherwise)
    equals the VJP of branch_step, differentiated through everything by autograd."""
    sp = SpatialCoarsening(levels=[1, 2], restrict=transfers[0], interpolate=transfers[1],
                           mode="branch")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 16, 8, generator=g), torch.randn(2, 3, 16, 8, generator=g)
    conv = nn.Conv2d(3, 3, 3, padding=1).double()

    def step(v):
        return v + 0.3 * torch.tanh(conv(v))

    for level in (1, 2):
        xr = x.clone().requires_grad_(True)
        expected, = torch.autograd.grad(sp.branch_step(step, xr, level), xr, w)
        torch.testing.assert_close(sp.branch_adjoint(step, x, w, level), expected,
                                   rtol=ROUNDOFF, atol=ROUNDOFF)
        cache = {}
        for _ in range(2):  # the second call restricts x from the cache
            torch.testing.assert_close(sp.branch_adjoint(step, x, w, level, cache=cache),
                                       expected, rtol=ROUNDOFF, atol=ROUNDOFF)
        assert ("x" in cache) == (transfers[0] != "inject")


def test_other_transfers_and_levels_that_stay_fine():
    sp = SpatialCoarsening(levels=[2], restrict="average", interpolate="nearest")
    x = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.equal(sp.restrict(x, 0), x)  # level 1 is not coarse in space
    torch.testing.assert_close(sp.restrict(x, 1), F.avg_pool2d(x, 2))
    assert sp.interpolate(sp.restrict(x, 1), 2).shape == x.shape
    inj = SpatialCoarsening(levels=[1], restrict="inject")
    assert torch.equal(inj.restrict(x, 0), x[:, :, ::2, ::2])
    custom = SpatialCoarsening(levels=[1], restrict=lambda x, lv: x[..., ::2, ::2] * 1.0,
                               interpolate=lambda e, lv: e.repeat_interleave(2, -1)
                               .repeat_interleave(2, -2))
    y = torch.randn(1, 1, 2, 2, dtype=torch.float64)
    assert inner(custom.restrict(x, 0), y) == pytest.approx(
        inner(x, custom.interpolate_adjoint(y, 1)))


def test_bad_arguments_and_grid_sizes():
    with pytest.raises(ValueError, match=r"levels >= 1, got \(0,\)"):
        SpatialCoarsening(levels=[0])
    with pytest.raises(ValueError, match="restrict must be"):
        SpatialCoarsening(levels=[1], restrict="cubic")
    with pytest.raises(ValueError, match="mode must be 'state' or 'branch', got 'coarse'"):
        SpatialCoarsening(levels=[1], mode="coarse")
    sp = SpatialCoarsening(levels=[1, 2])
    with pytest.raises(ValueError, match=r"multiple of 4 and at least 8, but the state has "
                                         r"spatial shape \(12, 6\)"):
        sp.check((2, 3, 12, 6), 3)
    with pytest.raises(ValueError, match=r"spatial shape \(9, 9\)"):
        SpatialCoarsening(levels=[1]).check((2, 3, 9, 9), 2)
    sp.check((2, 3, 16, 8), 3)
    SpatialCoarsening(levels=[1]).check((2, 3, 9, 9), 1)  # one MGRIT level: nothing to halve


class Net(LayerParallelModule):
    def __init__(self, comm, size, dims, **kw):
        super().__init__(num_steps=8, comm=comm, **kw)
        self.dims = dims
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        self.open = conv(1, 2, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(2 * size ** dims, 3))

    def step_layer(self, index):
        return ConvBlock(2, dims=self.dims)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_spatial_coarsening_converges_to_the_serial_answer():
    """Coarse levels coarse in space: MGRIT still converges to serial PyTorch (fine level
    unchanged), forward and adjoint, in 2D and 3D."""
    for (dims, size), mode in itertools.product(((2, 16), (3, 8)), ("state", "branch")):
        opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=12, tol=1e-12, nrelax=1)
        torch.manual_seed(0)
        model = Net(WORLD, size, dims, forward_options=opts, backward_options=opts,
                    spatial=SpatialCoarsening(levels=[1, 2], mode=mode))
        serial = model.to_serial()
        x = torch.randn((3, 1) + (size,) * dims)
        y = torch.tensor([0, 1, 2])
        out = model(x)
        F.cross_entropy(out, y).backward()
        ref = serial(x)
        F.cross_entropy(ref, y).backward()
        torch.testing.assert_close(out, ref, rtol=CONVERGED, atol=CONVERGED)
        for i, layer in model.owned_steps():
            for p, q in zip(layer.parameters(), serial.layers[i].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=CONVERGED, atol=CONVERGED)


@pytest.mark.parallel([1, 2])
def test_a_grid_too_small_for_the_levels_is_a_clear_error_on_every_rank():
    opts = MGRITOptions(nrelax=1, skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=2)
    model = Net(WORLD, 6, 2, forward_options=opts, backward_options=opts,
                spatial=SpatialCoarsening(levels=[1, 2]))
    with pytest.raises(ValueError, match=r"spatial shape \(6, 6\)"):
        model(torch.ones(2, 1, 6, 6))
    with pytest.raises(TypeError, match="SpatialCoarsening"):
        Net(WORLD, 6, 2, spatial=[1, 2])


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_branch_mode_approximates_as_well_as_coarsening_in_time_alone():
    """With few iterations (what training runs), mode="branch" stays as accurate as MGRIT without
    spatial coarsening, and keeps MGRIT's exactness after enough iterations (8 steps, 3 levels,
    cfactor 2: 2 FCF iterations), which mode="state" loses (P R is not the identity)."""
    def output_error(size, iters, spatial):
        opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=iters, tol=0.0, nrelax=1)
        torch.manual_seed(0)
        model = Net(WORLD, size, 2, forward_options=opts, backward_options=opts, spatial=spatial)
        serial = model.to_serial()
        x = torch.randn(3, 1, size, size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out, ref = model(x), serial(x)
        return float((out - ref).norm() / ref.norm())

    for size in (16, 32):
        plain = output_error(size, 1, None)
        branch = output_error(size, 1, SpatialCoarsening(levels=[1, 2], mode="branch"))
        assert 1e-3 < plain < 0.1 and branch < 1.5 * plain, (size, plain, branch)
    assert output_error(16, 2, SpatialCoarsening(levels=[1, 2], mode="branch")) < ROUNDOFF
    assert output_error(16, 2, SpatialCoarsening(levels=[1, 2], mode="state")) > 0.1
