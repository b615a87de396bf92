"""Every private torch API layerbraid uses, behind one seam, each with a public fallback.

torch may rename or drop a private function in any release.  Each one is looked up here, once,
at import; where it is gone, the public fallback beside it runs instead (slower, the same
numbers), and :data:`MISSING` names what fell back.  tests/test_torch_private.py fails, naming
the API, as soon as an installed torch lacks one, and checks every fallback against the fast
path it replaces.

=====================================  ===================================================
private API                            public fallback
=====================================  ===================================================
``torch._VF.gru``, ``torch._VF.lstm``  the cells' equations over the steps (``F.linear``)
``torch._utils._flatten_dense_tensors`` ``torch.cat`` of the flattened tensors
``torch._use_cudnn_rnn_flatten_weight`` no cuDNN weight buffer (cuDNN copies the weights
``torch._cudnn_rnn_flatten_weight``    at every call, as for an ``nn.GRU`` that was never
``torch.backends.cudnn.rnn``           flattened)
``.get_cudnn_mode``
=====================================  ===================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = [
    "MISSING",
    "PRIVATE_APIS",
    "cudnn_flatten_rnn_weights",
    "flatten_dense",
    "gru_kernel",
    "lstm_kernel",
]


def _lookup(path: str) -> Callable[..., Any] | None:
    """The object at dotted ``path`` (a module, then attributes), or None if torch lacks it."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


PRIVATE_APIS = (
    "torch._VF.gru",
    "torch._VF.lstm",
    "torch._utils._flatten_dense_tensors",
    "torch._use_cudnn_rnn_flatten_weight",
    "torch._cudnn_rnn_flatten_weight",
    "torch.backends.cudnn.rnn.get_cudnn_mode",
)
_FOUND = {path: _lookup(path) for path in PRIVATE_APIS}
MISSING = tuple(path for path, obj in _FOUND.items() if obj is None)


# ---------------------------------------------------------------- multi-step RNN kernels
def gru_kernel(
    xs: torch.Tensor, h: torch.Tensor, params: Sequence[torch.Tensor], bias: bool, train: bool
) -> torch.Tensor:
    """One GRU layer over ``xs`` (batch, steps, features) from ``h`` (batch, hidden): the
    output sequence (batch, steps, hidden), through torch's own kernel where it has one."""
    fast = _FOUND["torch._VF.gru"]
    if fast is not None:
        out, _ = fast(
            xs.contiguous(), h.unsqueeze(0), list(params), bias, 1, 0.0, train, False, True
        )
        return out
    return _gru_steps(xs, h, params, bias)


def lstm_kernel(
    xs: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    params: Sequence[torch.Tensor],
    bias: bool,
    train: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM layer over ``xs`` from ``(h, c)`` (each (1, batch, hidden)): the output
    sequence and the last ``(h, c)``, as ``torch._VF.lstm`` returns them."""
    fast = _FOUND["torch._VF.lstm"]
    if fast is not None:
        out, h_n, c_n = fast(
            xs.contiguous(), (h, c), list(params), bias, 1, 0.0, train, False, True
        )
        return out, h_n, c_n
    return _lstm_steps(xs, h, c, params, bias)


def _linear_pair(x, h, params, bias):
    b_ih, b_hh = (params[2], params[3]) if bias else (None, None)
    return F.linear(x, params[0], b_ih), F.linear(h, params[1], b_hh)


def _gru_steps(xs, h, params, bias):
    outs = []
    for k in range(xs.shape[1]):
        gi, gh = _linear_pair(xs[:, k], h, params, bias)
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        h = (1 - z) * n + z * h
        outs.append(h)
    return torch.stack(outs, 1)


def _lstm_steps(xs, h, c, params, bias):
    h, c = h[0], c[0]
    outs = []
    for k in range(xs.shape[1]):
        gi, gh = _linear_pair(xs[:, k], h, params, bias)
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, 1), h.unsqueeze(0), c.unsqueeze(0)


# ---------------------------------------------------------------- flattening
def flatten_dense(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements in one flat tensor, in order."""
    fast = _FOUND["torch._utils._flatten_dense_tensors"]
    if fast is not None:
        return fast(list(tensors))
    return torch.cat([t.reshape(-1) for t in tensors])


def cudnn_flatten_rnn_weights(
    layers: Sequence[Sequence[torch.Tensor]], kind: str, input_size: int, hidden_size: int
) -> bool:
    """Makes each layer's parameters views into one buffer in cuDNN's layout (in place, as
    ``nn.GRU.flatten_parameters`` does); ``kind`` is "GRU" or "LSTM".  Returns False, doing
    nothing, where torch does not offer it (then cuDNN copies the weights at each call)."""
    use = _FOUND["torch._use_cudnn_rnn_flatten_weight"]
    flatten = _FOUND["torch._cudnn_rnn_flatten_weight"]
    mode_of = _FOUND["torch.backends.cudnn.rnn.get_cudnn_mode"]
    if use is None or flatten is None or mode_of is None or not use():
        return False
    mode = mode_of(kind)
    for k, layer in enumerate(layers):
        size = input_size if k == 0 else hidden_size
        flatten(layer, len(layer), size, mode, hidden_size, 0, 1, True, False)
    return True
