"""The accuracy tools' interface (``LayerParallelPart``) for a part whose solves are one engine
chain, ``self._chain``: its solve statistics, gradient-error estimates, calibration, probes and
schedule traces.  Mixed into ``LayerParallelModule``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..stats import SolveStats
from .chain import _Chain, _gradient_estimate
from .parts import LayerParallelPart

__all__ = ["OneChainPart"]


class OneChainPart(LayerParallelPart):
    """A part solved by one chain (the subclass sets ``_chain`` when it builds)."""

    _chain: _Chain
    _grid: Any

    def mgrit_levels(self) -> tuple[int, int]:
        """``(forward, adjoint)``: the MGRIT levels that formed, which can be fewer than the
        options ask for (few steps, large cfactors: a warning says so); 1 is exact."""
        return self._chain.fwd.num_levels(), self._chain.bwd.num_levels()

    @property
    def forward_stats(self) -> SolveStats:
        """The last forward solve's SolveStats on this rank."""
        return self._chain.forward_stats

    @property
    def backward_stats(self) -> SolveStats:
        """The last adjoint solve's SolveStats on this rank."""
        return self._chain.backward_stats

    def gradient_error_estimate(self) -> float | None:
        """An estimate of the last backward's relative parameter-gradient error:
        ``backward_stats.error_estimate + 5 * forward_stats.error_estimate`` (the forward's
        error also enters the adjoint, through the states it is linearized at; its weight is the
        ratio of the two solves' shares of ``target_error``, Note [adaptive iterations]).  0.0
        for exact solves, None before a backward.  The same on every rank and for any rank
        count.  Calibrated by the audits run so far (``layerbraid.accuracy.audit_gradients``, Note
        [calibrated estimate]); before the first audit it is the residuals' raw estimate,
        which on trained networks can be off by orders of magnitude."""
        return _gradient_estimate(self.forward_stats, self.backward_stats, "error_estimate")

    def _raw_gradient_error_estimate(self) -> float | None:
        return _gradient_estimate(self.forward_stats, self.backward_stats, "raw_error_estimate")

    def _save_stats(self) -> Any:
        return None  # the stats live on the chain, which an audit's exact solves leave alone

    def _restore_stats(self, saved: Any) -> None:
        pass

    def _set_calibration(self, k: float) -> None:
        self._chain.calibration = k

    def _solved(self, counts: Sequence[Any]) -> Any:
        probe = self._chain._probes[tuple(counts[:2])]
        return probe.forward_stats, probe.backward_stats, probe._warm_fwd, probe._warm_bwd

    def _adopt(self, solved: Any, calibrate: Any) -> None:
        chain = self._chain
        k = chain.calibration
        chain.forward_stats, chain.backward_stats = (calibrate(s, k) for s in solved[:2])
        if chain.warm_start:
            chain._warm_fwd, chain._warm_bwd = solved[2], solved[3]

    def _process_grid(self) -> Any:
        return self._grid

    def set_trace(self, on: bool = True) -> None:
        """Record the schedule of the following forward and adjoint solves (see ``trace``)."""
        self._chain.fwd.set_trace(on)
        self._chain.bwd.set_trace(on)
        self._tracing = bool(on)  # a trace needs the core (Note [serial path])

    def trace(self) -> Any:
        """``(forward, adjoint)``: the schedule this rank ran in the last solves, as lists of
        TraceEntry (level, op, index, peer, done), after ``set_trace(True)``."""
        return self._chain.fwd.trace(), self._chain.bwd.trace()
