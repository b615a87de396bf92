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
``torch.distributed.pipelining``       the fused VJP: the input's and the parameters'
``._backward.construct_reverse_graph`` gradients in one pass (no weight gradients deferred
``._backward.get_param_groups``        to fill a pipeline's bubble)
=====================================  ===================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = [
    "missing",
    "PRIVATE_APIS",
    "cudnn_flatten_rnn_weights",
    "flatten_dense",
    "gru_kernel",
    "split_vjp",
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
    "torch.distributed.pipelining._backward.construct_reverse_graph",
    "torch.distributed.pipelining._backward.get_param_groups",
)


class _Found(dict):
    """Each private API's object (None where torch lacks it), looked up on first use: importing
    ``torch.distributed.pipelining`` registers exit handlers, which importing layerbraid must
    not do (layerbraid changes process state only in launch.install_process_hooks)."""

    def __missing__(self, path: str) -> Callable[..., Any] | None:
        if path not in PRIVATE_APIS:
            raise KeyError(path)
        found = self[path] = _lookup(path)
        return found


_FOUND = _Found()


def prepare_split() -> None:
    """Looks up split_vjp's helpers now: the first lookup imports
    torch.distributed.pipelining (most of a second on a busy node), which in a microbatched
    backward would hold up every rank to the left of this one, once per rank, in turn."""
    for path in PRIVATE_APIS:
        if path.startswith("torch.distributed.pipelining."):
            _FOUND[path]


def missing() -> tuple[str, ...]:
    """The private APIs the installed torch lacks (looks every one up)."""
    return tuple(path for path in PRIVATE_APIS if _FOUND[path] is None)


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


# ---------------------------------------------------------------- deferred weight gradients
WeightGrads = Callable[[bool], list]


def split_vjp(
    y: torch.Tensor, g: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, WeightGrads] | None:
    """The VJP of ``y`` (a function of the leaf ``x`` and ``params``) with output gradient
    ``g``, in two parts, as zero-bubble pipeline schedules split it: ``x``'s gradient now,
    and a function ``weights(retain)`` that computes the parameters' gradients later (in
    ``params``' order, None for a parameter ``y`` does not use), from the gradients the first
    part saw flow into the nodes where each parameter joins the path from ``x`` (torch's own
    parameter groups, torch.distributed.pipelining's B/W split), so no work is done twice.
    The graph is kept until ``weights(retain=False)``.  Returns None where torch lacks the
    helpers, where some parameter joins ``y`` by no path from ``x``, or where the graph holds a
    custom autograd Function (its one backward computes every gradient at once, so the second
    part would run it again: twice the work); the caller then takes the fused VJP."""
    reverse_graph = _FOUND["torch.distributed.pipelining._backward.construct_reverse_graph"]
    param_groups = _FOUND["torch.distributed.pipelining._backward.get_param_groups"]
    if reverse_graph is None or param_groups is None or y.grad_fn is None:
        return None
    from torch.autograd.graph import GradientEdge, get_gradient_edge

    x_node = get_gradient_edge(x).node
    weight_nodes = [get_gradient_edge(p).node for p in params]
    reverse = reverse_graph([y.grad_fn])
    # before the groups: torch's reverse graph is a defaultdict, which their search grows
    in_graph = set(reverse) | {n for children in reverse.values() for n in children}
    if any(isinstance(n, torch.autograd.function.BackwardCFunction) for n in in_graph):
        return None
    groups = param_groups([x_node], weight_nodes, reverse)
    covered = {n for group in groups for n in group["params"]}
    if any(n in in_graph and n not in covered for n in weight_nodes):
        return None
    handles = []
    for group in groups:
        nodes = list(group["intermediates"])
        group["intermediates"], group["grads"] = nodes, [None] * len(nodes)
        for i, node in enumerate(nodes):

            def keep(grad_outputs: Any, group: Any = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs

            handles.append(node.register_prehook(keep))
    try:
        (gx,) = torch.autograd.grad([y], [x], [g], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()

    def weights(retain: bool) -> list:
        out: dict[Any, torch.Tensor] = {}
        for k, group in enumerate(groups):
            nodes, grads = group["intermediates"], group["grads"]
            edges = [
                (GradientEdge(node, i), gi)
                for node, got in zip(nodes, grads)
                if got is not None
                for i, gi in enumerate(got)
                if gi is not None
            ]
            if not edges:
                continue
            # a node below another of the group takes the gradient it saw, not a second one
            clamps = [
                node.register_prehook(lambda _go, saved=got: saved)
                for node, got in zip(nodes, grads)
                if len(nodes) > 1 and got is not None
            ]
            try:
                owners = list(group["params"])
                found = torch.autograd.grad(
                    [e for e, _ in edges],
                    [GradientEdge(n, 0) for n in owners],
                    [gi for _, gi in edges],
                    # groups may share nodes (a layer called twice in a step): keep the
                    # graph until the last group has passed
                    retain_graph=retain or k < len(groups) - 1,
                    allow_unused=True,
                )
            finally:
                for handle in clamps:
                    handle.remove()
            out.update(zip(owners, found))
        return [out.get(n) for n in weight_nodes]

    return gx, weights
