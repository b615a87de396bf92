"""MGRITOptions: the settings of one MGRIT solve, validated when constructed."""

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

__all__ = ["MGRITOptions", "check_int"]

IntOrPerLevel = Union[int, tuple[int, ...]]


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(
    name: str, value: Any, lo: int = 1, hi: Optional[int] = None, hi_text: Optional[str] = None
) -> int:
    """``value`` when it is an int (not a bool) in ``lo..hi``; else ValueError "``name`` must be
    an int >= lo, got ..." (or "in lo..hi", with ``hi_text`` for hi)."""
    if _is_int(value) and value >= lo and (hi is None or value <= hi):
        return value
    bound = f">= {lo}" if hi is None else f"in {lo}..{hi_text or hi}"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")


# The C core keeps counts and factors in C ints.
_C_INT_MAX = 2**31 - 1


def _per_level(name, value, minimum, max_levels):
    """An int, or one int per coarsened level (max_levels - 1 of them), each >= minimum."""
    if _is_int(value):
        if not minimum <= value <= _C_INT_MAX:
            raise ValueError(
                f"MGRITOptions.{name} must be in {minimum}..{_C_INT_MAX}, got {value!r}"
            )
        return value
    if isinstance(value, (list, tuple)):
        value = tuple(value)
        if len(value) != max(max_levels - 1, 1) or not all(_is_int(v) for v in value):
            raise ValueError(
                f"MGRITOptions.{name} must be an int or {max(max_levels - 1, 1)} ints (one per "
                f"level that has a coarser level, max_levels={max_levels}), got {value!r}"
            )
        for k, v in enumerate(value):
            if not minimum <= v <= _C_INT_MAX:
                raise ValueError(
                    f"MGRITOptions.{name}[{k}] must be in {minimum}..{_C_INT_MAX}, "
                    f"got {v!r} in {value!r}"
                )
        return value
    raise ValueError(f"MGRITOptions.{name} must be an int or a tuple of ints, got {value!r}")


@dataclass(frozen=True)
class MGRITOptions:
    """Settings of an MGRIT solve (XBraid's algorithm).

    The defaults are the settings the examples, the command line (``layerbraid.cli``) and the
    planner (``layerbraid.plan``) use for training: two levels, cfactor 4, F-relaxation, the
    first down-cycle skipped.  (XBraid's own defaults are FCF-relaxation without the skip:
    ``nrelax=1, skip_first_downcycle=False``, which converge in fewer iterations at about twice
    the cost of each.)

    Args:
        max_levels: the most levels of the time hierarchy; 1 is plain sequential stepping.
        cfactor: the coarsening factor (>= 2), or one per level that gets a coarser level
            (``max_levels - 1`` values, level 0 first).
        max_iters: the most MGRIT cycles.
        tol: stop when the residual 2-norm over the fine C-points is below this (absolute).
        rtol: also stop when the residual is below ``rtol`` times the 2-norm of the states at
            the same points (the fine C-points from ``cfactor`` on, measured in the same pass):
            a tolerance relative to the solution's size.  0 (default) turns it off.
        nrelax: (F, C) sweeps before each restriction: 0 is F-relaxation, 1 is FCF; an int or one
            per coarsened level.  The coarsest level is always solved exactly.
        skip_first_downcycle: skip the relaxation and restriction work of the first descent.
        cycle: ``"V"`` or ``"F"``.
        min_coarse: a level is coarsened only while the coarser level keeps at least this many
            steps.
        final_fc_relax: finish with an F- then a C-relaxation (training needs this: every step then
            runs exactly once with ``done`` set).
    """

    max_levels: int = 2
    cfactor: IntOrPerLevel = 4
    max_iters: int = 10
    tol: float = 1e-9
    nrelax: IntOrPerLevel = 0
    skip_first_downcycle: bool = True
    cycle: str = "V"
    min_coarse: int = 2
    final_fc_relax: bool = False
    rtol: float = 0.0

    def __post_init__(self):
        if not _is_int(self.max_levels) or not 1 <= self.max_levels <= 64:
            raise ValueError(
                f"MGRITOptions.max_levels must be an int in 1..64, got {self.max_levels!r}"
            )
        object.__setattr__(self, "cfactor", _per_level("cfactor", self.cfactor, 2, self.max_levels))
        object.__setattr__(self, "nrelax", _per_level("nrelax", self.nrelax, 0, self.max_levels))
        if not _is_int(self.max_iters) or not 1 <= self.max_iters <= _C_INT_MAX:
            raise ValueError(
                f"MGRITOptions.max_iters must be an int in 1..{_C_INT_MAX}, got {self.max_iters!r}"
            )
        if (
            isinstance(self.tol, bool)
            or not isinstance(self.tol, (int, float))
            or not math.isfinite(self.tol)
            or self.tol < 0
        ):
            raise ValueError(f"MGRITOptions.tol must be a finite number >= 0, got {self.tol!r}")
        object.__setattr__(self, "tol", float(self.tol))
        if (
            isinstance(self.rtol, bool)
            or not isinstance(self.rtol, (int, float))
            or not math.isfinite(self.rtol)
            or self.rtol < 0
        ):
            raise ValueError(f"MGRITOptions.rtol must be a finite number >= 0, got {self.rtol!r}")
        object.__setattr__(self, "rtol", float(self.rtol))
        if self.cycle not in ("V", "F"):
            raise ValueError(f"MGRITOptions.cycle must be 'V' or 'F', got {self.cycle!r}")
        if not _is_int(self.min_coarse) or not 1 <= self.min_coarse <= _C_INT_MAX:
            raise ValueError(
                f"MGRITOptions.min_coarse must be an int in 1..{_C_INT_MAX}, got "
                f"{self.min_coarse!r}"
            )
        for name in ("skip_first_downcycle", "final_fc_relax"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"MGRITOptions.{name} must be True or False, got {getattr(self, name)!r}"
                )

    def cfactors(self) -> tuple[int, ...]:
        """The coarsening factors as a tuple, one per coarsened level."""
        return self.cfactor if isinstance(self.cfactor, tuple) else (self.cfactor,)

    def nrelaxes(self) -> tuple[int, ...]:
        """The relaxation counts as a tuple, one per coarsened level."""
        return self.nrelax if isinstance(self.nrelax, tuple) else (self.nrelax,)
