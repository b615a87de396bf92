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

    def holds(self, model: ParameterizedModel, key: str) -> bool | None:
        """Whether this rank is the one that saves the state_dict entry ``key`` of what the
        parameterization registered (checkpoints gather each entry from one rank); None for
        a key that is not the parameterization's."""
        return None

    def loads(self, model: ParameterizedModel, key: str) -> bool:
        """Whether this rank keeps the entry ``key`` of a state_dict being loaded (False for
        state it does not store)."""
        return True


class LinearStepWeights(StepParameterization):
    """Step weights as fixed linear combinations of trained coefficient sets:
    ``theta_i = sum_k W[i, k] c_k``, for every parameter of the step (buffers, e.g. batch-norm
    statistics, stay the step's own).

    Coefficient set ``k`` is the module ``factory(k)``, seeded apart from the step layers and
    alike on every rank; a rank stores only the sets its owned steps use (nonzero ``W[i, k]``),
    registered as ``model.<name>`` (an ``nn.ModuleDict`` keyed by ``str(k)``:
    ``model.parameters()`` yields them, its state_dict stores them as ``<name>.k.*``), so that
    a rank's memory for the sets does not grow with the depth or the rank count
    (:meth:`stored`, :meth:`stored_bytes`; :meth:`all_sets` gathers every set).  The owned
    steps' weights are evaluated before each forward; the adjoint's gradients of those weights
    go back to the sets through ``W``, and each set's gradient is summed over the ranks that
    store it (neighbours, for local weights such as splines) in one message per pair, so that
    each of them holds the set's whole gradient and their optimizers keep the copies equal
    (Note [linear step gradients]).  The step layers'
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
        self._holders: dict[int, list[int]] = {}  # set -> the ranks that store it, in order
        self._seed = 0

    def weights(self, model: ParameterizedModel, index: int) -> Sequence[tuple[int, float]]:
        """``[(set k, W[index, k])]``, the nonzero weights of step ``index``."""
        raise NotImplementedError(f"{type(self).__name__} must define weights(model, index)")

    def coefficients(self, model: ParameterizedModel) -> nn.ModuleDict:
        """The sets this rank stores, ``{str(k): module}``."""
        return getattr(model, self.name)

    def stored(self, model: ParameterizedModel) -> list[int]:
        """The sets this rank stores: those its owned steps use."""
        return [int(k) for k in self.coefficients(model)]

    def stored_bytes(self, model: ParameterizedModel) -> int:
        """The bytes of the sets' parameters this rank stores (an optimizer's state for them
        comes on top: Adam's two moments double it again)."""
        return sum(p.numel() * p.element_size() for p in self.coefficients(model).parameters())

    def all_sets(self, model: ParameterizedModel) -> nn.ModuleList:
        """Every coefficient set (collective over the layer group): a new ModuleList on CPU
        whose set ``k`` holds the values of the rank that saves it; a set that no step uses
        (and so no rank stores) keeps its initial values."""
        mine = {
            k: {n: t.detach().cpu() for n, t in c.state_dict().items()}
            for k, c in self.coefficients(model).items()
            if model.comm.Get_rank() == self._holders[int(k)][0]
        }
        parts = [mine]
        if model.comm.Get_size() > 1:
            parts = model.comm.allgather_obj(mine, "every coefficient set")
        out = nn.ModuleList(seeded_layer(self.factory, k, self._seed) for k in range(self.sets))
        for part in parts:
            for k, state in part.items():
                out[int(k)].load_state_dict(state)
        return out

    def attach(self, model: ParameterizedModel) -> None:
        grid = model._process_grid()
        if grid is not None and grid.data_size > 1:
            raise ValueError(
                f"{type(self).__name__} under data parallelism (a ProcessGrid with "
                f"{grid.data_size} data groups) is not supported: use one data group"
            )
        seed = int(torch.randint(0, 2**62, ()).item()) ^ _COEFFICIENT_SEED  # alike on every rank
        self._seed = seed
        self._combos = {i: list(self.weights(model, i)) for i, _ in model.owned_steps()}
        for i, combo in self._combos.items():
            bad = [k for k, _ in combo if not (isinstance(k, int) and 0 <= k < self.sets)]
            if bad:
                raise ValueError(
                    f"weights(model, {i}) names set {bad[0]!r}: the sets are 0 .. {self.sets - 1}"
                )
        used = sorted({k for combo in self._combos.values() for k, _ in combo})
        comm = model.comm
        everyone = [used]
        if comm.Get_size() > 1:
            everyone = comm.allgather_obj(used, "the coefficient sets each rank uses")
        self._holders = {}
        for r, ks in enumerate(everyone):
            for k in ks:
                self._holders.setdefault(k, []).append(r)
        made = getattr(self.factory, "__name__", "factory").lstrip("_")
        template = seeded_layer(self.factory, 0, seed)
        names = [n for n, _ in template.named_parameters()]
        sets = nn.ModuleDict({str(k): seeded_layer(self.factory, k, seed) for k in used})
        ref = next((p for _, layer in model.owned_steps() for p in layer.parameters()), None)
        if ref is not None:
            sets.to(ref.device)
        setattr(model, self.name, sets)
        for key, c in sets.items():
            if [n for n, _ in c.named_parameters()] != names:
                raise ValueError(
                    f"{made}({key}) has other parameters than {made}(0): every coefficient set "
                    "must have the same"
                )
        for i, layer in model.owned_steps():
            if [n for n, _ in layer.named_parameters()] != names:
                raise ValueError(
                    f"step {i}'s layer has other parameters than the coefficient sets: a step "
                    "layer must have a set's parameters"
                )

    def holds(self, model: ParameterizedModel, key: str) -> bool | None:
        k = _set_of(key, self.name)
        if k is None:
            return None
        holders = self._holders.get(k)
        return holders is not None and holders[0] == model.comm.Get_rank()

    def loads(self, model: ParameterizedModel, key: str) -> bool:
        k = _set_of(key, self.name)
        return k is None or str(k) in self.coefficients(model)

    def sum_gradients(
        self, model: ParameterizedModel, partial: dict[int, list[torch.Tensor]]
    ) -> dict[int, list[torch.Tensor]]:
        """Each stored set's gradient summed over the ranks that store it, from this rank's
        ``partial`` sums: one message to and from each rank that shares a set with this one
        (the transport's exchange, with its deadline); the terms added in rank order, so
        that every copy is the same to the bit."""
        comm, rank = model.comm, model.comm.Get_rank()
        shared: dict[int, list[int]] = {}  # peer -> the sets both store, in order
        for k in partial:
            for r in self._holders[k]:
                if r != rank:
                    shared.setdefault(r, []).append(k)
        if not shared:
            return partial
        messages = {r: [t for k in ks for t in partial[k]] for r, ks in shared.items()}
        got = comm.exchange(messages, messages, _GRADIENT_TAG, "the coefficient sets' gradients")
        theirs: dict[tuple[int, int], list[torch.Tensor]] = {}
        for r, ks in shared.items():
            flat = iter(got[r])
            for k in ks:
                theirs[(r, k)] = [next(flat) for _ in partial[k]]
        out = {}
        for k, mine in partial.items():
            terms = [mine if r == rank else theirs[(r, k)] for r in self._holders[k]]
            total = [t.clone() for t in terms[0]]
            for more in terms[1:]:
                for a, b in zip(total, more):
                    a.add_(b.to(a.device))
            out[k] = total
        return out

    def refresh(self, model: ParameterizedModel) -> None:
        sets = {int(k): list(c.parameters()) for k, c in self.coefficients(model).items()}
        with torch.no_grad():
            for i, layer in model.owned_steps():
                for q, p in enumerate(layer.parameters()):
                    (k0, w0), *rest = self._combos[i]
                    value = w0 * sets[k0][q]
                    for k, w in rest:
                        value = value + w * sets[k][q]
                    p.copy_(value)

    def inputs(self, model: ParameterizedModel, params: list[torch.Tensor]) -> list[torch.Tensor]:
        trained = [p for c in self.coefficients(model).values() for p in c.parameters()]
        return list(_LinearFn.apply(self, model, len(params), *trained))

    def serial_path(self, model: ParameterizedModel) -> bool:
        return False  # the sets' gradients come through the chain's inputs


_COEFFICIENT_SEED = 7919  # seeds coefficient set k apart from step layer k
_GRADIENT_TAG = 7331  # the sets' gradient sums (the transport's exchange uses it and the next)


def _set_of(key: str, name: str) -> int | None:
    """The set of the state_dict entry ``key`` (``<name>.k.*``), or None."""
    head, _, rest = key.partition(".")
    if head != name:
        return None
    k, _, _ = rest.partition(".")
    return int(k) if k.isdigit() else None


# Note [linear step gradients]: the chain's autograd Function takes, as the inputs its parameter
# gradients are returned for, the outputs of _LinearFn (one per owned step parameter, the
# evaluated weights), whose inputs are the sets this rank stores.  So autograd hands
# _LinearFn.backward the gradients of the evaluated weights; it maps them onto the sets through
# W (each set's gradient sums its owned steps' gradients times their weights) and sums each set
# over the ranks that store it (sum_gradients: every one of them reaches it, as every rank's
# chain backward runs, Note [every rank runs backward]).  Each of them thus gets the set's
# whole gradient, added in the same order, and identical optimizer steps keep the copies
# identical.  A rank stores only the sets its steps use: a B-spline is nonzero on degree + 1
# knot spans, so a rank's sets are its interval's few, shared only with its neighbours.
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
        stored = how.coefficients(model)
        params = {int(k): list(c.parameters()) for k, c in stored.items()}
        sums: dict[int, list[torch.Tensor | None]] = {
            k: [None] * len(ps) for k, ps in params.items()
        }
        n = 0
        for i, layer in model.owned_steps():
            size = len(list(layer.parameters()))
            for q, g in enumerate(grads[n : n + size]):
                if g is None:
                    continue
                for k, w in how._combos[i]:
                    have = sums[k][q]
                    sums[k][q] = w * g if have is None else have + w * g
            n += size
        partial = {
            k: [s if s is not None else torch.zeros_like(p) for s, p in zip(sums[k], params[k])]
            for k in params
        }
        total = how.sum_gradients(model, partial)
        return (None, None, None, *[t for k in params for t in total[k]])
