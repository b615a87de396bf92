"""The steps of a LayerParallelModule on the engine: ``x <- step_rule(layer_i, x, dt, i)``.

The state enters on the first rank (the open layer's output) and leaves on the last (the close
layer's input); each rank differentiates the layers it owns.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .step_rule import check_shape, combine, euler_step, increment, note_step
from .steps import Run, State, Steps, _Graph
from .torch_private import flatten_dense

__all__ = []


@dataclass
class _LayerRun:
    """What the ResNet's provider keeps per run (``run.own``)."""

    h0: Optional[torch.Tensor] = None  # the chain's input, on the first rank
    h0_requires_grad: bool = False
    h0_shape: tuple = ()
    h0_dtype: Optional[torch.dtype] = None
    params: list = field(default_factory=list)  # the owned steps' parameters, in order
    grad_out: Optional[torch.Tensor] = None  # the output's gradient, on the last rank
    coarse_x: dict = field(default_factory=dict)  # (step, level) -> R^k x, for mode "branch"
    # set by the module before the solve: each owned step's parameters that require a gradient
    # (step -> [(id, parameter)]), and whether runs of steps are fused (Note [fused runs])
    step_params: dict = field(default_factory=dict)
    fused: bool = True
    # Note [fused runs]: id(state handed to the core) -> (that state, the same values as a
    # tensor of the run's graph), for every state the final relaxation made
    live: dict = field(default_factory=dict)
    # Note [deferred parameter gradients]: (graph, adjoint at its output) of the steps whose
    # parameter gradients wait until the adjoint solve is over
    deferred: list = field(default_factory=list)


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

    def __init__(
        self, comm: Any, num_steps: int, layers: Any, rule: Any, spatial: Any, check_finite: bool
    ) -> None:
        self.comm, self.num_steps = comm, num_steps
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.layers, self.rule, self.spatial = layers, rule, spatial
        self.check_finite = check_finite

    def apply_rule(self, layer: nn.Module, x: torch.Tensor, dt: float, index: int) -> torch.Tensor:
        if self.rule is None:
            return euler_step(layer, x, dt, index)
        try:
            y = self.rule(layer, x, dt, index)
        except Exception as exc:
            note_step(exc, layer, x, index)
            raise
        check_shape(y, x, index)
        return y

    def step_params(self, owned: Sequence[int]) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """{step: [(id, parameter)]} for the owned steps: the parameters that require a
        gradient, walked once per forward (a run's graphs collect their gradients by id)."""
        layers = self.layers.layers
        return {
            i: [(id(p), p) for p in _parameters(layers[str(i)]) if p.requires_grad] for i in owned
        }

    # ------------------------------------------------------------------ boundary
    def new_run_state(self) -> Any:
        return _LayerRun()

    def begin(self, run: Run, inputs: Sequence[torch.Tensor]) -> None:
        h0 = inputs[0]
        own = run.own
        own.h0 = h0 if self.rank == 0 else None
        own.h0_requires_grad, own.h0_shape, own.h0_dtype = h0.requires_grad, h0.shape, h0.dtype
        # the parameters whose gradients the chain returns, in the order of its other inputs
        # (which may be tensors they were made from: StepParameterization.inputs)
        own.params = [p for leaves in own.step_params.values() for _, p in leaves]
        own.coarse_x = {}

    def initial(self, run: Run) -> State:
        return run.own.h0.detach()

    def output(self, run: Run, states: Any) -> torch.Tensor:
        run.own.live = {}  # the forward's final relaxation is over
        if run.record:
            _unchain_outputs(run.graphs)
        if self.rank != self.size - 1:
            return torch.zeros((), dtype=run.dtype, device=run.device)
        out = states[self.num_steps]
        return out.clone() if out is run.own.h0 else out

    def begin_adjoint(self, run: Run, grad: torch.Tensor) -> None:
        run.own.grad_out = grad.detach() if self.rank == self.size - 1 else None

    def adjoint_initial(self, run: Run) -> State:
        return run.own.grad_out

    def input_grads(self, run: Run, states: Any) -> tuple[torch.Tensor | None, ...]:
        self._deferred_parameter_grads(run)
        if self.rank == 0:
            grad_h0 = states[self.num_steps]
        elif run.own.h0_requires_grad:
            grad_h0 = torch.zeros(run.own.h0_shape, dtype=run.own.h0_dtype, device=run.device)
        else:
            grad_h0 = None
        grads = [run.grads.get(id(p)) for p in run.own.params]
        run.own.live = {}
        if not run.retain:
            run.own.coarse_x = {}
        if self.check_finite:
            self._check_finite(grad_h0 if self.rank == 0 else None, grads)
        return (grad_h0, *grads)

    # ------------------------------------------------------------------ microbatches
    # Note [parts] in cbridge/src/cycle.c.  The batch is the first dimension of the state: the
    # first rank's input and the last rank's output and its gradient split and join along it;
    # the other ranks hold placeholders, which every part shares.
    def split_run(self, run: Run, inputs: Sequence[torch.Tensor]) -> list[tuple[Run, list[Any]]]:
        out: list[tuple[Run, list[Any]]] = []
        start = 0
        for size in run.sizes:
            part = Run(self, (size, *run.shape[1:]), run.dtype, run.device, run.record, run.retain)
            part.own.step_params, part.own.fused = run.own.step_params, run.own.fused
            part.rows = (start, start + size)
            h0 = inputs[0][start : start + size] if self.rank == 0 else inputs[0]
            out.append((part, [h0, *inputs[1:]]))
            start += size
        return out

    def split_grad(self, run: Run, grad: torch.Tensor) -> list[torch.Tensor]:
        if self.rank != self.size - 1:
            return [grad] * len(run.parts)
        return list(torch.split(grad, list(run.sizes)))

    def join_output(self, run: Run, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(outputs)) if self.rank == self.size - 1 else outputs[0]

    def join_input_grads(
        self, run: Run, grads: Sequence[tuple[Optional[torch.Tensor], ...]]
    ) -> tuple[Optional[torch.Tensor], ...]:
        h0s = [g[0] for g in grads]
        if self.rank != 0 or any(h is None for h in h0s):
            grad_h0 = h0s[0]
        else:
            grad_h0 = torch.cat([h for h in h0s if h is not None])
        summed: list[Optional[torch.Tensor]] = []
        for column in zip(*(g[1:] for g in grads)):
            present = [g for g in column if g is not None]
            total = present[0] if present else None
            for g in present[1:]:
                total = total + g
            summed.append(total)
        return (grad_h0, *summed)

    def _check_finite(
        self, grad_h0: Optional[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
    ) -> None:
        """Raises on every rank if any rank's input or parameter gradients are not finite."""
        bad = not gradients_finite(grad_h0, grads)
        first = self.comm.first_rank_where(bad, "the finiteness check of the gradients")
        if first is not None:
            raise nonfinite_gradients(first)

    # ------------------------------------------------------------------ forward steps
    def _branch(self, level: int) -> bool:
        """Whether ``level``'s steps compute their increment on a grid coarse in space."""
        sp = self.spatial
        return sp is not None and sp.mode == "branch" and sp.factor(level) > 0

    def step(self, run: Run, u: State, dt: float, level: int, index: int) -> State:
        layer = self.layers.layer(index)
        if level > 0 and self._branch(level):
            return self.spatial.branch_step(
                lambda x: self.apply_rule(layer, x, dt, index), u, level
            )
        return self.apply_rule(layer, u, dt, index)

    def record(self, run: Run, u: State, dt: float, index: int) -> tuple[State, _Graph | None]:
        if not run.record:
            return self.step(run, u, dt, 0, index), None
        if run.own.fused:  # a run of one step, chained to the step that made u if it can
            made = self.step_interval(run, u, [dt], 0, index, 1, True, True)
            assert made is not None and made[0] is not None  # recorded, fused, level 0
            return made[0], None
        layer = self.layers.layers[str(index)]
        xg = u.detach().requires_grad_(True)
        leaves = run.own.step_params[index]
        if self.rule is None:
            # Note [Euler graphs]: keep the graph of f(x) alone.  Its VJP serves every step
            # size, so the coarse adjoint steps reuse it instead of recomputing the layer.
            with torch.enable_grad():
                fx = increment(layer, xg, index)
            return combine(u, dt, fx.detach()), _Graph(xg, fx, leaves, increment=True)
        with torch.enable_grad():
            y = self.apply_rule(layer, xg, dt, index)
        return y.detach(), _Graph(xg, y, leaves)

    # Note [fused runs]: in the final relaxation each step runs once, recording its graph.  The
    # steps are recorded as one graph wherever they follow each other: within a run the core
    # hands over in one call (an F-interval; a rank's whole block with one level) each step's
    # input is the previous step's output tensor itself, not a fresh leaf; and a step whose
    # input state is one the final relaxation made (a C-point's step after its F-interval) is
    # chained to the tensor that made it (``live``, found by the state object's identity; the
    # core never changes a state).  Each step still keeps its own _Graph (x, out) into that
    # graph, so coarse adjoint steps take their VJPs step by step as before (autograd.grad
    # with a non-leaf input walks only the nodes between out and x).  The adjoint's final
    # relaxation goes through each step once in reverse: a run of steps whose graphs are
    # chained is one autograd call, for the adjoint states at every step (the gradients with
    # respect to each step's x) and every parameter's gradient at once.  The operations are
    # those of the step-by-step path (fused=False), so the two agree to round-off (tested in
    # float64 at 1e-12); what is saved is an autograd call and its Python per step.  The
    # state handed to the core is a detached view of the graph's tensor: no copy.
    def step_interval(
        self,
        run: Run,
        u: State,
        dts: Sequence[float],
        level: int,
        index: int,
        stride: int,
        final: bool,
        keep: bool,
    ) -> list[State | None] | None:
        if not (final and level == 0 and run.record and run.own.fused):
            return None
        out: list[State | None] = []
        live = run.own.live
        made = live.get(id(u))
        x = made[1] if made is not None and made[0] is u else u.detach().requires_grad_(True)
        with torch.enable_grad():
            for k, dt in enumerate(dts):
                i = index + k * stride
                layer, leaves = self.layers.layers[str(i)], run.own.step_params[i]
                if self.rule is None:  # Note [Euler graphs]: the graph of f(x) is kept
                    fx = increment(layer, x, i)
                    y = combine(x, dt, fx)
                    run.graphs[i] = _Graph(x, fx, leaves, increment=True, y=y)
                else:
                    y = self.apply_rule(layer, x, dt, i)
                    run.graphs[i] = _Graph(x, y, leaves, y=y)
                state = y.detach()
                live[id(state)] = (state, y)
                out.append(state)
                x = y
        return out

    # Note [deferred parameter gradients]: with one level the adjoint is a pipeline: a rank
    # steps its whole block once, after the rank on its right, and the rank on its left waits
    # for its last adjoint state.  A step's parameter gradients are not on that path, so every
    # rank but the first (which ends the pipeline) takes two passes: the chain of adjoint states
    # alone (autograd computes no weight gradient it is not asked for), whose last state the
    # core then sends at once, and afterwards, while the ranks on its left step theirs, the
    # parameter gradients: one autograd call per run of steps, from the run's output and the
    # same adjoint there, as the one-pass path's call but for the leaves alone.  The second
    # pass repeats the run's state gradients that its parameters need (more work on this rank,
    # off the pipeline's critical path); in exchange it keeps no adjoint state per step, so a
    # deferring rank's memory is the one-pass path's.  The gradients agree with the one-pass
    # path's to round-off (tested in float64 at 1e-12).
    def adjoint_interval(
        self,
        run: Run,
        w: State,
        dts: Sequence[float],
        level: int,
        ss: Sequence[int],
        final: bool,
        keep: bool,
    ) -> list[State | None] | None:
        """The final relaxation's adjoint over forward steps ``ss`` (latest first): one
        autograd call per chained run of their graphs (Note [fused runs]), the parameter
        gradients deferred where that shortens the pipeline (Note [deferred parameter
        gradients])."""
        if not (final and level == 0 and run.own.fused):
            return None
        defer = run.adjoint_levels == 1 and self.rank > 0
        graphs = [run.graphs[s] for s in ss]
        out: list[Optional[torch.Tensor]] = []
        start = 0
        while start < len(graphs):
            end = start + 1  # graphs[start:end] chained: each step's x is the next one's y
            while end < len(graphs) and graphs[end].y is graphs[end - 1].x:
                end += 1
            w = self._adjoint_run(run, graphs[start:end], w, keep, out, defer)
            start = end
        return out

    @staticmethod
    def _adjoint_run(
        run: Run,
        graphs: Sequence[_Graph],
        w: torch.Tensor,
        keep: bool,
        out: list[Any],
        defer: bool = False,
    ) -> torch.Tensor:
        """Appends to ``out`` the adjoint states after each step of a chained run (latest step
        first; only the last without ``keep``), sums the leaves' gradients into ``run.grads``
        (or, with ``defer``, leaves them to ``_deferred_parameter_grads``), and returns the
        last adjoint state."""
        xs = [g.x for g in graphs] if keep else [graphs[-1].x]
        leaves = {} if defer else _run_leaves(graphs)
        root = graphs[0].y
        assert root is not None  # a fused run's graphs keep their outputs
        grads = torch.autograd.grad(
            root,
            xs + list(leaves.values()),
            w,
            allow_unused=True,
            retain_graph=run.retain or defer,
        )
        if defer:
            run.own.deferred.append((graphs, w))
        _accumulate(run.grads, leaves, grads[len(xs) :])
        states: list[Optional[torch.Tensor]] = [
            g if g is not None else torch.zeros_like(w) for g in grads[: len(xs)]
        ]
        if not keep:
            missing: list[Optional[torch.Tensor]] = [None] * (len(graphs) - 1)
            states = missing + states
        out.extend(states)
        last = states[-1]
        assert last is not None
        return last

    def adjoint_idle(self, run: Run) -> None:
        self._deferred_parameter_grads(run)

    @staticmethod
    def _deferred_parameter_grads(run: Run) -> None:
        """The parameter gradients that the adjoint's first pass left (Note [deferred parameter
        gradients]): one autograd call per run of steps, from the run's output."""
        deferred, run.own.deferred = run.own.deferred, []
        for graphs, w in deferred:
            leaves = _run_leaves(graphs)
            if leaves:
                grads = torch.autograd.grad(
                    graphs[0].y,
                    list(leaves.values()),
                    w,
                    allow_unused=True,
                    retain_graph=run.retain,
                )
                _accumulate(run.grads, leaves, grads)

    # ------------------------------------------------------------------ adjoint steps
    def adjoint_step(
        self, run: Run, w: State, dt: float, level: int, s: int, final: bool
    ) -> State | None:
        """Coarse adjoint steps that cannot reuse the kept graph; None elsewhere."""
        if level == 0:
            return None
        sp = self.spatial
        xg = run.graphs[s].x
        layer = self.layers.layers[str(s)]
        if self._branch(level):
            # The transpose of x + P^k (Phi(R^k x) - R^k x), linearized at the fine state.
            return sp.branch_adjoint(
                lambda x: self.apply_rule(layer, x, dt, s),
                xg,
                w,
                level,
                cache=run.own.coarse_x.setdefault((s, level), {}),
            )
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
            (gx,) = torch.autograd.grad(yr, xr, w, allow_unused=True)
        return gx if gx is not None else torch.zeros_like(w)


def _unchain_outputs(graphs: dict[int, _Graph]) -> None:
    """Note [unchained outputs]: a fused step's graph keeps its output ``y``, the next step's
    ``x`` where the two are chained (Note [fused runs]) and the root of its run's adjoint call.
    A ``y`` that no step takes as its ``x`` (a C-point's new value: the final F-relaxation ran
    from the old one) is kept by nothing else, a whole state per C-point for as long as the
    graphs live.  Its gradient edge serves as the root instead (``torch.autograd.grad`` takes
    one), and the state is freed; the chained ones are the next step's saved input anyway."""
    xs = {id(g.x) for g in graphs.values()}
    for g in graphs.values():
        y = g.y
        if isinstance(y, torch.Tensor) and id(y) not in xs and y.grad_fn is not None:
            g.y = get_gradient_edge(y)
            if g.out is y:
                g.out = g.y


def _run_leaves(graphs: Sequence[_Graph]) -> dict[Any, torch.Tensor]:
    """{key: leaf} of a run's graphs that require a gradient; a parameter shared by several
    steps appears once, and one autograd call sums its gradient over them."""
    leaves: dict[Any, torch.Tensor] = {}
    for g in graphs:
        leaves.update((key, t) for key, t in g.leaves if t.requires_grad)
    return leaves


def _accumulate(
    sums: dict[Any, torch.Tensor],
    leaves: dict[Any, torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
) -> None:
    """Adds each leaf's gradient (None where the graph does not use it) into ``sums`` by key."""
    for key, g in zip(leaves, grads):
        if g is not None:
            sums[key] = g if key not in sums else sums[key] + g


def gradients_finite(
    grad_h0: Optional[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
) -> bool:
    """Whether this rank's input and parameter gradients (None: none) are all finite."""
    return all_finite([g for g in [grad_h0, *grads] if g is not None])


def nonfinite_gradients(rank: int) -> FloatingPointError:
    """The error of a backward whose gradients on ``rank`` (the lowest such) are not finite."""
    return FloatingPointError(
        f"the layer-parallel backward produced non-finite gradients (NaN or Inf) on rank "
        f"{rank}: the loss, the weights or the steps overflowed (check_finite=False turns this "
        "check off)"
    )


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite.  NaN and Inf survive a sum, so one sum per
    tensor (the small ones concatenated first: per-tensor calls cost more than their elements
    here), in the tensors' own precision, and the sum of those sums, read as one number per
    device and dtype, decide when they are all finite; a sum that is not finite (which a sum of
    huge finite values can be too) sends that group to the exact elementwise check."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            real = torch.view_as_real(t) if t.is_complex() else t
            groups.setdefault((real.device, real.dtype), []).append(real)
    with torch.no_grad():
        for group in groups.values():
            small = [t for t in group if t.numel() <= _SMALL]
            sums = [t.sum() for t in group if t.numel() > _SMALL]
            if small:  # one C++ call flattens them (as torch's DistributedDataParallel does)
                sums.append(flatten_dense(small).sum() if len(small) > 1 else small[0].sum())
            total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
            if not math.isfinite(float(total)) and not all(
                bool(torch.isfinite(t).all()) for t in group
            ):
                return False
    return True


_SMALL = 4096  # elements: a tensor up to this size is summed in one concatenation with the others


def _parameters(module: nn.Module) -> list[nn.Parameter]:
    """``list(module.parameters())``, in its order (modules depth first, each one's own
    parameters in registration order, every module and parameter once), without the generators
    of ``named_parameters``: this runs for every owned step at every forward."""
    out, seen, seen_modules = [], set(), set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out
