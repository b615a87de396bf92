"""The interface between the engine (``_chain``) and a network: a :class:`Steps` provider, and
the types the two speak in (:class:`Run`, one forward and its backward; :class:`_Graph`, one
recorded step).

A provider is the whole of what a network adds to the engine: the ResNet's layers
(``_layer_steps._LayerSteps``) and the GRU and LSTM cells (``nn._cell_steps``) are the two.  Its
required methods are abstract; its optional capabilities are methods with defaults that say
"not offered" (None), so a new provider overrides only what it can do better than the default.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

__all__ = ["Run", "Steps"]

State = torch.Tensor  # a provider's state: the ResNet's activations, an RNN's hidden state


class _Graph:
    """The graph of one step, kept from the forward's final relaxation.

    ``out`` is a function of the state leaf ``x`` and of ``leaves`` (``[(key, tensor)]``:
    parameters, inputs), whose gradients are collected under ``key``.  With ``increment`` set
    the step was ``x + scale(dt) * out`` (``Steps.scale``): the VJP ``w + out'(x)^T (scale(dt)
    w)`` then serves every step size, so coarse adjoint steps reuse the graph instead of
    recomputing the step (Note [Euler graphs]).  Otherwise ``out`` is the new state itself.

    ``y``: the new state as a tensor of a run's graph (Note [fused runs] in _engine/layer_steps.py),
    whose next step's ``x`` is this same tensor; None for a step recorded alone (``x`` a leaf).
    """

    __slots__ = ("x", "out", "leaves", "increment", "y")

    def __init__(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        leaves: Iterable[tuple[Any, torch.Tensor]] = (),
        increment: bool = False,
        y: torch.Tensor | None = None,
    ) -> None:
        self.x, self.leaves, self.increment = x, list(leaves), increment
        # out and y become gradient edges once their tensors are freed (Note [unchained
        # outputs] in _engine/layer_steps.py)
        self.out: Any = out
        self.y: Any = y


class Run:
    """One forward solve and its backward.  The engine's fields are declared here; a provider
    keeps its own in ``own``, the object its ``new_run_state()`` returns (its declared
    structure), so nothing else can be attached to a run.

    Fields: the provider (``steps``), the state's shape, dtype and device, whether to record
    graphs, whether to keep them after a backward (``retain``: differentiate again), the kept
    graphs (forward step index -> _Graph), the gradients collected per leaf (summed over the
    steps), the solves' statistics, the owned forward steps and the adjoint's level count (set
    by the engine), and ``on_backward``, called with the backward's SolveStats when it is
    known (how a module hears of it).

    Microbatches (Note [parts] in cbridge/src/cycle.c): ``sizes``, set by the module, splits an
    MGRIT solve's batch into that many microbatches solved in lockstep; the engine then makes one
    run per microbatch (``parts``, by :meth:`Steps.split_run`), each knowing its ``rows`` of the
    batch, and the callbacks of a microbatch get its run."""

    __slots__ = (
        "steps",
        "shape",
        "dtype",
        "device",
        "record",
        "retain",
        "graphs",
        "grads",
        "forward_stats",
        "backward_stats",
        "owned",
        "adjoint_levels",
        "on_backward",
        "own",
        "sizes",
        "rows",
        "parts",
    )

    def __init__(
        self,
        steps: Steps,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: Any,
        record: bool,
        retain: bool = False,
        on_backward: Callable[[Any], None] | None = None,
    ) -> None:
        self.steps = steps
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.record = bool(record)
        self.retain = bool(retain)
        self.graphs: dict[int, _Graph] = {}
        self.grads: dict[Any, torch.Tensor] = {}
        self.forward_stats: Any = None  # SolveStats, once the solve ran
        self.backward_stats: Any = None
        self.owned: Sequence[int] = ()
        self.adjoint_levels = 0
        self.on_backward = on_backward
        self.own = steps.new_run_state()
        self.sizes: Sequence[int] = ()
        self.rows: tuple[int, int] | None = None  # (start, stop) in the batch of a part's run
        self.parts: list[Run] = []


class Steps(abc.ABC):
    """What a network supplies to the engine.  Methods take the run first; ``dt`` is the step's
    length (coarse levels take longer steps), ``index`` a forward step's global index, ``s``
    the forward step an adjoint step transposes, ``level`` the MGRIT level (0 the finest),
    ``final`` whether the step belongs to the final relaxation (where graphs are recorded and
    leaves' gradients collected)."""

    # ---------------------------------------------------------------- the run
    def new_run_state(self) -> Any:
        """A new object of the provider's declared structure (``run.own``), or None when it
        keeps nothing per run."""
        return None

    # ---------------------------------------------------------------- the chain's boundary
    @abc.abstractmethod
    def begin(self, run: Run, inputs: Sequence[torch.Tensor]) -> None:
        """Keep what the steps need from the autograd Function's tensor inputs."""

    @abc.abstractmethod
    def initial(self, run: Run) -> State:
        """The state at point 0 (asked on the first rank only)."""

    @abc.abstractmethod
    def output(self, run: Run, states: Any) -> torch.Tensor:
        """The Function's output from this rank's solved states."""

    @abc.abstractmethod
    def begin_adjoint(self, run: Run, grad: torch.Tensor) -> None:
        """Keep the output's gradient."""

    @abc.abstractmethod
    def adjoint_initial(self, run: Run) -> State:
        """The adjoint state at adjoint point 0 (forward point N)."""

    @abc.abstractmethod
    def input_grads(self, run: Run, states: Any) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the Function's inputs, in order, from the adjoint states and
        ``run.grads``."""

    # ---------------------------------------------------------------- microbatches (optional)
    # Note [parts] in cbridge/src/cycle.c: a provider that can split a run's batch offers MGRIT
    # solves in microbatches; the default refuses.
    def split_run(self, run: Run, inputs: Sequence[torch.Tensor]) -> list[tuple[Run, list[Any]]]:
        """One (run, its inputs) per microbatch of ``run.sizes``, each run with its ``rows``."""
        raise ValueError(
            f"{type(self).__name__} cannot solve its batch in microbatches: use microbatches=1"
        )

    def split_grad(self, run: Run, grad: torch.Tensor) -> list[torch.Tensor]:
        """The output's gradient of each microbatch of a split run."""
        raise NotImplementedError

    def join_output(self, run: Run, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The output of a split run from its microbatches' outputs."""
        raise NotImplementedError

    def join_input_grads(
        self, run: Run, grads: Sequence[tuple[torch.Tensor | None, ...]]
    ) -> tuple[torch.Tensor | None, ...]:
        """The input gradients of a split run from its microbatches' (:meth:`input_grads`)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- steps
    @abc.abstractmethod
    def step(self, run: Run, u: State, dt: float, level: int, index: int) -> State:
        """The step from point ``index`` (no graph)."""

    @abc.abstractmethod
    def record(self, run: Run, u: State, dt: float, index: int) -> tuple[State, _Graph | None]:
        """``(next state, _Graph or None)``: a step of the final relaxation (each step once),
        with its graph when ``run.record`` (None: the provider differentiates its steps
        itself, in :meth:`adjoint_step`)."""

    def scale(self, dt: float) -> float:
        """The factor of an increment graph (see _Graph)."""
        return dt

    def adjoint_step(
        self, run: Run, w: State, dt: float, level: int, s: int, final: bool
    ) -> State | None:
        """A provider's own adjoint of forward step ``s``, or None for the VJP of its kept
        graph (the default)."""
        return None

    def source(self, run: Run, s: int) -> State | None:
        """A term added to the adjoint after step ``s``'s VJP (None: none)."""
        return None

    # ---------------------------------------------------------------- runs of steps (optional)
    # Note [fused intervals] in cbridge/src/relax.c: None (the default) makes the engine take
    # the steps one by one, still in one call of the core.
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
        """The states after each of ``len(dts)`` steps from ``u``, step k from point
        ``index + k * stride``; without ``keep`` only the last is needed (the others may be
        None)."""
        return None

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
        """The adjoint states after each adjoint step over the forward steps ``ss`` (in the
        adjoint's order), sources included."""
        return None

    # ---------------------------------------------------------------- the adjoint's end
    def adjoint_idle(self, run: Run) -> None:
        """Called when this rank's part of the adjoint solve went well and only the allreduce
        that ends it is left (Note [idle work] in cbridge/src/cycle.c): work that needs no
        other rank, such as deferred parameter gradients."""
        return None
