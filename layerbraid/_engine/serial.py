"""The serial side of a LayerParallelModule: the serial path one rank takes when both solves
are exact (Note [serial path]), the network ``to_serial()`` returns, and the depth-smoothness
penalty of a list of layers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ..stats import SolveStats
from .chain import BACKWARD_TWICE, _solve_state
from .step_rule import euler_step

__all__ = [
    "_SerialChain",
    "layers_penalty",
    "parallel_penalty",
    "serial_forward",
    "time_points",
]


def time_points(t_final: float, n: int) -> list[float]:
    """The time points of the fine grid as the core computes them (grid.c): ``t_i = T *
    (i / N)``, so that a step's size is the core's to the bit."""
    return [0.0 + (t_final - 0.0) * (i / n) for i in range(n + 1)]


def _exact_stats(seconds: float) -> SolveStats:
    return SolveStats(0, [], seconds, seconds, 0.0, error_estimate=0.0, raw_error_estimate=0.0)


# Note [serial path]: with one rank and both solves exact (one level, or an audit's exact
# solve) MGRIT has nothing to do: the solve is the steps one after another, and its adjoint
# the steps' VJPs in reverse.  Then the steps run as plain autograd, in the caller's graph,
# with no solver between them: the forward is the serial network's, the backward torch's
# own (parameter gradients accumulate where PyTorch puts them), and what layerbraid adds is
# the step size per step, the checks a step's output gets in the core's path (shape and
# dtype), the solve statistics, and, at the end of the backward, the finiteness check of
# the gradients.  The step sizes are the core's (the differences of its time points), so
# the two paths agree bit for bit (tested).  A trace needs the core, which records it.
def serial_forward(
    steps: Any,
    chain: Any,
    owned: Sequence[int],
    h0: torch.Tensor,
    times: Sequence[float],
    record: bool,
    retain: bool,
    check_finite: bool,
) -> torch.Tensor:
    """The chain's output from ``h0`` on the serial path: ``steps`` (the module's _LayerSteps)
    one after another; ``chain`` (the solving chain) gets the statistics; ``owned``, the
    steps whose parameters' gradients the backward checks."""
    layers = steps.layers.layers
    t0 = time.perf_counter()
    x = h0
    _solve_state.in_solve = _solve_state.final = True
    try:
        with torch.set_grad_enabled(record):
            for i in range(len(times) - 1):
                y = steps.apply_rule(layers[str(i)], x, times[i + 1] - times[i], i)
                if y.dtype != x.dtype:
                    raise TypeError(
                        f"the step at level 0, fine index {i} returned dtype {y.dtype}, "
                        f"but its input has dtype {x.dtype}: a step must keep the dtype"
                    )
                x = y
    finally:
        _solve_state.in_solve = _solve_state.final = False
    chain.forward_stats = _exact_stats(time.perf_counter() - t0)
    if x is h0:
        x = x.clone()
    if record and x.requires_grad:
        started = _backward_started(steps, chain, owned, h0, retain, check_finite)
        x.register_hook(lambda grad: started())
    return x


def _backward_started(
    steps: Any, chain: Any, owned: Sequence[int], h0: torch.Tensor, retain: bool, check: bool
) -> Callable[[], None]:
    """What runs when the chain's output gets its gradient: its adjoint runs now, in the same
    backward; once the backward is over, its statistics and the finiteness check.  A second
    backward through the same forward is refused unless ``retain`` (``retain_graphs`` at the
    forward), as on more ranks, where the first backward frees the graphs."""
    done: list[bool] = []

    def started() -> None:
        if done and not retain:
            raise RuntimeError(BACKWARD_TWICE)
        done.append(True)
        t0 = time.perf_counter()
        params = [p for leaves in steps.step_params(owned).values() for _, p in leaves]

        def finished() -> None:
            chain.backward_stats = _exact_stats(time.perf_counter() - t0)
            if check:
                grads = [p.grad for p in params if p.grad is not None]
                if h0.is_leaf and h0.grad is not None:
                    grads.append(h0.grad)
                steps._check_finite(None, grads)

        torch.autograd.Variable._execution_engine.queue_callback(finished)

    return started


def layers_penalty(layers: Sequence[nn.Module]) -> torch.Tensor:
    """``sum_i |theta_{i+1} - theta_i|^2`` over consecutive layers (their trainable
    parameters, flattened): the depth-smoothness penalty before its ``1 / (2 dt)``."""
    flat = [
        torch.cat([p.reshape(-1) for p in layer.parameters() if p.requires_grad])
        for layer in layers
    ]
    return sum(((b - a).pow(2).sum() for a, b in zip(flat[:-1], flat[1:])), flat[0].new_zeros(()))


def parallel_penalty(comm: Any, layers: Sequence[nn.Module], first: int) -> torch.Tensor:
    """:func:`layers_penalty` of the whole network, whose consecutive ``layers`` from step
    ``first`` on are this rank's (collective over ``comm``: each rank exchanges its first and
    last layer with its neighbours).  The same value on every rank, differentiable with respect
    to this rank's layers (each gets exactly its gradient)."""
    params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    shapes = [tuple(tuple(p.shape) for p in ps) for ps in params]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "depth_smoothness needs step layers whose parameters have the same shapes; "
            f"steps {first}..{first + len(layers) - 1} have {set(shapes)}"
        )
    flat = [torch.cat([p.reshape(-1) for p in ps]) for ps in params]
    what = "the depth-smoothness penalty"
    left, right = comm.neighbour_exchange(flat[0].detach(), flat[-1].detach(), what)
    inner = layers_penalty(layers)
    graph = inner
    if left is not None:
        graph = graph + (flat[0] - left).pow(2).sum()
    mine = float(inner.detach())
    if right is not None:
        right_pair = (right - flat[-1]).pow(2).sum()
        graph = graph + right_pair
        mine += float(right_pair.detach())
    (total,) = comm.allreduce_floats([mine], "sum", what)
    return graph + (total - graph).detach()


class _SerialChain(nn.Module):
    """The serial network a LayerParallelModule computes: open, N steps, close.  ``rule`` is
    None (forward Euler) or a subclass's ``step_rule`` function, called with this module as
    ``self`` (a plain function: pickled by reference, like the module classes)."""

    def __init__(
        self,
        open: nn.Module | None,
        layers: nn.ModuleList,
        close: nn.Module | None,
        dt: float,
        rule: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.open, self.layers, self.close = open, layers, close
        self.dt = dt
        self.rule = rule

    def depth_smoothness(self) -> torch.Tensor:
        """LayerParallelModule.depth_smoothness of the same layers."""
        return layers_penalty(list(self.layers)) / (2 * self.dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.open is not None:
            x = self.open(x)
        for i, layer in enumerate(self.layers):
            if self.rule is None:
                x = euler_step(layer, x, self.dt, i)
            else:
                x = self.rule(self, layer, x, self.dt, i)
        return self.close(x) if self.close is not None else x
