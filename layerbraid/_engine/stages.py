"""The stages around the chain: the open layer on the first rank of the layer group, the close
layer on the last, each reporting to the other ranks instead of raising alone (the
handshake then raises the same error on every rank)."""

from typing import Any, Optional

import torch
from torch import nn

from .handshake import MAX_DIMS, CloseReport, CloseStatus, InputMeta, Opened, check_input
from .layer_steps import all_finite

__all__ = ["close_output", "open_input", "placeholder"]


def open_input(open_layer: Optional[nn.Module], x: Any, check_finite: bool) -> Opened:
    """The open layer's state from ``x`` on the first rank, or the error it raised."""
    try:
        check_input(x, check_finite)
        h0 = open_layer(x) if open_layer is not None else x
        if not isinstance(h0, torch.Tensor):
            raise TypeError(f"the open layer must return a tensor, got {type(h0).__name__}")
        if h0.dim() > MAX_DIMS:
            raise ValueError(f"the chain's state has {h0.dim()} dimensions, more than {MAX_DIMS}")
        return Opened(InputMeta(tuple(h0.shape), h0.dtype, h0.device), state=h0)
    except Exception as exc:  # tell every rank, then raise here
        return Opened(error=exc, input_shape=tuple(getattr(x, "shape", ())))


def close_output(
    close: Optional[nn.Module], out: Any, check_finite: bool
) -> tuple[Any, CloseReport, Optional[BaseException]]:
    """The close layer's output on the last rank and its report to the others."""
    try:
        if close is not None:
            out = close(out)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the close layer must return a tensor, got {type(out).__name__}")
        if out.dim() > MAX_DIMS:
            raise ValueError(
                f"the close layer's output has {out.dim()} dimensions, more than {MAX_DIMS}"
            )
        ok = not check_finite or all_finite([out.detach()])
        status = CloseStatus.OK if ok else CloseStatus.NONFINITE
        return out, CloseReport(status, tuple(out.shape), out.dtype), None
    except Exception as exc:  # tell every rank, then raise here
        return out, CloseReport(CloseStatus.ERROR, message=f"{type(exc).__name__}: {exc}"), exc


def placeholder(x: Any, meta: InputMeta) -> torch.Tensor:
    """The chain's input off the first rank: not used by the solve; but when ``x`` comes from
    an earlier stage it must stay in the graph, so that that stage's backward (collective)
    runs on this rank too."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return x
    return torch.zeros((), dtype=meta.dtype, device=meta.device)
