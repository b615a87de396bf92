"""The engine under every layer-parallel network: a chain of N steps solved forward in time by
MGRIT, and its adjoint solved backward in time by MGRIT, plugged into autograd.

A network supplies its steps through a :class:`Steps` provider (the ResNet's layers in
``_engine/layer_steps.py``, the GRU and LSTM cells in ``nn/rnn.py``); the engine owns the rest:

- the forward core, and the adjoint core on the reversed communicator with the extra steps
  mirrored, so that each rank differentiates exactly the steps it ran forward;
- the adjoint index map (Note [adjoint index map]);
- the capture of each owned step's graph in the forward's final relaxation, the only time a step
  runs with ``done`` on the fine level, and the VJPs that reuse it;
- the collection of the gradients of the graphs' leaves (parameters, inputs);
- warm starts, statistics, and the solve state that layer-parallel batch norms read.

Everything one forward and its backward need travels in a :class:`Run`, handed by the core to
every callback (the app of the solve) and saved in the autograd context: nothing is handed over
through attributes of the model.

Note [every rank runs backward]: the adjoint solve is collective, so ``_ChainFn.backward`` must
run on every rank of the layer group.  A chain whose output is used on one rank only (the
ResNet's, on the last) is given an anchor input that requires grad, so that its output always
requires grad; on the other ranks that output is a dummy which feeds a broadcast whose output
every rank uses (``_autograd._BroadcastFn``), so whenever the loss depends on the model's output,
autograd reaches ``_ChainFn.backward`` everywhere.
"""

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from ..options import MGRITOptions
from ..stats import SolveStats, contraction, error_estimate
from .bridge import _Core
from .steps import Run, Steps
from .warn import warn

__all__ = ["Run", "Steps"]  # (the interface types live in _steps)

# The probe solvers a chain keeps, one per pair of iteration counts (each holds two cores and a
# communicator; MPICH allows about 2,000 communicators per process).
_PROBES_KEPT = 4

# How adaptive iterations split a model's target_error (Note [adaptive iterations]).
_FORWARD_SHARE = 0.1
_ADJOINT_SHARE = 0.5


class _SolveState(threading.local):
    """Note [batch-norm stats] (nn/batchnorm.py): ``in_solve`` while a solve (forward or
    adjoint) runs, ``final`` while a step of the forward's final fine relaxation runs."""

    in_solve = False
    final = False


_solve_state = _SolveState()


class _Chain:
    """The forward and adjoint MGRIT cores of one chain of ``num_steps`` steps over ``comm``.

    Args:
        comm: the layer group's communicator.
        num_steps, t_final: the steps and the time they span (``dt = t_final / num_steps``).
        forward_options, backward_options: MGRITOptions (final FC relaxation on).
        spatial: a SpatialCoarsening in mode "state" (coarse levels hold coarse states), else
            None.
        warm_start: start each solve from the previous solve's states (Note [warm start]).
        target_error: iterate each solve until its error estimate meets its share of
            ``target_error`` (Note [adaptive iterations]); None: the options' own stopping
            rule.
        store_all: the forward core keeps every state (else only what its cycles read again;
            the provider then takes what its output needs in the final relaxation).

    ``calibration`` (default 1) multiplies the residuals' error estimates (Note [calibrated
    estimate], accuracy/audit.py); ``exact()`` is the same chain solved exactly, ``probe()``
    the same chain iterated further (Note [gradient probe], accuracy/probe.py).
    """

    def __init__(
        self,
        comm: Any,
        num_steps: int,
        t_final: float,
        forward_options: MGRITOptions,
        backward_options: MGRITOptions,
        *,
        spatial: Any = None,
        warm_start: bool = False,
        target_error: Optional[float] = None,
        store_all: bool = True,
    ) -> None:
        self.comm = comm
        self.num_steps = num_steps
        self.t_final, self.store_all = t_final, store_all
        self.calibration = 1.0
        self._exact: Optional[_Chain] = None
        self._probes: dict[tuple[int, int], _Chain] = {}  # (forward, adjoint iterations) ->
        # the variant tuned() returns, with its counts in _tuned_key
        self._tuned: Optional[_Chain] = None
        self._tuned_key: Optional[tuple[int, int]] = None
        # a tuned variant's chain: it takes the variant's stats and states
        self._parent: Optional[_Chain] = None
        self.spatial, self.target_error = spatial, target_error
        self._cores: list[_Core] = []  # what free() closes, set before anything can fail
        self.fwd: _Core = self._forward_core(forward_options)
        self._cores.append(self.fwd)
        try:
            self.fwd.setup()  # collective: the options must agree across ranks
            self.levels = self.fwd.level_info()
            lo, hi, _ = self.levels[0]
            self.owned = list(range(max(lo, 1) - 1, hi))
            self.bwd: _Core = self._adjoint_core(backward_options)
            self._cores.append(self.bwd)
            self.bwd.setup()
        except BaseException:
            self.free()
            raise
        self.strides = [m for (_, _, m) in self.bwd.level_info()]
        if comm.Get_rank() == 0:
            _warn_if_reduced(
                num_steps,
                [
                    (forward_options, self.fwd.num_levels(), "forward"),
                    (backward_options, self.bwd.num_levels(), "adjoint"),
                ],
            )
        alo, ahi, _ = self.bwd.level_info()[0]
        starts = sorted(num_steps - j for j in range(max(alo, 1), ahi + 1))
        assert starts == self.owned, "adjoint distribution does not mirror the forward one"
        self.warm_start = bool(warm_start)
        self._warm_fwd: dict[int, Any] = {}
        self._warm_bwd: dict[int, Any] = {}
        # the cold guesses of the solve running, one per part's shape
        self._zeros: dict[tuple[int, ...], torch.Tensor] = {}
        self._options = {id(self.fwd): forward_options, id(self.bwd): backward_options}
        self._contraction: dict[Any, float] = {}  # core -> the last contraction factor
        self._alignment: dict[Any, float] = {}  # core -> last residual sum / residual norm
        self.forward_stats, self.backward_stats = SolveStats(), SolveStats()

    def _forward_core(self, options: MGRITOptions) -> _Core:
        spatial = self.spatial
        return _Core(
            self.comm,
            self.num_steps,
            0.0,
            self.t_final,
            options,
            init=self._fwd_init,
            step=self._fwd_step,
            step_interval=self._fwd_interval,
            store_all=self.store_all,
            coarsen=spatial.restrict if spatial else None,
            refine=spatial.interpolate if spatial else None,
        )

    def _adjoint_core(self, options: MGRITOptions) -> _Core:
        """The adjoint runs backward in time on the reversed communicator, with the extra steps
        mirrored, so that each rank differentiates exactly its own steps.  It keeps only the
        states its cycles read again: the gradients need the last point alone."""
        comm, spatial = self.comm, self.spatial
        rank, size = comm.Get_rank(), comm.Get_size()
        rev = comm.Split(0, size - 1 - rank, "the construction of the adjoint's MGRIT solver")
        return _Core(
            rev,
            self.num_steps,
            0.0,
            self.t_final,
            options,
            init=self._bwd_init,
            step=self._bwd_step,
            mirror=True,
            step_interval=self._bwd_interval,
            store_all=False,
            idle=lambda run: run.steps.adjoint_idle(run),
            real_ranks=list(range(size))[::-1],
            owns_comm=True,
            coarsen=spatial.restrict_adjoint if spatial else None,
            refine=spatial.interpolate_adjoint if spatial else None,
        )

    def free(self) -> None:
        """Frees both cores and the reversed communicator (owned by the adjoint core), and the
        exact chain's."""
        for core in self._cores:
            core.close()
        if self._exact is not None:
            self._exact.free()
        for probe in self._probes.values():
            probe.free()
        self._probes.clear()
        if self._tuned is not None:
            self._tuned.free()
            self._tuned = None

    def exact(self) -> "_Chain":
        """This chain solved exactly: one level, i.e. sequential stepping across the ranks, over
        the same steps on the same ranks (the distribution does not depend on the levels).
        Built on first use (collective), freed with this chain; no warm start, no target."""
        if self._exact is None:
            one = MGRITOptions(max_levels=1, final_fc_relax=True)
            self._exact = _Chain(
                self.comm, self.num_steps, self.t_final, one, one, store_all=self.store_all
            )
        return self._exact

    def probe(self, fwd_iters: int, bwd_iters: int, cold: bool = False) -> "_Chain":
        """This chain with its forward and adjoint solves running exactly ``fwd_iters`` and
        ``bwd_iters`` MGRIT iterations (no stopping rule, no target), on the same levels, from
        the guesses this chain's next solves would start from: with warm starts the last
        solves' states (unless ``cold``), else the cold guess (Note [gradient probe],
        accuracy/probe.py).  Built on first use per pair of counts (collective); the last
        _PROBES_KEPT pairs' are kept, freed with this chain."""
        key = (fwd_iters, bwd_iters)
        probe = self._probes.pop(key, None)  # reinserted below: the most recently used last
        if probe is None:
            if len(self._probes) >= _PROBES_KEPT:  # adaptive iterations vary the counts
                self._probes.pop(next(iter(self._probes))).free()  # the same on every rank
            probe = self._counted(fwd_iters, bwd_iters)
        self._probes[key] = probe
        probe._warm_fwd, probe._warm_bwd = (
            ({}, {}) if cold else (dict(self._warm_fwd), dict(self._warm_bwd))
        )
        return probe

    def tuned(self, fwd_iters: int, bwd_iters: int) -> "_Chain":
        """This chain with its solves running exactly ``fwd_iters`` and ``bwd_iters``
        iterations, for training (Note [tuned iterations], accuracy/tuner.py): unlike a
        probe's, what it solves is this chain's own: its solve statistics and warm-start
        states are this chain's, as if this chain had solved.  Built when the counts change
        (collective), one at a time, freed with this chain."""
        key = (fwd_iters, bwd_iters)
        if self._tuned_key != key:
            if self._tuned is not None:
                self._tuned.free()
                self._tuned = None
            self._tuned = self._counted(fwd_iters, bwd_iters)
            self._tuned._parent, self._tuned_key = self, key
        tuned = self._tuned
        assert tuned is not None
        tuned._warm_fwd, tuned._warm_bwd = self._warm_fwd, self._warm_bwd
        tuned.calibration = self.calibration
        return tuned

    def _counted(self, fwd_iters: int, bwd_iters: int) -> "_Chain":
        f, b = (
            replace(o, max_iters=k, tol=0.0, rtol=0.0)
            for o, k in (
                (self._options[id(self.fwd)], fwd_iters),
                (self._options[id(self.bwd)], bwd_iters),
            )
        )
        return _Chain(
            self.comm,
            self.num_steps,
            self.t_final,
            f,
            b,
            spatial=self.spatial,
            warm_start=self.warm_start,
            store_all=self.store_all,
        )

    @property
    def freed(self) -> bool:
        return self.fwd._core is None

    def num_levels(self) -> int:
        return max(self.fwd.num_levels(), self.bwd.num_levels())

    def adjoint_step_index(self, index: int, level: int) -> int:
        """Note [adjoint index map]: adjoint point j is forward point N - j, so the adjoint step
        from point j on a level of stride m runs backward over forward step s = N - j - m (the
        step from forward point s to s + m)."""
        return self.num_steps - index - self.strides[level]

    # ------------------------------------------------------------------ the two solves
    def forward(self, run: Run, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The forward solve of ``run`` from the autograd Function's ``inputs``: its output.
        With ``run.sizes`` the batch is solved in microbatches (Note [parts] in
        cbridge/src/cycle.c), one run of ``run.parts`` each."""
        run.owned = self.owned
        run.adjoint_levels = self.bwd.num_levels()
        split = run.steps.split_run(run, inputs) if len(run.sizes) > 1 else [(run, list(inputs))]
        for part, part_inputs in split:
            part.owned, part.adjoint_levels = run.owned, run.adjoint_levels
            run.steps.begin(part, part_inputs)
        run.parts = [part for part, _ in split] if len(split) > 1 else []
        _solve_state.in_solve = True
        try:
            run.forward_stats, states = self._solve(self.fwd, run, self._warm_fwd)
        finally:
            _solve_state.in_solve = _solve_state.final = False
        self.forward_stats = run.forward_stats
        if self.warm_start:
            self._warm_fwd = {i: s for i, s in _joined(states).items() if i > 0}
        if self._parent is not None:  # a tuned variant: what it solved is its chain's
            self._parent.forward_stats, self._parent._warm_fwd = self.forward_stats, self._warm_fwd
        if not run.parts:
            return run.steps.output(run, states[0])
        outs = [run.steps.output(part, st) for part, st in zip(run.parts, states)]
        return run.steps.join_output(run, outs)

    def backward(self, run: Run, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """The adjoint solve of ``run`` for the output's gradient: the inputs' gradients."""
        if not run.record:
            raise RuntimeError("backward through a layer-parallel forward that ran without grad")
        parts = run.parts or [run]
        grads = run.steps.split_grad(run, grad) if run.parts else [grad]
        for part, part_grad in zip(parts, grads):
            run.steps.begin_adjoint(part, part_grad)
            part.grads = {}
        # Coarse adjoint steps may run a layer again (a custom rule, spatial coarsening): as in
        # the forward's sweeps, its batch norms then leave their running statistics alone.
        _solve_state.in_solve = True
        try:
            run.backward_stats, states = self._solve(self.bwd, run, self._warm_bwd)
        finally:
            _solve_state.in_solve = _solve_state.final = False
            if not run.retain:
                for part in parts:
                    part.graphs = {}
        self.backward_stats = run.backward_stats
        if run.on_backward is not None:
            run.on_backward(run.backward_stats)
        if self.warm_start:
            self._warm_bwd = {i: s for i, s in _joined(states).items() if i > 0}
        if self._parent is not None:
            self._parent.backward_stats, self._parent._warm_bwd = (
                self.backward_stats,
                self._warm_bwd,
            )
        if not run.parts:
            return run.steps.input_grads(run, states[0])
        part_grads = [run.steps.input_grads(part, st) for part, st in zip(parts, states)]
        return run.steps.join_input_grads(run, part_grads)

    def _solve(
        self, core: _Core, run: Run, warm: dict[int, Any]
    ) -> tuple[SolveStats, list[dict[int, Any]]]:
        """Solves ``run`` (each of its parts) on ``core``: the statistics, and each part's
        {fine index: state}."""
        opts = self._options[id(core)]
        if opts.max_levels > 1:
            # Note [warm start]: a skipped first down-cycle gives the coarse levels no
            # right-hand side, so they solve the coarse chain from point 0 alone, whatever the
            # guess, and the correction then replaces the guess at every C-point by that coarse
            # solution: the guess is lost.  So a solve skips only when it has no warm guess.
            has_guess = self.warm_start and self._usable(warm, run)
            core.set_skip(opts.skip_first_downcycle and not has_guess)
            if self.target_error is not None:
                share = _FORWARD_SHARE if core is self.fwd else _ADJOINT_SHARE
                core.set_rtol(self._adaptive_rtol(core, share * self.target_error))
        t0 = time.perf_counter()
        self._zeros = {}
        try:
            with torch.no_grad():
                iters, norms = core.solve(run, run.device, run.parts)
        finally:
            self._zeros = {}
        states = [core.states(p) for p in range(max(len(run.parts), 1))]
        core.release_states()  # what the solve returns is in states; the core would keep it
        stats = SolveStats(
            iters, norms, time.perf_counter() - t0, core.step_seconds, core.comm_seconds()
        )
        final, final_sum, unorm = core.final_residual()
        if final is not None:
            assert final_sum is not None and unorm is not None  # measured together
            stats.final_residual, stats.state_norm = final, unorm
            stats.contraction = contraction(norms + [final])
            stats.raw_error_estimate = error_estimate(final_sum, unorm, core.num_c_points())
            if stats.raw_error_estimate is not None:
                stats.error_estimate = self.calibration * stats.raw_error_estimate
            if stats.contraction is not None:
                self._contraction[id(core)] = stats.contraction
            if final > 0:
                self._alignment[id(core)] = final_sum / final
        elif opts.max_levels == 1 or core.num_levels() == 1:
            stats.error_estimate = stats.raw_error_estimate = 0.0
        if self.target_error is not None and stats.error_estimate is not None:
            share = _FORWARD_SHARE if core is self.fwd else _ADJOINT_SHARE
            stats.target = share * self.target_error
        return stats, states

    def _adaptive_rtol(self, core: _Core, target: float) -> float:
        """Note [adaptive iterations]: a solve stops at the first residual r with
        ``k * a * sqrt(C) * q * r / |u| <= target``: the error estimate (Note [error estimate])
        of the solution after the final relaxation, which reduces the residual by about the last
        measured contraction q, with the residuals' last measured alignment a (the sum of their
        norms over their 2-norm, between 1 and sqrt(C)), times the calibration k from the last
        audits (Note [calibrated estimate]); before any was measured q = 1 and a = sqrt(C).

        The target splits unevenly: the adjoint gets half of ``target_error``, the forward a
        tenth.  The forward's error enters the gradients twice, through the adjoint's
        linearization: with ReLU steps a state error flips activations near their kink, so a
        small forward error can give a much larger gradient error.  A tighter forward costs
        about one iteration."""
        c = max(core.num_c_points(), 1)
        q = min(max(self._contraction.get(id(core), 1.0), 0.05), 1.0)
        a = min(max(self._alignment.get(id(core), math.sqrt(c)), 1.0), math.sqrt(c))
        return target / (self.calibration * a * math.sqrt(c) * q)

    @staticmethod
    def _usable(warm: dict[int, Any], run: Run) -> bool:
        s = next(iter(warm.values()), None)
        return s is not None and tuple(s.shape) == run.shape and s.dtype == run.dtype

    def _guess(self, warm: dict[int, Any], index: int, run: Run) -> torch.Tensor:
        """The previous solve's state at ``index`` (warm start; a part's run takes its rows of
        it), else zeros: one tensor for every point of a solve (the core never writes into a
        state the application made, Note [private states] in _engine/bridge.py), so that a cold
        start's guesses cost one state per part's shape."""
        s = warm.get(index)
        if s is not None and run.rows is not None:
            s = s[run.rows[0] : run.rows[1]]
        if s is not None and tuple(s.shape) == run.shape and s.dtype == run.dtype:
            return s
        zeros = self._zeros.get(run.shape)
        if zeros is None:
            zeros = self._zeros[run.shape] = torch.zeros(
                run.shape, dtype=run.dtype, device=run.device
            )
        return zeros

    # ------------------------------------------------------------------ callbacks
    def _fwd_init(self, run: Run, t: float, index: int) -> torch.Tensor:
        if index == 0:
            return run.steps.initial(run)
        return self._guess(self._warm_fwd, index, run)

    def _fwd_step(
        self, run: Run, u: Any, t0: float, t1: float, level: int, index: int, done: bool
    ) -> Any:
        self._zeros = {}  # the guesses are made: what the core keeps of them stays
        final = bool(done and level == 0)
        _solve_state.final = final
        if final:
            y, graph = run.steps.record(run, u, t1 - t0, index)
            if graph is not None:
                run.graphs[index] = graph
            return y
        return run.steps.step(run, u, t1 - t0, level, index)

    def _fwd_interval(
        self,
        run: Run,
        u: Any,
        times: Any,
        level: int,
        index: int,
        stride: int,
        done: bool,
        keep: bool,
    ) -> list[Any]:
        """A run of forward steps: the provider's fused version, else one step at a time
        (which still saves the core's crossing into Python per step)."""
        self._zeros = {}  # the guesses are made: what the core keeps of them stays
        final = bool(done and level == 0)
        _solve_state.final = final
        dts = [b - a for a, b in zip(times[:-1], times[1:])]
        out = run.steps.step_interval(run, u, dts, level, index, stride, final, keep)
        if out is not None:
            return out
        return _one_by_one(self._fwd_step, run, u, times, level, index, stride, done, keep)

    def _bwd_init(self, run: Run, t: float, index: int) -> torch.Tensor:
        if index == 0:
            return run.steps.adjoint_initial(run)
        return self._guess(self._warm_bwd, index, run)

    def _bwd_step(
        self, run: Run, w: Any, t0: float, t1: float, level: int, index: int, done: bool
    ) -> Any:
        self._zeros = {}  # the guesses are made: what the core keeps of them stays
        s = self.adjoint_step_index(index, level)
        steps = run.steps
        final = bool(level == 0 and done)
        out = steps.adjoint_step(run, w, t1 - t0, level, s, final)
        if out is None:
            out = self._vjp(run, run.graphs[s], w, steps.scale(t1 - t0), final)
        src = steps.source(run, s)
        return out if src is None else out + src

    def _bwd_interval(
        self,
        run: Run,
        w: Any,
        times: Any,
        level: int,
        index: int,
        stride: int,
        done: bool,
        keep: bool,
    ) -> list[Any]:
        self._zeros = {}  # the guesses are made: what the core keeps of them stays
        dts = [b - a for a, b in zip(times[:-1], times[1:])]
        ss = [self.adjoint_step_index(index + k * stride, level) for k in range(len(dts))]
        out = run.steps.adjoint_interval(run, w, dts, level, ss, bool(level == 0 and done), keep)
        if out is not None:
            return out
        return _one_by_one(self._bwd_step, run, w, times, level, index, stride, done, keep)

    @staticmethod
    def _vjp(run: Run, graph: Any, w: torch.Tensor, scale: float, final: bool) -> torch.Tensor:
        """The VJP of a kept graph for the state; in the final relaxation (each step once) also
        for its leaves, whose gradients are summed into ``run.grads``."""
        leaves = [(k, t) for k, t in graph.leaves if t.requires_grad] if final else []
        if graph.increment and not leaves:
            # The VJP is linear in w: scaling the result instead of w keeps one state less
            # alive while autograd runs.
            (gx,) = torch.autograd.grad(
                graph.out, graph.x, w, allow_unused=True, retain_graph=run.retain or not final
            )
            return w.clone() if gx is None else torch.add(w, gx, alpha=scale)
        grads = torch.autograd.grad(
            graph.out,
            [graph.x] + [t for _, t in leaves],
            scale * w if graph.increment else w,
            allow_unused=True,
            retain_graph=run.retain or not final,
        )
        for (key, _), g in zip(leaves, grads[1:]):
            if g is not None:
                run.grads[key] = g if key not in run.grads else run.grads[key] + g
        gx = grads[0]
        if graph.increment:
            return w + gx if gx is not None else w.clone()
        return gx if gx is not None else torch.zeros_like(w)


def _joined(states: list[dict[int, Any]]) -> dict[int, Any]:
    """The whole batch's {fine index: state} from its parts' (one part: its own)."""
    if len(states) == 1:
        return states[0]
    return {i: torch.cat([st[i] for st in states]) for i in states[0]}


# The reduced-hierarchy messages already given in this process: a network's solvers are built
# again when the batch's shape changes, and the user needs to read it once.
_REDUCED_WARNED: set[str] = set()


def _warn_if_reduced(num_steps: int, solves: list[tuple[MGRITOptions, int, str]]) -> None:
    """Warns (once per process and message, on the calling rank) when the hierarchy that
    formed is smaller than the options ask for: a level is coarsened only while the coarser
    one keeps ``min_coarse`` steps, so few steps or large cfactors give fewer levels, down to
    exact sequential stepping.  ``solves``: (options, levels formed, name) of each solve;
    solves reduced alike share one message."""
    texts: dict[str, list[str]] = {}
    for options, levels, solve in solves:
        if levels >= options.max_levels:
            continue
        what = "exact sequential stepping" if levels == 1 else f"{levels} levels"
        text = (
            f"asked for {options.max_levels} MGRIT levels with cfactor {options.cfactor} over "
            f"{num_steps} steps, but only {levels} level(s) form (a level is coarsened while "
            f"the coarser one keeps at least min_coarse={options.min_coarse} steps): it runs "
            f"{what}"
        )
        texts.setdefault(text, []).append(solve)
    for text, names in texts.items():
        message = f"the {' and '.join(names)} solve{'s' if len(names) > 1 else ''} {text}"
        if message not in _REDUCED_WARNED:
            _REDUCED_WARNED.add(message)
            warn(message)


def _one_by_one(
    step: Any,
    run: Run,
    u: Any,
    times: Any,
    level: int,
    index: int,
    stride: int,
    done: bool,
    keep: bool,
) -> list[Any]:
    """A run of steps as ``len(times) - 1`` calls of a one-step callback; without keep only the
    last state is returned (the core keeps no other)."""
    out = []
    for k in range(len(times) - 1):
        u = step(run, u, times[k], times[k + 1], level, index + k * stride, done)
        out.append(u if keep or k == len(times) - 2 else None)
    return out


BACKWARD_TWICE = (
    "backward ran twice through the same layer-parallel forward: the forward's "
    "graphs are freed by the first backward (to save memory); set "
    "model.retain_graphs = True before the forward to backward through it again "
    "(retain_graph=True, gradcheck)"
)


class _ChainFn(torch.autograd.Function):
    """``inputs -> output`` by a chain's forward solve; backward by its adjoint solve.  The chain
    and the run arrive as arguments and are kept in ``ctx``; ``anchor`` (Note [every rank runs
    backward]) may be None."""

    @staticmethod
    def forward(
        ctx: Any, chain: _Chain, run: Run, anchor: Any, *inputs: torch.Tensor
    ) -> torch.Tensor:
        out = chain.forward(run, inputs)
        ctx.chain, ctx.run = chain, run
        ctx.num_inputs = len(inputs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        run = ctx.run
        if run is None:
            raise RuntimeError(BACKWARD_TWICE)
        grads = ctx.chain.backward(run, grad)
        if not run.retain:
            ctx.run = None  # the kept graphs are consumed
        assert len(grads) == ctx.num_inputs
        return (None, None, None, *grads)


def _gradient_estimate(
    fwd: Optional[SolveStats], bwd: Optional[SolveStats], field: str
) -> Optional[float]:
    """Note [adaptive iterations]: the adjoint's estimate plus the forward's weighted by the
    ratio of the two solves' shares of a target."""
    if fwd is None or bwd is None:
        return None
    f, b = getattr(fwd, field), getattr(bwd, field)
    if f is None or b is None:
        return None
    return b + (_ADJOINT_SHARE / _FORWARD_SHARE) * f


def _check_target(target: Any) -> Optional[float]:
    """``target_error``: None or a number in (0, 1)."""
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
        raise ValueError(
            f"target_error must be a number in (0, 1) (a relative error, e.g. "
            f"1e-2), or None, got {target!r}"
        )
    return float(target)
