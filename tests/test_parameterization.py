"""A third step parameterization, written here as a user would: neighbouring steps share their
weights (steps 2k and 2k + 1 run set k).  It equals a serial network written in plain PyTorch
to round-off in float64 on 1-3 ranks, one level and converged MGRIT, outputs and every
gradient; and a parameterization of the wrong type is refused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layerbraid
from layerbraid.nn import ConvBlock
from layerbraid.parameterization import LinearStepWeights
from nets import batch
from tolerances import ROUNDOFF
from transports import WORLD

CONVERGED = layerbraid.MGRITOptions(max_levels=2, cfactor=2, max_iters=30, tol=1e-15)


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


# ---- the parameterization and the network: what a user writes
class Tied(LinearStepWeights):
    def weights(self, model, index):
        return [(index // 2, 1.0)]  # steps 2k and 2k + 1 run set k


class TiedNet(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps=6, **kwargs):
        super().__init__(steps, 1.0, comm, parameterization=Tied(steps // 2, self.block), **kwargs)
        self.open = nn.Conv2d(1, 4, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

    def block(self, index):
        return ConvBlock(4)

    def step_layer(self, index):
        return ConvBlock(4)


# ---- the reference
def serial_loss(model, x, y):
    """The same network in plain PyTorch, from copies of the model's open, close and sets."""
    import copy

    open_, close = (copy.deepcopy(m) for m in (model.open, model.close))
    sets = model.parameterization.all_sets(model)  # collective: each rank stores its own
    h = open_(x)
    for i in range(model.num_steps):
        h = h + model.dt * sets[i // 2](h)
    return F.cross_entropy(close(h), y), {"open": open_, "close": close, "coefficients": sets}


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("options", [None, CONVERGED], ids=["one level", "converged"])
def test_tied_neighbours_equal_their_serial_network(options):
    torch.manual_seed(0)
    solves = {} if options is None else {"forward_options": options, "backward_options": options}
    model = TiedNet(WORLD, **solves)
    x, y = batch(seed=1)
    loss, parts = serial_loss(model, x, y)
    loss.backward()
    mine = F.cross_entropy(model(x), y)
    mine.backward()
    torch.testing.assert_close(mine, loss, rtol=0, atol=ROUNDOFF)
    rank, last = WORLD.rank, WORLD.size - 1
    for name, ref in parts.items():
        if (name == "open" and rank != 0) or (name == "close" and rank != last):
            continue  # the open layer lives on the first rank, the close on the last
        theirs = dict(ref.named_parameters())
        for n, p in getattr(model, name).named_parameters():  # the sets this rank stores
            torch.testing.assert_close(p.grad, theirs[n].grad, rtol=0, atol=ROUNDOFF,
                                       msg=f"{name}.{n}")
    # the tied sets: set k is steps 2k and 2k + 1's, stored by the ranks that own those
    stored = model.parameterization.stored(model)
    assert stored == sorted({i // 2 for i, _ in model.owned_steps()})
    assert all(p.grad is None for _, layer in model.owned_steps() for p in layer.parameters())


@pytest.mark.parallel([1])
def test_a_parameterization_of_another_type_is_refused():
    class Wrong(layerbraid.LayerParallelModule):
        def __init__(self):
            super().__init__(6, parameterization={"weights": "tied"})

    with pytest.raises(TypeError, match="parameterization must be a StepParameterization, got "
                                        "dict"):
        Wrong()
