"""SolveStats: what one MGRIT solve of a layer-parallel model did."""
from dataclasses import dataclass, field
from typing import List

__all__ = ["SolveStats"]


@dataclass
class SolveStats:
    """One MGRIT solve (forward or adjoint) on this rank.

    Attributes:
        iterations, residual_norms: as XBraid counts and prints them.
        seconds: the whole solve; step_seconds: inside the steps (layers or VJPs);
        comm_seconds: in the core's MPI calls, waiting for other ranks included.  The rest is
        the MGRIT bookkeeping (vector sums, norms, packing).
    """

    iterations: int = 0
    residual_norms: List[float] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: float = 0.0
    comm_seconds: float = 0.0
