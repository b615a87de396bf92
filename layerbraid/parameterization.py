"""What the parameters of a layer-parallel network's steps are.

By default each step layer holds its own weights and training updates them directly.  A
:class:`StepParameterization` says otherwise: the spline steps of :class:`layerbraid.SplineModule`
evaluate every step's weights from a few coefficient sets, and ``layerbraid.from_serial`` builds
each step from a block of the user's serial network.  A model asks its parameterization for four
things: the module of a step (:meth:`~StepParameterization.layer`), what to set up once the
owned steps exist (:meth:`~StepParameterization.attach`), what to refresh before each forward
(:meth:`~StepParameterization.refresh`) and the tensors through which the steps' parameter
gradients reach what is trained (:meth:`~StepParameterization.inputs`).

:class:`LinearStepWeights` is the family the splines belong to: every step's weights a fixed
linear combination ``theta_i = sum_k W[i, k] c_k`` of trained coefficient sets; a subclass says
only which sets, with which weights, make step ``i`` (:meth:`LinearStepWeights.weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ._engine.ownership import seeded_layer

__all__ = ["LinearStepWeights", "StepParameterization"]


class ParameterizedModel(Protocol):
    """What a parameterization may use of the model that asks it (a
    :class:`layerbraid.LayerParallelModule`)."""

    num_steps: int
    t_final: float
    dt: float

    @property
    def comm(self) -> Any: ...

    def step_layer(self, index: int) -> nn.Module: ...

    def owned_steps(self) -> list[tuple[int, nn.Module]]: ...

    def _process_grid(self) -> Any: ...


class StepParameterization:
    """The plain parameterization: step ``i`` is ``model.step_layer(i)``, whose parameters are
    trained directly.  Subclass it and override what your parameterization changes; pass an
    instance as ``LayerParallelModule(..., parameterization=...)``.  One instance serves one
    model."""

    #: state_dict prefixes the serial network (``to_serial()``) has no place for
    serial_skip: tuple[str, ...] = ()

    def layer(self, model: ParameterizedModel, index: int) -> nn.Module:
        """The module of step ``index``: built for the steps this rank owns, for the copies its
        coarse steps inject, and for every step by ``to_serial()``."""
        return model.step_layer(index)

    def attach(self, model: ParameterizedModel) -> None:
        """Called on every rank once the owned step layers exist (``model.owned_steps()``),
        before the constructor returns: register what is trained (as modules of ``model``, so
        that ``model.parameters()`` and its state_dict hold them)."""

    def refresh(self, model: ParameterizedModel) -> None:
        """Called before every forward and by ``to_serial()``: set the owned step layers'
        values from what is trained."""

    def inputs(self, model: ParameterizedModel, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The chain's inputs that its step parameters' gradients are returned for: ``params``
        themselves (the owned step layers' parameters, in order), or tensors computed from
        what is trained by an autograd Function that maps their gradients back."""
        return params

    def serial_path(self, model: ParameterizedModel) -> bool:
        """Whether one rank in exact mode may run the steps as plain autograd (Note [serial
        path] in _engine/serial.py): only when the step parameters are what is trained."""
        return True


class LinearStepWeights(StepParameterization):
    """Step weights as fixed linear combinations of trained coefficient sets:
    ``theta_i = sum_k W[i, k] c_k``, for every parameter of the step (buffers, e.g. batch-norm
    statistics, stay the step's own).

    Coefficient set ``k`` is the module ``factory(k)``, seeded apart from the step layers and
    alike on every rank; the sets are registered as ``model.<name>`` (an ``nn.ModuleList``:
    ``model.parameters()`` yields them, its state_dict stores them) and every rank of the layer
    group holds all of them.  The owned steps' weights are evaluated before each forward; the
    adjoint's gradients of those weights go back to the sets through ``W``, summed over the
    layer group in one message, so that every rank holds each set's whole gradient and its
    optimizer keeps the replicas equal (Note [linear step gradients]).  The step layers'
    own parameters never get a gradient (an optimizer over ``model.parameters()`` skips them).
    Not under data parallelism (a ProcessGrid with several data groups).

    Args:
        sets: the number of coefficient sets.
        factory: ``factory(k)``, the module holding set ``k``; every set must have the same
            parameters as the step layers.
        name: the attribute of the model that holds the sets.
    """

    def __init__(
        self, sets: int, factory: Callable[[int], nn.Module], name: str = "coefficients"
    ) -> None:
        if isinstance(sets, bool) or not isinstance(sets, int) or sets < 1:
            raise ValueError(f"sets must be an int >= 1, got {sets!r}")
        self.sets, self.factory, self.name = sets, factory, name
        self.serial_skip = (name + ".",)
        self._combos: dict[int, list[tuple[int, float]]] = {}

    def weights(self, model: ParameterizedModel, index: int) -> Sequence[tuple[int, float]]:
        """``[(set k, W[index, k])]``, the nonzero weights of step ``index``."""
        raise NotImplementedError(f"{type(self).__name__} must define weights(model, index)")

    def coefficients(self, model: ParameterizedModel) -> nn.ModuleList:
        return getattr(model, self.name)

    def attach(self, model: ParameterizedModel) -> None:
        grid = model._process_grid()
        if grid is not None and grid.data_size > 1:
            raise ValueError(
                f"{type(self).__name__} under data parallelism (a ProcessGrid with "
                f"{grid.data_size} data groups) is not supported: use one data group"
            )
        seed = int(torch.randint(0, 2**62, ()).item()) ^ _COEFFICIENT_SEED  # alike on every rank
        sets = nn.ModuleList(seeded_layer(self.factory, k, seed) for k in range(self.sets))
        ref = next((p for _, layer in model.owned_steps() for p in layer.parameters()), None)
        if ref is not None:
            sets.to(ref.device)
        setattr(model, self.name, sets)
        names = [n for n, _ in sets[0].named_parameters()]
        for k, c in enumerate(sets):
            if [n for n, _ in c.named_parameters()] != names:
                made = getattr(self.factory, "__name__", "factory").lstrip("_")
                raise ValueError(
                    f"{made}({k}) has other parameters than {made}(0): every coefficient set "
                    "must have the same"
                )
        for i, layer in model.owned_steps():
            if [n for n, _ in layer.named_parameters()] != names:
                raise ValueError(
                    f"step {i}'s layer has other parameters than the coefficient sets: a step "
                    "layer must have a set's parameters"
                )
        self._combos = {i: list(self.weights(model, i)) for i, _ in model.owned_steps()}

    def refresh(self, model: ParameterizedModel) -> None:
        sets = [list(c.parameters()) for c in self.coefficients(model)]
        with torch.no_grad():
            for i, layer in model.owned_steps():
                for q, p in enumerate(layer.parameters()):
                    (k0, w0), *rest = self._combos[i]
                    value = w0 * sets[k0][q]
                    for k, w in rest:
                        value = value + w * sets[k][q]
                    p.copy_(value)

    def inputs(self, model: ParameterizedModel, params: list[torch.Tensor]) -> list[torch.Tensor]:
        trained = [p for c in self.coefficients(model) for p in c.parameters()]
        return list(_LinearFn.apply(self, model, len(params), *trained))

    def serial_path(self, model: ParameterizedModel) -> bool:
        return False  # the sets' gradients come through the chain's inputs


_COEFFICIENT_SEED = 7919  # seeds coefficient set k apart from step layer k


# Note [linear step gradients]: the chain's autograd Function takes, as the inputs its parameter
# gradients are returned for, the outputs of _LinearFn (one per owned step parameter, the
# evaluated weights), whose inputs are the coefficient sets.  So autograd hands
# _LinearFn.backward the gradients of the evaluated weights; it maps them onto the sets through
# W (each set's gradient sums its owned steps' gradients times their weights) and sums every
# set over the layer group in one message (every rank reaches it: every rank's chain backward
# runs, Note [every rank runs backward]).  Every rank thus gets the whole gradient of every
# set, and identical optimizer steps keep the replicas identical.
class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, how: LinearStepWeights, model: ParameterizedModel, count: int, *trained):
        ctx.how, ctx.model, ctx.count = how, model, len(trained)
        outs = [p.detach() for _, layer in model.owned_steps() for p in layer.parameters()]
        if len(outs) != count:
            raise RuntimeError(
                f"the steps have {len(outs)} parameters, the chain {count}: every parameter of a "
                "step with linear weights must require a gradient"
            )
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        how, model = ctx.how, ctx.model
        per_set = ctx.count // how.sets
        sums: list[torch.Tensor | None] = [None] * ctx.count
        n = 0
        for i, layer in model.owned_steps():
            size = len(list(layer.parameters()))
            for q, g in enumerate(grads[n : n + size]):
                if g is None:
                    continue
                for k, w in how._combos[i]:
                    at = k * per_set + q
                    sums[at] = w * g if sums[at] is None else sums[at] + w * g
            n += size
        trained = [p for c in how.coefficients(model) for p in c.parameters()]
        local = [s if s is not None else torch.zeros_like(p) for s, p in zip(sums, trained)]
        if model.comm.Get_size() > 1:
            local = model.comm.allreduce_sum(local, "the coefficient sets' gradients")
        return (None, None, None, *local)
