"""Iterations tuned by the probe.

Note [tuned iterations]: adaptive iterations aimed with the probe, the estimate that holds
where the residuals' does not (docs/accuracy.md).  At the probe's batches (``audit_due``'s
schedule) ``IterationTuner`` probes the batch: the change with one iteration more in every
solve estimates the error at the counts the batch ran.  The tuner aims below the target, at
``target / margin`` (the aim; margin 2 by default): the counts it settles at met the aim at a
probe, but the network keeps training between probes and its error drifts, so the margin is
the room for that drift (and for the probe's own factor against the truth) before the error
crosses the target, paid for with an iteration more where the probe lies between the aim and
the target.  Below, a probe "meets" the aim when it is at most the aim.  Above the aim, the
tuner climbs within the batch: it has the gradients at k + 1 iterations (the probe's), solves
the batch again at k + 2 and compares (``g_{k+2} - g_{k+1}``, the estimate at k + 1), and so
on, one iteration more each time, until a change meets the aim or every count is at
``max_iterations``; the counts become the fewest whose change met the aim, and the batch
trains on the climb's last solve (one iteration further still, and already paid for), whose
solve statistics and warm-start states become the model's as well, so that an audit of the
batch, its logged iterations and the next warm start describe the gradients it trains on.
An earlier version climbed one count per batch, probing every batch until a probe met the
aim; the batches of such a climb trained on gradients that had not met it (on the GRU of
docs/accuracy.md, its first three batches, whose true error was 0.2-0.95 while the counts
climbed from 2/1 to 8/7).  At a probe that meets the aim, the tuner solves the batch once more
with one iteration fewer in every solve that runs more than one, from the cold guess, and
compares with the batch's gradients: that change is the probe the lower counts would get
(``g_k - g_{k-1}``), so if it meets the aim the counts go down by one; with warm starts it is
an upper bound where they help (a cold solve at k - 1 iterations, which the batch's own
solution cannot measure).  A climb does not try one fewer (that count has just failed); the
next probe does.  So the counts settle at the fewest whose probed error meets the aim and
follow the network as it trains.  Between probes every solve runs exactly its count (no
stopping rule).  The cost per probed batch: the probe, about (k + 1) / k times the batch's
solves, and at most one more solve at k - 1 iterations; a climb of j counts costs j solves
more, at k + 2, ..., k + j + 1 iterations.

"""

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .._engine.chain import _check_target
from .._engine.parts import (
    TunedSolve,
)
from ._solves import _adopt, _iterations, _parts, _relative_change, _solve_at, _tuned_counts
from .audit import audit_due
from .probe import _probe

__all__ = ["IterationTuner", "Tuning"]


@dataclass
class Tuning:
    """What ``IterationTuner`` measured and did at one probed batch (the same on every rank).

    Attributes:
        change: the probe at the counts the batch ran (``GradientProbe.change``): the estimate
            of its gradients' relative error.  Above ``aim`` the tuner climbed (``climb``).
        lower_change: the gradients' relative change with one iteration fewer in every solve
            that runs more than one (from the cold guess): the error estimate at the lower
            counts; None where the tuner did not try them (``change`` above the aim, or no
            solve above one iteration).
        ran: per layer-parallel part, the (forward, adjoint) iterations of the batch; None for
            a part that solves exactly.
        iterations: per part, the counts from the next batch on.
        seconds: the tuner's time at this batch (the probe, the climb's solves and the lower
            solve).
        aim: the probed error the tuner held the counts to (``target / margin``).
        climb: where ``change`` is above the aim, the error estimates of the counts the tuner
            climbed through: the j-th (from 0) is the gradients' change from ``ran`` + j + 1
            to ``ran`` + j + 2 iterations in every solve (capped at ``max_iterations``), the
            estimate at ``ran`` + j + 1.  It stops at the first that meets the aim (those
            counts are ``iterations``) or where every count is at ``max_iterations``; the
            batch trains on the gradients of its last solve.  Empty where the probe met the
            aim.
    """

    change: float
    lower_change: Optional[float]
    ran: list
    iterations: list
    seconds: float
    aim: float
    climb: list = field(default_factory=list)


class IterationTuner:
    """Adaptive iterations aimed with the gradient probe (Note [tuned iterations]): every
    layer-parallel solve of ``model`` runs a fixed number of iterations, which the tuner moves
    to the fewest whose probed gradient error is at most the aim, ``target / margin`` (down by
    one at a probe, up as far as a climb within the batch takes them), so that the true error
    stays below ``target`` between probes.

    Call it at every batch, after ``loss.backward()`` and before ``optimizer.step()``, on every
    rank of the layer group, with the batch's closure (as for ``probe_gradients``) and the
    batch's index counted over the whole run: ``tuner(lambda: loss_fn(model(x), y), batch)``.
    It probes (collective) at the batches ``audit_due(batch, every)`` names and returns a
    :class:`Tuning`; at the others it returns None at no cost.  The buffers it finds are the
    ones it leaves, and so are the gradients and solve statistics where the probe meets the
    aim; above it, the tuner climbs within the batch, and the batch's gradients, solve
    statistics and warm-start states are replaced by those of the climb's last solve (closer
    to the truth, and already paid for).  The counts change from the next batch on.

    Args:
        model: a layer-parallel module or a model holding some; their solves must not use
            ``target_error`` (the residuals' adaptive iterations), which this replaces.
        target: the relative gradient error to stay below, in (0, 1), e.g. 1e-2.
        every: probe every ``every``-th batch (and the batches 0, 1, 2, 4, ... below it).
        max_iterations: the most iterations any solve is given.
        margin: the tuner aims at ``target / margin`` (>= 1; 1 aims at the target itself).
    """

    def __init__(
        self,
        model: nn.Module,
        target: float,
        *,
        every: int = 20,
        max_iterations: int = 10,
        margin: float = 2.0,
    ) -> None:
        self.parts = _parts(model, "IterationTuner")
        if target is None:
            raise ValueError("IterationTuner's target must be a number in (0, 1), got None")
        self.target = float(target)
        _check_target(target)
        for name, v in (("every", every), ("max_iterations", max_iterations)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"IterationTuner's {name} must be an int >= 1, got {v!r}")
        for part in self.parts:
            if part.target_error is not None:
                raise ValueError(
                    f"IterationTuner replaces target_error, but a part of the model "
                    f"has target_error={part.target_error!r}: build it without"
                )
        if (
            isinstance(margin, bool)
            or not isinstance(margin, (int, float))
            or not math.isfinite(margin)
            or margin < 1
        ):
            raise ValueError(f"IterationTuner's margin must be a number >= 1, got {margin!r}")
        self.model, self.every, self.max_iterations = model, every, max_iterations
        self.margin = float(margin)
        self.history: list[Tuning] = []  # every Tuning so far

    @property
    def aim(self) -> float:
        """The probed error the tuner holds the counts to: ``target / margin``."""
        return self.target / self.margin

    @property
    def iterations(self) -> list[Optional[tuple[int, int]]]:
        """Per part, the (forward, adjoint) iterations the next batch runs; None for a part
        whose solves are exact or that the tuner has not set yet (before its first probe)."""
        return [_tuned_counts(p) for p in self.parts]

    def __call__(self, closure: Callable[[], torch.Tensor], batch: int) -> Optional[Tuning]:
        if not audit_due(batch, self.every):
            return None
        t0 = time.perf_counter()
        model, parts, aim = self.model, self.parts, self.aim
        ran = [_iterations(p) for p in parts]
        probe, grads, left = _probe(model, closure)
        change, lower_change, counts, climb = probe.change, None, ran, []
        if change > aim:  # climb: the probe's counts, then one more, until a change meets it
            counts = self._up(ran)
            while True:
                higher = self._up(counts)
                if higher == counts:  # every count at max_iterations: nothing to compare with
                    break
                more, more_left = _solve_at(model, parts, closure, higher)
                climb.append(_relative_change(model, grads, more, "an iteration tuner"))
                grads, left = more, more_left  # trained on: the furthest solved
                if climb[-1] <= aim:  # the counts' own error estimate meets the aim
                    break
                counts = higher
            for p in model.parameters():
                p.grad = grads[id(p)]
            for part, its, solved in zip(parts, counts, left):
                if its is not None:
                    _adopt(part, solved)
        else:
            lower = [
                None if its is None else (max(its[0] - 1, 1), max(its[1] - 1, 1)) for its in ran
            ]
            if lower != ran:
                now = {id(p): p.grad for p in model.parameters()}
                fewer, _ = _solve_at(model, parts, closure, lower, cold=True)
                lower_change = _relative_change(model, fewer, now, "an iteration tuner")
                if lower_change <= aim:
                    counts = lower
        for part, its in zip(parts, counts):
            part.solve_mode = None if its is None else TunedSolve(*its)
        tuning = Tuning(
            change, lower_change, ran, list(counts), time.perf_counter() - t0, aim, climb
        )
        self.history.append(tuning)
        return tuning

    def _up(self, counts):
        """``counts`` with every count one higher, at most ``max_iterations``."""
        return [
            None if its is None else tuple(min(k + 1, self.max_iterations) for k in its)
            for its in counts
        ]
