"""The steps of a LayerParallelModule on the engine: ``x <- step_rule(layer_i, x, dt, i)``.

The state enters on the first rank (the open layer's output) and leaves on the last (the close
layer's input); each rank differentiates the layers it owns.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch

from ._chain import Steps, _Graph
from ._comm import first_rank_where

__all__ = []


@dataclass
class _LayerRun:
    """What the ResNet's provider keeps per run (``run.own``)."""

    h0: Optional[torch.Tensor] = None           # the chain's input, on the first rank
    h0_requires_grad: bool = False
    h0_shape: tuple = ()
    h0_dtype: Optional[torch.dtype] = None
    params: list = field(default_factory=list)  # the owned steps' parameters, in order
    grad_out: Optional[torch.Tensor] = None     # the output's gradient, on the last rank
    coarse_x: dict = field(default_factory=dict)  # (step, level) -> R^k x, for mode "branch"


class _LayerSteps(Steps):
    """Args:
        comm: the layer group's communicator.
        num_steps: N.
        layers: a _StepLayers (owned layers and the copies coarse steps inject).
        rule: ``rule(layer, x, dt, index) -> next state`` (the model's step_rule), or None for
            forward Euler ``x + dt * layer(x)``, whose graphs are increments (Note [Euler graphs]).
        spatial: a SpatialCoarsening, or None.
        check_finite: check the gradients for NaN/Inf after the adjoint (collective).
    """

    def __init__(self, comm, num_steps, layers, rule, spatial, check_finite):
        self.comm, self.num_steps = comm, num_steps
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.layers, self.rule, self.spatial = layers, rule, spatial
        self.check_finite = check_finite

    def apply_rule(self, layer, x, dt, index):
        if self.rule is not None:
            y = self.rule(layer, x, dt, index)
            check_shape(y, x, index)
            return y
        fx = layer(x)
        check_shape(fx, x, index)
        return x + dt * fx

    def params(self, index):
        return [p for p in self.layers.layers[str(index)].parameters() if p.requires_grad]

    # ------------------------------------------------------------------ boundary
    def new_run_state(self):
        return _LayerRun()

    def begin(self, run, inputs):
        h0, params = inputs[0], inputs[1:]
        own = run.own
        own.h0 = h0 if self.rank == 0 else None
        own.h0_requires_grad, own.h0_shape, own.h0_dtype = h0.requires_grad, h0.shape, h0.dtype
        own.params = params
        own.coarse_x = {}

    def initial(self, run):
        return run.own.h0.detach()

    def output(self, run, states):
        if self.rank != self.size - 1:
            return torch.zeros((), dtype=run.dtype, device=run.device)
        out = states[self.num_steps]
        return out.clone() if out is run.own.h0 else out

    def begin_adjoint(self, run, grad):
        run.own.grad_out = grad.detach() if self.rank == self.size - 1 else None

    def adjoint_initial(self, run):
        return run.own.grad_out

    def input_grads(self, run, states):
        if self.rank == 0:
            grad_h0 = states[self.num_steps]
        elif run.own.h0_requires_grad:
            grad_h0 = torch.zeros(run.own.h0_shape, dtype=run.own.h0_dtype, device=run.device)
        else:
            grad_h0 = None
        grads = [run.grads.get(id(p)) for p in run.own.params]
        if not run.retain:
            run.own.coarse_x = {}
        if self.check_finite:
            self._check_finite(grad_h0 if self.rank == 0 else None, grads)
        return (grad_h0, *grads)

    def _check_finite(self, grad_h0, grads):
        """Raises on every rank if any rank's input or parameter gradients are not finite."""
        with torch.no_grad():
            bad = any(g is not None and not bool(torch.isfinite(g).all())
                      for g in [grad_h0] + grads)
        first = first_rank_where(self.comm, bad, "the finiteness check of the gradients")
        if first is not None:
            raise FloatingPointError(
                f"the layer-parallel backward produced non-finite gradients (NaN or Inf) on rank "
                f"{first}: the loss, the weights or the steps overflowed (check_finite=False "
                "turns this check off)")

    # ------------------------------------------------------------------ forward steps
    def _branch(self, level):
        """Whether ``level``'s steps compute their increment on a grid coarse in space."""
        sp = self.spatial
        return sp is not None and sp.mode == "branch" and sp.factor(level) > 0

    def step(self, run, u, dt, level, index):
        layer = self.layers.layer(index)
        if level > 0 and self._branch(level):
            return self.spatial.branch_step(
                lambda x: self.apply_rule(layer, x, dt, index), u, level)
        return self.apply_rule(layer, u, dt, index)

    def record(self, run, u, dt, index):
        if not run.record:
            return self.step(run, u, dt, 0, index), None
        layer = self.layers.layers[str(index)]
        xg = u.detach().requires_grad_(True)
        leaves = [(id(p), p) for p in layer.parameters() if p.requires_grad]
        if self.rule is None:
            # Note [Euler graphs]: keep the graph of f(x) alone.  Its VJP serves every step
            # size, so the coarse adjoint steps reuse it instead of recomputing the layer.
            with torch.enable_grad():
                fx = layer(xg)
            check_shape(fx, u, index)
            return u + dt * fx.detach(), _Graph(xg, fx, leaves, increment=True)
        with torch.enable_grad():
            y = self.apply_rule(layer, xg, dt, index)
        return y.detach(), _Graph(xg, y, leaves)

    # ------------------------------------------------------------------ adjoint steps
    def adjoint_step(self, run, w, dt, level, s, final):
        """Coarse adjoint steps that cannot reuse the kept graph; None elsewhere."""
        if level == 0:
            return None
        sp = self.spatial
        xg = run.graphs[s].x
        layer = self.layers.layers[str(s)]
        if self._branch(level):
            # The transpose of x + P^k (Phi(R^k x) - R^k x), linearized at the fine state.
            return sp.branch_adjoint(lambda x: self.apply_rule(layer, x, dt, s), xg, w, level,
                                     cache=run.own.coarse_x.setdefault((s, level), {}))
        if sp is not None and sp.factor(level) > 0:
            # Mode "state", a grid coarse in space: linearize at the fine state restricted to it.
            xr = sp.to_level(xg.detach(), level)
        elif self.rule is None:
            return None  # an increment graph serves the coarse dt too
        else:
            # The transpose of the forward coarse step over the same interval: the layer at its
            # start in forward time, linearized at the fine state there.
            xr = xg.detach()
        with torch.enable_grad():
            xr = xr.requires_grad_(True)
            yr = self.apply_rule(layer, xr, dt, s)
            gx, = torch.autograd.grad(yr, xr, w, allow_unused=True)
        return gx if gx is not None else torch.zeros_like(w)


def check_shape(fx, x, index):
    if not isinstance(fx, torch.Tensor):
        raise TypeError(f"step layer {index} returned {type(fx).__name__}, not a tensor: a step "
                        "layer must return a tensor of the state's shape")
    if fx.shape != x.shape:
        raise ValueError(f"step layer {index} returned shape {tuple(fx.shape)} for a state of "
                         f"shape {tuple(x.shape)}: a step layer must keep the state's shape")
