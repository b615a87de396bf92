"""torch.autograd.gradcheck (float64, finite differences) through the layer-parallel forward and
the adjoint MGRIT backward, in exact mode."""
import pytest
import torch
from mpi4py import MPI
from torch import nn

from layerbraid import LayerParallelModule

class Tiny(LayerParallelModule):
    def __init__(self, comm):
        super().__init__(num_steps=4, t_final=1.0, comm=comm)
        self.open = nn.Conv2d(1, 2, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 3))

    def step_layer(self, index):
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh())


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def test_gradcheck_through_the_input():
    """On one rank: gradcheck's own checks (undefined output gradients among them) differentiate
    the ranks' graphs differently, so it is not run collectively; multi-rank gradients are held
    to serial PyTorch elsewhere (test_module.py)."""
    torch.manual_seed(0)
    model = Tiny(MPI.COMM_SELF)
    model.retain_graphs = True  # gradcheck differentiates each forward once per output
    x = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: model(t), (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_through_every_parameter_on_one_rank():
    torch.manual_seed(0)
    model = Tiny(MPI.COMM_SELF)
    model.retain_graphs = True
    x = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 2 + 2 + 4 * 2  # open, close, 4 steps of weight + bias

    def f(*ps):  # gradcheck perturbs the parameters themselves, in place
        return model(x)

    assert torch.autograd.gradcheck(f, tuple(params), eps=1e-6, atol=1e-6, rtol=1e-5)
