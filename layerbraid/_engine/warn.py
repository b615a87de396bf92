"""Warnings that point at the user's line: the first frame outside the package, wherever in
the package the warning is raised (a fixed ``stacklevel`` breaks when a call path gains or
loses a frame, and then names a line of layerbraid's)."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch

__all__ = ["warn"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's own frames between the user's call and layerbraid's (``nn.Module.__call__``, autograd)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that names the first caller outside layerbraid and torch, counted from
    the caller of this function's caller (as ``warnings.warn`` counts from its own caller)."""
    frame: FrameType | None = sys._getframe(2)  # the function that warns
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE, _TORCH)):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel() + 1)
