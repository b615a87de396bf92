"""The depth-smoothness penalty against the same sum over a serial copy's layers."""
import pytest
import torch
from mpi4py import MPI

from nets import ODEResNet
from tolerances import ROUNDOFF

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_depth_smoothness_equals_serial_in_value_and_gradient():
    assert WORLD.Get_size() in (1, 2, 3)
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=7)
    serial = model.to_serial()
    penalty = model.depth_smoothness()
    penalty.backward()
    flat = [torch.cat([p.reshape(-1) for p in layer.parameters()]) for layer in serial.layers]
    ref = sum((b - a).pow(2).sum() for a, b in zip(flat[:-1], flat[1:])) / (2 * model.dt)
    ref.backward()
    assert penalty.item() == pytest.approx(ref.item(), rel=ROUNDOFF)
    for i, layer in model.owned_steps():
        for p, q in zip(layer.parameters(), serial.layers[i].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=ROUNDOFF, atol=ROUNDOFF)
    model.free()


def test_depth_smoothness_needs_layers_of_one_shape():
    class Mixed(ODEResNet):
        def step_layer(self, index):
            return torch.nn.Conv2d(4, 4, 3 if index % 2 else 1, padding="same")

    torch.manual_seed(0)
    model = Mixed(MPI.COMM_SELF, num_steps=4)
    with pytest.raises(ValueError, match="depth_smoothness needs step layers whose parameters"):
        model.depth_smoothness()
    model.free()


@pytest.mark.parallel([2])
def test_a_rank_that_never_computes_the_penalty_is_reported(short_timeout):
    """Rank 1 skips depth_smoothness: rank 0 raises StallError after the timeout, naming what
    it waited for, instead of waiting forever."""
    import layerbraid

    assert WORLD.Get_size() == 2
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=4)
    if WORLD.rank == 0:
        with pytest.raises(layerbraid.StallError, match="its neighbours' layers for the "
                                                        "depth-smoothness penalty"):
            model.depth_smoothness()
