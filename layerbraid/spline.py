"""Deprecated alias of :mod:`layerbraid.depth.spline` (spline steps live with the other training
over depths, in layerbraid/depth/), kept for one release."""

import warnings

from .depth.spline import SplineModule, SplineWeights, bspline_basis  # noqa: F401

warnings.warn(
    "layerbraid.spline is deprecated: import layerbraid.depth.spline",
    DeprecationWarning,
    stacklevel=2,
)
