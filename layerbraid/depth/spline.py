"""Spline-parameterized step weights (SpliNet: Günther, Pazner, Qi, 2021): the weights of the
step at time ``t`` are a B-spline combination of ``nsplines`` coefficient sets,
``theta(t) = sum_k B_k(t) c_k``, so the network's parameters do not depend on its depth.

A :class:`SplineModule` is a :class:`LayerParallelModule` whose trainable step parameters are
the coefficient sets (``model.coefficients``; a rank stores the few sets whose splines are
nonzero at its steps' times): its parameterization is :class:`SplineWeights`, the linear step
weights (:class:`layerbraid.LinearStepWeights`) whose matrix is the basis.  Each forward
first evaluates the weights of the steps this rank owns; the steps then run as any
layer-parallel network's (the MGRIT solves, the copies coarse levels inject), and the
adjoint's gradients of those weights go back to the coefficients through the basis
(``dc_k = sum_i B_k(t_i) dtheta_i`` over the owned steps), summed over the ranks that store
each set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import nn

from ..module import LayerParallelModule
from ..parameterization import LinearStepWeights, ParameterizedModel

__all__ = ["SplineModule", "SplineWeights", "bspline_basis"]


KNOTS = ("clamped", "uniform")


def bspline_basis(
    nsplines: int, degree: int, times: np.ndarray, t_final: float, knots: str = "clamped"
) -> np.ndarray:
    """``B[i, k]``: B-spline ``k`` of ``degree`` at ``times[i]``, for ``nsplines`` splines
    whose ``nsplines - degree + 1`` knots in ``[0, t_final]`` are evenly spaced, ``h`` apart.
    ``knots``: ``"clamped"`` (the ends repeated ``degree + 1`` times: the first and last
    splines are 1 at the ends) or ``"uniform"`` (the knots go on ``h`` apart beyond both ends,
    ``degree`` more on each side: every spline is the same shape, shifted, as TorchBraid's
    SpliNet takes them).  Cox-de Boor, in float64; every row sums to 1 on ``[0, t_final)``."""
    if degree < 0 or nsplines < degree + 1:
        raise ValueError(
            f"nsplines must be at least degree + 1 = {degree + 1} for degree {degree}, "
            f"got nsplines={nsplines}"
        )
    if knots not in KNOTS:
        raise ValueError(f"knots must be one of {KNOTS}, got {knots!r}")
    inner = np.linspace(0.0, t_final, nsplines - degree + 1)
    if knots == "uniform":
        h = t_final / (nsplines - degree)
        ends = (h * np.arange(-degree, 0), t_final + h * np.arange(1, degree + 1))
    else:
        ends = (np.zeros(degree), np.full(degree, t_final))
    knots_at = np.concatenate([ends[0], inner, ends[1]])
    t = np.asarray(times, dtype=np.float64)[:, None]
    # degree 0: the indicator of each knot span [knots_at[k], knots_at[k + 1])
    basis = ((knots_at[:-1] <= t) & (t < knots_at[1:])).astype(np.float64)
    for d in range(1, degree + 1):
        out = np.zeros((len(t), len(knots_at) - d - 1))
        for k in range(out.shape[1]):
            left, right = knots_at[k + d] - knots_at[k], knots_at[k + d + 1] - knots_at[k + 1]
            if left > 0:
                out[:, k] += (t[:, 0] - knots_at[k]) / left * basis[:, k]
            if right > 0:
                out[:, k] += (knots_at[k + d + 1] - t[:, 0]) / right * basis[:, k + 1]
        basis = out
    return basis


class SplineWeights(LinearStepWeights):
    """Step ``i``'s weights ``sum_k B_k(t_i) c_k`` for B-splines ``B_k`` of ``degree`` over
    ``[0, T]`` (:func:`bspline_basis`) and ``nsplines`` coefficient sets ``factory(k)``."""

    def __init__(
        self,
        nsplines: int,
        degree: int,
        factory: Callable[[int], nn.Module],
        knots: str = "clamped",
    ) -> None:
        if knots not in KNOTS:
            raise ValueError(f"knots must be one of {KNOTS}, got {knots!r}")
        if not isinstance(degree, int) or not 1 <= degree <= 3:
            raise ValueError(f"degree must be 1, 2 or 3, got {degree!r}")
        if not isinstance(nsplines, int) or nsplines < degree + 1:
            raise ValueError(
                f"nsplines must be an int >= degree + 1 = {degree + 1}, got {nsplines!r}"
            )
        super().__init__(nsplines, factory)
        self.degree, self.knots = degree, knots
        self._basis: np.ndarray | None = None

    def weights(self, model: ParameterizedModel, index: int) -> list[tuple[int, float]]:
        if self._basis is None:
            times = np.arange(model.num_steps) * model.dt
            self._basis = bspline_basis(self.sets, self.degree, times, model.t_final, self.knots)
        row = self._basis[index]
        return [(k, float(row[k])) for k in range(self.sets) if row[k] != 0.0]


class SplineModule(LayerParallelModule):
    """A layer-parallel network whose step weights are B-splines in time.

    Subclass it as a :class:`LayerParallelModule`, but define ``coefficient_layer(k)``
    instead of ``step_layer``: the module ``f`` whose parameters are coefficient set ``k``
    (``0 <= k < nsplines``; every set must have the same parameters).  Step ``i`` runs ``f``
    with the parameters ``sum_k B_k(t_i) c_k`` at its time ``t_i = i * dt`` (buffers, e.g. a
    batch norm's statistics, stay the step's own).

    Args:
        num_steps, t_final, comm, and the keyword arguments: as :class:`LayerParallelModule`.
        nsplines: the number of coefficient sets (at least ``degree + 1``).
        degree: the splines' degree, 1 (piecewise linear) to 3 (cubic).
        knots: ``"clamped"`` (default) or ``"uniform"``, TorchBraid's SpliNet's
            (:func:`bspline_basis`); the two agree at degree 1.

    ``model.coefficients`` (an ``nn.ModuleDict`` keyed by ``str(k)``) holds the trainable step
    parameters this rank stores: the sets whose splines are nonzero at its steps' times
    (``model.parameterization.stored(model)``, ``stored_bytes(model)``; ``all_sets(model)``
    gathers every set); the step layers' own parameters (``model.layers``) hold the evaluated
    weights, refreshed at every forward, and never get a gradient (an optimizer over
    ``model.parameters()`` skips them).
    ``to_serial()`` returns the plain network of the evaluated weights; changing the depth
    (``layerbraid.depth.refine``, nested iteration) keeps the coefficients.  Under data
    parallelism (a ``ProcessGrid`` with several data groups) it is not supported yet.
    """

    def __init__(
        self,
        num_steps: int,
        t_final: float = 1.0,
        comm: Any = None,
        *,
        nsplines: int,
        degree: int = 1,
        knots: str = "clamped",
        **kwargs: Any,
    ) -> None:
        weights = SplineWeights(nsplines, degree, self._coefficient_layer, knots)
        super().__init__(num_steps, t_final, comm, parameterization=weights, **kwargs)
        self.nsplines, self.degree, self.knots = nsplines, degree, knots

    def _coefficient_layer(self, index: int) -> nn.Module:
        return self.coefficient_layer(index)  # looked up when called: the subclass's

    def coefficient_layer(self, index: int) -> nn.Module:
        """The module ``f`` holding coefficient set ``index``."""
        raise NotImplementedError(f"{type(self).__name__} must define coefficient_layer(index)")

    def step_layer(self, index: int) -> nn.Module:
        """A module of ``f``'s structure; its parameters are overwritten at every forward."""
        return self.coefficient_layer(0)

    def refresh_steps(self) -> None:
        """Evaluates the owned steps' weights from the coefficients (every forward does)."""
        self.parameterization.refresh(self)
