"""Small layer-parallel networks shared by the tests."""
import torch
import torch.nn.functional as F
from torch import nn

import layerbraid
from layerbraid.nn import ConvBlock


class ODEResNet(layerbraid.LayerParallelModule):
    """open conv -> N conv steps -> flatten + linear."""

    def __init__(self, comm, num_steps=8, channels=4, size=8, classes=3, **kwargs):
        super().__init__(num_steps=num_steps, t_final=1.0, comm=comm, **kwargs)
        self.channels = channels  # set after super().__init__: step_layer may still use it
        self.open = nn.Conv2d(1, channels, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, classes))

    def step_layer(self, index):
        return ConvBlock(self.channels)


def batch(n=6, size=8, classes=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def train(model, steps, data_rank=0, data_size=1):
    """SGD steps on fixed batches (each data group its shard); returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for k in range(steps):
        x, y = batch(n=8, seed=k)
        # each data group its contiguous share of a shuffled batch of 8
        idx = torch.randperm(8, generator=torch.Generator().manual_seed(k))
        idx = idx.tensor_split(data_size)[data_rank]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_gradients_match(model, serial, tol, world):
    """Every parameter gradient a rank of ``world`` holds (its steps; the open layer on the
    first rank, the close layer on the last) against the serial copy's."""
    for i, layer in model.owned_steps():
        for (name, p), q in zip(layer.named_parameters(), serial.layers[i].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol,
                                       msg=lambda m: f"step {i} {name}: {m}")
    if world.rank == 0:
        for p, q in zip(model.open.parameters(), serial.open.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
    if world.rank == world.size - 1:
        for p, q in zip(model.close.parameters(), serial.close.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)


def compare_with_serial(model, x, y, tol, world):
    """Output, input gradient and every parameter gradient of model vs model.to_serial()."""
    serial = model.to_serial()
    xp = x.clone().requires_grad_(True)
    out = model(xp)
    F.cross_entropy(out, y).backward()
    xs = x.clone().requires_grad_(True)
    ref = serial(xs)
    F.cross_entropy(ref, y).backward()
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if world.rank == 0:
        torch.testing.assert_close(xp.grad, xs.grad, rtol=tol, atol=tol)
    assert_gradients_match(model, serial, tol, world)
