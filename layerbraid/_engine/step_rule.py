"""Forward Euler, ``x <- x + dt * f(x)``: the step of every residual chain, written once.

The module's default ``step_rule``, the ResNet's step provider (its plain and fused paths),
the serial network ``to_serial()`` returns and the planner's step measurement all step
through these functions.  The engine's fast paths keep the graph of ``f(x)`` alone (an
increment, Note [Euler graphs] in _engine/layer_steps.py), so they call :func:`increment` and
:func:`combine` apart; :func:`euler_step` is the two together.  tests/test_step_rule.py holds
the fast paths equal to a custom rule that computes the same step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["StepRule", "check_shape", "combine", "euler_step", "increment"]

# rule(layer, x, dt, index) -> the next state, of x's shape and dtype
StepRule = Callable[[nn.Module, torch.Tensor, float, int], torch.Tensor]


def check_shape(fx: object, x: torch.Tensor, index: int) -> None:
    """Raises when step layer ``index`` returned something other than a state-shaped tensor."""
    if not isinstance(fx, torch.Tensor):
        raise TypeError(
            f"step layer {index} returned {type(fx).__name__}, not a tensor: a step "
            "layer must return a tensor of the state's shape"
        )
    if fx.shape != x.shape:
        raise ValueError(
            f"step layer {index} returned shape {tuple(fx.shape)} for a state of "
            f"shape {tuple(x.shape)}: a step layer must keep the state's shape"
        )


def increment(layer: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
    """``f(x)`` of step ``index``, checked to keep the state's shape."""
    try:
        fx = layer(x)
    except Exception as exc:
        note_step(exc, layer, x, index)
        raise
    check_shape(fx, x, index)
    return fx


def note_step(exc: BaseException, layer: nn.Module, x: torch.Tensor, index: int) -> None:
    """Adds to ``exc`` which step raised it and on what state (torch's own message names
    neither: e.g. a channel count that does not chain from the open layer or the step before)."""
    if not hasattr(exc, "add_note") or getattr(exc, "_layerbraid_step_noted", False):
        return  # Python < 3.11; or a step rule's own call of a layer, noted there already
    exc.add_note(
        f"(in step layer {index}, a {type(layer).__name__}, on a state of shape "
        f"{tuple(x.shape)} and dtype "
        f"{x.dtype}: each step layer takes and returns a state of one shape)"
    )
    exc._layerbraid_step_noted = True  # type: ignore[attr-defined]


def combine(x: torch.Tensor, dt: float, fx: torch.Tensor) -> torch.Tensor:
    """The forward Euler update from the increment ``fx``."""
    return x + dt * fx


def euler_step(layer: nn.Module, x: torch.Tensor, dt: float, index: int) -> torch.Tensor:
    """One forward Euler step ``x + dt * layer(x)`` (a :data:`StepRule`)."""
    return combine(x, dt, increment(layer, x, index))
