"""The exact path over several ranks, in microbatches (Note [microbatched exact path]).

Note [microbatched exact path]: with exact solves the chain is its steps one after another,
each rank running its block.  Handed the whole batch at once, a rank waits while the ranks
before it step (forward) or after it (adjoint): a pipeline with one microbatch.  Split along
its first dimension into M microbatches, the batch flows as in GPipe: rank r steps microbatch m
while rank r + 1 steps m - 1.  The forward records each microbatch's graph of the owned steps
from a leaf input; every rank's backward (Note [every rank runs backward] in _engine/chain.py)
takes each microbatch's VJP as its output gradient arrives from the right and sends the input
gradient left as soon as it has it.  Steps act on each sample alone (batch statistics are
refused, see :func:`check_independent`), so the output is the batched one and each parameter's
gradient is the sum of the microbatches' gradients, equal to the batched one to round-off.

Note [deferred W]: a rank's VJP of a microbatch is two kinds of work, the input's gradient
(which the rank to its left waits for) and the parameters' gradients (which nobody waits for
until the pass ends).  Zero-bubble pipeline schedules split them; so does this backward on every
rank but the first (torch_private.split_vjp), for the first VJPs of each pass (how many: Note
[split count] in _engine/pipeline_model.py, from this rank's timings of the passes before): it
computes the input's gradient, sends it at once, and leaves the parameters' gradients for when
the next microbatch's gradient has not arrived yet (and for the end), so the left rank starts
about half a microbatch's VJP sooner.  The rest of the pass runs fused VJPs, which cost less
work than the two parts.  The sums over microbatches are the same; only their order of addition
may differ.  A step graph that holds a custom autograd Function keeps the fused VJP: the
Function's one backward computes every gradient, so the split would run it twice.

Every message carries, after the state, one int64: -1, or the rank whose step raised.  A rank
whose step raises sends that mark in place of each state it still owes, so that its neighbour
never waits for a state that will not come; each rank receives exactly the messages the other
sent (no receive is left posted for a later forward to land in), and the pass ends with one
error check over the layer group that raises the failing rank's error on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .chain import BACKWARD_TWICE, _solve_state
from .layer_steps import gradients_finite, nonfinite_gradients
from .pipeline_model import SplitPlanner
from .serial import _exact_stats
from .torch_private import split_vjp

__all__ = ["Pipeline", "check_independent", "microbatch_sizes"]

_FORWARD_TAG, _ADJOINT_TAG = 7411, 7412
_OK = -1  # the mark of a message whose sender's steps ran


def microbatch_sizes(batch: int, microbatches: int) -> list[int]:
    """The sizes of ``min(microbatches, batch)`` microbatches of a batch of ``batch`` samples,
    as ``torch.tensor_split`` cuts it: the first ``batch % M`` get one sample more."""
    m = max(1, min(microbatches, batch))
    return [batch // m + (1 if k < batch % m else 0) for k in range(m)]


def check_independent(layers: Sequence[nn.Module], training: bool) -> None:
    """Refuses microbatches where a step couples a batch's samples: a batch norm in training
    mode normalizes over the batch, and over a microbatch it would normalize otherwise."""
    if not training:
        return
    for layer in layers:
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
                raise ValueError(
                    f"microbatches > 1 with a batch norm in training mode in a step layer "
                    f"({type(mod).__name__} {name or '(the layer)'}): its statistics are over "
                    "the batch, and microbatches would normalize each over a part of it; use "
                    "microbatches=1, or a normalization over each sample (GroupNorm, LayerNorm)"
                )


class Pipeline:
    """The microbatched exact path of one forward over its layer group ``comm``.

    Args:
        comm: the layer group's transport.
        steps: the module's _LayerSteps (``apply_rule`` and the owned layers).
        owned: the steps this rank runs, in order.
        times: the fine grid's time points (the step sizes are their differences).
        sizes: the microbatches' sizes (:func:`microbatch_sizes`).
        chain: the chain that gets the solve statistics.
        params: the owned steps' parameters whose gradients the backward returns, in order.
        record: record the graphs for a backward.
        retain: keep them after a backward (``retain_graphs``).
        check_finite: check the gradients for NaN/Inf after the backward (collective).
        planner: how many VJPs a backward splits (Note [split count]); it is handed this
            pass's timings.
    """

    def __init__(
        self,
        comm: Any,
        steps: Any,
        owned: Sequence[int],
        times: Sequence[float],
        sizes: Sequence[int],
        chain: Any,
        params: Sequence[torch.Tensor],
        *,
        record: bool,
        retain: bool,
        check_finite: bool,
        planner: SplitPlanner | None = None,
    ) -> None:
        self.comm, self.steps, self.chain = comm, steps, chain
        self.planner = planner if planner is not None else SplitPlanner()
        self.timings: dict[str, list[float]] = {k: [] for k in SplitPlanner.KINDS}
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        layers = steps.layers.layers
        self.blocks = [(i, layers[str(i)], times[i + 1] - times[i]) for i in owned]
        self.sizes, self.params = list(sizes), list(params)
        self.record, self.retain, self.check_finite = record, retain, check_finite
        self.xs: list[torch.Tensor] = []  # per microbatch: its input, a leaf of its graph
        self.ys: list[torch.Tensor] = []  # and its state after the owned steps
        self.h0_requires_grad = False
        self.used = False

    # ------------------------------------------------------------------ the passes
    def forward(self, h0: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The chain's output on the last rank (a 0-d dummy elsewhere).  ``h0``: the chain's
        input on the first rank; ``shape``, ``dtype``: its, on every rank."""
        t0 = time.perf_counter()
        device, rest = h0.device, tuple(shape[1:])
        self.h0_requires_grad = h0.requires_grad
        chunks = torch.split(h0.detach(), self.sizes) if self.first else []
        order = range(len(self.sizes))
        inbox = self._post(self.rank - 1, rest, dtype, device, _FORWARD_TAG, "state", order)
        outbox, error, mark = [], None, _OK
        xs, ys = [], []
        _solve_state.in_solve = _solve_state.final = True
        try:
            for m, n in enumerate(self.sizes):
                x, got = (chunks[m], _OK) if self.first else _receive(inbox[m])
                mark = got if got != _OK else mark
                y = x
                if mark == _OK:
                    try:
                        x = x.detach().requires_grad_(self.record)
                        with torch.set_grad_enabled(self.record):
                            begun = time.perf_counter()
                            y = self._steps(x)
                            self.timings["forward"].append(time.perf_counter() - begun)
                    except Exception as exc:  # sent on as a mark, raised on every rank below
                        error, mark = exc, self.rank
                if mark != _OK:
                    y = torch.zeros((n, *rest), dtype=dtype, device=device)
                xs.append(x)
                ys.append(y)
                if not self.last:
                    outbox.append(self._send(y, mark, self.rank + 1, _FORWARD_TAG, m, "state"))
            for msg in outbox:
                msg.wait()
        finally:
            _solve_state.in_solve = _solve_state.final = False
        self.comm.raise_on_every_rank(error, "the microbatched forward")
        self.chain.forward_stats = _exact_stats(time.perf_counter() - t0)
        if self.record:
            self.xs, self.ys = xs, ys
        if self.last:
            return torch.cat([y.detach() for y in ys]) if len(ys) > 1 else ys[0].detach()
        return torch.zeros((), dtype=dtype, device=device)

    def backward(
        self, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``(the input's gradient on the first rank, the owned parameters' gradients)``,
        summed over the microbatches."""
        if self.used and not self.retain:
            raise RuntimeError(BACKWARD_TWICE)
        self.used = True
        t0 = time.perf_counter()
        chunks = torch.split(grad, self.sizes) if self.last and grad is not None else []
        rest, dtype, device = tuple(self.xs[0].shape[1:]), self.xs[0].dtype, self.xs[0].device
        # the last microbatch first: the last rank has just made it, its graph is warm
        order = list(reversed(range(len(self.sizes))))
        inbox = self._post(self.rank + 1, rest, dtype, device, _ADJOINT_TAG, "gradient", order)
        want_x = not self.first or self.h0_requires_grad
        totals: list[torch.Tensor | None] = [None] * len(self.params)
        gxs: list[torch.Tensor] = []
        outbox, error, mark = [], None, _OK
        deferred: list[Any] = []  # weight gradients left for the waits (Note [deferred W])
        split_first = 0 if self.first else self.planner.split_first(self.size, len(order))
        for i, m in enumerate(order):
            x, y = self.xs[m], self.ys[m]
            if self.last:
                g, got = (chunks[m] if chunks else torch.zeros_like(y)), _OK
            else:
                while deferred and mark == _OK and not inbox[m][0].arrived():
                    error, mark = self._weights(deferred.pop(0), totals, error, mark)
                g, got = _receive(inbox[m])
            mark = got if got != _OK else mark
            gx = None
            if mark == _OK:
                try:
                    gx = self._vjp(x, y, g, totals, want_x, deferred if i < split_first else None)
                except Exception as exc:  # sent on as a mark, raised on every rank below
                    error, mark = exc, self.rank
            if gx is None or mark != _OK:
                gx = torch.zeros_like(x)
            if self.first:
                gxs.insert(0, gx)
            else:
                outbox.append(self._send(gx, mark, self.rank - 1, _ADJOINT_TAG, m, "gradient"))
        while deferred and mark == _OK:
            error, mark = self._weights(deferred.pop(0), totals, error, mark)
        for msg in outbox:
            msg.wait()
        grad_h0 = None
        if self.first and self.h0_requires_grad and error is None:
            grad_h0 = torch.cat(gxs) if len(gxs) > 1 else gxs[0]
        # the finiteness check rides on the error check's reduction: one, not two, at the end
        # of every backward, where the first rank waits for it
        bad = self.check_finite and error is None and not gradients_finite(grad_h0, totals)
        (nonfinite,) = self.comm.raise_on_every_rank(error, "the microbatched backward", [bad])
        for kind, seconds in self.timings.items():
            self.planner.note(kind, seconds)
            seconds.clear()
        self.planner.finished_pass()
        if not self.retain:
            self.xs, self.ys = [], []
        self.chain.backward_stats = _exact_stats(time.perf_counter() - t0)
        if nonfinite is not None:
            raise nonfinite_gradients(nonfinite)
        return grad_h0, totals

    # ------------------------------------------------------------------ pieces
    def _steps(self, x: torch.Tensor) -> torch.Tensor:
        """The owned steps on one microbatch."""
        for i, layer, dt in self.blocks:
            y = self.steps.apply_rule(layer, x, dt, i)
            if y.dtype != x.dtype:
                raise TypeError(
                    f"the step at level 0, fine index {i} returned dtype {y.dtype}, "
                    f"but its input has dtype {x.dtype}: a step must keep the dtype"
                )
            x = y
        return x

    def _vjp(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        g: torch.Tensor,
        totals: list[torch.Tensor | None],
        want_x: bool,
        deferred: list[Any] | None,
    ) -> torch.Tensor | None:
        """One microbatch's VJP: its input's gradient (when wanted); the parameters'
        gradients are added to ``totals``, or, given ``deferred`` (where a rank to the left
        waits for the input's gradient), left there to compute later (Note [deferred W])."""
        inputs = ([x] if want_x else []) + self.params
        if not y.requires_grad or not inputs:
            return None
        begun = time.perf_counter()
        if deferred is not None and self.params and x.requires_grad:
            split = split_vjp(y, g, x, self.params)
            if split is not None:
                gx, weights = split
                deferred.append(weights)
                self.timings["split_input"].append(time.perf_counter() - begun)
                return gx
        got = torch.autograd.grad(y, inputs, g, retain_graph=self.retain, allow_unused=True)
        _add(totals, got[1:] if want_x else got)
        self.timings["vjp"].append(time.perf_counter() - begun)
        return got[0] if want_x else None

    def _weights(
        self, weights: Any, totals: list[torch.Tensor | None], error: Any, mark: int
    ) -> tuple[Any, int]:
        """Computes one microbatch's deferred weight gradients into ``totals``; a failure
        becomes this rank's mark, as a step's does."""
        try:
            begun = time.perf_counter()
            _add(totals, weights(self.retain))
            self.timings["split_weights"].append(time.perf_counter() - begun)
        except Exception as exc:  # raised on every rank at the end of the backward
            return exc, self.rank
        return error, mark

    def _post(
        self,
        peer: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: Any,
        tag: int,
        what: str,
        order: Sequence[int],
    ) -> dict[int, tuple[Any, tuple[int, ...], torch.dtype]]:
        """Every microbatch's message from ``peer`` (none where there is no such rank), posted
        at once so that each arrives while this rank works on the one before, in ``order``,
        the order they are sent in (messages with one tag match receives in posting order)."""
        if not 0 <= peer < self.size:
            return {}
        size = torch.empty((), dtype=dtype).element_size()
        out = {}
        for m in order:
            shape = (self.sizes[m], *rest)
            count = size * math.prod(shape) + _MARK_BYTES
            msg = self.comm.start_recv(
                (count,), torch.uint8, device, peer, tag, f"microbatch {m}'s {what}"
            )
            out[m] = (msg, shape, dtype)
        return out

    def _send(self, t: torch.Tensor, mark: int, dest: int, tag: int, m: int, what: str) -> Any:
        """Starts sending microbatch ``m``'s ``t`` and the mark to ``dest``, as one message."""
        mark_t = torch.tensor([mark], dtype=torch.int64, device=t.device)
        flat = torch.cat([_flat(t), _flat(mark_t)])
        return self.comm.start_send(flat, dest, tag, f"microbatch {m}'s {what}")


_MARK_BYTES = 8


def _add(totals: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Adds a microbatch's parameter gradients to the sums over microbatches."""
    for k, dp in enumerate(grads):
        if dp is not None:
            total = totals[k]
            totals[k] = dp if total is None else total.add_(dp)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _receive(posted: tuple[Any, tuple[int, ...], torch.dtype]) -> tuple[torch.Tensor, int]:
    """(the state, the mark) of a posted message, once it arrived."""
    msg, shape, dtype = posted
    flat = msg.wait()
    mark = int(flat[-_MARK_BYTES:].clone().view(torch.int64).item())
    return flat[:-_MARK_BYTES].view(dtype).view(shape), mark


class PipelineFn(torch.autograd.Function):
    """``inputs -> output`` by the microbatched exact path (``pipe``, one per forward);
    ``anchor`` (Note [every rank runs backward] in _engine/chain.py) makes the output require
    grad on every rank.  ``inputs``: the tensors the parameters' gradients are returned for."""

    @staticmethod
    def forward(ctx, pipe, shape, dtype, anchor, h0, *inputs):
        ctx.pipe = pipe
        return pipe.forward(h0, shape, dtype)

    @staticmethod
    def backward(ctx, grad):
        grad_h0, grads = ctx.pipe.backward(grad)
        return (None, None, None, None, grad_h0, *grads)
