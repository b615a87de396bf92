"""What the audit, the probe and the tuner share: solving a batch again with the parts' solves
varied (a SolveMode of _engine/parts.py in force for one batch), the gradients that gives, and
the solves it leaves."""

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from .._engine.parts import (
    ProbeSolve,
    TunedSolve,
    counted_parameters,
    layer_parallel_parts,
)

__all__ = []


def _solve_at(
    model: Any,
    parts: Sequence[Any],
    closure: Callable[[], Any],
    counts: Sequence[Any],
    cold: bool = False,
) -> tuple[Any, list[Any]]:
    """The parameter gradients ({id(p): gradient}) of ``closure``'s loss with every part's
    solves running ``counts`` iterations (None: the part solves as it does), from the cold
    guess or, without ``cold``, from the guesses its next solves would start from (a
    probe's); and per part, what those solves left (``_solved``).  The model is left as it
    was (``_gradients_with``)."""
    left: list[Any] = []
    kept: list[Any] = []

    def at(on: bool) -> None:
        modes = [None if its is None else ProbeSolve(its[0], its[1], cold) for its in counts]
        _switch_modes(parts, modes if on else None, kept)

    def keep() -> None:
        left.extend(None if its is None else _solved(part, its) for part, its in zip(parts, counts))

    return _gradients_with(model, parts, closure, at, after=keep), left


def _switch_modes(parts: Sequence[Any], modes: Optional[Sequence[Any]], kept: list[Any]) -> None:
    """Puts ``modes`` (one per part; None: leave the part's as it is) in force for one batch,
    keeping the parts' own (the tuner's counts) in ``kept``; ``modes=None`` restores them."""
    if modes is None:
        for part, mode in zip(parts, kept):
            part.solve_mode = mode
        kept.clear()
        return
    kept[:] = [part.solve_mode for part in parts]
    for part, mode in zip(parts, modes):
        if mode is not None:
            part.solve_mode = mode


def _tuned_counts(part: Any) -> Optional[tuple[int, int]]:
    """The (forward, adjoint) iterations a tuner set on ``part``, or None."""
    mode = part.solve_mode
    return (mode.forward, mode.adjoint) if isinstance(mode, TunedSolve) else None


def _solved(part: Any, counts: Sequence[Any]) -> Any:
    """What the part's solves at ``counts`` iterations (a probe's, just run) left."""
    return part._solved(counts)


def _adopt(part: Any, solved: Any) -> None:
    """Makes the solves that ``_solved`` described the part's own, as if the batch had run
    them: a tuner that trains a batch on a probe's gradients keeps the statistics (with the
    part's calibration) and the warm-start states that go with them, so that what an audit,
    the iteration log and the next warm start see describes the gradients trained on."""
    part._adopt(solved, _calibrated)


def _calibrated(stats: Any, k: float) -> Any:
    """``stats`` with its error estimate calibrated by ``k`` (a probe's solver has none)."""
    if stats.raw_error_estimate is None or not stats.iterations:
        return stats
    return replace(stats, error_estimate=k * stats.raw_error_estimate)


def _relative_change(
    model: Any,
    old: dict[int, Optional[torch.Tensor]],
    new: dict[int, Optional[torch.Tensor]],
    what: str,
) -> float:
    """``|new - old| / |new|`` over all parameter gradients ({id(p): gradient} each; None is
    0), the same on every rank (collective for ``what``)."""
    comm, counted = counted_parameters(model)
    num = den = 0.0
    with torch.no_grad():
        for p in counted:
            o, n = old[id(p)], new[id(p)]
            if o is None and n is None:
                continue
            if o is None:
                assert n is not None
                o = torch.zeros_like(n)
            n = torch.zeros_like(o) if n is None else n
            num += float((n - o).double().pow(2).sum())
            den += float(n.double().pow(2).sum())
    if comm is not None and comm.Get_size() > 1:
        num, den = comm.allreduce_floats([num, den], "sum", what)
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def _parts(model: Any, who: str) -> list[Any]:
    parts = layer_parallel_parts(model)
    if not parts:
        raise ValueError(f"{who} needs a model that holds layer-parallel modules")
    return parts


def _iterations(part: Any) -> Optional[tuple[int, int]]:
    """(forward, adjoint) iterations of the part's last solves (the most over an RNN's
    layers); None for a part whose solves are exact (one level)."""
    fwd, bwd = part.forward_stats, part.backward_stats
    fwd, bwd = (s if isinstance(s, list) else [s] for s in (fwd, bwd))
    if not fwd or not bwd or any(s is None or not s.seconds for s in fwd + bwd):
        raise ValueError(
            "probe_gradients needs a backward first: it probes the gradients "
            "that the last backward left"
        )
    its = max(s.iterations for s in fwd), max(s.iterations for s in bwd)
    return None if its == (0, 0) else its  # one level: no iterations


def _gradients_with(
    model: Any,
    parts: Sequence[Any],
    closure: Callable[[], Any],
    mode: Callable[[bool], None],
    after: Optional[Callable[[], None]] = None,
) -> Any:
    """The parameter gradients of ``closure``'s loss with ``mode(True)`` in force ({id(p):
    gradient}); ``after()``, if given, runs right after its backward; afterwards the gradients,
    the buffers and the parts' solve statistics are put back as they were, and
    ``mode(False)``."""
    params = list(model.parameters())
    approx = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    stats = [(p, p._save_stats()) for p in parts]
    try:
        for p in params:
            p.grad = None
        mode(True)
        try:
            loss = closure()
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(
                    f"the closure must return the loss, a 0-d tensor; got "
                    f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
                )
            loss.backward()
            if after is not None:
                after()
        finally:
            mode(False)
        return {id(p): p.grad for p in params}
    finally:
        for p, g in zip(params, approx):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for part, saved in stats:
            part._restore_stats(saved)
