"""What a layer-parallel part of a model is (the interface the accuracy tools, clipping and
checkpoints use), how its solves can be varied, and which of its gradients a rank counts."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..stats import SolveStats

__all__ = [
    "ExactSolve",
    "LayerParallelPart",
    "ProbeSolve",
    "ShardedPart",
    "SolveMode",
    "TunedSolve",
    "counted_parameters",
    "layer_parallel_parts",
    "sharded_parts",
]


# ---------------------------------------------------------------- solve modes
class SolveMode(abc.ABC):
    """A variant of a part's solves that the accuracy tools put in force for one batch."""

    @abc.abstractmethod
    def pick(self, chain: Any) -> Any:
        """The chain (an engine ``_Chain``) that solves in this mode, made from ``chain``."""


@dataclass(frozen=True)
class ExactSolve(SolveMode):
    """Exact solves (one level): what ``audit_gradients`` compares with."""

    def pick(self, chain: Any) -> Any:
        return chain.exact()


@dataclass(frozen=True)
class ProbeSolve(SolveMode):
    """``forward`` / ``adjoint`` iterations from the batch's own guess, or the cold one
    (``probe_gradients``, ``IterationTuner``)."""

    forward: int
    adjoint: int
    cold: bool = False

    def pick(self, chain: Any) -> Any:
        return chain.probe(self.forward, self.adjoint, self.cold)


@dataclass(frozen=True)
class TunedSolve(SolveMode):
    """Exactly ``forward`` / ``adjoint`` iterations (the counts ``IterationTuner`` set)."""

    forward: int
    adjoint: int

    def pick(self, chain: Any) -> Any:
        return chain.tuned(self.forward, self.adjoint)


# ---------------------------------------------------------------- the parts
Calibrate = Callable[[SolveStats, float], SolveStats]


class LayerParallelPart(abc.ABC):
    """A module whose forward and backward are MGRIT solves over a layer group: what the
    accuracy tools (audits, probes, the tuner), ``clip_grad_norm_`` and the data loader need
    of it.  ``LayerParallelModule`` and the layer-parallel RNNs are the two kinds.

    Attributes (set by :meth:`_init_part`):
        solve_mode: the variant the accuracy tools put in force, or None (the part's own).
        audit_ratios: the audits' true / estimated error ratios (the calibration's history).
    """

    comm: Any
    target_error: float | None
    solve_mode: SolveMode | None
    audit_ratios: list[float]

    def _init_part(self) -> None:
        self.solve_mode = None
        self.audit_ratios = []

    def _solving(self, chain: Any) -> Any:
        """The chain a forward solves with: ``chain`` itself, or the solve mode's variant."""
        return chain if self.solve_mode is None else self.solve_mode.pick(chain)

    def _process_grid(self) -> Any:
        """The ProcessGrid the part was built on, or None."""
        return None

    @abc.abstractmethod
    def _counted_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradient this rank alone counts (for clip_grad_norm_)."""

    @abc.abstractmethod
    def gradient_error_estimate(self) -> float | None:
        """The calibrated estimate of the last backward's relative gradient error."""

    @abc.abstractmethod
    def _raw_gradient_error_estimate(self) -> float | None:
        """The same, before calibration."""

    @abc.abstractmethod
    def _save_stats(self) -> Any:
        """The solve statistics an accuracy tool's extra solves would overwrite."""

    @abc.abstractmethod
    def _restore_stats(self, saved: Any) -> None:
        """Puts back what :meth:`_save_stats` returned."""

    @abc.abstractmethod
    def _set_calibration(self, k: float) -> None:
        """Sets the factor that calibrates the error estimates."""

    @abc.abstractmethod
    def _solved(self, counts: tuple[int, ...]) -> Any:
        """What the solves of a probe at ``counts`` iterations, just run, left: statistics
        and, with warm starts, states."""

    @abc.abstractmethod
    def _adopt(self, solved: Any, calibrate: Calibrate) -> None:
        """Makes the solves :meth:`_solved` described the part's own, their statistics
        calibrated by ``calibrate(stats, k)`` with the part's factor ``k``."""


class ShardedPart(LayerParallelPart):
    """A part whose state is spread over the ranks (each rank holds its own step layers)."""

    @abc.abstractmethod
    def _holds_key(self, key: str) -> bool:
        """Whether this rank holds the state_dict entry ``key``."""


def layer_parallel_parts(model: nn.Module) -> list[LayerParallelPart]:
    """The layer-parallel modules inside ``model`` (itself included)."""
    return [m for m in model.modules() if isinstance(m, LayerParallelPart)]


def sharded_parts(model: nn.Module) -> list[tuple[str, ShardedPart]]:
    """[(name, module)] of the layer-parallel parts of ``model`` whose state is spread over the
    ranks, outermost first.  A layer-parallel RNN holds every weight on every rank, so it is
    not one: a checkpoint saves it as any replicated module."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ShardedPart)]


def counted_parameters(model):
    """``(comm, params)``: the layer group's communicator (None if the model holds no
    layer-parallel part) and the parameters of ``model`` whose gradients this rank counts, so
    that a sum over the ranks counts every gradient of the whole network once: a step layer on
    the rank that owns it, the open layer on the first rank, the close layer on the last,
    weights shared over the layer group on the first, and parameters outside any layer-parallel
    part (e.g. a head run on every rank) on the first."""
    parts = layer_parallel_parts(model)
    comms = {id(m.comm): m.comm for m in parts}
    if len(comms) > 1 and len({c.Get_size() for c in comms.values()}) > 1:
        raise ValueError("the layer-parallel parts of the model must all be on one layer group")
    comm = next(iter(comms.values())) if comms else None
    rank = comm.Get_rank() if comm is not None else 0
    inside: set[int] = set()
    counted: set[int] = set()
    for m in parts:
        assert isinstance(m, nn.Module)
        inside.update(id(p) for p in m.parameters())
        counted.update(id(p) for p in m._counted_parameters())
    params = [
        p for p in model.parameters() if id(p) in counted or (id(p) not in inside and rank == 0)
    ]
    return comm, params


class FreedOnExit:
    """``with obj:`` calls ``obj.free()`` at the end of the block (models, RNNs, grids)."""

    def free(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
