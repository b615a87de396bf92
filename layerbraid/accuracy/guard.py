"""The bias guard: training that a layer-parallel gradient's bias stalls is noticed, and given
better gradients.

Note [bias guard]: a few MGRIT iterations give a gradient with an error, and an error that does
not average out from batch to batch is a bias: the optimizer then follows a slightly wrong
direction, which costs little while the loss falls fast and can stop it falling where the true
gradient is small.  ``BiasGuard`` watches the loss: every ``window`` batches it compares the
mean loss of the last window with the window before, and a relative decrease below ``stall`` is
a stall.  At a stall it audits the batch (``audit_gradients``: the true relative error of the
gradients, against exact solves of the same batch); an error above ``max_error`` says the
gradients, not the optimizer, may be what stalls, and the guard escalates every layer-parallel
part's solves: one iteration more in every solve (the counts an ``IterationTuner`` would set),
and once a solve is at ``max_iterations``, exact solves.  A stall whose audited error is below
``max_error`` is training's own (a plateau, the learning rate): nothing changes.  Every stall is
logged as it happens (``log``, on the layer group's first rank) and kept in ``events``.  The
audits cost one exact forward and backward each, at stalls only.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .._engine.parts import ExactSolve, TunedSolve
from ._solves import _iterations, _parts
from .audit import audit_gradients

__all__ = ["BiasGuard", "GuardEvent"]


@dataclass
class GuardEvent:
    """One stall the guard saw (the same on every rank).

    Attributes:
        batch: the batch at which the stall was seen (counted as the caller counts).
        before, now: the mean loss of the window before and of the last window.
        error: the audited true relative gradient error at that batch.
        action: "raised" (one iteration more in every solve), "exact" (exact solves from now
            on) or "kept" (the error was below ``max_error``, not the gradients' doing, or
            every solve is exact already).
        iterations: per layer-parallel part, the (forward, adjoint) iterations from the next
            batch on; None for a part that solves exactly.
        seconds: the guard's time at this batch (the audit).
    """

    batch: int
    before: float
    now: float
    error: float
    action: str
    iterations: list[Optional[tuple[int, int]]] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        """The log line of this event."""
        what = {
            "raised": "raised the iterations to " + _counts(self.iterations),
            "exact": "switched to exact solves",
            "kept": "kept the solves (below the error limit, or exact already)",
        }[self.action]
        return (
            f"bias guard, batch {self.batch}: the loss stalled ({self.before:.4g} -> "
            f"{self.now:.4g}), the audited gradient error is {self.error:.2e}: {what}"
        )


def _counts(iterations: list[Optional[tuple[int, int]]]) -> str:
    return ", ".join("exact" if c is None else f"{c[0]}/{c[1]}" for c in iterations)


class BiasGuard:
    """Watches the loss for stalls and escalates the solves where the gradients' error is
    what stalls it (Note [bias guard]).

    Call it after each batch's ``optimizer.step()`` (or before), on every rank of the layer
    group, with that batch's loss, the batch's number and a closure that computes the same
    batch's loss again (``lambda: F.cross_entropy(model(x), y)``) for the audit; it returns
    the :class:`GuardEvent` of a stall it saw at this batch, else None.  The closure's loss
    must be the batch's: call the guard before the optimizer step for an audit of the
    gradients the step used, or after it for the weights the next batch starts from.

    Args:
        model: a module that is, or contains, layer-parallel modules.
        window: batches per window of the loss (the first check comes after two windows).
        stall: a relative decrease of the windows' mean loss below this is a stall.
        max_error: the audited relative gradient error above which a stall is put down to
            the gradients.
        max_iterations: the most iterations a solve is raised to; past it, exact solves.
        log: called with each event's line on the layer group's first rank (default print);
            None logs nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        window: int = 50,
        stall: float = 0.01,
        max_error: float = 0.05,
        max_iterations: int = 8,
        log: Optional[Callable[[str], Any]] = print,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        for name, v in (("stall", stall), ("max_error", max_error)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e300:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"max_iterations must be a positive int, got {max_iterations!r}")
        self.model, self.parts = model, _parts(model, "a bias guard")
        self.window, self.stall, self.max_error = window, float(stall), float(max_error)
        self.max_iterations, self.log = max_iterations, log
        self.events: list[GuardEvent] = []
        self._losses: list[float] = []
        part = self.parts[0]
        grid = part._process_grid()
        self._data = grid.data_comm if grid is not None and grid.data_size > 1 else None
        self._first = part.comm.Get_rank() == 0

    def __call__(
        self, loss: Any, batch: int, closure: Callable[[], torch.Tensor]
    ) -> Optional[GuardEvent]:
        value = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
        if self._data is not None:  # every data group decides on the whole batch's loss
            (total,) = self._data.allreduce_floats(
                [value], "sum", "the bias guard's loss over the data groups"
            )
            value = total / self._data.Get_size()
        self._losses.append(value)
        w = self.window
        if len(self._losses) < 2 * w:
            return None
        before = sum(self._losses[-2 * w : -w]) / w
        now = sum(self._losses[-w:]) / w
        self._losses = self._losses[-w:]  # the next check compares the next window with this
        if not before - now < self.stall * abs(before):
            return None
        t0 = time.perf_counter()
        audit = audit_gradients(self.model, closure, calibrate=False)
        action = "kept"
        if audit.error > self.max_error:
            action = self._escalate()
        event = GuardEvent(
            batch,
            before,
            now,
            audit.error,
            action,
            [self._counts_of(p) for p in self.parts],
            time.perf_counter() - t0,
        )
        self.events.append(event)
        if self.log is not None and self._first:
            self.log(event.line())
        return event

    def _counts_of(self, part: Any) -> Optional[tuple[int, int]]:
        mode = part.solve_mode
        if isinstance(mode, ExactSolve):
            return None
        if isinstance(mode, TunedSolve):
            return (mode.forward, mode.adjoint)
        return _iterations(part)

    def _escalate(self) -> str:
        """One iteration more in every solve of every part, or exact solves for a part whose
        solves are at ``max_iterations``: "exact" where a part switched, else "raised" where
        one was raised, else "kept" (every part solves exactly already)."""
        switched = raised = False
        for part in self.parts:
            counts = self._counts_of(part)
            if counts is None:  # exact already (one level, or switched)
                continue
            if max(counts) >= self.max_iterations:
                part.solve_mode, switched = ExactSolve(), True
            else:
                part.solve_mode, raised = TunedSolve(counts[0] + 1, counts[1] + 1), True
        return "exact" if switched else "raised" if raised else "kept"
