"""layerbraid: layer-parallel multigrid (MGRIT) training for PyTorch."""

from .errors import DivergenceError, MGRITError, RemoteRankError, StallError
from .launch import abort_on_exception, check_launch, set_timeout
from .mgrit import MGRIT, MGRITResult
from .options import MGRITOptions

__all__ = [
    "MGRIT",
    "MGRITResult",
    "MGRITOptions",
    "LayerParallelModule",
    "SolveStats",
    "SpatialCoarsening",
    "ProcessGrid",
    "MGRITError",
    "RemoteRankError",
    "DivergenceError",
    "StallError",
    "set_timeout",
    "clip_grad_norm_",
    "check_launch",
    "abort_on_exception",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "audit_gradients",
    "audit_due",
    "GradientAudit",
    "probe_gradients",
    "GradientProbe",
    "IterationTuner",
    "Tuning",
]
__version__ = "0.1.0"

# The names that need torch load on first use, so that the general solver works (and imports
# fast) without it.
_LAZY = {
    "LayerParallelModule": "module",
    "SolveStats": "stats",
    "ProcessGrid": "grid",
    "SpatialCoarsening": "coarsening",
    "clip_grad_norm_": "clip",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "audit_gradients": "accuracy",
    "audit_due": "accuracy",
    "GradientAudit": "accuracy",
    "probe_gradients": "accuracy",
    "GradientProbe": "accuracy",
    "IterationTuner": "accuracy",
    "Tuning": "accuracy",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'layerbraid' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
