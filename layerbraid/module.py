"""LayerParallelModule: a ResNet-like chain of layers as MGRIT time steps, trained with autograd."""

import dataclasses
import logging
import re
import time
from typing import Any, Optional

import torch
from torch import nn

from . import checkpoint
from ._autograd import _BroadcastFn, _ToFirstFn
from ._chain import (
    BACKWARD_TWICE,
    Run,
    _Chain,
    _ChainFn,
    _check_target,
    _gradient_estimate,
    _solve_state,
)
from ._comm import (
    allgather_obj,
    allreduce_floats,
    gather_obj,
    is_comm,
    world,
)
from ._handshake import (
    MAX_DIMS,
    CloseReport,
    CloseStatus,
    Fingerprint,
    InputMeta,
    Opened,
    agree_on_input,
    check_input,
    raise_for_close,
    share_close_report,
)
from ._layer_steps import _LayerSteps, all_finite
from ._ownership import _StepLayers, draw_seed, seeded_layer
from ._parts import FreedOnExit
from ._step_rule import euler_step
from ._transport import bcast_into, neighbour_exchange
from .coarsening import SpatialCoarsening
from .grid import _GradAverager
from .launch import _enter
from .nn.batchnorm import _plain_copy, plain_modules
from .options import MGRITOptions, check_int
from .stats import SolveStats

__all__ = ["LayerParallelModule", "SolveStats"]

logger = logging.getLogger(__name__)

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")
_MAX_STEPS = 2**62  # the C core counts steps in int64


class _BuildStepsAfterInit(type):  # nn.Module's metaclass is type
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


class LayerParallelModule(FreedOnExit, nn.Module, metaclass=_BuildStepsAfterInit):
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
            iterations] in _chain.py), up to the options' ``max_iters``; e.g. 1e-2.  Cheap while the
            network is easy, more iterations as training makes it amplify.  None (default):
            the options' own stopping rule (``tol``, ``rtol``, ``max_iters``).
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
            the per-step calls (Note [fused runs] in _layer_steps.py).

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
        comm=None,
        *,
        forward_options: Optional[MGRITOptions] = None,
        backward_options: Optional[MGRITOptions] = None,
        warm_start: bool = False,
        output: str = "all",
        spatial=None,
        check_inputs: bool = True,
        check_finite: bool = True,
        target_error: Optional[float] = None,
        fused: bool = True,
    ):
        super().__init__()
        _enter()

        check_int("num_steps", num_steps, 1, _MAX_STEPS, "2**62")
        for name, flag in (
            ("warm_start", warm_start),
            ("check_inputs", check_inputs),
            ("check_finite", check_finite),
            ("fused", fused),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if (
            isinstance(t_final, bool)
            or not isinstance(t_final, (int, float))
            or not 0 < t_final < float("inf")
        ):
            raise ValueError(f"t_final must be a finite number > 0, got {t_final!r}")
        comm = world() if comm is None else comm
        grid = comm if hasattr(comm, "layer_comm") else None  # a ProcessGrid
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
        for name, o in (
            ("forward_options", forward_options),
            ("backward_options", backward_options),
        ):
            if o is not None and not isinstance(o, MGRITOptions):
                raise TypeError(f"{name} must be an MGRITOptions, got {type(o).__name__}")
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
        self.check_inputs = bool(check_inputs)
        self.check_finite = bool(check_finite)
        self.fused = fused
        self.retain_graphs = False
        if output not in ("all", "next"):
            raise ValueError(f"output must be 'all' or 'next', got {output!r}")
        self.output = output
        if spatial is not None and not isinstance(spatial, SpatialCoarsening):
            raise TypeError(f"spatial must be a SpatialCoarsening, got {type(spatial).__name__}")
        object.__setattr__(self, "spatial", spatial)
        self.open = None
        self.close = None
        self.layers = nn.ModuleDict()
        object.__setattr__(self, "_comm", comm)
        object.__setattr__(self, "_grid", grid)
        self._built = False
        self._solve_exactly = False  # set by audit_gradients
        self._solve_probe = None  # (forward, adjoint iterations[, cold]), set by probe_gradients
        self._solve_iterations = None  # (forward, adjoint iterations), set by IterationTuner
        self._audit_ratios: list[float] = []

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
    def comm(self):
        """The layer-parallel communicator."""
        return self._comm

    def _build_steps(self):
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
                self.step_layer,
                self._layer_seed,
                ref.device if ref is not None else None,
                self.layers,
            )
        except BaseException:
            self._release()
            raise
        custom = type(self).step_rule is not LayerParallelModule.step_rule
        self._steps = _LayerSteps(
            comm,
            self.num_steps,
            self._step_layers,
            self.step_rule if custom else None,
            sp,
            self.check_finite,
        )
        self._averager = None
        if self._grid is not None and self._grid.data_size > 1:
            # The replicas in a data group start from rank 0's weights (as DDP does), then
            # average their gradients at the end of every backward.
            data = self._grid.data_comm
            bcast_into(data, list(self.parameters()) + list(self.buffers()))
            self._averager = _GradAverager(self.parameters(), data)
        self._anchor = torch.zeros((), requires_grad=True)
        self._built = True

    def free(self):
        """Frees the communicator and the MGRIT cores this model created (MPICH allows about
        2,000 communicators per process).  Also done when the model is garbage collected, and
        at the end of a ``with`` block; the model cannot run afterwards.  (``close`` is the
        close layer, hence the name.)"""
        self._release()

    def _release(self):
        chain = self.__dict__.get("_chain")
        if chain is not None:
            chain.free()

    def _ref_tensors(self):
        for mod in (self.open, self.close):
            if isinstance(mod, nn.Module):
                yield from mod.parameters()

    def _counted_parameters(self):
        """The parameters whose gradient this rank alone holds (see _holds_key), for
        clip_grad_norm_."""
        return [p for k, p in self.named_parameters() if self._holds_key(k)]

    def owned_steps(self):
        """``[(global step index, step module)]`` for the steps this rank owns, in order."""
        return [(i, self.layers[str(i)]) for i in self._chain.owned]

    def mgrit_levels(self):
        """``(forward, adjoint)``: the MGRIT levels that formed, which can be fewer than the
        options ask for (few steps, large cfactors: a warning says so); 1 is exact."""
        return self._chain.fwd.num_levels(), self._chain.bwd.num_levels()

    @property
    def forward_stats(self) -> SolveStats:
        """The last forward solve's SolveStats on this rank."""
        return self._chain.forward_stats

    @property
    def backward_stats(self) -> SolveStats:
        """The last adjoint solve's SolveStats on this rank."""
        return self._chain.backward_stats

    def gradient_error_estimate(self) -> Optional[float]:
        """An estimate of the last backward's relative parameter-gradient error:
        ``backward_stats.error_estimate + 5 * forward_stats.error_estimate`` (the forward's
        error also enters the adjoint, through the states it is linearized at; its weight is the
        ratio of the two solves' shares of ``target_error``, Note [adaptive iterations]).  0.0
        for exact solves, None before a backward.  The same on every rank and for any rank
        count.  Calibrated by the audits run so far (``layerbraid.audit_gradients``, Note
        [calibrated estimate]); before the first audit it is the residuals' raw estimate,
        which on trained networks can be off by orders of magnitude."""
        return _gradient_estimate(self.forward_stats, self.backward_stats, "error_estimate")

    def _raw_gradient_error_estimate(self):
        return _gradient_estimate(self.forward_stats, self.backward_stats, "raw_error_estimate")

    def _save_stats(self):
        return None  # the stats live on the chain, which an audit's exact solves leave alone

    def _restore_stats(self, saved):
        pass

    def _set_calibration(self, k):
        self._chain.calibration = k

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
        params = [[p for p in self.layers[str(i)].parameters() if p.requires_grad] for i in owned]
        shapes = [tuple(tuple(p.shape) for p in ps) for ps in params]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                "depth_smoothness needs step layers whose parameters have the "
                f"same shapes; steps {owned[0]}..{owned[-1]} have {set(shapes)}"
            )
        flat = [torch.cat([p.reshape(-1) for p in ps]) for ps in params]
        left, right = neighbour_exchange(
            self._comm, flat[0].detach(), flat[-1].detach(), "the depth-smoothness penalty"
        )
        inner = sum(
            ((b - a).pow(2).sum() for a, b in zip(flat[:-1], flat[1:])), flat[0].new_zeros(())
        )
        graph = inner
        if left is not None:
            graph = graph + (flat[0] - left).pow(2).sum()
        if right is not None:
            right_pair = (right - flat[-1]).pow(2).sum()
            graph = graph + right_pair
        mine = float(inner.detach()) + (float(right_pair.detach()) if right is not None else 0.0)
        (total,) = allreduce_floats(self._comm, [mine], "sum", "the depth-smoothness penalty")
        return (graph + (total - graph).detach()) / (2 * self.dt)

    def set_trace(self, on: bool = True):
        """Record the schedule of the following forward and adjoint solves (see ``trace``)."""
        self._chain.fwd.set_trace(on)
        self._chain.bwd.set_trace(on)
        self._tracing = bool(on)  # a trace needs the core (Note [serial path])

    def trace(self):
        """``(forward, adjoint)``: the schedule this rank ran in the last solves, as lists of
        TraceEntry (level, op, index, peer, done), after ``set_trace(True)``."""
        return self._chain.fwd.trace(), self._chain.bwd.trace()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over the layer group.  ``x`` is used on the first rank; every rank passes
        the same batch (checked, see ``check_inputs``), or None / a 0-d tensor off the first
        rank.  Returns the close layer's output on every rank."""
        comm, first, last = self._comm, self._rank == 0, self._rank == self._size - 1
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
        opened = self._open(x) if first else None
        fingerprint = Fingerprint.of(x) if self.check_inputs else None
        meta = agree_on_input(comm, opened, fingerprint, self._settings())
        shape, dtype, device = meta.shape, meta.dtype, meta.device
        h0 = opened.state if opened is not None else None
        if self.spatial is not None:  # the same check, and error, on every rank
            self.spatial.check(shape, self._chain.num_levels())
        record = torch.is_grad_enabled()
        if h0 is None:
            # Not used by the solve; but when x comes from an earlier stage it must stay in the
            # graph, so that that stage's backward (collective) runs on this rank too.
            h0 = (
                x
                if isinstance(x, torch.Tensor) and x.requires_grad
                else torch.zeros((), dtype=dtype, device=device)
            )
        self._step_layers.exchange()
        if self._size == 1 and self._serial_path():
            out = made = self._serial_forward(h0, record)
        else:
            run = Run(self._steps, shape, dtype, device, record, retain=self.retain_graphs)
            run.own.step_params = self._steps.step_params(self._chain.owned)
            run.own.fused = bool(self.fused)
            anchor = self._anchor.to(device) if self._anchor.device != device else self._anchor
            chain = self._solving_chain()
            params = [p for leaves in run.own.step_params.values() for _, p in leaves]
            out = made = _ChainFn.apply(chain, run, anchor, h0, *params)
        report, error = None, None
        if last:
            out, report, error = self._close_report(out)
        report = share_close_report(comm, report, self._size - 1)
        raise_for_close(report, error, self._size - 1)
        if self._size == 1 and out is not made:
            return out  # a new tensor of the close layer: nothing to move, nothing to copy
        if self.output == "next":
            return _ToFirstFn.apply(comm, out, report.shape, report.dtype)
        return _BroadcastFn.apply(comm, self._size - 1, out, report.shape, report.dtype)

    def _open(self, x: Any) -> Opened:
        """The open layer's state from ``x`` on the first rank, or the error it raised."""
        try:
            check_input(x, self.check_finite)
            h0 = self.open(x) if self.open is not None else x
            if not isinstance(h0, torch.Tensor):
                raise TypeError(f"the open layer must return a tensor, got {type(h0).__name__}")
            if h0.dim() > MAX_DIMS:
                raise ValueError(
                    f"the chain's state has {h0.dim()} dimensions, more than {MAX_DIMS}"
                )
            return Opened(InputMeta(tuple(h0.shape), h0.dtype, h0.device), state=h0)
        except Exception as exc:  # tell every rank, then raise here
            return Opened(error=exc, input_shape=tuple(getattr(x, "shape", ())))

    def _close_report(self, out: Any) -> tuple[Any, CloseReport, Optional[BaseException]]:
        """The close layer's output on the last rank and its report to the others."""
        try:
            if self.close is not None:
                out = self.close(out)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the close layer must return a tensor, got {type(out).__name__}")
            if out.dim() > MAX_DIMS:
                raise ValueError(
                    f"the close layer's output has {out.dim()} dimensions, more than {MAX_DIMS}"
                )
            ok = not self.check_finite or all_finite([out.detach()])
            status = CloseStatus.OK if ok else CloseStatus.NONFINITE
            return out, CloseReport(status, tuple(out.shape), out.dtype), None
        except Exception as exc:  # tell every rank, then raise here
            return out, CloseReport(CloseStatus.ERROR, message=f"{type(exc).__name__}: {exc}"), exc

    def _solving_chain(self):
        """The chain a forward solves with: this module's own, or the variant an audit
        (exact) or a probe (further iterations) asks for."""
        if self._solve_exactly:
            return self._chain.exact()
        if self._solve_probe is not None:
            return self._chain.probe(*self._solve_probe)
        if self._solve_iterations is not None:
            return self._chain.tuned(*self._solve_iterations)
        return self._chain

    # Note [serial path]: with one rank and both solves exact (one level, or an audit's exact
    # solve) MGRIT has nothing to do: the solve is the steps one after another, and its adjoint
    # the steps' VJPs in reverse.  Then the steps run as plain autograd, in the caller's graph,
    # with no solver between them: the forward is the serial network's, the backward torch's
    # own (parameter gradients accumulate where PyTorch puts them), and what layerbraid adds is
    # the step size per step, the checks a step's output gets in the core's path (shape and
    # dtype), the solve statistics, and, at the end of the backward, the finiteness check of
    # the gradients.  The step sizes are the core's (the differences of its time points), so
    # the two paths agree bit for bit (tested).  A trace needs the core, which records it.
    def _serial_path(self):
        chain = self._chain
        exact = self._solve_exactly or (chain.fwd.num_levels() == 1 and chain.bwd.num_levels() == 1)
        return exact and not self.__dict__.get("_tracing", False)

    def _serial_forward(self, h0, record):
        """The chain's output from ``h0`` on the serial path (Note [serial path])."""
        chain = self._solving_chain()
        layers, steps, n = self._steps.layers.layers, self._steps, self.num_steps
        times = self._times()
        t0 = time.perf_counter()
        x = h0
        _solve_state.in_solve = _solve_state.final = True
        try:
            with torch.set_grad_enabled(record):
                for i in range(n):
                    y = steps.apply_rule(layers[str(i)], x, times[i + 1] - times[i], i)
                    if y.dtype != x.dtype:
                        raise TypeError(
                            f"the step at level 0, fine index {i} returned dtype {y.dtype}, "
                            f"but its input has dtype {x.dtype}: a step must keep the dtype"
                        )
                    x = y
        finally:
            _solve_state.in_solve = _solve_state.final = False
        seconds = time.perf_counter() - t0
        chain.forward_stats = SolveStats(
            0, [], seconds, seconds, 0.0, error_estimate=0.0, raw_error_estimate=0.0
        )
        if x is h0:
            x = x.clone()
        if record and x.requires_grad:
            done, retain = [], self.retain_graphs  # the backwards through this forward
            x.register_hook(lambda grad: self._serial_backward_started(chain, h0, done, retain))
        return x

    def _serial_backward_started(self, chain, h0, done, retain):
        """The chain's output got its gradient: its adjoint runs now, in the same backward;
        once the backward is over, its statistics and the finiteness check (Note [serial
        path]).  A second backward through the same forward is refused unless
        ``retain_graphs`` was set at the forward, as on more ranks, where the first backward
        frees the graphs."""
        if done and not retain:
            raise RuntimeError(BACKWARD_TWICE)
        done.append(True)
        t0 = time.perf_counter()
        owned = [
            p for leaves in self._steps.step_params(self._chain.owned).values() for _, p in leaves
        ]

        def finished():
            seconds = time.perf_counter() - t0
            chain.backward_stats = SolveStats(
                0, [], seconds, seconds, 0.0, error_estimate=0.0, raw_error_estimate=0.0
            )
            if self.check_finite:
                grads = [p.grad for p in owned if p.grad is not None]
                if h0.is_leaf and h0.grad is not None:
                    grads.append(h0.grad)
                self._steps._check_finite(None, grads)

        torch.autograd.Variable._execution_engine.queue_callback(finished)

    def _times(self):
        """The time points of the fine grid as the core computes them (grid.c): ``t_i = T *
        (i / N)``, so that a step's size is the core's to the bit."""
        times = self.__dict__.get("_time_points")
        if times is None:
            n = self.num_steps
            times = [0.0 + (self.t_final - 0.0) * (i / n) for i in range(n + 1)]
            self._time_points = times
        return times

    def _settings(self):
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
            "an exact solve (audit_gradients)": self._solve_exactly,
            "a probe's iterations (probe_gradients)": self._solve_probe,
            "tuned iterations (IterationTuner)": self._solve_iterations,
        }

    # ------------------------------------------------------------------ serial view, state
    def _gather_state(self, root=None):
        """{serial state_dict key: CPU tensor} of the whole network, on every rank (or root)."""
        mine = {k: v.detach().cpu() for k, v in super().state_dict().items() if self._holds_key(k)}
        if self._size == 1:
            return mine
        what = "the weights of every step layer"
        parts = (
            allgather_obj(self._comm, mine, what)
            if root is None
            else gather_obj(self._comm, mine, root, what)
        )
        if parts is None:
            return None
        full = {}
        for p in parts:
            full.update(p)
        return full

    def to_serial(self) -> nn.Module:
        """An ordinary, self-contained nn.Module computing the same function in one process
        (collective: it gathers every layer's weights).

        It holds no communicator, core or reference to this model, so it pickles, deep-copies
        and runs anywhere; layer-parallel batch norms become plain ``nn.BatchNorm*`` with the
        same state.  A custom ``step_rule`` is called with the serial network as ``self``: it
        should depend only on its arguments."""
        full = self._gather_state()
        layers = nn.ModuleList(
            seeded_layer(self.step_layer, i, self._layer_seed) for i in range(self.num_steps)
        )
        rule = type(self).step_rule
        serial = _SerialChain(
            _plain_copy(self.open),
            plain_modules(layers),
            _plain_copy(self.close),
            self.dt,
            None if rule is LayerParallelModule.step_rule else rule,
        )
        # assign: each tensor keeps the dtype the model has (after .double(), say), not the
        # fresh layers' default; then the device of this rank's own tensors.
        # (Copies: on one rank the gathered tensors share the model's memory.)
        serial.load_state_dict({k: v.clone() for k, v in full.items()}, assign=True)
        ref = next(iter(super().state_dict().values()), None)
        return serial if ref is None else serial.to(ref.device)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a serial (or any rank count's) state_dict: each rank keeps its own layers."""
        owned = set(self._chain.owned) if self._built else None
        keep = {}
        for k, v in state_dict.items():
            m = _LAYER_KEY.match(k)
            if m and owned is not None and int(m.group(1)) not in owned:
                continue
            keep[k] = v
        return super().load_state_dict(keep, strict=strict, assign=assign)

    def _holds_key(self, key):
        """Whether this rank holds the state_dict entry ``key``: a step layer's on its owner,
        the open layer's on the first rank, the close layer's on the last, the rest on the
        first."""
        if _LAYER_KEY.match(key):
            return True  # only the owned layers exist here
        if key.startswith("close."):
            return self._rank == self._size - 1
        return self._rank == 0

    def save_checkpoint(self, path, optimizer=None, extra=None):
        """Writes one file that any number of ranks can resume from (collective); see
        :func:`layerbraid.save_checkpoint`."""
        checkpoint.save_checkpoint(self, path, optimizer, extra)

    def load_checkpoint(self, path, optimizer=None):
        """Resumes from :meth:`save_checkpoint`'s file on any number of ranks; returns ``extra``
        (see :func:`layerbraid.load_checkpoint`)."""
        return checkpoint.load_checkpoint(self, path, optimizer)


class _SerialChain(nn.Module):
    """The serial network a LayerParallelModule computes: open, N steps, close.  ``rule`` is
    None (forward Euler) or a subclass's ``step_rule`` function, called with this module as
    ``self`` (a plain function: pickled by reference, like the module classes)."""

    def __init__(self, open, layers, close, dt, rule=None):
        super().__init__()
        self.open, self.layers, self.close = open, layers, close
        self.dt = dt
        self.rule = rule

    def depth_smoothness(self):
        """LayerParallelModule.depth_smoothness of the same layers."""
        flat = [
            torch.cat([p.reshape(-1) for p in layer.parameters() if p.requires_grad])
            for layer in self.layers
        ]
        return sum(
            ((b - a).pow(2).sum() for a, b in zip(flat[:-1], flat[1:])), flat[0].new_zeros(())
        ) / (2 * self.dt)

    def forward(self, x):
        if self.open is not None:
            x = self.open(x)
        for i, layer in enumerate(self.layers):
            if self.rule is None:
                x = euler_step(layer, x, self.dt, i)
            else:
                x = self.rule(self, layer, x, self.dt, i)
        return self.close(x) if self.close is not None else x
