"""SolveStats: what one MGRIT solve of a layer-parallel model did, and how accurate it is."""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["SolveStats"]


@dataclass
class SolveStats:
    """One MGRIT solve (forward or adjoint) on this rank.

    Attributes:
        iterations, residual_norms: as XBraid counts and prints them (no residual is measured
            in a skipped first down-cycle).
        final_residual: the residual of the returned solution, measured by the final
            C-relaxation (what it changed at the fine C-points); None with one level.
        state_norm: the 2-norm of the states at those C-points.
        contraction: the residual's mean reduction per iteration over ``residual_norms +
            [final_residual]``; None with fewer than two.
        raw_error_estimate: the estimated relative error of the solution's states (the output
            of a forward solve, the input gradient of an adjoint one) from the residuals alone:
            Note [error estimate].  0.0 for one level (exact to round-off).
        error_estimate: ``raw_error_estimate`` times the model's calibration, the ratio of the
            true gradient error to the raw estimate measured by the last audits (Note
            [calibrated estimate] in accuracy/audit.py); equal to the raw estimate before any audit.
        target: with adaptive iterations, the solve's share of ``target_error`` (else None);
            ``target_met`` says whether the estimate reached it.
        seconds: the whole solve; step_seconds: inside the steps (layers or VJPs);
        comm_seconds: in the core's MPI calls, waiting for other ranks included.  The rest is
            the MGRIT bookkeeping (vector sums, norms, packing).
    """

    iterations: int = 0
    residual_norms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: float = 0.0
    comm_seconds: float = 0.0
    final_residual: Optional[float] = None
    state_norm: Optional[float] = None
    contraction: Optional[float] = None
    error_estimate: Optional[float] = None
    raw_error_estimate: Optional[float] = None
    target: Optional[float] = None

    @property
    def target_met(self) -> Optional[bool]:
        """With adaptive iterations (``target_error``): whether the solve's estimate met its
        share of the target within ``max_iters``; None without a target."""
        if self.target is None or self.error_estimate is None:
            return None
        return self.error_estimate <= self.target


def error_estimate(
    residual_sum: Optional[float], state_norm: Optional[float], num_c_points: int
) -> Optional[float]:
    """Note [error estimate]: the error e of the C-point values solves the chain's own
    recurrence driven by the residuals, e_c = Phi^m(e_{c-m}) + r_c with e_0 = 0, so the error
    at the last point is the residuals propagated to it and summed (but the last point's own:
    the final C-relaxation removes it, and nothing comes after).  For steps that neither
    amplify nor damp much that is the vector sum of the residuals, whose norm is at most
    ``residual_sum``, the sum of their norms (computed by the core over all ranks, so that
    the estimate does not depend on the rank count).  Relative to the states' RMS,
    ``state_norm / sqrt(C-points)``, that gives the estimate
    ``sqrt(C-points) * residual_sum / state_norm`` of the last state's relative error (the
    forward's output, the adjoint's input gradient).

    It is exact in its assumption only: a trained network's steps amplify or damp errors, and
    the parameter gradients depend on the adjoint at every step, not only at the last.  On a
    near-identity chain at initialization it bounds the true error from above, within the
    factor tests/tolerances.py sets; in training it was seen off by up to a few hundred times either
    way, which is why the estimate users see is calibrated against audits (Note [calibrated
    estimate])."""
    if residual_sum is None or not state_norm:
        return None
    return math.sqrt(max(num_c_points, 1)) * residual_sum / state_norm


def contraction(norms: Sequence[float]) -> Optional[float]:
    """The mean reduction factor per iteration of a residual history (the geometric mean of the
    ratios: a last ratio alone is noise once the residual reaches round-off); None with fewer
    than two values."""
    if len(norms) < 2 or not norms[0] or norms[-1] < 0:
        return None
    return (norms[-1] / norms[0]) ** (1.0 / (len(norms) - 1))


def sum_or_none(values: Iterable[Optional[float]]) -> Optional[float]:
    """The sum of ``values``, or None where any is None (an estimate some part lacks)."""
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total
