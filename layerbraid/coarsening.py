"""Spatial coarsening on coarse MGRIT levels: coarse in time *and* in space.

On the MGRIT levels you choose, states (batch, channels, *spatial) are restricted to a grid of
half the size in every spatial dimension when they move down to that level, and corrections are
interpolated back when they move up.  Convolutional step layers then run on the coarse grid with
the same weights, which makes the coarse propagators, which dominate a cycle's cost, much
cheaper (by 4x in 2D, 8x in 3D per coarsened level).

Transfers (d = number of spatial dimensions):
- interpolate "linear": (bi/tri)linear interpolation P (``F.interpolate``, align_corners=False);
  "nearest": piecewise constant.
- restrict "full-weighting" (default): R = 2^-d P^T, so that ``<R x, y> = 2^-d <x, P y>`` exactly
  (the tests check this); "average": 2^d-point averaging; "inject": every other point.
- any callable ``f(x, level)`` for either.
The adjoint (backward) solve uses the transposed transfers, P^T to restrict gradients and R^T to
interpolate their corrections, computed with autograd so that user functions work too.
"""
from typing import Callable, Iterable, Union

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
    """

    def __init__(self, levels: Iterable[int], restrict: Union[str, Callable] = "full-weighting",
                 interpolate: Union[str, Callable] = "linear"):
        levels = tuple(sorted(set(levels)))
        if not levels or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                             for v in levels):
            raise ValueError(f"SpatialCoarsening levels must be MGRIT levels >= 1, got {levels!r}")
        if not callable(restrict) and restrict not in ("full-weighting", "average", "inject"):
            raise ValueError(f"restrict must be 'full-weighting', 'average', 'inject' or a "
                             f"function, got {restrict!r}")
        if not callable(interpolate) and interpolate not in ("linear", "nearest"):
            raise ValueError(f"interpolate must be 'linear', 'nearest' or a function, got "
                             f"{interpolate!r}")
        self.levels = levels
        self._restrict, self._interpolate = restrict, interpolate

    def __repr__(self):
        return (f"SpatialCoarsening(levels={self.levels}, restrict={self._restrict!r}, "
                f"interpolate={self._interpolate!r})")

    # ------------------------------------------------------------------ checks
    def factor(self, level: int) -> int:
        """How many times the grid of `level` was halved, relative to level 0."""
        return sum(1 for v in self.levels if v <= level)

    def check(self, shape, num_levels: int):
        """A clear error if a state of `shape` cannot be halved as often as asked."""
        halvings = self.factor(num_levels - 1)
        spatial = tuple(shape[2:])
        if len(shape) < 3 or len(spatial) > 3:
            raise ValueError(f"spatial coarsening needs states of shape (batch, channels, 1 to 3 "
                             f"spatial dims), got {tuple(shape)}")
        need = 2 ** (halvings + 1)
        bad = [n for n in spatial if n % (2 ** halvings) or n < need]
        if halvings and bad:
            raise ValueError(
                f"spatial coarsening on levels {[v for v in self.levels if v < num_levels]} halves "
                f"the grid {halvings} time(s): every spatial size must be a multiple of "
                f"{2 ** halvings} and at least {need}, but the state has spatial shape {spatial}")

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
        # full weighting: 2^-d P^T, with P linear interpolation
        mode = _MODES[d]
        return _transpose(lambda z: F.interpolate(z, scale_factor=2, mode=mode,
                                                  align_corners=False),
                          x, _half(x)) / 2 ** d

    def restrict(self, x, level):
        """x on `level`'s grid -> level+1's grid (a copy when level+1 is not coarse in space)."""
        if level + 1 not in self.levels:
            return x.clone()
        return self._restrict(x, level) if callable(self._restrict) else self._R(x)

    def interpolate(self, e, level):
        """A correction on `level`'s grid -> level-1's grid."""
        if level not in self.levels:
            return e
        return self._interpolate(e, level) if callable(self._interpolate) else self._P(e)

    # The adjoint solve: transposes of the forward transfers.
    def restrict_adjoint(self, w, level):
        """P^T: an adjoint state on `level`'s grid -> level+1's grid."""
        if level + 1 not in self.levels:
            return w.clone()
        return _transpose(lambda z: self.interpolate(z, level + 1), w, _half(w))

    def interpolate_adjoint(self, e, level):
        """R^T: an adjoint correction on `level`'s grid -> level-1's grid."""
        if level not in self.levels:
            return e
        fine_like = self.interpolate(e, level)  # a tensor of the finer grid's shape
        return _transpose(lambda z: self.restrict(z, level - 1), e, fine_like.shape)

    def to_level(self, x, level):
        """A fine (level-0) state restricted to `level`'s grid."""
        for lv in range(level):
            if lv + 1 in self.levels:
                x = self.restrict(x, lv)
        return x


def _half(x):
    return tuple(x.shape[:2]) + tuple(n // 2 for n in x.shape[2:])


def _transpose(linear_map, y, in_shape):
    """A^T y for a linear map A (from tensors of in_shape), by autograd."""
    with torch.enable_grad():
        z = torch.zeros(in_shape, dtype=y.dtype, device=y.device, requires_grad=True)
        out = linear_map(z)
        # create_graph when y itself is being differentiated (a transpose of a transpose)
        g, = torch.autograd.grad(out, z, y, create_graph=y.requires_grad)
    return g
