"""layerbraid: layer-parallel multigrid (MGRIT) training for PyTorch.

The top level is the training surface: the module, ``from_serial`` (a layer-parallel model from a
serial network), its options, the process grid, spatial coarsening, gradient clipping,
checkpoints, the stall timeout, the errors, and the general solver.  Around it:
``layerbraid.data`` (loaders), ``layerbraid.nn`` (step blocks, batch norms, RNNs),
``layerbraid.parameterization`` (what a step's parameters are),
``layerbraid.accuracy`` (gradient audits, probes, the iteration tuner), ``layerbraid.cli`` (the
examples' flags), ``layerbraid.plan`` (the work model), ``layerbraid.launch`` (the abort hook).
"""

import importlib
import warnings
from typing import Any

from .errors import DivergenceError, MGRITError, RemoteRankError, StallError
from .launch import set_timeout
from .mgrit import MGRIT
from .options import MGRITOptions

__all__ = [
    "MGRIT",
    "CheckpointError",
    "DivergenceError",
    "LayerParallelModule",
    "MGRITError",
    "MGRITOptions",
    "ProcessGrid",
    "RemoteRankError",
    "SpatialCoarsening",
    "StallError",
    "clip_grad_norm_",
    "from_serial",
    "load_checkpoint",
    "save_checkpoint",
    "set_timeout",
]
__version__ = "0.1.0"

# The names that need torch load on first use, so that the general solver works (and imports
# fast) without it.
_LAZY = {
    "LayerParallelModule": "module",
    "ProcessGrid": "grid",
    "SpatialCoarsening": "coarsening",
    "clip_grad_norm_": "clip",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "from_serial": "convert",
}
# Subpackages reachable as attributes after ``import layerbraid`` (loaded on first use).
_SUBMODULES = {
    "accuracy",
    "cli",
    "data",
    "nn",
    "parameterization",
    "plan",
    "stats",
    "checkpoint",
    "launch",
    "mgrit",
}
# Names that left the top level: where they live now (one release of warnings, CHANGELOG.md).
_MOVED = {
    "audit_gradients": "accuracy",
    "audit_due": "accuracy",
    "GradientAudit": "accuracy",
    "probe_gradients": "accuracy",
    "GradientProbe": "accuracy",
    "IterationTuner": "accuracy",
    "Tuning": "accuracy",
    "SolveStats": "stats",
    "MGRITResult": "mgrit",
    "check_launch": "launch",
    "abort_on_exception": "launch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        where = f"layerbraid.{_MOVED[name]}"
        warnings.warn(
            f"layerbraid.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'layerbraid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
