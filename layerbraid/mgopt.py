"""Deprecated alias of :mod:`layerbraid.depth.mgopt` (MG/Opt lives with the other training over
depths, in layerbraid/depth/), kept for one release."""

import warnings

from .depth.mgopt import MGOpt, MGOptStats  # noqa: F401

warnings.warn(
    "layerbraid.mgopt is deprecated: import layerbraid.depth.mgopt",
    DeprecationWarning,
    stacklevel=2,
)
