"""``from_serial``: a layer-parallel model from a serial network, the inverse of ``to_serial()``.
The round trip (outputs and every gradient, to round-off in float64), building from parts
(forward Euler blocks with batch norms, and residual blocks that add their own skip), training
beside the serial original, what each rank keeps, and the errors; on 1 and 2 ranks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid.convert import own_skip_rule
from nets import ODEResNet, assert_gradients_match, batch
from tolerances import CONVERGED, ROUNDOFF

WORLD = MPI.COMM_WORLD
TWO_LEVELS = layerbraid.MGRITOptions(max_levels=2, cfactor=2, max_iters=30, tol=1e-13)


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class BasicBlock(nn.Module):
    """A ResNet basic block without downsampling: ``relu(x + bn2(conv2(relu(bn1(conv1 x)))))``,
    a block that adds its own skip."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _parts(n=8, own_skip=False):
    """An open layer, ``n`` blocks and a close layer, as a user's serial network has them."""
    torch.manual_seed(3)
    open_ = nn.Conv2d(1, 4, 3, padding=1)
    if own_skip:
        blocks = [BasicBlock(4) for _ in range(n)]
    else:
        blocks = [nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh())
                  for _ in range(n)]
    close = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    return open_, nn.ModuleList(blocks), close


def _plain_forward(open_, blocks, close, x, dt, own_skip=False):
    """The serial network, written as a user writes it."""
    h = open_(x)
    for b in blocks:
        h = b(h) if own_skip else h + dt * b(h)
    return close(h)


def _check_round_trip(levels):
    torch.manual_seed(0)
    opts = {} if levels == 1 else {"forward_options": TWO_LEVELS, "backward_options": TWO_LEVELS}
    original = ODEResNet(WORLD, num_steps=8, **opts)
    serial = original.to_serial()
    model = layerbraid.from_serial(serial, **opts)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    out = serial(x)
    F.cross_entropy(out, y).backward()
    tol = ROUNDOFF if levels == 1 else CONVERGED
    with torch.no_grad():
        torch.testing.assert_close(model(x), out, rtol=tol, atol=tol)
    assert_gradients_match(model, serial, tol, WORLD)
    # ... and back: the model's serial copy is the serial network it was built from
    back = model.to_serial().state_dict()
    assert back.keys() == serial.state_dict().keys()
    for k, v in serial.state_dict().items():
        assert torch.equal(back[k], v), k


def test_the_round_trip_is_exact_on_one_rank():
    _check_round_trip(1)


def test_the_round_trip_converges_at_two_levels_on_one_rank():
    _check_round_trip(2)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_the_round_trip_is_exact_on_two_ranks():
    _check_round_trip(1)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_the_round_trip_converges_at_two_levels_on_two_ranks():
    _check_round_trip(2)


def _check_parts(own_skip, levels, train_steps=0):
    """from_serial(parts) against the user's own serial network: a forward and backward, then
    ``train_steps`` SGD steps side by side (the networks stay equal as they train)."""
    open_, blocks, close = _parts(own_skip=own_skip)
    dt = 1.0 if own_skip else 0.125
    opts = {} if levels == 1 else {"forward_options": TWO_LEVELS, "backward_options": TWO_LEVELS}
    kw = {"own_skip": True} if own_skip else {"dt": dt}
    model = layerbraid.from_serial(open=open_, steps=blocks, close=close, **kw, **opts)
    tol = ROUNDOFF if levels == 1 else CONVERGED
    params = list(open_.parameters()) + list(blocks.parameters()) + list(close.parameters())
    opt_serial = torch.optim.SGD(params, lr=0.05)
    opt_model = torch.optim.SGD(model.parameters(), lr=0.05)
    for k in range(train_steps + 1):
        x, y = batch(seed=k)
        for opt in (opt_serial, opt_model):
            opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        ref = _plain_forward(open_, blocks, close, x, dt, own_skip)
        F.cross_entropy(ref, y).backward()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        for i, layer in model.owned_steps():
            for p, q in zip(layer.parameters(), blocks[i].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
            for p, q in zip(layer.buffers(), blocks[i].buffers()):  # running statistics
                torch.testing.assert_close(p, q, rtol=tol, atol=tol)
        opt_serial.step()
        opt_model.step()


@pytest.mark.parametrize("own_skip", [False, True])
def test_parts_equal_the_users_serial_network_on_one_rank(own_skip):
    _check_parts(own_skip, levels=1)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
@pytest.mark.parametrize("own_skip", [False, True])
@pytest.mark.parametrize("levels", [1, 2])
def test_parts_equal_the_users_serial_network_on_two_ranks(own_skip, levels):
    _check_parts(own_skip, levels)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
@pytest.mark.parametrize("own_skip", [False, True])
def test_a_model_from_parts_trains_as_its_serial_original(own_skip):
    _check_parts(own_skip, levels=2, train_steps=4)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_each_rank_keeps_only_its_blocks_and_the_parts_stay_the_users():
    open_, blocks, close = _parts()
    before = copy.deepcopy(blocks.state_dict())
    model = layerbraid.from_serial(open=open_, steps=blocks, close=close, dt=0.125)
    owned = [i for i, _ in model.owned_steps()]
    assert owned == list(range(4 * WORLD.rank, 4 * WORLD.rank + 4))
    assert sorted(int(k) for k in model.layers) == owned
    for i, skeleton in enumerate(model.parameterization.skeletons):  # shapes, no memory
        assert all(p.is_meta for p in skeleton.parameters()), i
    for _, layer in model.owned_steps():  # copies: plain batch norms became layer-parallel
        assert isinstance(layer[1], layerbraid.nn.LPBatchNorm2d)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(1.0)
    for k, v in blocks.state_dict().items():  # the user's blocks share nothing with the model
        assert torch.equal(v, before[k]), k
    assert isinstance(blocks[0][1], nn.BatchNorm2d)


def test_the_own_skip_rule_scales_the_increment_on_coarse_levels():
    class Holder(nn.Module):
        dt = 0.5

    block = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    y = block(x)
    assert torch.equal(own_skip_rule(Holder(), block, x, 0.5, 0), y)
    torch.testing.assert_close(own_skip_rule(Holder(), block, x, 1.0, 0), x + 2 * (y - x))


@pytest.mark.parametrize("call, message", [
    (lambda p: layerbraid.from_serial(nn.Linear(2, 2)), "got Linear"),
    (lambda p: layerbraid.from_serial(p[3], dt=0.1), "not both"),
    (lambda p: layerbraid.from_serial(open=p[0], close=p[2]), "step blocks"),
    (lambda p: layerbraid.from_serial(steps=p[1]), "exactly one of dt and t_final"),
    (lambda p: layerbraid.from_serial(steps=p[1], dt=0.1, t_final=1.0), "exactly one"),
    (lambda p: layerbraid.from_serial(steps=p[1], dt=-1.0), "dt must be a finite number > 0"),
    (lambda p: layerbraid.from_serial(steps=[], dt=0.1), "steps is empty"),
    (lambda p: layerbraid.from_serial(steps=[nn.Tanh(), 3], dt=0.1), r"steps\[1\]"),
    (lambda p: layerbraid.from_serial(steps=nn.Tanh(), dt=0.1), "wrap a single block"),
    (lambda p: layerbraid.from_serial(steps=p[1], dt=0.1, open=3), "open must be an nn.Module"),
    (lambda p: layerbraid.from_serial(steps=p[1], own_skip=True, step_rule=own_skip_rule),
     "not both"),
])
def test_bad_arguments_name_the_bad_value(call, message):
    open_, blocks, close = _parts()
    serial = layerbraid.from_serial(open=open_, steps=blocks, close=close, dt=0.1).to_serial()
    with pytest.raises((TypeError, ValueError), match=message):
        call((open_, blocks, close, serial))
