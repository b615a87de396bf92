"""A new step rule, as docs/ARCHITECTURE.md's walkthrough adds one: Heun's method (explicit
RK2), ``x + dt/2 (f(x) + f(x + dt f(x)))``, by overriding ``step_rule``.  Exact (one level) and
converged MGRIT against a serial loop written here in plain PyTorch, on 1 and 2 ranks; and the
engine's forward Euler fast paths (increment graphs, fused runs) against a custom rule that
computes the same Euler step through the general path."""

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import layerbraid
from nets import ODEResNet, assert_gradients_match, batch
from tolerances import CONVERGED, ROUNDOFF

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class HeunResNet(ODEResNet):
    """The same network, stepped by Heun's method."""

    def step_rule(self, layer, x, dt, index):
        k1 = layer(x)
        k2 = layer(x + dt * k1)
        return x + 0.5 * dt * (k1 + k2)


class EulerByHand(ODEResNet):
    """Forward Euler through the general path (a custom rule: no increment graphs)."""

    def step_rule(self, layer, x, dt, index):
        return x + dt * layer(x)


def heun_serial(serial, x):
    """The serial oracle: the network's layers, stepped by Heun's method in a plain loop."""
    h = serial.open(x)
    dt = 1.0 / len(serial.layers)
    for layer in serial.layers:
        k1 = layer(h)
        h = h + 0.5 * dt * (k1 + layer(h + dt * k1))
    return serial.close(h)


def _check_against_serial(model, tol):
    serial = model.to_serial()
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    out = heun_serial(serial, x)
    F.cross_entropy(out, y).backward()
    with torch.no_grad():
        torch.testing.assert_close(model(x), out, rtol=tol, atol=tol)
    assert_gradients_match(model, serial, tol, WORLD)


def _exact():
    torch.manual_seed(0)
    return HeunResNet(WORLD, num_steps=8)


def _converged():
    torch.manual_seed(0)
    opts = layerbraid.MGRITOptions(max_levels=2, cfactor=2, max_iters=30, tol=1e-13)
    return HeunResNet(WORLD, num_steps=8, forward_options=opts, backward_options=opts)


def test_heun_exact_equals_the_serial_loop_on_one_rank():
    _check_against_serial(_exact(), ROUNDOFF)


def test_heun_multilevel_converges_to_the_serial_loop_on_one_rank():
    _check_against_serial(_converged(), CONVERGED)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_heun_exact_equals_the_serial_loop_on_two_ranks():
    _check_against_serial(_exact(), ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_heun_multilevel_converges_to_the_serial_loop_on_two_ranks():
    _check_against_serial(_converged(), CONVERGED)


def _euler_pair(fused, levels):
    opts = layerbraid.MGRITOptions(max_levels=levels, cfactor=2, max_iters=2)
    models = []
    for cls in (ODEResNet, EulerByHand):
        torch.manual_seed(0)
        models.append(cls(WORLD, num_steps=8, fused=fused, forward_options=opts,
                          backward_options=opts))
    return models


def _same_training_step(fast, general):
    x, y = batch()
    outs = []
    for m in (fast, general):
        out = m(x)
        F.cross_entropy(out, y).backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=ROUNDOFF, atol=ROUNDOFF)
    for p, q in zip(fast.parameters(), general.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("levels", [1, 2])
def test_the_euler_fast_paths_equal_the_general_path_on_one_rank(fused, levels):
    _same_training_step(*_euler_pair(fused, levels))


@pytest.mark.shared_job
@pytest.mark.parallel([2])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("levels", [1, 2])
def test_the_euler_fast_paths_equal_the_general_path_on_two_ranks(fused, levels):
    _same_training_step(*_euler_pair(fused, levels))
