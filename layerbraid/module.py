"""LayerParallelModule: a ResNet-like chain of layers as MGRIT time steps, trained with autograd."""
import dataclasses
import logging
import re
import time
from typing import Dict, Optional

import numpy as np
import torch
from torch import nn

from ._autograd import _BroadcastFn, _ChainFn, _ToFirstFn
from ._transport import bcast_into
from .nn import _solve_state
from .errors import RemoteRankError
from .launch import FreedOnExit, arrive
from .options import MGRITOptions
from .stats import SolveStats

__all__ = ["LayerParallelModule", "SolveStats"]

logger = logging.getLogger(__name__)

_WEIGHT_TAG = 7301
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


class _Run:
    """What one forward keeps for its backward."""

    def __init__(self):
        self.h0 = None
        self.shape = self.dtype = self.device = None
        self.record = False
        self.graphs: Dict[int, tuple] = {}  # step index -> (input leaf, output) of the done pass
        self.coarse_x: Dict[tuple, torch.Tensor] = {}  # (step, level) -> R^k x, for mode "branch"
        self.output = None
        self.param_grads: Dict[int, torch.Tensor] = {}


class _BuildStepsAfterInit(type(nn.Module)):
    """Builds the step layers when the subclass's __init__ has returned, so that ``step_layer``
    may use attributes the subclass sets after ``super().__init__()``."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
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
            which makes cheap settings (2 forward, 1 backward iteration) much more accurate.
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

    The attribute ``retain_graphs`` (default False) keeps the steps' graphs after a backward,
    so that the same forward can be differentiated again (``retain_graph=True``,
    ``torch.autograd.gradcheck``); by default the first backward frees them.

    Both solves always finish with an FC relaxation (``final_fc_relax`` is forced on): that is
    when each layer runs once more to record the graph that backward differentiates.
    """

    def __init__(self, num_steps: int, t_final: float = 1.0, comm=None, *,
                 forward_options: Optional[MGRITOptions] = None,
                 backward_options: Optional[MGRITOptions] = None,
                 warm_start: bool = False, output: str = "all", spatial=None,
                 check_inputs: bool = True, check_finite: bool = True):
        super().__init__()
        from mpi4py import MPI

        from .launch import _enter

        _enter()

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if isinstance(t_final, bool) or not isinstance(t_final, (int, float)) or \
                not 0 < t_final < float("inf"):
            raise ValueError(f"t_final must be a finite number > 0, got {t_final!r}")
        comm = MPI.COMM_WORLD if comm is None else comm
        grid = comm if hasattr(comm, "layer_comm") else None  # a ProcessGrid
        comm = grid.layer_comm if grid is not None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py communicator or a ProcessGrid, got "
                            f"{type(comm).__name__}")
        if num_steps < comm.Get_size():
            raise ValueError(f"num_steps={num_steps} is smaller than the number of layer-parallel "
                             f"ranks ({comm.Get_size()}): every rank needs at least one step")
        for name, o in (("forward_options", forward_options), ("backward_options", backward_options)):
            if o is not None and not isinstance(o, MGRITOptions):
                raise TypeError(f"{name} must be an MGRITOptions, got {type(o).__name__}")
        self.num_steps = num_steps
        self.t_final = float(t_final)
        self.dt = self.t_final / num_steps
        self.forward_options = dataclasses.replace(
            forward_options or MGRITOptions(max_levels=1), final_fc_relax=True)
        self.backward_options = dataclasses.replace(
            backward_options or MGRITOptions(max_levels=1), final_fc_relax=True)
        self.warm_start = bool(warm_start)
        self.check_inputs = bool(check_inputs)
        self.check_finite = bool(check_finite)
        self.retain_graphs = False
        if output not in ("all", "next"):
            raise ValueError(f"output must be 'all' or 'next', got {output!r}")
        self.output = output
        from .coarsening import SpatialCoarsening

        if spatial is not None and not isinstance(spatial, SpatialCoarsening):
            raise TypeError(f"spatial must be a SpatialCoarsening, got {type(spatial).__name__}")
        object.__setattr__(self, "spatial", spatial)
        self.open = None
        self.close = None
        self.layers = nn.ModuleDict()
        self.forward_stats = SolveStats()
        self.backward_stats = SolveStats()
        object.__setattr__(self, "_comm", comm)
        object.__setattr__(self, "_grid", grid)
        self._built = False

    # ------------------------------------------------------------------ what subclasses define
    def step_layer(self, index: int) -> nn.Module:
        """The module f of global step ``index`` (0 <= index < num_steps)."""
        raise NotImplementedError(f"{type(self).__name__} must define step_layer(index)")

    def step_rule(self, layer: nn.Module, x: torch.Tensor, dt: float, index: int) -> torch.Tensor:
        """One step of the chain; forward Euler by default.  Must return a new tensor of the same
        shape and dtype as ``x``.  Coarse MGRIT levels call it with a longer ``dt``."""
        fx = layer(x)
        _check_shape(fx, x, index)
        return x + dt * fx

    # ------------------------------------------------------------------ construction
    @property
    def comm(self):
        """The layer-parallel communicator."""
        return self._comm

    def _build_steps(self):
        from ._bridge import _Core

        comm = self._comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        sp = self.spatial
        sp_state = sp is not None and sp.mode == "state"  # else states stay on the fine grid
        self._fwd = _Core(comm, self.num_steps, 0.0, self.t_final, self.forward_options,
                          init=self._fwd_init, step=self._fwd_step,
                          coarsen=sp.restrict if sp_state else None,
                          refine=sp.interpolate if sp_state else None)
        self._fwd.setup()  # collective: options must agree across ranks
        levels = self._fwd.level_info()
        lo, hi, _ = levels[0]
        self._owned = list(range(max(lo, 1) - 1, hi))
        # Each layer is built from its own seed, drawn once on every rank: the same global index
        # gets the same initial weights whatever the number of ranks.
        base = int(torch.randint(0, 2**62, ()).item())
        error = None
        try:
            for i in self._owned:
                self.layers[str(i)] = self._make_layer(i, base)
        except Exception as exc:  # every rank learns of it in the allgather below
            error = exc
        self._layer_seed = base
        # Coarse forward steps inject the fine layer at the coarse step's start, which can belong
        # to a rank on the left: those weights are copied once per forward.
        needed = sorted({(i - 1) * m for (lo_l, hi_l, m) in levels[1:]
                         for i in range(max(lo_l, 1), hi_l + 1)} - set(self._owned))
        report = None if error is None else f"{type(error).__name__}: {error}"
        everyone = comm.allgather((needed, report))
        failed = [(r, msg) for r, (_, msg) in enumerate(everyone) if msg is not None]
        if failed:
            self._release()
            if error is not None:
                raise error
            r, msg = failed[0]
            raise RemoteRankError(f"building the step layers failed on rank {r}: {msg}", r)
        everyone = [idx for idx, _ in everyone]
        mine = set(self._owned)
        self._weight_sends = {r: [i for i in idx if i in mine] for r, idx in enumerate(everyone)
                              if r != self._rank and any(i in mine for i in idx)}
        self._copies = {}
        for i in needed:
            layer = self._make_layer(i, base)
            for p in layer.parameters():
                p.requires_grad_(False)
            self._copies[i] = layer
        owners = {}
        for i in needed:
            owners.setdefault(self._owner_of_step(i), []).append(i)
        self._weight_recvs = owners
        # The adjoint runs backward in time on the reversed communicator, with the extra steps
        # mirrored, so that each rank differentiates exactly its own layers.
        self._rev_comm = comm.Split(0, self._size - 1 - self._rank)
        self._bwd = _Core(self._rev_comm, self.num_steps, 0.0, self.t_final,
                          self.backward_options, init=self._bwd_init, step=self._bwd_step,
                          mirror=True, real_ranks=list(range(self._size))[::-1], owns_comm=True, coarsen=sp.restrict_adjoint if sp_state else None,
                          refine=sp.interpolate_adjoint if sp_state else None)
        self._bwd.setup()
        self._bwd_strides = [m for (_, _, m) in self._bwd.level_info()]
        alo, ahi, _ = self._bwd.level_info()[0]
        starts = sorted(self.num_steps - j for j in range(max(alo, 1), ahi + 1))
        assert starts == self._owned, "adjoint distribution does not mirror the forward one"
        self._euler = type(self).step_rule is LayerParallelModule.step_rule
        self._averager = None
        if self._grid is not None and self._grid.data_size > 1:
            from .grid import _GradAverager

            # The replicas in a data group start from rank 0's weights (as DDP does), then
            # average their gradients at the end of every backward.
            data = self._grid.data_comm
            bcast_into(data, list(self.parameters()) + list(self.buffers()))
            self._averager = _GradAverager(self.parameters(), data)
        self._anchor = torch.zeros((), requires_grad=True)
        self._run = None
        self._fwd_warm, self._bwd_warm = {}, {}
        self._built = True

    def free(self):
        """Frees the communicator and the MGRIT cores this model created (MPICH allows about
        2,000 communicators per process).  Also done when the model is garbage collected, and
        at the end of a ``with`` block; the model cannot run afterwards.  (``close`` is the
        close layer, hence the name.)"""
        self._release()

    def _release(self):
        for name in ("_fwd", "_bwd"):
            core = self.__dict__.get(name)
            if core is not None:
                core.close()
        self.__dict__.pop("_rev_comm", None)  # freed with the adjoint core that owns it

    def _make_layer(self, index, base):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((base + 1000003 * index) % (2**63 - 1))
            layer = self.step_layer(index)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"step_layer({index}) must return an nn.Module, got "
                            f"{type(layer).__name__}")
        ref = next(self._ref_tensors(), None)
        return layer.to(ref.device) if ref is not None else layer

    def _ref_tensors(self):
        for mod in (self.open, self.close):
            if isinstance(mod, nn.Module):
                yield from mod.parameters()

    def _owner_of_step(self, step):
        n, p = self.num_steps, self._size
        quo, rem = divmod(n, p)
        big = rem * (quo + 1)
        return step // (quo + 1) if step < big else rem + (step - big) // quo

    def _counted_parameters(self):
        """The parameters whose gradient this rank alone holds (see _holds_key), for
        clip_grad_norm_."""
        return [p for k, p in self.named_parameters() if self._holds_key(k)]

    def owned_steps(self):
        """``[(global step index, step module)]`` for the steps this rank owns, in order."""
        return [(i, self.layers[str(i)]) for i in self._owned]

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over the layer group.  ``x`` is used on the first rank; every rank passes
        the same batch (checked, see ``check_inputs``), or None / a 0-d tensor off the first
        rank.  Returns the close layer's output on every rank."""
        comm, first, last = self._comm, self._rank == 0, self._rank == self._size - 1
        if self._fwd._core is None:
            raise RuntimeError("this layer-parallel model was freed (model.free()): build a "
                               "new one")
        h0, meta, error = None, None, None
        if first:
            try:
                h0 = self.open(x) if self.open is not None else x
                if not isinstance(h0, torch.Tensor):
                    raise TypeError(f"the open layer must return a tensor, got {type(h0).__name__}")
                meta = (tuple(h0.shape), h0.dtype, str(h0.device))
            except Exception as exc:  # tell every rank, then raise here
                error = exc
                meta = ("error", f"{type(exc).__name__}: {exc}", tuple(getattr(x, "shape", ())))
        if self._size > 1:
            arrive(comm, f"the forward of model(x) (layer-parallel rank {self._rank})")
            mine = _fingerprint(x) if self.check_inputs else None
            gathered = comm.allgather((meta, mine) if first else mine)
            meta, ref = gathered[0]
        if meta[0] == "error":
            if error is not None:
                raise error
            raise ValueError(f"the layer-parallel forward failed on rank 0, where the input of "
                             f"shape {meta[2]} went through the open layer: {meta[1]}")
        if self._size > 1 and self.check_inputs and ref is not None:
            bad = [(r, fp) for r, fp in enumerate(gathered[1:], 1)
                   if fp is not None and not _same_input(fp, ref)]
            if bad:
                r, fp = bad[0]
                raise ValueError(
                    f"layer-parallel ranks were given different inputs: rank {r} got shape "
                    f"{fp[0]} (fingerprint {fp[2]:.6g}, {fp[3]:.6g}), rank 0 got shape {ref[0]} "
                    f"(fingerprint {ref[2]:.6g}, {ref[3]:.6g}); {len(bad)} rank(s) differ: "
                    f"{[b[0] for b in bad]}.  Every rank of a layer group must be fed the same "
                    "batch (the first rank reads the input, the last the labels): use "
                    "layerbraid.data.LayerParallelLoader, or seed every rank's shuffling alike. "
                    "(check_inputs=False turns this check off.)")
        shape, dtype, device = meta
        device = torch.device(device)
        if self.spatial is not None:  # the same check, and error, on every rank
            self.spatial.check(shape, max(self._fwd.num_levels(), self._bwd.num_levels()))
        record = torch.is_grad_enabled()
        if h0 is None:
            # Not used by the solve; but when x comes from an earlier stage it must stay in the
            # graph, so that that stage's backward (collective) runs on this rank too.
            h0 = x if isinstance(x, torch.Tensor) and x.requires_grad else \
                torch.zeros((), dtype=dtype, device=device)
        run = _Run()
        run.shape, run.dtype, run.device, run.record = shape, dtype, device, record
        self._pending_run = run
        anchor = self._anchor.to(device) if self._anchor.device != device else self._anchor
        params = self._owned_params()
        out = _ChainFn.apply(self, h0, anchor, *params)
        status, error = None, None
        if last:
            try:
                if self.close is not None:
                    out = self.close(out)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"the close layer must return a tensor, got "
                                    f"{type(out).__name__}")
                status = ("ok", tuple(out.shape), out.dtype)
                if self.check_finite and not bool(torch.isfinite(out.detach()).all()):
                    status = ("nonfinite", tuple(out.shape), out.dtype)
            except Exception as exc:  # tell every rank, then raise here
                error, status = exc, ("error", f"{type(exc).__name__}: {exc}")
        if self._size > 1:
            status = comm.bcast(status, root=self._size - 1)
        if status[0] == "error":
            if error is not None:
                raise error
            raise RemoteRankError(f"the close layer failed on rank {self._size - 1}: "
                                  f"{status[1]}", self._size - 1)
        if status[0] == "nonfinite":
            raise FloatingPointError(
                f"the layer-parallel forward produced a non-finite output (NaN or Inf) on rank "
                f"{self._size - 1}, shape {status[1]}: the input, the weights or the steps "
                "overflowed (check_finite=False turns this check off)")
        if self.output == "next":
            return _ToFirstFn.apply(comm, out, status[1], status[2])
        return _BroadcastFn.apply(comm, self._size - 1, out, status[1], status[2])

    def _owned_params(self):
        return [p for i in self._owned for p in self.layers[str(i)].parameters() if p.requires_grad]

    def _exchange_weights(self):
        """Copy the weights of the layers that coarse steps inject from the ranks that own them."""
        if not self._weight_sends and not self._weight_recvs:
            return
        from mpi4py import MPI

        reqs, keep = [], []
        for dest, idx in self._weight_sends.items():
            buf = np.concatenate([_bytes(t) for i in idx for t in self.layers[str(i)].state_dict().values()])
            keep.append(buf)
            reqs.append(self._comm.Isend([buf, MPI.BYTE], dest=dest, tag=_WEIGHT_TAG))
        incoming = []
        ref = next((p for i in self._owned for p in self.layers[str(i)].parameters()), None)
        for src, idx in self._weight_recvs.items():
            if ref is not None:  # follow model.to(...) / .double() on the owned layers
                for i in idx:
                    self._copies[i].to(device=ref.device, dtype=ref.dtype)
            tensors = [t for i in idx for t in self._copies[i].state_dict().values()]
            buf = np.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=np.uint8)
            reqs.append(self._comm.Irecv([buf, MPI.BYTE], source=src, tag=_WEIGHT_TAG))
            incoming.append((buf, tensors))
        MPI.Request.Waitall(reqs)
        for buf, tensors in incoming:
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                src = torch.from_numpy(buf[off:off + n].copy()).view(t.dtype).reshape(t.shape)
                with torch.no_grad():
                    t.copy_(src)
                off += n

    def _forward_solve(self, h0):
        run = self._pending_run
        self._pending_run = None
        run.h0_requires_grad, run.h0_shape, run.h0_dtype = h0.requires_grad, h0.shape, h0.dtype
        run.h0 = h0 if self._rank == 0 else None
        self._exchange_weights()
        _solve_state.in_solve = True
        try:
            self.forward_stats, states = self._solve(self._fwd, run)
        finally:
            _solve_state.in_solve = _solve_state.final = False
        logger.debug("forward MGRIT: %s", self.forward_stats)
        if self.warm_start:
            self._fwd_warm = {i: s for i, s in states.items() if i > 0}
        if self._rank == self._size - 1:
            run.output = states[self.num_steps]
        else:
            run.output = torch.zeros((), dtype=run.dtype, device=run.device)
        if run.output is h0:
            run.output = run.output.clone()
        return run

    def _solve(self, core, run):
        """One solve with ``run`` as the callbacks' context: (SolveStats, owned states)."""
        self._run = run
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                iters, norms = core.solve()
            states = core.states()
        finally:
            self._run = None
        return SolveStats(iters, norms, time.perf_counter() - t0, core.step_seconds,
                          core.comm_seconds()), states

    def _guess(self, warm, index, run):
        """The previous solve's state at `index` (warm start), else zeros."""
        s = warm.get(index)
        if s is not None and tuple(s.shape) == tuple(run.shape) and s.dtype == run.dtype:
            return s
        return torch.zeros(run.shape, dtype=run.dtype, device=run.device)

    def _fwd_init(self, t, index):
        run = self._run
        if index == 0:
            return run.h0.detach()
        return self._guess(self._fwd_warm, index, run)

    def _fwd_step(self, u, t0, t1, level, index, done):
        layer = self.layers[str(index)] if level == 0 or str(index) in self.layers \
            else self._copies[index]
        run = self._run
        _solve_state.final = bool(done and level == 0)
        if done and level == 0 and run.record:
            xg = u.detach().requires_grad_(True)
            if self._euler:
                # Note [Euler graphs]: keep the graph of f(x) alone.  Its VJP serves every step
                # size, so the coarse adjoint steps reuse it instead of recomputing the layer.
                with torch.enable_grad():
                    fx = layer(xg)
                _check_shape(fx, u, index)
                run.graphs[index] = (xg, fx)
                return u + (t1 - t0) * fx.detach()
            with torch.enable_grad():
                y = self.step_rule(layer, xg, t1 - t0, index)
            _check_shape(y, u, index)
            run.graphs[index] = (xg, y)
            return y.detach()
        if level > 0 and self._branch(level):
            return self.spatial.branch_step(
                lambda x: self.step_rule(layer, x, t1 - t0, index), u, level)
        y = self.step_rule(layer, u, t1 - t0, index)
        if not self._euler:
            _check_shape(y, u, index)
        return y

    def _branch(self, level):
        """Whether `level`'s steps compute their increment on a grid coarse in space."""
        sp = self.spatial
        return sp is not None and sp.mode == "branch" and sp.factor(level) > 0

    # ------------------------------------------------------------------ backward
    def _backward_solve(self, run, grad_out):
        if run is None:
            raise RuntimeError("backward ran twice through the same layer-parallel forward: the "
                               "forward's graphs are freed by the first backward (to save "
                               "memory); set model.retain_graphs = True before the forward to "
                               "backward through it again (retain_graph=True, gradcheck)")
        if not run.record:
            raise RuntimeError("backward through a layer-parallel forward that ran without grad")
        last = self._rank == self._size - 1
        run.grad_out = grad_out.detach() if last else None
        params = self._owned_params()
        run.param_grads = {}
        try:
            self.backward_stats, states = self._solve(self._bwd, run)
        finally:
            if not self.retain_graphs:
                run.graphs.clear()
                run.coarse_x.clear()
        logger.debug("adjoint MGRIT: %s", self.backward_stats)
        if self.warm_start:
            self._bwd_warm = {i: s for i, s in states.items() if i > 0}
        if self._rank == 0:
            grad_h0 = states[self.num_steps]
        elif run.h0_requires_grad:
            grad_h0 = torch.zeros(run.h0_shape, dtype=run.h0_dtype, device=run.device)
        else:
            grad_h0 = None
        grads = [run.param_grads.get(id(p)) for p in params]
        if self.check_finite:
            self._check_finite_gradients(grad_h0 if self._rank == 0 else None, grads)
        return grad_h0, grads

    def _check_finite_gradients(self, grad_h0, grads):
        """Raises on every rank if any rank's input or parameter gradients are not finite."""
        from mpi4py import MPI

        with torch.no_grad():
            bad = any(g is not None and not bool(torch.isfinite(g).all())
                      for g in [grad_h0] + grads)
        first = self._comm.allreduce(self._rank if bad else self._size, op=MPI.MIN) \
            if self._size > 1 else (0 if bad else 1)
        if first < self._size:
            raise FloatingPointError(
                f"the layer-parallel backward produced non-finite gradients (NaN or Inf) on rank "
                f"{first}: the loss, the weights or the steps overflowed (check_finite=False "
                "turns this check off)")

    def _final_vjp(self, run, s, xg, y, cotangent):
        """The VJP of step s's kept graph for the state and, once, for its parameters."""
        params = [p for p in self.layers[str(s)].parameters() if p.requires_grad]
        grads = torch.autograd.grad(y, [xg] + params, cotangent, allow_unused=True,
                                    retain_graph=self.retain_graphs)
        for p, g in zip(params, grads[1:]):
            if g is not None:
                run.param_grads[id(p)] = g
        return grads[0]

    def _bwd_init(self, t, index):
        run = self._run
        if index == 0:
            return run.grad_out
        return self._guess(self._bwd_warm, index, run)

    def _bwd_step(self, w, t0, t1, level, index, done):
        """Adjoint step: the vector-Jacobian product of forward step s = N - index - stride."""
        run = self._run
        s = self.num_steps - index - self._bwd_strides[level]
        xg, y = run.graphs[s]
        if level > 0 and self._branch(level):
            # The transpose of x + P^k (Phi(R^k x) - R^k x), linearized at the fine state.
            layer = self.layers[str(s)]
            return self.spatial.branch_adjoint(
                lambda x: self.step_rule(layer, x, t1 - t0, s), xg, w, level,
                cache=run.coarse_x.setdefault((s, level), {}))
        if level > 0 and self.spatial is not None and self.spatial.factor(level) > 0:
            # Mode "state", a grid coarse in space: linearize at the fine state restricted to it.
            with torch.enable_grad():
                xr = self.spatial.to_level(xg.detach(), level).requires_grad_(True)
                yr = self.step_rule(self.layers[str(s)], xr, t1 - t0, s)
                gx, = torch.autograd.grad(yr, xr, w, allow_unused=True)
            return gx if gx is not None else torch.zeros_like(w)
        if self._euler:  # y is f(x): x + dt f(x) has the VJP w + f'(x)^T (dt w), for any dt
            dtw = (t1 - t0) * w
            if level == 0 and done:
                gx = self._final_vjp(run, s, xg, y, dtw)
            else:
                gx, = torch.autograd.grad(y, xg, dtw, retain_graph=True, allow_unused=True)
            return w + gx if gx is not None else w.clone()
        if level == 0:
            if done:
                gx = self._final_vjp(run, s, xg, y, w)
            else:
                gx, = torch.autograd.grad(y, xg, w, retain_graph=True)
            return gx if gx is not None else torch.zeros_like(w)
        # A coarse adjoint step is the transpose of the forward coarse step over the same
        # interval: the layer at its start in forward time, linearized at the fine state there.
        with torch.enable_grad():
            xr = xg.detach().requires_grad_(True)
            yr = self.step_rule(self.layers[str(s)], xr, t1 - t0, s)
            gx, = torch.autograd.grad(yr, xr, w, allow_unused=True)
        return gx if gx is not None else torch.zeros_like(w)

    # ------------------------------------------------------------------ serial view, state
    def _gather_state(self, root=None):
        """{serial state_dict key: CPU tensor} of the whole network, on every rank (or root)."""
        mine = {k: v.detach().cpu() for k, v in super().state_dict().items()
                if self._holds_key(k)}
        if self._size == 1:
            return mine
        parts = self._comm.allgather(mine) if root is None else self._comm.gather(mine, root=root)
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
        from .nn import _plain_copy, plain_modules

        full = self._gather_state()
        layers = nn.ModuleList(self._make_layer(i, self._layer_seed) for i in range(self.num_steps))
        rule = type(self).step_rule
        serial = _SerialChain(_plain_copy(self.open), plain_modules(layers),
                              _plain_copy(self.close), self.dt,
                              None if rule is LayerParallelModule.step_rule else rule)
        serial.load_state_dict(full)
        return serial

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a serial (or any rank count's) state_dict: each rank keeps its own layers."""
        owned = set(self._owned) if self._built else None
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
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path, optimizer, extra)

    def load_checkpoint(self, path, optimizer=None):
        """Resumes from :meth:`save_checkpoint`'s file on any number of ranks; returns ``extra``
        (see :func:`layerbraid.load_checkpoint`)."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, path, optimizer)


class _SerialChain(nn.Module):
    """The serial network a LayerParallelModule computes: open, N steps, close.  ``rule`` is
    None (forward Euler) or a subclass's ``step_rule`` function, called with this module as
    ``self`` (a plain function: pickled by reference, like the module classes)."""

    def __init__(self, open, layers, close, dt, rule=None):
        super().__init__()
        self.open, self.layers, self.close = open, layers, close
        self.dt = dt
        self.rule = rule

    def forward(self, x):
        if self.open is not None:
            x = self.open(x)
        for i, layer in enumerate(self.layers):
            if self.rule is None:
                fx = layer(x)
                _check_shape(fx, x, i)
                x = x + self.dt * fx
            else:
                x = self.rule(self, layer, x, self.dt, i)
        return self.close(x) if self.close is not None else x


def _fingerprint(x):
    """(shape, dtype, sum, position-weighted sum) of an input batch; None for what is not a
    batch (None, a 0-d placeholder).  The weights (1, 2, ...) over the samples make a reordered
    batch differ; a different batch differs in both sums."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    with torch.no_grad():
        per_sample = x.detach().reshape(x.shape[0], -1).to(torch.float64).sum(1)
        pos = torch.arange(1, x.shape[0] + 1, dtype=torch.float64, device=per_sample.device)
        total, weighted = float(per_sample.sum()), float((per_sample * pos).sum())
    return (tuple(x.shape), str(x.dtype), total, weighted)


def _same_input(a, b):
    """Fingerprints equal, up to the summation order's round-off (ranks on other devices)."""
    if a[0] != b[0] or a[1] != b[1]:
        return False
    scale = 1e-9 * max(1, int(np.prod(a[0])))
    return all(u == v or (u != u and v != v) or abs(u - v) <= 1e-7 * (abs(u) + abs(v)) + scale
               for u, v in zip(a[2:], b[2:]))  # equal, both NaN, or round-off apart


def _check_shape(fx, x, index):
    if not isinstance(fx, torch.Tensor):
        raise TypeError(f"step layer {index} returned {type(fx).__name__}, not a tensor: a step "
                        "layer must return a tensor of the state's shape")
    if fx.shape != x.shape:
        raise ValueError(f"step layer {index} returned shape {tuple(fx.shape)} for a state of "
                         f"shape {tuple(x.shape)}: a step layer must keep the state's shape")


def _bytes(t):
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy()
