"""Spatial coarsening on coarse MGRIT levels: coarse in time *and* in space.

On the MGRIT levels you choose, the step layers run on a grid of half the size (in every spatial
dimension) of the level above's, with the same weights: the coarse propagators, which dominate a
cycle's cost, get cheaper by up to 4x in 2D and 8x in 3D per coarsened level.

Two modes:
- ``mode="branch"`` (default): the states stay on the fine grid on every level; a coarse step
  computes its increment on the level's grid: ``x + P^k (Phi(R^k x) - R^k x)`` (for the Euler
  rule ``x + dt P^k f(R^k x)``), where ``R^k``/``P^k`` restrict the fine state to the level's
  grid and interpolate back.  Fine-scale content the coarse grid cannot hold is carried by the
  step's identity part instead of being dropped, so the coarse propagator stays close to the
  fine one.  Storage and messages are those of the fine grid.  On random networks it
  approximates as well after 1-2 iterations as MGRIT without spatial coarsening
  (docs/bench_spatial.md).
- ``mode="state"``: the coarse levels' *states* live on the coarse grid: states and FAS
  right-hand sides are restricted on the way down (the C core's coarsen callback), corrections
  interpolated on the way up (refine).  Storage, messages and every vector operation shrink too,
  but the coarse correction only carries what the half-size grid can represent: where states are
  dominated by fine-scale content (random inputs, random weights) the coarse levels correct
  little of the error, and FCF's exactness of two intervals per iteration is lost (P R is not
  the identity), so few-iteration solves are far off (~100% output error in the benchmark).

Transfers (d = number of spatial dimensions):
- interpolate "linear": (bi/tri)linear interpolation P (``F.interpolate``, align_corners=False);
  "nearest": piecewise constant.
- restrict "full-weighting" (default): R = 2^-d P^T, so that ``<R x, y> = 2^-d <x, P y>`` exactly
  (the tests check this); "average": 2^d-point averaging; "inject": every other point.
- any callable ``f(x, level)`` for either.
The adjoint (backward) solve uses the transposes: in mode "state", P^T to restrict gradients and
R^T to interpolate their corrections (by autograd, so that user functions work too); in mode
"branch", the transpose of the coarse step (see :meth:`SpatialCoarsening.branch_adjoint`).
"""

from collections.abc import Iterable, Sequence
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["SpatialCoarsening"]

_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


class SpatialCoarsening:
    """Which MGRIT levels are coarse in space, and how states move between grids.

    Args:
        levels: MGRIT levels (>= 1) whose grid is half the size of the level above's.
        restrict: "full-weighting", "average", "inject", or ``f(x, level) -> coarse x``
            (x on level's grid, result on level+1's).
        interpolate: "linear", "nearest", or ``f(e, level) -> fine e`` (e on level's grid,
            result on level-1's).
        mode: "branch" (default: states stay fine; the step's increment is computed on the
            coarse grid) or "state" (coarse levels store coarse states); see the module's
            docstring.
    """

    def __init__(
        self,
        levels: Iterable[int],
        restrict: Union[str, Callable] = "full-weighting",
        interpolate: Union[str, Callable] = "linear",
        mode: str = "branch",
    ) -> None:
        levels = tuple(sorted(set(levels)))
        if not levels or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in levels
        ):
            raise ValueError(f"SpatialCoarsening levels must be MGRIT levels >= 1, got {levels!r}")
        if not callable(restrict) and restrict not in ("full-weighting", "average", "inject"):
            raise ValueError(
                f"restrict must be 'full-weighting', 'average', 'inject' or a "
                f"function, got {restrict!r}"
            )
        if not callable(interpolate) and interpolate not in ("linear", "nearest"):
            raise ValueError(
                f"interpolate must be 'linear', 'nearest' or a function, got {interpolate!r}"
            )
        if mode not in ("state", "branch"):
            raise ValueError(f"mode must be 'state' or 'branch', got {mode!r}")
        self.levels = levels
        self.mode = mode
        self._restrict, self._interpolate = restrict, interpolate

    def __repr__(self) -> str:
        return (
            f"SpatialCoarsening(levels={self.levels}, restrict={self._restrict!r}, "
            f"interpolate={self._interpolate!r}, mode={self.mode!r})"
        )

    # ------------------------------------------------------------------ checks
    def factor(self, level: int) -> int:
        """How many times the grid of `level` was halved, relative to level 0."""
        return sum(1 for v in self.levels if v <= level)

    def check(self, shape: Sequence[int], num_levels: int) -> None:
        """A clear error if a state of `shape` cannot be halved as often as asked."""
        halvings = self.factor(num_levels - 1)
        spatial = tuple(shape[2:])
        if len(shape) < 3 or len(spatial) > 3:
            raise ValueError(
                f"spatial coarsening needs states of shape (batch, channels, 1 to 3 "
                f"spatial dims), got {tuple(shape)}"
            )
        need = 2 ** (halvings + 1)
        bad = [n for n in spatial if n % (2**halvings) or n < need]
        if halvings and bad:
            raise ValueError(
                f"spatial coarsening on levels {[v for v in self.levels if v < num_levels]} halves "
                f"the grid {halvings} time(s): every spatial size must be a multiple of "
                f"{2**halvings} and at least {need}, but the state has spatial shape {spatial}"
            )

    # ------------------------------------------------------------------ transfers
    def _P(self, e):
        mode = _MODES[e.dim() - 2] if self._interpolate == "linear" else "nearest"
        kw = {"align_corners": False} if mode != "nearest" else {}
        return F.interpolate(e, scale_factor=2, mode=mode, **kw)

    def _R(self, x):
        d = x.dim() - 2
        if self._restrict == "average":
            return (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[d - 1](x, 2)
        if self._restrict == "inject":
            idx = (slice(None), slice(None)) + (slice(0, None, 2),) * d
            return x[idx].clone()
        return _full_weighting(x)

    def restrict(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """x on `level`'s grid -> level+1's grid (a copy when level+1 is not coarse in space)."""
        if level + 1 not in self.levels:
            return x.clone()
        return self._restrict(x, level) if callable(self._restrict) else self._R(x)

    def interpolate(self, e: torch.Tensor, level: int) -> torch.Tensor:
        """A correction on `level`'s grid -> level-1's grid."""
        if level not in self.levels:
            return e
        return self._interpolate(e, level) if callable(self._interpolate) else self._P(e)

    # The adjoint solve: transposes of the forward transfers.
    def restrict_adjoint(self, w: torch.Tensor, level: int) -> torch.Tensor:
        """P^T: an adjoint state on `level`'s grid -> level+1's grid."""
        if level + 1 not in self.levels:
            return w.clone()
        return _transpose(lambda z: self.interpolate(z, level + 1), w, _half(w))

    def interpolate_adjoint(self, e: torch.Tensor, level: int) -> torch.Tensor:
        """R^T: an adjoint correction on `level`'s grid -> level-1's grid."""
        if level not in self.levels:
            return e
        fine_like = self.interpolate(e, level)  # a tensor of the finer grid's shape
        return _transpose(lambda z: self.restrict(z, level - 1), e, fine_like.shape)

    def to_level(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """A fine (level-0) state restricted to `level`'s grid."""
        for lv in range(level):
            if lv + 1 in self.levels:
                x = self.restrict(x, lv)
        return x

    def from_level(self, e: torch.Tensor, level: int) -> torch.Tensor:
        """A correction on `level`'s grid interpolated to the fine (level-0) grid."""
        for lv in range(level, 0, -1):
            e = self.interpolate(e, lv)
        return e

    def branch_adjoint(
        self,
        step: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        w: torch.Tensor,
        level: int,
        cache: Optional[dict] = None,
    ) -> torch.Tensor:
        """Mode "branch"'s adjoint step: the transpose of branch_step's linearization at the fine
        state x, applied to w (``step`` as for branch_step, differentiable).

        With R = 2^-d P^T (the default transfers, and "average" with "nearest") the transposes
        cancel their scalings and the adjoint step has the forward one's form,
        ``w + P^k (J(R^k x)^T R^k w - R^k w)`` with J the step's Jacobian on `level`'s grid: only
        the step is differentiated.  Other transfers are differentiated by autograd too.
        ``cache``: a dict kept with x, to restrict x only once over an adjoint solve."""
        pair = (self._restrict, self._interpolate) in (
            ("full-weighting", "linear"),
            ("average", "nearest"),
        )
        with torch.enable_grad():
            if self.factor(level) == 0 or not pair:
                xr = x.detach().requires_grad_(True)
                y = self.branch_step(step, xr, level)
                (g,) = torch.autograd.grad(y, xr, w, allow_unused=True)
                return g if g is not None else torch.zeros_like(w)
            xc = cache.get("x") if cache is not None else None
            if xc is None:
                xc = self.to_level(x.detach(), level)
                if cache is not None:
                    cache["x"] = xc
            xc = xc.detach().requires_grad_(True)
            wc = self.to_level(w, level)
            (g,) = torch.autograd.grad(step(xc), xc, wc, allow_unused=True)
        return (
            w + self.from_level(g - wc, level) if g is not None else w - self.from_level(wc, level)
        )

    def branch_step(
        self, step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, level: int
    ) -> torch.Tensor:
        """Mode "branch": ``x + P^k (step(R^k x) - R^k x)``, a coarse step whose increment is
        computed on `level`'s grid (``step`` maps a state to the next one on any grid)."""
        if self.factor(level) == 0:
            return step(x)
        xc = self.to_level(x, level)
        return x + self.from_level(step(xc) - xc, level)


def _full_weighting(x):
    """2^-d P^T x for P the linear interpolation of ``F.interpolate(scale_factor=2,
    align_corners=False)``: in each dimension, the stencil (1, 3, 3, 1) / 8 at stride 2 with the
    edge values repeated (P clamps at the edges).  Strided slices, several times faster than
    transposing F.interpolate by autograd; tests check it against that transpose."""
    for dim in range(2, x.dim()):
        n = x.shape[dim]
        a = torch.cat([x.narrow(dim, 0, 1), x, x.narrow(dim, n - 1, 1)], dim)
        every_other = (slice(None),) * dim + (slice(0, None, 2),)

        taps = [a.narrow(dim, k, n - 1)[every_other] for k in range(4)]
        x = 0.125 * (taps[0] + taps[3]) + 0.375 * (taps[1] + taps[2])
    return x


def _half(x):
    return tuple(x.shape[:2]) + tuple(n // 2 for n in x.shape[2:])


def _transpose(linear_map, y, in_shape):
    """A^T y for a linear map A (from tensors of in_shape), by autograd."""
    with torch.enable_grad():
        z = torch.zeros(in_shape, dtype=y.dtype, device=y.device, requires_grad=True)
        out = linear_map(z)
        # create_graph when y itself is being differentiated (a transpose of a transpose)
        (g,) = torch.autograd.grad(out, z, y, create_graph=y.requires_grad)
    return g
