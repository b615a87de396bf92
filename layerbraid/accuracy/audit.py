"""Gradient audits: the true error of a layer-parallel gradient, measured in training.

Note [calibrated estimate]: a gradient's error estimate from the residuals (Note [error
estimate], stats.py) assumes steps that neither amplify nor damp errors, and measures the error
of the last state only; on trained networks it was seen off by up to a few hundred times either
way.  An audit computes the exact gradient for the same batch and weights (one-level solves:
sequential stepping across the ranks) and the true relative error of the approximate one.  The
ratio ``true / raw estimate`` changes slowly as a network trains, so the model keeps the
geometric mean of the last ``history`` audits' ratios as its calibration ``k``: from then on
every solve's ``SolveStats.error_estimate`` is ``k`` times its raw estimate, and adaptive
iterations (``target_error``) aim with the calibrated number.  Audits that measure an error at
round-off (at most 10 machine epsilons of the gradients' dtype) leave the calibration as it is:
converged float32 solves were measured at relative gradient errors up to about 2 epsilons,
while the ratio of errors a few times above that was as steady as at larger ones.

Note [audit schedule]: the ratio moves most in the first batches of training, as the weights
leave their initialization (a network at its initialization has nearly identity steps, which
the raw estimate assumes), and slowly afterwards.  So ``audit_due`` audits the batches 0, 1, 2,
4, 8, ... below ``every`` (a handful of extra audits, once), then every ``every``-th batch: the
calibration follows the network out of its initialization instead of keeping the first audit's
ratio for ``every`` batches.
"""

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .._engine.parts import (
    ExactSolve,
    counted_parameters,
)
from ..stats import sum_or_none
from ._solves import _gradients_with, _parts, _switch_modes

__all__ = ["GradientAudit", "ROUNDOFF_EPSILONS", "audit_due", "audit_gradients"]


ROUNDOFF_EPSILONS = 10  # an audit's error at or below this many epsilons is round-off


@dataclass
class GradientAudit:
    """What one audit measured (the same on every rank of the layer group).

    Attributes:
        error: the true relative 2-norm error of all parameter gradients, as the backward left
            them, against the exact gradients of the same batch and weights.
        estimate: ``gradient_error_estimate`` for those gradients (calibrated by the earlier
            audits), summed over the model's layer-parallel parts; None if a part had none.
        raw_estimate: the same from the residuals alone.
        calibration: the calibration in force after this audit (Note [calibrated estimate]).
        calibrated: whether ``estimate`` was calibrated by earlier audits (the first audit
            sees the raw estimate).
        seconds: the audit's time: an exact forward and backward of the batch, about what
            plain PyTorch takes for them, plus the gradient comparison.
    """

    error: float
    estimate: Optional[float]
    raw_estimate: Optional[float]
    calibration: float
    calibrated: bool
    seconds: float

    @property
    def ratio(self) -> Optional[float]:
        """``estimate / error`` (1 is a perfect estimate); None where either is missing or 0."""
        if not self.estimate or not self.error:
            return None
        return self.estimate / self.error


def audit_due(batch: int, every: int) -> bool:
    """Whether training batch ``batch`` (counted from 0 over the whole run, not per epoch)
    is one to audit when auditing every ``every`` batches: the batches 0, 1, 2, 4, 8, ...
    below ``every``, then every ``every``-th (Note [audit schedule]).  ``every`` 0 audits none.
    """
    for name, v in (("batch", batch), ("every", every)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if every == 0:
        return False
    return batch % every == 0 or (batch < every and batch & (batch - 1) == 0)


def audit_gradients(
    model: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    history: int = 3,
    calibrate: bool = True,
) -> GradientAudit:
    """Measures the true error of the gradients the last backward left, and calibrates the
    model's error estimate with it (Note [calibrated estimate]).

    Call it after ``loss.backward()`` and before ``optimizer.step()``, with a ``closure`` that
    computes the same batch's loss again (``lambda: F.cross_entropy(model(x), y)``), on every
    rank of the layer group (collective).  The closure runs once with every layer-parallel
    part of ``model`` solving exactly, and its backward gives the exact gradients; then the
    gradients, the buffers (batch-norm statistics) and the solve statistics are put back as they
    were: training goes on as if no audit had run.  It costs one exact forward and backward of
    the batch (``GradientAudit.seconds``).

    The comparison assumes the gradients hold this batch's alone (``zero_grad()`` before its
    forward) and that the closure's forward repeats the batch's: layers that draw random numbers
    (dropout) draw new ones, and their noise then counts as error.

    Args:
        model: an ``nn.Module`` that is, or contains, layer-parallel modules.
        closure: computes the batch's loss from ``model`` (no backward, no optimizer step).
        history: how many of the latest audits the calibration averages.
        calibrate: False measures only, leaving the calibration as it is.

    Returns:
        A :class:`GradientAudit`, the same on every rank.
    """
    if not isinstance(history, int) or isinstance(history, bool) or history < 1:
        raise ValueError(f"history must be an int >= 1, got {history!r}")
    if not isinstance(calibrate, bool):
        raise ValueError(f"calibrate must be True or False, got {calibrate!r}")
    parts = _parts(model, "audit_gradients")
    comm, counted = counted_parameters(model)
    t0 = time.perf_counter()
    raw = sum_or_none(p._raw_gradient_error_estimate() for p in parts)
    estimate = sum_or_none(p.gradient_error_estimate() for p in parts)

    kept: list = []

    def exactly(on) -> None:
        _switch_modes(parts, [ExactSolve()] * len(parts) if on else None, kept)

    exact = _gradients_with(model, parts, closure, exactly)
    num, den, eps = _difference(counted, exact)
    if comm is not None and comm.Get_size() > 1:
        num, den = comm.allreduce_floats([num, den], "sum", "a gradient audit")
        (eps,) = comm.allreduce_floats([eps], "max", "a gradient audit")
    # the same on every rank, bit for bit: each rank's adaptive stopping rule uses it
    error = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    calibrated = bool(parts[0].audit_ratios)
    if calibrate:
        calibration = _calibrate(parts, error, raw, eps, history)
    else:
        calibration = _calibration(parts[0].audit_ratios)
    return GradientAudit(error, estimate, raw, calibration, calibrated, time.perf_counter() - t0)


def _difference(counted, other):
    """(sum |g - other|^2, sum |other|^2, the largest machine epsilon of their dtypes) over
    this rank's counted parameters."""
    num = den = eps = 0.0
    with torch.no_grad():
        for p in counted:
            g, ref = p.grad, other[id(p)]
            if ref is None and g is None:
                continue
            if ref is None:
                ref = torch.zeros_like(g)
            diff = ref if g is None else g - ref
            num += float(diff.double().pow(2).sum())
            den += float(ref.double().pow(2).sum())
            eps = max(eps, torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0)
    return num, den, eps


def _calibration(ratios):
    """The geometric mean of the ratios, 1 without any."""
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0


def _calibrate(parts, error, raw, eps, history):
    """Adds this audit's ratio to the parts' history and sets their calibration (Note
    [calibrated estimate]); returns it."""
    ratios = parts[0].audit_ratios
    if raw and math.isfinite(error) and error > ROUNDOFF_EPSILONS * eps:
        ratios.append(error / raw)
        del ratios[:-history]
    calibration = _calibration(ratios)
    for part in parts:
        part.audit_ratios[:] = ratios
        part._set_calibration(calibration)
    return calibration
