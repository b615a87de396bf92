"""Spline-parameterized steps (layerbraid.depth.spline): the B-spline basis, and a SplineModule equal
to a serial spline network written here in plain PyTorch (float64, 1e-12) on 1-3 ranks, one
level and converged MGRIT, outputs and every gradient; training, refinement in depth,
checkpoints, to_serial; bad input; a rank that stalls before the coefficients' gradient sum."""
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import layerbraid
from layerbraid import depth
from layerbraid.nn import ConvBlock
from layerbraid.depth.spline import SplineModule, bspline_basis
from nets import batch
from transports import WORLD

CONVERGED = dict(max_levels=2, cfactor=2, max_iters=30, tol=1e-15)


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class Net(SplineModule):
    def __init__(self, comm, steps=8, nsplines=4, degree=2, **kwargs):
        super().__init__(steps, 1.0, comm, nsplines=nsplines, degree=degree, **kwargs)
        self.open = nn.Conv2d(1, 4, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

    def coefficient_layer(self, index):
        return ConvBlock(4)


def converged():
    return dict(forward_options=layerbraid.MGRITOptions(**CONVERGED),
                backward_options=layerbraid.MGRITOptions(**CONVERGED))


class SerialSplineNet(nn.Module):
    """The same network in plain PyTorch: weights of step i = sum_k B[i, k] c_k."""

    def __init__(self, model):
        super().__init__()
        state = model.to_serial().state_dict()
        self.open, self.close = nn.Conv2d(1, 4, 3, padding=1), nn.Sequential(
            nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
        self.open.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("open.")})
        self.close.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("close.")})
        self.coefficients = model.parameterization.all_sets(model)  # collective
        self.basis = bspline_basis(model.nsplines, model.degree,
                                   np.arange(model.num_steps) * model.dt, 1.0, model.knots)
        self.dt, self.template = model.dt, ConvBlock(4)

    def forward(self, x):
        h = self.open(x)
        sets = [dict(c.named_parameters()) for c in self.coefficients]
        for row in self.basis:
            w = {n: sum(float(b) * s[n] for b, s in zip(row, sets) if b) for n in sets[0]}
            h = h + self.dt * functional_call(self.template, w, (h,))
        return self.close(h)


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def stored_sets(named):
    """The sets among ``{"k.name": ...}`` keys, in order."""
    return sorted({int(n.split(".")[0]) for n in named})


def model_uses(model, k):
    """Whether some step of the network has a nonzero weight on set ``k``."""
    basis = bspline_basis(model.nsplines, model.degree, np.arange(model.num_steps) * model.dt,
                          1.0, model.knots)
    return bool((basis[:, k] != 0).any())


@pytest.mark.parallel([1])
def test_the_basis_is_a_partition_of_unity_with_local_support():
    t = np.linspace(0, 1, 101)[:-1]
    for degree in (1, 2, 3):
        for n in range(degree + 1, degree + 6):
            b = bspline_basis(n, degree, t, 1.0)
            assert b.shape == (100, n) and (b >= 0).all()
            np.testing.assert_allclose(b.sum(1), 1.0, rtol=0, atol=1e-14)
            assert ((b > 0).sum(1) <= degree + 1).all()  # at most degree + 1 splines at a time
    # degree 1: hat functions on the uniform knots 0, 1/3, 2/3, 1
    b = bspline_basis(4, 1, np.array([0.0, 0.5, 0.75]), 1.0)
    np.testing.assert_allclose(b, [[1, 0, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.75, 0.25]],
                               atol=1e-15)
    with pytest.raises(ValueError, match="nsplines must be at least degree \\+ 1 = 3"):
        bspline_basis(2, 2, t, 1.0)


def cardinal(degree, x):
    """The cardinal B-spline of ``degree`` on the integer knots 0 .. degree + 1, by its own
    recursion (N_0 the indicator of [0, 1); N_d(x) = (x N_{d-1}(x) + (d + 1 - x)
    N_{d-1}(x - 1)) / d): the shape every spline of a uniform, unclamped basis has."""
    if degree == 0:
        return ((0 <= x) & (x < 1)).astype(np.float64)
    return (x * cardinal(degree - 1, x) + (degree + 1 - x) * cardinal(degree - 1, x - 1)) / degree


@pytest.mark.parallel([1])
@pytest.mark.parametrize("degree, nsplines", [(1, 4), (2, 4), (2, 7), (3, 6)])
def test_uniform_knots_are_torchbraids_shifted_splines(degree, nsplines):
    """knots="uniform": spline k is the cardinal B-spline shifted to start degree knot spans
    before k's, on knots T / (nsplines - degree) apart that go on beyond both ends, as
    TorchBraid's SpliNet evaluates them; at degree 1 the clamped basis is the same."""
    t = np.linspace(0, 1, 97)[:-1]
    h = 1.0 / (nsplines - degree)
    want = np.stack([cardinal(degree, t / h - k + degree) for k in range(nsplines)], 1)
    got = bspline_basis(nsplines, degree, t, 1.0, "uniform")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)
    np.testing.assert_allclose(got.sum(1), 1.0, rtol=0, atol=1e-14)
    clamped = bspline_basis(nsplines, degree, t, 1.0, "clamped")
    if degree == 1:
        np.testing.assert_allclose(clamped, got, rtol=0, atol=1e-15)
    else:  # they differ near the ends
        assert np.abs(clamped - got).max() > 0.1
    with pytest.raises(ValueError, match="knots must be one of .*got 'open'"):
        bspline_basis(nsplines, degree, t, 1.0, "open")


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("degree, nsplines", [(2, 4), (3, 6)])
def test_uniform_knot_splines_equal_the_serial_network_with_that_basis(degree, nsplines):
    torch.manual_seed(degree)
    model = Net(WORLD, steps=12, nsplines=nsplines, degree=degree, knots="uniform")
    serial = SerialSplineNet(model)
    x, y = batch(seed=degree)
    out, want = model(x), serial(x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    got, ref = grads(model.coefficients), grads(serial.coefficients)
    assert stored_sets(got) == model.parameterization.stored(model)
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("degree, nsplines", [(1, 3), (2, 4), (3, 6)])
@pytest.mark.parametrize("levels", [1, 2])
def test_equals_the_serial_spline_network(degree, nsplines, levels):
    torch.manual_seed(degree)
    model = Net(WORLD, steps=12, nsplines=nsplines, degree=degree,
                **(converged() if levels == 2 else {}))
    serial = SerialSplineNet(model)
    x, y = batch(seed=degree)
    out = model(x)
    want = serial(x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    got, ref = grads(model.coefficients), grads(serial.coefficients)
    assert stored_sets(got) == model.parameterization.stored(model)
    for k in got:  # every rank holds each set it stores' whole gradient
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-14, msg=k)
    used = {k for k in range(nsplines) if model_uses(model, k)}
    everyone = WORLD.allgather_obj(model.parameterization.stored(model), "the stored sets")
    assert set().union(*map(set, everyone)) == used  # each set a step uses, stored somewhere
    for name in ("open", "close"):
        mine, theirs = grads(getattr(model, name)), grads(getattr(serial, name))
        for k in mine:  # on the rank that runs it
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-12, atol=1e-14, msg=k)
    # the step layers' evaluated weights never get a gradient; the coefficients' accumulate
    assert all(p.grad is None for p in model.layers.parameters())
    F.cross_entropy(model(x), y).backward()
    for k, g in grads(model.coefficients).items():
        torch.testing.assert_close(g, 2 * got[k], rtol=1e-12, atol=1e-14)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_training_keeps_the_replicas_equal_and_the_serial_trajectory():
    torch.manual_seed(3)
    model = Net(WORLD, steps=9, nsplines=5, degree=3)
    serial = SerialSplineNet(model)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, serial)]
    for k in range(4):
        x, y = batch(seed=k)
        for m, opt in zip((model, serial), opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    mine = {k: v.clone() for k, v in model.coefficients.state_dict().items()}
    for theirs in WORLD.allgather_obj(mine, "the coefficients"):
        for k in set(mine) & set(theirs):
            assert torch.equal(theirs[k], mine[k]), k  # bit for bit on every rank
    want = serial.coefficients.state_dict()
    for k, v in mine.items():
        torch.testing.assert_close(v, want[k], rtol=1e-11, atol=1e-13, msg=k)
    x, _ = batch(seed=9)
    torch.testing.assert_close(model(x), serial(x), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(model.to_serial()(x), serial(x), rtol=1e-11, atol=1e-12)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
def test_refining_the_depth_keeps_the_coefficients(tmp_path):
    torch.manual_seed(4)
    coarse = Net(WORLD, steps=4, nsplines=4, degree=2)
    torch.manual_seed(5)
    fine = Net(WORLD, steps=12, nsplines=4, degree=2)
    opt_c = torch.optim.SGD(coarse.parameters(), lr=0.1, momentum=0.9)
    opt_f = torch.optim.SGD(fine.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(seed=1)
    opt_c.zero_grad()
    F.cross_entropy(coarse(x), y).backward()
    opt_c.step()
    depth.refine(coarse, fine, "linear", (opt_c, opt_f))
    sets_c = coarse.parameterization.all_sets(coarse)
    for k, c in fine.coefficients.items():  # a set this rank stores at 12 steps, maybe not at 4
        for (n, a), b in zip(sets_c[int(k)].state_dict().items(), c.state_dict().values()):
            assert torch.equal(a, b), (k, n)
    momentum = {}  # every set's momentum at 4 steps, from the ranks that store it
    for part in WORLD.allgather_obj(
            {(k, n): opt_c.state[p]["momentum_buffer"].clone()
             for k, c in coarse.coefficients.items() for n, p in c.named_parameters()},
            "the momenta"):
        momentum.update(part)
    for k, c in fine.coefficients.items():
        for n, q in c.named_parameters():
            assert torch.equal(opt_f.state[q]["momentum_buffer"], momentum[(k, n)]), (k, n)
    # the same weight function, finer steps: the output changes by the time step's error only
    assert (fine(x) - coarse(x)).abs().max() < 0.05 * coarse(x).abs().max()
    # a checkpoint of the fine network resumes on one rank
    path = tmp_path / "spline.pt" if WORLD.rank == 0 else None
    path = WORLD.allgather_obj(str(path), "the path")[0]
    layerbraid.save_checkpoint(fine, path)
    from mpi4py import MPI

    torch.manual_seed(6)
    alone = Net(MPI.COMM_SELF, steps=12, nsplines=4, degree=2)
    layerbraid.load_checkpoint(alone, path)
    torch.testing.assert_close(alone(x), fine(x), rtol=1e-12, atol=1e-13)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
def test_each_rank_stores_only_the_sets_its_steps_use(tmp_path):
    """24 steps on 12 cubic splines: a rank stores the sets nonzero at its steps' times
    (fewer than all of them on several ranks) and their bytes alone; a checkpoint written on
    one rank loads here, each rank keeping its sets."""
    from mpi4py import MPI

    torch.manual_seed(7)
    model = Net(WORLD, steps=24, nsplines=12, degree=3)
    how = model.parameterization
    basis = bspline_basis(12, 3, np.arange(24) * model.dt, 1.0)
    owned = [i for i, _ in model.owned_steps()]
    want = sorted({k for i in owned for k in range(12) if basis[i, k] != 0})
    assert how.stored(model) == want
    per_set = sum(p.numel() * p.element_size() for p in ConvBlock(4).double().parameters())
    assert how.stored_bytes(model) == len(want) * per_set
    if WORLD.size > 1:
        assert len(want) < 12
    torch.manual_seed(8)
    alone = Net(MPI.COMM_SELF, steps=24, nsplines=12, degree=3)
    path = str(tmp_path / "alone.pt")
    path = WORLD.allgather_obj(path, "the path")[0]
    if WORLD.rank == 0:
        layerbraid.save_checkpoint(alone, path)
    WORLD.allgather_obj(None, "the checkpoint is written")
    layerbraid.load_checkpoint(model, path)
    x, _ = batch(seed=2)
    torch.testing.assert_close(model(x), alone(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parallel([1])
def test_bad_splines_are_clear_errors():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="degree must be 1, 2 or 3, got 4"):
        Net(MPI.COMM_SELF, degree=4, nsplines=6)
    with pytest.raises(ValueError, match="nsplines must be an int >= degree \\+ 1 = 3, got 2"):
        Net(MPI.COMM_SELF, degree=2, nsplines=2)

    class Uneven(Net):
        def coefficient_layer(self, index):
            return ConvBlock(4) if index else nn.Linear(2, 2)

    with pytest.raises(ValueError, match="coefficient_layer\\(1\\) has other parameters"):
        Uneven(MPI.COMM_SELF)


@pytest.mark.parallel([2])
def test_data_parallel_splines_are_refused():
    grid = layerbraid.ProcessGrid(WORLD, data_parallel=2)
    with pytest.raises(ValueError, match="not supported: use one data group"):
        Net(grid, steps=4)


@pytest.mark.parallel([2])
def test_a_rank_late_for_the_gradient_sum_is_reported(short_timeout, monkeypatch):
    """Rank 1 stalls just before the sum of the coefficients' gradients: rank 0 raises
    StallError naming it instead of waiting forever."""
    model = Net(WORLD, steps=4)
    x, y = batch(seed=0)
    reached = []
    if WORLD.rank == 1:
        real = model.comm.exchange

        def late(sends, recvs, tag, what):
            if what == "the coefficient sets' gradients":
                reached.append(True)
                time.sleep(short_timeout + 3)
            return real(sends, recvs, tag, what)

        monkeypatch.setattr(model.comm, "exchange", late)
    loss = F.cross_entropy(model(x), y)
    if WORLD.rank == 0:
        with pytest.raises(layerbraid.StallError, match="the coefficient sets' gradients"):
            loss.backward()
    else:  # late, after the chain's adjoint: whether its sum then fails or not is MPI's
        try:
            loss.backward()
        except Exception:
            pass
        assert reached == [True]


@pytest.mark.parallel([2])
def test_a_rank_late_for_the_stored_sets_agreement_is_reported(short_timeout, monkeypatch):
    """Rank 1 stalls while choosing its coefficient sets, just before the allgather in which
    the ranks agree who stores which: rank 0 raises StallError naming it."""
    from layerbraid.depth.spline import SplineWeights

    if WORLD.rank == 1:
        real = SplineWeights.weights

        def late(self, model, index):
            time.sleep(short_timeout + 3)
            monkeypatch.setattr(SplineWeights, "weights", real)
            return real(self, model, index)

        monkeypatch.setattr(SplineWeights, "weights", late)
        try:
            Net(WORLD, steps=4)
        except Exception:
            pass  # late: whether it then fails is MPI's
        return
    with pytest.raises(layerbraid.StallError, match="the coefficient sets each rank uses"):
        Net(WORLD, steps=4)


@pytest.mark.parallel([2])
def test_a_rank_late_for_refines_set_transfer_is_reported(short_timeout, monkeypatch):
    """Rank 1 stalls just before refine hands the coefficient sets to their new ranks: rank 0
    raises StallError naming the transfer."""
    torch.manual_seed(4)
    coarse = Net(WORLD, steps=4, nsplines=4, degree=2)
    fine = Net(WORLD, steps=12, nsplines=4, degree=2)
    if WORLD.rank == 1:
        real = depth._move_sets

        def late(*args):
            time.sleep(short_timeout + 3)
            return real(*args)

        monkeypatch.setattr(depth, "_move_sets", late)
        try:
            depth.refine(coarse, fine)
        except Exception:
            pass  # late: whether it then fails is MPI's
        return
    with pytest.raises(layerbraid.StallError, match="refine"):
        depth.refine(coarse, fine)
