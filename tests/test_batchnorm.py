"""Layer-parallel batch norm: equal to torch's batch norm in exact mode, converging with
multilevel MGRIT, and synchronized over data groups."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from layerbraid import LayerParallelModule, MGRITOptions, ProcessGrid
from layerbraid.nn import ConvBlock, LPBatchNorm2d
from nets import batch, train
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD



@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class BNNet(LayerParallelModule):
    def __init__(self, comm, steps=6, **kw):
        super().__init__(num_steps=steps, comm=comm, **kw)
        self.open = nn.Conv2d(1, 3, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3))


def serial_bn_copy(model):
    """The same network with torch's own nn.BatchNorm2d, and the model's weights."""
    ser = model.to_serial()
    assert all(type(layer[1]) is nn.BatchNorm2d for layer in ser.layers)
    return ser


def check_bn(model, tol):
    ser = serial_bn_copy(model)
    for k in range(3):  # three training batches, then eval
        x, y = batch(seed=k)
        xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        model.zero_grad()
        ser.zero_grad()
        out = model(xp)
        F.cross_entropy(out, y).backward()
        ref = ser(xs)
        F.cross_entropy(ref, y).backward()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        for i, layer in model.owned_steps():
            for p, q in zip(layer.parameters(), ser.layers[i].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
            for b, c in zip(layer.buffers(), ser.layers[i].buffers()):
                torch.testing.assert_close(b, c, rtol=tol, atol=tol)  # running stats, count
    model.eval()
    ser.eval()
    x, _ = batch(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ser(x), rtol=tol, atol=tol)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_batch_norm_exact_mode_equals_serial_batch_norm():
    torch.manual_seed(0)
    check_bn(BNNet(WORLD), ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_batch_norm_multilevel_converges_to_serial():
    torch.manual_seed(0)
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=2, max_iters=40, tol=1e-13, nrelax=1)
    check_bn(BNNet(WORLD, forward_options=opts, backward_options=opts), CONVERGED)


class SyncBNNet(BNNet):
    def __init__(self, comm, sync_comm, **kw):
        self._sync = sync_comm  # read by step_layer, which runs after __init__
        super().__init__(comm, **kw)

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3, sync_comm=self._sync))


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_synchronized_batch_norm_over_data_groups_matches_the_whole_batch():
    """2 x 2 with batch statistics shared across the data groups trains like 1 x 4 on the whole
    batch (plain batch norm)."""
    torch.manual_seed(0)
    grid = ProcessGrid(WORLD, data_parallel=2)
    dp = SyncBNNet(grid, grid.data_comm)
    torch.manual_seed(0)
    lp = BNNet(WORLD)
    train(dp, 3, grid.data_rank, 2)
    train(lp, 3)
    full = lp.to_serial().state_dict()  # every layer, whichever rank owns it
    for name, t in dp.state_dict().items():
        if name.startswith("layers."):
            torch.testing.assert_close(t, full[name], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{name}: {m}")
