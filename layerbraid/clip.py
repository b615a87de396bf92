"""Gradient clipping over the whole layer-parallel network, as serial PyTorch clips it."""

import math

import torch
from torch import nn

from ._engine.parts import counted_parameters

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model that holds layer-parallel parts.

    Collective over the layer group.  The total norm is that of every gradient of the whole
    network, each counted once: a step layer on the rank that owns it, the open layer on the
    first rank, the close layer on the last, weights shared over the layer group (layer-parallel
    RNNs) and parameters outside any layer-parallel part (e.g. a head run on every rank) on the
    first rank.  Every rank gets the same total and scales its gradients by the same factor, so
    the clipped gradients equal the serial network's.  Under data parallelism (``ProcessGrid``)
    the gradients are already averaged over the data groups when backward returns, so the
    answer is the same in every group.

    Args:
        model: an ``nn.Module`` that is, or contains, layer-parallel modules.
        max_norm, norm_type, error_if_nonfinite: as in ``torch.nn.utils.clip_grad_norm_``
            (``norm_type`` may be ``inf``).

    Returns:
        The total norm of the gradients (a 0-d tensor), the same on every rank.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type!r}")
    comm, counted = counted_parameters(model)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in counted if p.grad is not None]
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type, False).item()
    else:
        local = 0.0
    if comm is not None and comm.Get_size() > 1:
        what = "the gradient norm of clip_grad_norm_"
        if math.isinf(norm_type):
            total = comm.allreduce_floats([local], "max", what)[0]
        else:
            total = comm.allreduce_floats([local**norm_type], "sum", what)[0] ** (1.0 / norm_type)
    else:
        total = local
    ref = params[0].grad if params else None
    total = torch.tensor(
        total,
        dtype=torch.float64 if ref is None else ref.dtype,
        device=None if ref is None else ref.device,
    )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is "
            f"{total.item()}: clip_grad_norm_ cannot clip them "
            "(error_if_nonfinite=True)"
        )
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
