"""The private torch APIs layerbraid uses (layerbraid/_engine/torch_private.py): each is still in the
installed torch (a failure names the one torch removed: its public fallback then runs), and
each fallback computes what the private API does."""

import pytest
import torch

from layerbraid._engine import torch_private as tp


@pytest.mark.parametrize("path", tp.PRIVATE_APIS)
def test_the_private_api_is_still_in_torch(path):
    assert tp._FOUND[path] is not None, (
        f"torch {torch.__version__} no longer has {path}: layerbraid runs its public fallback "
        "(see layerbraid/_engine/torch_private.py); make the seam use torch's replacement")
    assert path not in tp.missing()


def _params(gates, n_in, hidden, bias, g):
    shapes = [(gates * hidden, n_in), (gates * hidden, hidden)]
    shapes += [(gates * hidden,), (gates * hidden,)] if bias else []
    return [torch.randn(s, dtype=torch.float64, generator=g) * 0.5 for s in shapes]


@pytest.mark.parametrize("bias", [True, False])
def test_the_gru_fallback_equals_torchs_kernel(bias):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(3, 7, 4, dtype=torch.float64, generator=g)
    h = torch.randn(3, 5, dtype=torch.float64, generator=g)
    params = _params(3, 4, 5, bias, g)
    torch.testing.assert_close(tp._gru_steps(xs, h, params, bias),
                               tp.gru_kernel(xs, h, params, bias, False), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("bias", [True, False])
def test_the_lstm_fallback_equals_torchs_kernel(bias):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 7, 4, dtype=torch.float64, generator=g)
    h, c = (torch.randn(1, 3, 5, dtype=torch.float64, generator=g) for _ in range(2))
    params = _params(4, 4, 5, bias, g)
    for a, b in zip(tp._lstm_steps(xs, h, c, params, bias),
                    tp.lstm_kernel(xs, h, c, params, bias, False)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_the_flatten_fallback_equals_torchs():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    assert torch.equal(tp.flatten_dense(ts), torch.cat([t.reshape(-1) for t in ts]))


def test_without_the_private_apis_the_fallbacks_run(monkeypatch):
    """With every private API gone, the seam still computes (the fallbacks), and the cuDNN
    weight buffer is simply not made."""
    for path in tp.PRIVATE_APIS:
        monkeypatch.setitem(tp._FOUND, path, None)
    g = torch.Generator().manual_seed(2)
    xs, h = torch.randn(2, 3, 4, generator=g), torch.randn(2, 5, generator=g)
    params = _params(3, 4, 5, True, g)
    params = [p.float() for p in params]
    assert tp.gru_kernel(xs, h, params, True, False).shape == (2, 3, 5)
    ts = [torch.ones(2), torch.zeros(3)]
    assert torch.equal(tp.flatten_dense(ts), torch.tensor([1.0, 1, 0, 0, 0]))
    assert tp.cudnn_flatten_rnn_weights([params], "GRU", 4, 5) is False
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    assert tp.split_vjp(x @ w, torch.ones(2, 3), x, [w]) is None  # the fused VJP then


def _chain(x, layers, twice):
    """Residual steps of ``layers``; with ``twice``, each layer called twice per step (the
    midpoint rule), so that a weight joins the path from ``x`` at two nodes."""
    for f in layers:
        x = x + 0.1 * f(x + 0.05 * f(x)) if twice else x + 0.1 * f(x)
    return x


@pytest.mark.parametrize("twice", [False, True])
def test_the_split_vjp_equals_the_fused_one(twice):
    """split_vjp (zero-bubble's B/W split over torch's parameter groups): the input's gradient
    first, the parameters' later, equal to one autograd.grad of both, on convolution steps
    with biases, a layer norm and an unused parameter."""
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.GroupNorm(1, 3))
              for _ in range(3)]
    unused = nn.Parameter(torch.ones(2))
    params = [p for f in layers for p in f.parameters()] + [unused]
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    g = torch.randn(4, 3, 6, 6)
    want = torch.autograd.grad(_chain(x, layers, twice), [x, *params], g, allow_unused=True)
    split = tp.split_vjp(_chain(x, layers, twice), g, x, params)
    assert split is not None
    gx, weights = split
    torch.testing.assert_close(gx, want[0], rtol=1e-6, atol=1e-6)
    got = weights(False)
    assert got[-1] is None and want[-1] is None
    for a, b in zip(got[:-1], want[1:-1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_custom_function_in_the_graph_takes_the_fused_vjp():
    """A custom autograd Function's backward computes every gradient in one call: splitting
    around it would call it twice, so split_vjp declines and the caller fuses."""
    calls = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    y = Scale.apply(x, w) + b
    assert tp.split_vjp(y, torch.ones(4, 3), x, [w, b]) is None
    assert calls == []  # declined before any backward ran
