"""Data parallel x layer parallel (ProcessGrid) and layer-parallel batch norm."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from layerbraid import LayerParallelModule, MGRITOptions, ProcessGrid, shard_batches
from layerbraid.nn import ConvBlock, LPBatchNorm2d
from nets import ODEResNet, batch
from tolerances import CONVERGED, ROUNDOFF

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


@pytest.mark.parallel([3])
def test_a_grid_that_does_not_fit_is_a_clear_error_on_every_rank():
    with pytest.raises(ValueError, match="data_parallel=2 does not divide the 3 ranks"):
        ProcessGrid(WORLD, data_parallel=2)
    with pytest.raises(ValueError, match="data_parallel must be an int >= 1, got 0"):
        ProcessGrid(WORLD, data_parallel=0)


@pytest.mark.parallel([4])
def test_grid_layout():
    g = ProcessGrid(WORLD, data_parallel=2)
    assert (g.layer_size, g.data_size) == (2, 2)
    assert (g.layer_rank, g.data_rank) == (WORLD.rank % 2, WORLD.rank // 2)
    assert g.layer_comm.Get_size() == 2 and g.data_comm.Get_size() == 2
    # the data group holds the ranks at the same place of every layer group
    assert sorted(g.data_comm.allgather(WORLD.rank)) == [WORLD.rank % 2, WORLD.rank % 2 + 2]


def test_shards_split_every_batch_and_are_deterministic():
    n, b = 50, 8
    full = list(shard_batches(n, b, 0, 1, seed=3, epoch=1))
    parts = [list(shard_batches(n, b, r, 3, seed=3, epoch=1)) for r in range(3)]
    # 50 = 6 * 8 + 2: the last batch of 2 cannot be shared by 3 groups and is dropped by all
    assert all(len(p) == len(full) - 1 == 6 for p in parts)
    for k, whole in enumerate(full[:-1]):
        joined = torch.cat([parts[r][k] for r in range(3)])
        assert torch.equal(joined, whole)
    again = list(shard_batches(n, b, 1, 3, seed=3, epoch=1))
    assert all(torch.equal(a, c) for a, c in zip(again, parts[1]))
    other_epoch = list(shard_batches(n, b, 1, 3, seed=3, epoch=2))
    assert not torch.equal(other_epoch[0], parts[1][0])
    with pytest.raises(ValueError, match="batch_size=2 is smaller than the 3 data groups"):
        list(shard_batches(n, 2, 0, 3))


def train(model, steps, data_rank=0, data_size=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for k in range(steps):
        x, y = batch(n=8, seed=k)
        idx = next(shard_batches(8, 8, data_rank, data_size, seed=k))
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parallel([4])
def test_two_by_two_training_matches_one_by_four_and_serial():
    torch.manual_seed(0)
    grid = ProcessGrid(WORLD, data_parallel=2)
    dp = ODEResNet(grid, num_steps=6)
    torch.manual_seed(0)
    lp = ODEResNet(WORLD, num_steps=6)
    serial = lp.to_serial()
    train(dp, 4, grid.data_rank, 2)
    train(lp, 4)
    train(serial, 4)
    ref = serial.state_dict()
    for model in (dp, lp):
        for name, p in model.state_dict().items():
            if name.startswith("layers.") or (name.startswith("open.") and model.comm.rank == 0) \
                    or (name.startswith("close.") and model.comm.rank == model.comm.size - 1):
                torch.testing.assert_close(p, ref[name], rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{name}: {m}")


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
    for layer in ser.layers:
        bn = layer[1]
        plain = nn.BatchNorm2d(3)
        plain.load_state_dict(bn.state_dict())
        layer[1] = plain
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


@pytest.mark.parallel([1, 2, 3, 4])
def test_batch_norm_exact_mode_equals_serial_batch_norm():
    torch.manual_seed(0)
    check_bn(BNNet(WORLD), ROUNDOFF)


@pytest.mark.parallel([1, 3])
def test_batch_norm_multilevel_converges_to_serial():
    torch.manual_seed(0)
    opts = MGRITOptions(max_levels=2, cfactor=2, max_iters=40, tol=1e-13, nrelax=1)
    check_bn(BNNet(WORLD, forward_options=opts, backward_options=opts), CONVERGED)


class SyncBNNet(BNNet):
    def __init__(self, comm, sync_comm, **kw):
        self._sync = sync_comm  # read by step_layer, which runs after __init__
        super().__init__(comm, **kw)

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3, sync_comm=self._sync))


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
    full = lp._gather_state()
    for name, t in dp.state_dict().items():
        if name.startswith("layers."):
            torch.testing.assert_close(t, full[name], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{name}: {m}")
