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
    assert path not in tp.MISSING


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
