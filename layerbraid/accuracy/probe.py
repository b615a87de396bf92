"""Gradient probes: the gradients' change with one more iteration, an estimate of their error.

Note [gradient probe]: an iterate's error is what further iterations remove.  If the solves
shrink the gradients' error by a factor q per iteration, one more iteration changes the
gradients by between (1 - q) and (1 + q) times their error, so the change estimates the error
within a factor 1 / (1 - q) (within 3x for q <= 2/3), measured in the gradients themselves:
it needs neither the residual estimate's assumption of steps that neither amplify nor damp nor
a calibration.  ``probe_gradients`` re-solves the batch with one iteration more in each
multilevel solve: without warm starts from the same cold guess, so that the first iterations
repeat the batch's and the change is that of one iteration, ``g_{k+1} - g_k``; with warm starts
from the batch's own solution, for k + 1 iterations more (``g_{2k+1} - g_k``, closer still to
the error).  It cannot see an error that iterations do not reduce (q near 1: a stalled solve,
whose SolveStats.contraction is near 1).  Its cost is one layer-parallel forward and backward at
k + 1 iterations: about (k + 1) / k times a training batch's solves, where an audit's exact
solve steps the whole network in sequence.
"""

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ._solves import _iterations, _parts, _relative_change, _solve_at

__all__ = ["GradientProbe", "probe_gradients"]


@dataclass
class GradientProbe:
    """What one probe measured (the same on every rank of the layer group).

    Attributes:
        change: the relative 2-norm change of all parameter gradients, ``|g' - g| / |g'|``,
            where ``g`` are the gradients the last backward left and ``g'`` those of the same
            batch and weights with every multilevel solve iterated further (Note [gradient
            probe]): the probe's estimate of ``g``'s true relative error.  0.0 where every
            part solves exactly.
        iterations: per layer-parallel part, the (forward, adjoint) iterations the probe ran;
            None for a part that solves exactly (it is not probed).
        seconds: the probe's time: a layer-parallel forward and backward of the batch at those
            iterations, plus the comparison.
    """

    change: float
    iterations: list
    seconds: float


def probe_gradients(model: nn.Module, closure: Callable[[], torch.Tensor]) -> GradientProbe:
    """Measures how much the gradients the last backward left change when every layer-parallel
    solve of the batch iterates further (Note [gradient probe]): an estimate of their error that
    needs no exact solve and no calibration.

    Call it where ``audit_gradients`` is called (after ``loss.backward()``, before
    ``optimizer.step()``, on every rank of the layer group, with a ``closure`` that computes the
    same batch's loss again).  The closure runs once with each part's solves at one iteration
    more than the batch's last solves ran, from the same cold guess or, with warm starts, from
    the batch's own solution; then the gradients, the buffers, the solve statistics and the
    warm-start states are as they were.  It costs one layer-parallel forward and backward of the
    batch at those iterations (``GradientProbe.seconds``).

    Returns:
        A :class:`GradientProbe`, the same on every rank.
    """
    return _probe(model, closure)[0]


def _probe(model, closure):
    """``probe_gradients``, the probe's gradients ({id(p): gradient}) and what its solves
    left per part (``_solve_at``)."""
    parts = _parts(model, "probe_gradients")
    probed = [
        None if its is None else (its[0] + 1, its[1] + 1) for its in (_iterations(p) for p in parts)
    ]
    t0 = time.perf_counter()
    more, left = _solve_at(model, parts, closure, probed)
    now = {id(p): p.grad for p in model.parameters()}
    change = _relative_change(model, now, more, "a gradient probe")
    return GradientProbe(change, probed, time.perf_counter() - t0), more, left
