"""LayerParallelModule: a ResNet-like chain of layers as MGRIT time steps, trained with autograd."""

import abc
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from ._comm.world import Comm, is_comm, resolve
from ._engine.autograd import _BroadcastFn, _ToFirstFn
from ._engine.chain import (
    Run,
    _Chain,
    _ChainFn,
    _check_target,
)
from ._engine.chain_part import OneChainPart
from ._engine.handshake import (
    Fingerprint,
    InputMeta,
    agree_on_input,
    raise_for_close,
    share_close_report,
)
from ._engine.layer_steps import _LayerSteps
from ._engine.ownership import _StepLayers, draw_seed
from ._engine.parts import ExactSolve, FreedOnExit
from ._engine.pipeline import Pipeline, PipelineFn, check_independent, microbatch_sizes
from ._engine.pipeline_model import SplitPlanner
from ._engine.schedule import lib
from ._engine.serial import parallel_penalty, serial_forward, time_points
from ._engine.sharded_state import ShardedState
from ._engine.stages import close_output, open_input, placeholder
from ._engine.step_rule import euler_step
from ._engine.torch_private import prepare_split
from .coarsening import SpatialCoarsening
from .grid import ProcessGrid, replicate
from .launch import _enter
from .options import MGRITOptions, check_int
from .parameterization import StepParameterization
from .stats import SolveStats

__all__ = ["LayerParallelModule", "SolveStats"]

logger = logging.getLogger(__name__)

_MAX_STEPS = 2**62  # the C core counts steps in int64
_MAX_MGRIT_PARTS = int(lib.MGRIT_MAX_PARTS)  # the C core's tags hold this many microbatches


class _BuildStepsAfterInit(abc.ABCMeta):  # nn.Module's metaclass is type; the part's ABCMeta
    """Builds the step layers when the subclass's __init__ has returned, so that ``step_layer``
    may use attributes the subclass sets after ``super().__init__()``."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        if "_comm" not in obj.__dict__:
            raise TypeError(
                f"{cls.__name__}.__init__ must call super().__init__(num_steps, ...) "
                "(LayerParallelModule's), before setting any layer"
            )
        obj._build_steps()
        return obj


class LayerParallelModule(FreedOnExit, OneChainPart, ShardedState, metaclass=_BuildStepsAfterInit):
    """A network ``open -> N residual steps -> close`` whose steps are solved by MGRIT.

    Subclass it, call ``super().__init__(...)``, set ``self.open`` and ``self.close`` (optional
    modules; the open layer runs on the first rank of the layer group, the close layer on the
    last) and define ``step_layer(index)``, which returns the module ``f`` of global step
    ``index``; the step is ``x <- x + dt * f(x)`` unless ``step_rule`` is overridden.  The step
    layers are built for the steps this rank owns as soon as the constructor returns.

    ``model(x)`` is collective over the layer group and returns the close layer's output on every
    rank, connected to autograd: ``loss.backward()`` runs the adjoint MGRIT solve, and every
    parameter gets its gradient on the rank that owns it (``.grad`` accumulates as in PyTorch).

    Args:
        num_steps: N, the number of residual steps (at least the number of ranks).
        t_final: T; the step size is ``dt = T / N``.
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        forward_options: MGRIT settings of the forward solve (default: one level, i.e. exact
            sequential stepping across the ranks).
        backward_options: MGRIT settings of the adjoint solve (default: one level).
        warm_start: start each solve from the states of the previous one (same input shape),
            which makes cheap settings (2 forward, 1 backward iteration) much more accurate;
            a solve with a warm guess does not skip its first down-cycle (that would discard
            the guess), so ``skip_first_downcycle`` applies to the first batch only.
        target_error: adaptive iterations: each forward and adjoint solve iterates until its
            estimated relative error (``SolveStats.error_estimate``) is below its share of
            ``target_error`` (the forward a tenth, the adjoint half: Note [adaptive
            iterations] in _engine/chain.py), up to the options' ``max_iters``; e.g. 1e-2.
            Cheap while the network is easy, more iterations as training makes it amplify.
            None (default): the options' own stopping rule (``tol``, ``rtol``, ``max_iters``).
        output: ``"all"`` (default): the close layer's output on every rank, for a loss computed
            on every rank.  ``"next"``: the output only on the first rank (a placeholder on the
            others), to feed the next layer-parallel stage of a network whose state changes
            shape between stages (see examples/tiny_imagenet.py).
        spatial: a :class:`layerbraid.SpatialCoarsening`: coarse MGRIT levels also coarse in
            space (convolutional step layers then run on the coarse grid).
        check_inputs: every forward checks that each rank of the layer group was given the same
            input as the first rank (a fingerprint rides on the broadcast the forward does
            anyway) and raises ``ValueError`` on every rank if not.  Ranks that pass a 0-d
            tensor or None (e.g. the placeholder of an earlier stage) are not checked.  The
            labels are not seen by the model: the loss's gradient is taken on the last rank, so
            its labels must be the batch's (``layerbraid.data.LayerParallelLoader`` does both).
        check_finite: raise ``FloatingPointError`` on every rank when the output (checked on
            the last rank) or the input gradient and parameter gradients (checked after the
            adjoint solve) hold NaN or Inf, in every mode, one level included.
        fused: record each run of steps of the final relaxation as one graph and take the
            adjoint's final relaxation over it in one autograd call per run (default True);
            False takes one autograd call per step.  The two agree to round-off; fused saves
            the per-step calls (Note [fused runs] in _engine/layer_steps.py).
        parameterization: what the steps' parameters are (a
            :class:`layerbraid.parameterization.StepParameterization`); default: each step
            layer's own weights, trained directly.
        microbatches: split each batch along its first dimension into this many microbatches
            and pipeline them through the ranks: a rank steps one microbatch while the next
            rank steps the one before.  With exact solves on several ranks this is GPipe's
            schedule over the chain (Note [microbatched exact path] in _engine/pipeline.py);
            with MGRIT every phase of the solve runs microbatch after microbatch, so that the
            coarsest level's sequential solve and the sweeps' hand-offs become pipelines too
            (at most 254 microbatches; Note [parts] in cbridge/src/cycle.c).  The output and
            every gradient equal the batched ones to round-off (with MGRIT, at the same
            iteration counts).  Refused (ValueError) with a batch norm in training mode in a
            step layer, whose statistics are over the batch.  Default 1: the whole batch at
            once.

    The attribute ``retain_graphs`` (default False) keeps the steps' graphs after a backward,
    so that the same forward can be differentiated again (``retain_graph=True``,
    ``torch.autograd.gradcheck``); by default the first backward frees them.

    Both solves always finish with an FC relaxation (``final_fc_relax`` is forced on): that is
    when each layer runs once more to record the graph that backward differentiates.
    """

    spatial: Optional[SpatialCoarsening]

    def __init__(
        self,
        num_steps: int,
        t_final: float = 1.0,
        comm: Union[Comm, ProcessGrid, None] = None,
        *,
        forward_options: Optional[MGRITOptions] = None,
        backward_options: Optional[MGRITOptions] = None,
        warm_start: bool = False,
        output: str = "all",
        spatial: Optional[SpatialCoarsening] = None,
        check_inputs: bool = True,
        check_finite: bool = True,
        target_error: Optional[float] = None,
        fused: bool = True,
        parameterization: Optional[StepParameterization] = None,
        microbatches: int = 1,
    ) -> None:
        super().__init__()
        _enter()

        comm, grid = _check_arguments(
            num_steps,
            t_final,
            comm,
            {
                "warm_start": warm_start,
                "check_inputs": check_inputs,
                "check_finite": check_finite,
                "fused": fused,
            },
            {"forward_options": forward_options, "backward_options": backward_options},
        )
        self.num_steps = num_steps
        self.t_final = float(t_final)
        self.dt = self.t_final / num_steps
        self.forward_options = dataclasses.replace(
            forward_options or MGRITOptions(max_levels=1), final_fc_relax=True
        )
        self.backward_options = dataclasses.replace(
            backward_options or MGRITOptions(max_levels=1), final_fc_relax=True
        )
        self.warm_start = bool(warm_start)
        self.target_error = _check_target(target_error)
        _check_output_and_spatial(output, spatial)
        if parameterization is None:
            parameterization = StepParameterization()
        if not isinstance(parameterization, StepParameterization):
            raise TypeError(
                "parameterization must be a StepParameterization, got "
                f"{type(parameterization).__name__}"
            )
        self.parameterization = parameterization
        self.check_inputs = bool(check_inputs)
        self.check_finite = bool(check_finite)
        self.microbatches = check_int("microbatches", microbatches, 1, 2**31 - 1)
        self.fused = fused
        self.retain_graphs = False
        self.output = output
        self.spatial = spatial
        self.open = None
        self.close = None
        self.layers = nn.ModuleDict()
        self._comm = comm
        self._grid = grid
        self._built = False
        self._init_part()

    # ------------------------------------------------------------------ what subclasses define
    def step_layer(self, index: int) -> nn.Module:
        """The module f of global step ``index`` (0 <= index < num_steps)."""
        raise NotImplementedError(f"{type(self).__name__} must define step_layer(index)")

    def step_rule(self, layer: nn.Module, x: torch.Tensor, dt: float, index: int) -> torch.Tensor:
        """One step of the chain; forward Euler by default.  Must return a new tensor of the same
        shape and dtype as ``x``.  Coarse MGRIT levels call it with a longer ``dt``.  Override
        it for another rule (docs/ARCHITECTURE.md, "Adding a step rule")."""
        return euler_step(layer, x, dt, index)

    # ------------------------------------------------------------------ construction
    @property
    def comm(self) -> Comm:
        """The layer-parallel communicator."""
        return self._comm

    def _build_steps(self) -> None:
        comm = self._comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        sp = self.spatial
        self._chain = _Chain(
            comm,
            self.num_steps,
            self.t_final,
            self.forward_options,
            self.backward_options,
            warm_start=self.warm_start,
            target_error=self.target_error,
            spatial=sp if sp is not None and sp.mode == "state" else None,
        )
        ref = next(self._ref_tensors(), None)
        self._layer_seed = draw_seed()
        try:
            self._step_layers = _StepLayers(
                comm,
                self._chain.levels,
                self._chain.owned,
                self._step_factory,
                self._layer_seed,
                ref.device if ref is not None else None,
                self.layers,
            )
        except BaseException:
            self._release()
            raise
        self._steps = _LayerSteps(
            comm,
            self.num_steps,
            self._step_layers,
            self.step_rule if self._custom_rule() is not None else None,
            sp,
            self.check_finite,
        )
        self._averager = replicate(self, self._grid)
        self._anchor = torch.zeros((), requires_grad=True)
        self._split_planner = SplitPlanner()  # the microbatched backward's (Note [split count])
        if self.microbatches > 1 and self._rank > 0:  # a rank whose backward splits VJPs
            prepare_split()
        try:
            self.parameterization.attach(self)
        except BaseException:
            self._release()
            raise
        self._built = True

    def _step_factory(self, index: int) -> nn.Module:
        """The module of step ``index``, as the parameterization builds it."""
        return self.parameterization.layer(self, index)

    def free(self) -> None:
        """Frees the communicator and the MGRIT cores this model created (MPICH allows about
        2,000 communicators per process).  Also done when the model is garbage collected, and
        at the end of a ``with`` block; the model cannot run afterwards.  (``close`` is the
        close layer, hence the name.)"""
        self._release()

    def _release(self) -> None:
        chain = self.__dict__.get("_chain")
        if chain is not None:
            chain.free()

    def _ref_tensors(self) -> Iterator[torch.Tensor]:
        for mod in (self.open, self.close):
            if isinstance(mod, nn.Module):
                yield from mod.parameters()

    def _custom_rule(self) -> Any:
        rule = type(self).step_rule
        return None if rule is LayerParallelModule.step_rule else rule

    def owned_steps(self) -> list[tuple[int, nn.Module]]:
        """``[(global step index, step module)]`` for the steps this rank owns, in order."""
        return [(i, self.layers[str(i)]) for i in self._chain.owned]

    def depth_smoothness(self) -> torch.Tensor:
        """The depth-smoothness penalty of layer-parallel training (Günther et al., 2020):
        ``sum_i |theta_{i+1} - theta_i|^2 / (2 dt)`` over consecutive step layers, the
        discretized integral of the weights' squared derivative in depth.  Add ``gamma`` times
        it to the loss to keep neighbouring layers alike: MGRIT's coarse steps use one fine
        layer's weights for ``cfactor`` steps, which approximates the fine steps only where
        the weights change slowly with depth.

        Collective over the layer group (each rank exchanges its first and last layer with its
        neighbours).  Returns the whole network's penalty on every rank, differentiable with
        respect to the layers this rank owns (each gets exactly its gradient); needs step
        layers whose parameters have the same shapes."""
        owned = self._chain.owned
        layers = [self.layers[str(i)] for i in owned]
        return parallel_penalty(self._comm, layers, owned[0]) / (2 * self.dt)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over the layer group.  ``x`` is used on the first rank; every rank passes
        the same batch (checked, see ``check_inputs``), or None / a 0-d tensor off the first
        rank.  Returns the close layer's output on every rank."""
        self._check_usable()
        self.parameterization.refresh(self)  # before the exchange of the injected copies
        first, last = self._rank == 0, self._rank == self._size - 1
        opened = open_input(self.open, x, self.check_finite) if first else None
        fingerprint = Fingerprint.of(x) if self.check_inputs else None
        meta = agree_on_input(self._comm, opened, fingerprint, self._settings())
        if self.spatial is not None:  # the same check, and error, on every rank
            self.spatial.check(meta.shape, self._chain.num_levels())
        h0 = opened.state if opened is not None else None  # set where the open layer ran
        h0 = h0 if h0 is not None else placeholder(x, meta)
        self._step_layers.exchange()
        made = self._solve(h0, meta, torch.is_grad_enabled())
        out, report, error = made, None, None
        if last:
            out, report, error = close_output(self.close, made, self.check_finite)
        report = share_close_report(self._comm, report, self._size - 1)
        raise_for_close(report, error, self._size - 1)
        if self._size == 1 and out is not made:
            return out  # a new tensor of the close layer: nothing to move, nothing to copy
        if self.output == "next":
            return _ToFirstFn.apply(self._comm, out, report.shape, report.dtype)
        return _BroadcastFn.apply(self._comm, self._size - 1, out, report.shape, report.dtype)

    def _check_usable(self) -> None:
        if not self.__dict__.get("_built", False):
            raise RuntimeError(
                f"model(x) was called before {type(self).__name__} finished building (from "
                "__init__ or step_layer?): the step layers and the MGRIT solvers are built "
                "after __init__ returns; call the model afterwards"
            )
        if self._chain.freed:
            raise RuntimeError(
                "this layer-parallel model was freed (model.free()): build a new one"
            )

    def _solve(self, h0: torch.Tensor, meta: InputMeta, record: bool) -> torch.Tensor:
        """The chain's output from ``h0``: the serial path (one rank, exact solves) or the
        MGRIT solves, as an autograd Function."""
        chain = self._solving(self._chain)
        owned, retain = self._chain.owned, self.retain_graphs
        if self._size == 1 and self._serial_path() and self.parameterization.serial_path(self):
            times = time_points(self.t_final, self.num_steps)
            return serial_forward(
                self._steps, chain, owned, h0, times, record, retain, self.check_finite
            )
        step_params = self._steps.step_params(owned)
        params = [p for leaves in step_params.values() for _, p in leaves]
        anchor = self._anchor
        if anchor.device != meta.device:
            anchor = anchor.to(meta.device)
        sizes = microbatch_sizes(meta.shape[0], self.microbatches) if meta.shape else [1]
        if self._size > 1 and len(sizes) > 1 and self._serial_path():
            check_independent([layer for _, layer in self.owned_steps()], self.training)
            times = time_points(self.t_final, self.num_steps)
            pipe = Pipeline(
                self._comm,
                self._steps,
                owned,
                times,
                sizes,
                chain,
                params,
                record=record,
                retain=retain,
                check_finite=self.check_finite,
                planner=self._split_planner,
            )
            inputs = self.parameterization.inputs(self, params)
            return PipelineFn.apply(pipe, meta.shape, meta.dtype, anchor, h0, *inputs)
        run = Run(self._steps, meta.shape, meta.dtype, meta.device, record, retain)
        run.own.step_params = step_params
        run.own.fused = bool(self.fused)
        if len(sizes) > 1:
            check_independent([layer for _, layer in self.owned_steps()], self.training)
            if len(sizes) > _MAX_MGRIT_PARTS:
                raise ValueError(
                    f"microbatches={self.microbatches} with MGRIT solves: at most "
                    f"{_MAX_MGRIT_PARTS} microbatches (exact solves take any number)"
                )
            run.sizes = sizes
        inputs = self.parameterization.inputs(self, params)
        return _ChainFn.apply(chain, run, anchor, h0, *inputs)

    def _serial_path(self) -> bool:
        """Whether this forward takes the serial path (Note [serial path] in _engine/serial.py)."""
        chain = self._chain
        exact = isinstance(self.solve_mode, ExactSolve) or (
            chain.fwd.num_levels() == 1 and chain.bwd.num_levels() == 1
        )
        return exact and not self.__dict__.get("_tracing", False)

    def _settings(self) -> dict[str, Any]:
        """What every rank of the layer group must agree on for a forward and its backward: the
        settings that change a solve's schedule or stopping, and what the step layers do."""
        modes = [m.training for m in self.modules()]
        chain = self._chain
        return {
            "training mode (model.train() / model.eval())": (all(modes), any(modes)),
            "target_error": chain.target_error,
            "the calibration of the error estimate": chain.calibration,
            "warm_start": chain.warm_start,
            "output": self.output,
            "check_finite": (self.check_finite, self._steps.check_finite),
            "check_inputs": self.check_inputs,
            "microbatches": self.microbatches,
            "the solve mode (audit_gradients, probe_gradients, IterationTuner)": self.solve_mode,
        }


def _check_arguments(
    num_steps: int, t_final: Any, comm: Any, flags: dict[str, Any], options: Any
) -> tuple[Any, Any]:
    """The constructor's checks, in its order; ``(layer communicator, ProcessGrid or None)``."""
    check_int("num_steps", num_steps, 1, _MAX_STEPS, "2**62")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if (
        isinstance(t_final, bool)
        or not isinstance(t_final, (int, float))
        or not 0 < t_final < float("inf")
    ):
        raise ValueError(f"t_final must be a finite number > 0, got {t_final!r}")
    comm = resolve(comm)
    grid = comm if isinstance(comm, ProcessGrid) else None
    comm = grid.layer_comm if grid is not None else comm
    if not is_comm(comm):
        raise TypeError(
            f"comm must be an mpi4py communicator or a ProcessGrid, got {type(comm).__name__}"
        )
    if num_steps < comm.Get_size():
        raise ValueError(
            f"num_steps={num_steps} is smaller than the number of layer-parallel "
            f"ranks ({comm.Get_size()}): every rank needs at least one step"
        )
    for name, o in options.items():
        if o is not None and not isinstance(o, MGRITOptions):
            raise TypeError(f"{name} must be an MGRITOptions, got {type(o).__name__}")
    return comm, grid


def _check_output_and_spatial(output: Any, spatial: Any) -> None:
    if output not in ("all", "next"):
        raise ValueError(f"output must be 'all' or 'next', got {output!r}")
    if spatial is not None and not isinstance(spatial, SpatialCoarsening):
        raise TypeError(f"spatial must be a SpatialCoarsening, got {type(spatial).__name__}")
