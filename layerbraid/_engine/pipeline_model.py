"""The schedule model of a pipeline over ranks in microbatches: a discrete-event simulation of
its actions (Note [pipeline model] in layerbraid/plan.py), and the choice it makes for
layerbraid's exact path of which VJPs to split (Note [split count]).

Note [split count]: past the first rank, the exact path's backward may split a microbatch's VJP
(Note [deferred W] in _engine/pipeline.py): the input's gradient first, sent at once, the
parameters' later.  The split hands the gradient on sooner but costs more work in all (its two
parts cost about 1.4 fused VJPs on a CPU's convolutions), and the deferred parts must still run
somewhere: on the last rank, which holds every microbatch's gradient at once and never waits,
they pile up at its end.  Splitting every microbatch made the last of 2 ranks the backward's
bottleneck (5 microbatches: 24% past the first rank's end in the model).  So a rank splits only
the first ``s`` microbatches of its backward, and runs the rest fused; ``s`` is the count from
1 up that the simulation finds fastest for the rank count, the microbatch count and the costs
(fewest splits among equals).  On 2 ranks that is 1 for any costs where a split is dearer than
a fused VJP: after the first gradient the first rank consumes one microbatch per fused VJP, as
fast as a fused last rank makes them.  Never 0: the first split costs the critical path
nothing while its input part is cheaper than a fused VJP (its parameter part runs on a rank
that ends before the first), and it keeps both parts measured.  The runtime takes the costs
from its own rank's timings of the passes before (:class:`SplitPlanner`), as if every rank
cost as much as it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PIPELINE_SCHEDULES",
    "StageCosts",
    "SplitPlanner",
    "best_split_count",
    "orders",
    "simulate",
]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "exact")


def orders(ranks: int, microbatches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Each rank's actions, ("F" or "B", microbatch), in the order it runs them: "gpipe" and
    "exact" (every forward, then every backward, the last microbatch first, as layerbraid's
    exact path runs them) or "1f1b" (as many forwards as stages ahead, then one backward and
    one forward in turn)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    m = microbatches
    out = []
    for r in range(ranks):
        if schedule in ("gpipe", "exact"):
            out.append([("F", k) for k in range(m)] + [("B", k) for k in reversed(range(m))])
            continue
        warmup = min(m, ranks - r)
        order = [("F", k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [("B", k), ("F", warmup + k)]
        order += [("B", k) for k in range(m - warmup, m)]
        out.append(order)
    return out


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one microbatch's actions on each rank: its forward, its fused VJP (input and
    parameter gradients), and the two parts of a split VJP; and of one message."""

    forward: Sequence[float]
    vjp: Sequence[float]
    split_input: Sequence[float]
    split_weights: Sequence[float]
    message: float = 0.0


def _deps(
    kind: str, r: int, k: int, ranks: int, msg: float
) -> list[tuple[tuple[str, int, int], float]]:
    """What action (kind, r, k) waits for, and the message time after each."""
    if kind == "F":
        return [(("F", r - 1, k), msg)] if r > 0 else []
    deps = [(("F", r, k), 0.0)]
    if r < ranks - 1:
        deps.append((("B", r + 1, k), msg))
    return deps


def simulate(
    costs: StageCosts, microbatches: int, schedule: str, split_first: int = 0
) -> tuple[float, float]:
    """(when the last forward ends, when the last rank ends) of the pipeline.  Under "exact",
    every rank past the first splits the first ``split_first`` VJPs of its backward and runs
    their parameter parts while it waits for the next gradient, and at the end (Note [deferred
    W] in _engine/pipeline.py); the other schedules never split."""
    ranks = len(costs.forward)
    plans = orders(ranks, microbatches, schedule)
    done: dict[tuple[str, int, int], float] = {}
    clock, at, backs = [0.0] * ranks, [0] * ranks, [0] * ranks
    deferred = [0] * ranks  # parameter parts each rank still owes
    while any(at[r] < len(plans[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            while at[r] < len(plans[r]):
                kind, k = plans[r][at[r]]
                deps = _deps(kind, r, k, ranks, costs.message)
                if any(d not in done for d, _ in deps):
                    break
                ready = max([0.0] + [done[d] + wait for d, wait in deps])
                while deferred[r] and clock[r] < ready:  # the wait filled
                    clock[r] += costs.split_weights[r]
                    deferred[r] -= 1
                split = schedule == "exact" and kind == "B" and r > 0 and backs[r] < split_first
                cost = (
                    costs.forward[r]
                    if kind == "F"
                    else costs.split_input[r]
                    if split
                    else costs.vjp[r]
                )
                done[(kind, r, k)] = clock[r] = max(clock[r], ready) + cost
                backs[r] += kind == "B"
                deferred[r] += split
                at[r] += 1
                moved = True
        assert moved, "a pipeline schedule whose ranks wait for each other"
    ends = [c + n * w for c, n, w in zip(clock, deferred, costs.split_weights)]
    forward = max(t for (kind, _, _), t in done.items() if kind == "F")
    return forward, max(ends)


def best_split_count(costs: StageCosts, microbatches: int) -> int:
    """The number of leading VJPs of each backward, at least one, that ranks past the first
    split in the exact path's fastest simulated schedule, the fewest among equals (Note [split
    count])."""
    ends = {s: simulate(costs, microbatches, "exact", s)[1] for s in range(1, microbatches + 1)}
    best = min(ends.values())
    return next(s for s, t in ends.items() if t <= best * (1 + 1e-9))


class SplitPlanner:
    """A rank's choice of :func:`best_split_count` for its microbatched backward, from its own
    measured seconds per microbatch of each action (an exponential average over the passes but
    the first, whose first calls are cold: torch's helpers for the split are looked up then),
    every rank assumed to cost the same.  Until it has averaged ``SAMPLES`` passes it splits
    one VJP a pass (which measures both kinds in a pass of two or more microbatches), and it
    chooses again after passes 4, 8, 16, ...; never fewer than one, so that both kinds stay
    measured."""

    KINDS = ("forward", "vjp", "split_input", "split_weights")
    SMOOTHING = 0.3  # the weight of the newest pass's seconds
    SAMPLES = 3  # passes averaged before the first choice

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.passes = 0
        self._choice: dict[tuple[int, int], int] = {}

    def note(self, kind: str, seconds: Sequence[float]) -> None:
        """Adds one pass's seconds of ``kind``, one per microbatch that ran it."""
        if not seconds or self.passes == 0:
            return
        mean = sum(seconds) / len(seconds)
        old = self.seconds.get(kind)
        self.seconds[kind] = mean if old is None else old + self.SMOOTHING * (mean - old)

    def finished_pass(self) -> None:
        """Counts a backward; the choice is made again after passes 4, 8, 16, ..."""
        self.passes += 1
        if self.passes & (self.passes - 1) == 0:
            self._choice.clear()

    def split_first(self, ranks: int, microbatches: int) -> int:
        """How many leading VJPs of this backward to split."""
        if self.passes <= self.SAMPLES or any(k not in self.seconds for k in self.KINDS):
            return 1
        key = (ranks, microbatches)
        if key not in self._choice:
            each = [[self.seconds[k]] * ranks for k in self.KINDS]
            costs = StageCosts(each[0], each[1], each[2], each[3])
            self._choice[key] = best_split_count(costs, microbatches)
        return self._choice[key]
