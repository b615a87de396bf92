"""SolveStats: what one MGRIT solve of a layer-parallel model did, and how accurate it is."""
import math
from dataclasses import dataclass, field
from typing import List, Optional

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
        error_estimate: the estimated relative error of the solution's states (the output of a
            forward solve, the input gradient of an adjoint one): Note [error estimate].  0.0
            for one level (exact to round-off).
        seconds: the whole solve; step_seconds: inside the steps (layers or VJPs);
        comm_seconds: in the core's MPI calls, waiting for other ranks included.  The rest is
            the MGRIT bookkeeping (vector sums, norms, packing).
    """

    iterations: int = 0
    residual_norms: List[float] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: float = 0.0
    comm_seconds: float = 0.0
    final_residual: Optional[float] = None
    state_norm: Optional[float] = None
    contraction: Optional[float] = None
    error_estimate: Optional[float] = None


def error_estimate(residual_sum, state_norm, num_c_points):
    """Note [error estimate]: the error e of the C-point values solves the chain's own
    recurrence driven by the residuals, e_c = Phi^m(e_{c-m}) + r_c with e_0 = 0, so the error
    at the last point is the residuals propagated to it and summed (but the last point's own:
    the final C-relaxation removes it, and nothing comes after).  For steps that neither
    amplify nor damp much that is the vector sum of the residuals, whose norm the core bounds
    by ``residual_sum`` (each rank's vector sum, their norms added).  Relative to the states'
    RMS, ``state_norm / sqrt(C-points)``, that gives the estimate
    ``sqrt(C-points) * residual_sum / state_norm`` of the last state's relative error (the
    forward's output, the adjoint's input gradient).  It follows the residuals' alignment: a
    smooth error, all residuals one way, grows with the C-points; residuals of random direction
    only with their square root.  Measured against serial in float64 (tests/test_accuracy.py,
    docs/accuracy.md) it is within a factor 2.5 of the true relative error, mostly above it; a
    chain that amplifies errors strongly can exceed it."""
    if residual_sum is None or not state_norm:
        return None
    return math.sqrt(max(num_c_points, 1)) * residual_sum / state_norm


def contraction(norms):
    """The mean reduction factor per iteration of a residual history (the geometric mean of the
    ratios: a last ratio alone is noise once the residual reaches round-off); None with fewer
    than two values."""
    if len(norms) < 2 or not norms[0] or norms[-1] < 0:
        return None
    return (norms[-1] / norms[0]) ** (1.0 / (len(norms) - 1))
