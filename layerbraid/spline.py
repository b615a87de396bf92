"""Spline-parameterized step weights (SpliNet: Günther, Pazner, Qi, 2021): the weights of the
step at time ``t`` are a B-spline combination of ``nsplines`` coefficient sets,
``theta(t) = sum_k B_k(t) c_k``, so the network's parameters do not depend on its depth.

A :class:`SplineModule` is a :class:`LayerParallelModule` whose trainable step parameters are
the coefficient sets (``model.coefficients``, every set on every rank of the layer group: their
number does not grow with the depth).  Each forward first evaluates the weights of the steps
this rank owns from them; the steps then run as any layer-parallel network's (the MGRIT
solves, the copies coarse levels inject), and the adjoint's gradients of those weights go back
to the coefficients through the basis (``dc_k = sum_i B_k(t_i) dtheta_i`` over the owned
steps), summed over the layer group once, in one message, so that every rank holds the whole
gradient and its optimizer keeps the replicas equal (Note [spline gradients]).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ._engine.ownership import seeded_layer
from .module import LayerParallelModule

__all__ = ["SplineModule", "bspline_basis"]

_COEFFICIENT_SEED = 7919  # seeds coefficient set k apart from step layer k


def bspline_basis(nsplines: int, degree: int, times: np.ndarray, t_final: float) -> np.ndarray:
    """``B[i, k]``: B-spline ``k`` of ``degree`` at ``times[i]``, for ``nsplines`` splines on
    the clamped uniform knot vector of ``[0, t_final]`` (``nsplines - degree + 1`` distinct
    knots; the ends repeated ``degree + 1`` times).  Cox-de Boor, in float64; every row sums
    to 1 on ``[0, t_final)``."""
    if degree < 0 or nsplines < degree + 1:
        raise ValueError(
            f"nsplines must be at least degree + 1 = {degree + 1} for degree {degree}, "
            f"got nsplines={nsplines}"
        )
    inner = np.linspace(0.0, t_final, nsplines - degree + 1)
    knots = np.concatenate([[0.0] * degree, inner, [t_final] * degree])
    t = np.asarray(times, dtype=np.float64)[:, None]
    # degree 0: the indicator of each knot span [knots[k], knots[k + 1])
    basis = ((knots[:-1] <= t) & (t < knots[1:])).astype(np.float64)
    for d in range(1, degree + 1):
        out = np.zeros((len(t), len(knots) - d - 1))
        for k in range(out.shape[1]):
            left, right = knots[k + d] - knots[k], knots[k + d + 1] - knots[k + 1]
            if left > 0:
                out[:, k] += (t[:, 0] - knots[k]) / left * basis[:, k]
            if right > 0:
                out[:, k] += (knots[k + d + 1] - t[:, 0]) / right * basis[:, k + 1]
        basis = out
    return basis


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

    ``model.coefficients`` (an ``nn.ModuleList``) holds the trainable step parameters; the step
    layers' own parameters (``model.layers``) hold the evaluated weights, refreshed at every
    forward, and never get a gradient (an optimizer over ``model.parameters()`` skips them).
    ``to_serial()`` returns the plain network of the evaluated weights; changing the depth
    (``layerbraid.depth.refine``, nested iteration) keeps the coefficients.  Under data
    parallelism (a ``ProcessGrid`` with several data groups) it is not supported yet.
    """

    _SERIAL_SKIP = ("coefficients.",)

    def __init__(
        self,
        num_steps: int,
        t_final: float = 1.0,
        comm: Any = None,
        *,
        nsplines: int,
        degree: int = 1,
        **kwargs: Any,
    ):
        if not isinstance(degree, int) or not 1 <= degree <= 3:
            raise ValueError(f"degree must be 1, 2 or 3, got {degree!r}")
        if not isinstance(nsplines, int) or nsplines < degree + 1:
            raise ValueError(
                f"nsplines must be an int >= degree + 1 = {degree + 1}, got {nsplines!r}"
            )
        super().__init__(num_steps, t_final, comm, **kwargs)
        grid = self._grid
        if grid is not None and grid.data_size > 1:
            raise ValueError(
                "SplineModule under data parallelism (a ProcessGrid with "
                f"{grid.data_size} data groups) is not supported: use one data group"
            )
        self.nsplines, self.degree = nsplines, degree
        self.coefficients = nn.ModuleList()

    def coefficient_layer(self, index: int) -> nn.Module:
        """The module ``f`` holding coefficient set ``index``."""
        raise NotImplementedError(f"{type(self).__name__} must define coefficient_layer(index)")

    def step_layer(self, index: int) -> nn.Module:
        """A module of ``f``'s structure; its parameters are overwritten at every forward."""
        return self.coefficient_layer(0)

    # ------------------------------------------------------------------ construction
    def _build_steps(self):
        seed = self._coefficient_seed()
        for k in range(self.nsplines):
            self.coefficients.append(seeded_layer(self.coefficient_layer, k, seed))
        ref = next(self._ref_tensors(), None)
        if ref is not None:
            self.coefficients.to(ref.device)
        super()._build_steps()
        basis = bspline_basis(
            self.nsplines, self.degree, np.arange(self.num_steps) * self.dt, self.t_final
        )
        # {owned step: [(coefficient set, weight)]}: the sets whose support holds its time
        self._weights = {
            i: [(k, float(basis[i, k])) for k in range(self.nsplines) if basis[i, k] != 0.0]
            for i in self._chain.owned
        }
        names = [n for n, _ in self.coefficients[0].named_parameters()]
        for k, c in enumerate(self.coefficients):
            if [n for n, _ in c.named_parameters()] != names:
                raise ValueError(
                    f"coefficient_layer({k}) has other parameters than coefficient_layer(0): "
                    "every coefficient set must have the same"
                )
        for i, _ in self.owned_steps():
            if [n for n, _ in self.layers[str(i)].named_parameters()] != names:
                raise ValueError(
                    "step_layer must build coefficient_layer's parameters (override neither "
                    "or both)"
                )

    def _coefficient_seed(self) -> int:
        # one draw from torch's generator, as the step layers' seed: the same on every rank
        return int(torch.randint(0, 2**62, ()).item()) ^ _COEFFICIENT_SEED

    # ------------------------------------------------------------------ forward
    def refresh_steps(self) -> None:
        """Evaluates the owned steps' weights from the coefficients (every forward does)."""
        sets = [list(c.parameters()) for c in self.coefficients]
        with torch.no_grad():
            for i, layer in self.owned_steps():
                for q, p in enumerate(layer.parameters()):
                    value = sum(w * sets[k][q] for k, w in self._weights[i])
                    p.copy_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # before the forward's exchange of the weights that coarse steps inject
        self.refresh_steps()
        return super().forward(x)

    def to_serial(self) -> nn.Module:
        self.refresh_steps()
        return super().to_serial()

    def _serial_path(self) -> bool:
        return False  # the coefficients' gradients come through the chain's inputs

    def _step_inputs(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        coefficients = [p for c in self.coefficients for p in c.parameters()]
        return list(_SplineFn.apply(self, len(params), *coefficients))


# Note [spline gradients]: the chain's autograd Function takes, as the inputs its parameter
# gradients are returned for, the outputs of _SplineFn (one per owned step parameter, the
# evaluated weights), whose inputs are the coefficients.  So autograd hands _SplineFn.backward
# the gradients of the evaluated weights; it maps them onto the coefficients through the basis
# (each set's gradient sums its owned steps' gradients times their basis weights) and sums
# every set over the layer group in one message (every rank reaches it: every rank's chain
# backward runs, Note [every rank runs backward]).  Every rank thus gets the whole gradient of
# every set, and identical optimizer steps keep the replicas identical.
class _SplineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: SplineModule, count: int, *coefficients: torch.Tensor):
        ctx.module, ctx.shapes = module, [p.shape for p in coefficients]
        outs = [p.detach() for _, layer in module.owned_steps() for p in layer.parameters()]
        if len(outs) != count:
            raise RuntimeError(
                f"the spline steps have {len(outs)} parameters, the chain {count}: every "
                "parameter of a spline step must require a gradient"
            )
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        module = ctx.module
        per_set = len(ctx.shapes) // module.nsplines
        sums: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        n = 0
        for i, layer in module.owned_steps():
            params = list(layer.parameters())
            for q, g in enumerate(grads[n : n + len(params)]):
                if g is None:
                    continue
                for k, w in module._weights[i]:
                    at = k * per_set + q
                    sums[at] = w * g if sums[at] is None else sums[at] + w * g
            n += len(params)
        coefficients = [p for c in module.coefficients for p in c.parameters()]
        local = [s if s is not None else torch.zeros_like(p) for s, p in zip(sums, coefficients)]
        if module.comm.Get_size() > 1:
            local = module.comm.allreduce_sum(local, "the spline coefficients' gradients")
        return (None, None, *local)
