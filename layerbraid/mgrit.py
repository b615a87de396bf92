"""MGRIT: a parallel-in-time solver for any one-step propagator."""

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ._comm.world import is_comm, resolve
from .launch import _enter
from .options import MGRITOptions, check_int

__all__ = ["MGRIT", "MGRITResult"]


@dataclass
class MGRITResult:
    """The outcome of :meth:`MGRIT.solve`.

    Attributes:
        iterations: MGRIT cycles done, counted as XBraid counts them (0 for one level).
        residual_norms: every residual norm computed, in order; the same on all ranks.
        states: ``{global fine index: state}`` for the points this rank owns.
        num_levels: levels in the hierarchy.
        trace: the schedule this rank ran (``TraceEntry`` list), when asked for.
    """

    iterations: int
    residual_norms: list[float]
    states: dict[int, Any]
    num_levels: int
    trace: list = field(default_factory=list)


class MGRIT:
    """Solves ``u_i = step(u_{i-1}, t_{i-1}, t_i, level)``, i = 1..num_steps, all at once.

    The steps are split into contiguous blocks over the ranks of ``comm``; every rank runs
    ``solve()`` together.

    Args:
        step: ``step(u, t_start, t_stop, level) -> state`` one step later; must not modify ``u``.
            On coarse levels (``level >= 1``) it takes the longer coarse step; the FAS right-hand
            side is added by the core afterwards.
        init: ``init(t) -> state``: the initial value at ``t_start``, the initial guess elsewhere.
        num_steps: fine steps (at least the number of ranks).
        t_start, t_stop: the time interval, split into equal steps.
        options: an :class:`MGRITOptions`.
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        trace: record the schedule (``result.trace``).
        coarsen, refine: optional spatial transfers: ``coarsen(x, level)`` gives x on level+1's
            spatial grid (used for states and FAS residuals), ``refine(e, level)`` gives a
            correction on level-1's grid.  Steps on level l then see level l's grid.
        store_all: keep every fine state (default).  False keeps only the fine C-points, the
            points just before them and each rank's last point (``result.states`` then holds
            those), releasing the others during the sweeps: less memory for long solves.
        step_interval: optional ``step_interval(u, times, level, keep) -> [state] * n``: the
            ``n = len(times) - 1`` consecutive steps from u over ``times``, as n calls of
            ``step`` would give them, in one call (for a fused kernel).  The core uses it for
            the runs of steps between C-points where no coarse right-hand side enters (every
            fine F-interval, the coarsest solve before its first restriction).  When ``keep``
            is False the core keeps only the last state (``store_all=False``) and the others may
            be None.

    States are numpy arrays or torch tensors of any shape and dtype; they cross ranks as raw
    bytes, so float64 stays float64.
    """

    def __init__(
        self,
        step: Callable,
        init: Callable,
        num_steps: int,
        t_start: float = 0.0,
        t_stop: float = 1.0,
        *,
        options: Optional[MGRITOptions] = None,
        comm: Optional[Any] = None,
        trace: bool = False,
        coarsen: Optional[Callable] = None,
        refine: Optional[Callable] = None,
        store_all: bool = True,
        step_interval: Optional[Callable] = None,
    ) -> None:
        _enter()

        # here, not at the top: `import layerbraid` does not load the compiled core (the
        # state format works without it)
        from ._engine.bridge import _Core

        if not callable(step) or not callable(init):
            raise TypeError("MGRIT needs callable step and init")
        if step_interval is not None and not callable(step_interval):
            raise TypeError(
                f"MGRIT step_interval must be callable or None, got {type(step_interval).__name__}"
            )
        check_int("MGRIT num_steps", num_steps, 1, 2**62, "2**62")  # the core's int64 counts
        if not float(t_stop) > float(t_start):
            raise ValueError(
                f"MGRIT needs t_stop > t_start, got t_start={t_start!r}, t_stop={t_stop!r}"
            )
        options = MGRITOptions() if options is None else options
        if not isinstance(options, MGRITOptions):
            raise TypeError(f"options must be an MGRITOptions, got {type(options).__name__}")
        self.options = options
        self.comm = resolve(comm)
        if not is_comm(self.comm):
            raise TypeError(
                f"comm must be an mpi4py communicator or a torch.distributed ProcessGroup, "
                f"got {type(comm).__name__}"
            )
        self.num_steps = num_steps
        self._core = _Core(
            self.comm,
            num_steps,
            t_start,
            t_stop,
            options,
            init=lambda app, t, index: init(t),
            step=lambda app, u, t0, t1, level, index, done: step(u, t0, t1, level),
            trace=trace,
            coarsen=coarsen,
            refine=refine,
            store_all=store_all,
            step_interval=None
            if step_interval is None
            else (
                lambda app, u, times, level, index, stride, done, keep: step_interval(
                    u, times, level, keep
                )
            ),
        )
        self._trace = trace

    def solve(self) -> MGRITResult:
        """Runs MGRIT on every rank.  Raises the same kind of error on every rank on failure."""
        iterations, norms = self._core.solve()
        return MGRITResult(
            iterations=iterations,
            residual_norms=norms,
            states=self._core.states(),
            num_levels=self._core.num_levels(),
            trace=self._core.trace() if self._trace else [],
        )
