"""MG/Opt: Nash's multilevel optimization applied to depth (Nash 2000; Günther et al., SIAM
J. Sci. Comput. 2020, for ODE networks).  A V-cycle over a hierarchy of the same network at
decreasing depths trains the deepest one, each level driven by the user's own optimizer.

One cycle on one batch, at level ``l`` (``F_l(x) = f_l(x) - <v_l, x>``, ``v_0 = 0``):

1. pre-relaxation: ``pre_relax`` optimizer steps on ``F_l``;
2. ``g_l = grad F_l(x_l)``;
3. restriction: the coarser network gets ``x_{l+1} = R x_l`` (the step weights by
   ``restrict``, the open and close layers copied) and, by ``state``, the optimizer's state;
   ``~g = R' g_l`` (``grad_restrict``);
4. ``v_{l+1} = grad f_{l+1}(x_{l+1}) - ~g``: the coherence term, which makes the coarse
   objective's gradient at the restricted point the restricted fine gradient, exactly;
5. the coarse problem ``min F_{l+1}``: a cycle on the next level, or on the coarsest
   ``coarse_relax`` optimizer steps;
6. the correction ``e = P (x_{l+1} - R x_l)`` (``interpolate``), applied as ``x_l + alpha e``
   with ``alpha`` from the line search;
7. post-relaxation: ``post_relax`` optimizer steps on ``F_l``.

Collective over the layer group: every level is a layer-parallel network on the same ranks;
each rank moves only the steps it owns and the ones that cross a rank boundary
(layerbraid.depth), and every scalar the ranks decide on (objective values, the line
search's choice) is gathered and summed in rank order, so every rank decides alike.  With
data parallelism (models built on a :class:`layerbraid.ProcessGrid`) the gradients are averaged
over the data groups as in any training step, and the objective is the mean of the groups'
losses, so every group takes the same steps: the full batch's cycle, to round-off.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from ..module import LayerParallelModule
from . import interpolation, move_state, move_steps, restriction

__all__ = ["MGOpt", "MGOptStats"]

Vec = dict[nn.Parameter, torch.Tensor]
LossFn = Callable[[LayerParallelModule], torch.Tensor]
Levels = Union[str, Sequence[str]]  # one option for every level, or one per coarse level
_LINE_SEARCHES = ("backtracking", "alphas", "none", "optimizer")
_STATES = ("restrict", "keep", "reset")


@dataclass
class MGOptStats:
    """What the last :meth:`MGOpt.step` did: the fine loss before its first cycle, the line
    search's step ``alpha`` per level in its last cycle (finest first; 0: the correction was
    refused), how many cycles it ran, and the largest gap, over the levels, between the coarse
    objective's gradient at the restricted point and the restricted fine gradient, relative to
    the latter (round-off: the coherence term's check, measured only with
    ``check_coherence=True``)."""

    loss: float = float("nan")
    alphas: list[float] = field(default_factory=list)
    coherence_gap: Optional[float] = None
    cycles: int = 0


class MGOpt:
    """An MG/Opt V-cycle over networks of decreasing depth, each trained by its own
    ``torch.optim`` optimizer.

    Args:
        models: the hierarchy, finest first: layer-parallel networks of the same kind on the
            same layer group, each one's depth a multiple of the next one's (e.g. built with
            ``num_steps`` from :func:`layerbraid.depth.depths`, reversed).
        optimizers: one per model, over its parameters (any ``torch.optim`` optimizer; with
            ``state="restrict"``, SGD or Adam/AdamW).
        pre_relax, post_relax: optimizer steps before and after the coarse correction on every
            level but the coarsest (default 1, 1).
        coarse_relax: optimizer steps on the coarsest level (default 2).
        restrict, grad_restrict, interpolate, line_search: one name for every level, or a
            sequence of one per coarse level (finest pair first), as TorchBraid's per-level
            options.
        restrict: how the step weights go down: ``"injection"`` (default), ``"average"`` or
            ``"full_weighting"`` (the stencil [1/4, 1/2, 1/4] at a factor of 2).
        grad_restrict: how the gradient goes down: ``"adjoint"`` (default: the transpose of
            linear interpolation, which makes the correction a descent direction wherever the
            coarse step decreases the coarse objective), ``"injection"`` (TorchBraid's
            default), ``"average"`` or ``"full_weighting"``.
        interpolate: how the correction goes up: ``"linear"`` (default) or ``"injection"``.
        line_search: ``"backtracking"`` (default: from ``alpha``, halved up to ``tries``
            times until the Armijo condition holds with ``c1``; no step if it never does, nor
            where the correction is not a descent direction, its slope along the fine
            gradient at least 0),
            ``"alphas"`` (the best of ``alphas``, or none if none lowers the objective),
            ``"none"`` (``alpha`` itself) or ``"optimizer"`` (TorchBraid's ``tb_adam_no_ls``: no
            search; the fine optimizer takes one step with ``-e`` as the gradient, so its
            learning rate, momentum and Adam's scaling shape the correction; its ``alpha``
            in ``stats`` is 1.0).
        state: the coarse optimizers' state each cycle: ``"restrict"`` (default: restricted
            from the finer level's optimizer, as the weights), ``"keep"`` (each keeps its own
            from cycle to cycle) or ``"reset"`` (every cycle starts afresh).  With momentum,
            a restricted velocity moves the coarse weights again by what the fine steps
            already moved them, and the correction carries that back: a larger step per
            batch than the fine optimizer's own.  The examples reset.
        cycles: V-cycles per :meth:`step` (per batch; default 1), TorchBraid's ``mgopt_iter``.
        tol: with several cycles, stop a batch's cycles once the fine loss is at most ``tol``
            (one more forward per cycle to see it); None: always ``cycles``.
        check_coherence: measure the coherence term's gap each cycle (``stats``): the
            gradient of each coarse objective, coherence term included, at the restricted
            point, against the restricted fine gradient (one more forward and backward per
            coarse level).
    """

    def __init__(
        self,
        models: Sequence[LayerParallelModule],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        pre_relax: int = 1,
        post_relax: int = 1,
        coarse_relax: int = 2,
        restrict: Levels = "injection",
        grad_restrict: Levels = "adjoint",
        interpolate: Levels = "linear",
        line_search: Levels = "backtracking",
        alpha: float = 1.0,
        alphas: Sequence[float] = (1.0, 0.5, 0.25, 0.125),
        tries: int = 4,
        c1: float = 1e-4,
        state: str = "restrict",
        check_coherence: bool = False,
        cycles: int = 1,
        tol: Optional[float] = None,
    ) -> None:
        if len(models) < 2 or len(models) != len(optimizers):
            raise ValueError(
                f"MGOpt needs at least two models and one optimizer per model, got "
                f"{len(models)} model(s) and {len(optimizers)} optimizer(s)"
            )
        for name, n in (
            ("pre_relax", pre_relax),
            ("post_relax", post_relax),
            ("coarse_relax", coarse_relax),
            ("tries", tries),
        ):
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        if not isinstance(cycles, int) or cycles < 1:
            raise ValueError(f"cycles must be an int >= 1, got {cycles!r}")
        pairs = len(models) - 1
        downs = ("injection", "average", "full_weighting")
        restricts = _per_level("restrict", restrict, pairs, downs)
        grads = _per_level("grad_restrict", grad_restrict, pairs, ("adjoint", *downs))
        interps = _per_level("interpolate", interpolate, pairs, ("linear", "injection"))
        searches = _per_level("line_search", line_search, pairs, _LINE_SEARCHES)
        _choose("state", state, _STATES)
        if not alpha > 0 or not alphas or any(not a > 0 for a in alphas):
            raise ValueError(f"alpha and alphas must be > 0, got {alpha!r} and {list(alphas)!r}")
        groups = [m._grid.data_size if m._grid is not None else 1 for m in models]
        if len(set(groups)) > 1:
            raise ValueError(
                f"MGOpt: every model must be built with the same number of data groups: "
                f"{groups} (finest first); build each on the same ProcessGrid"
            )
        self.models, self.optimizers = list(models), list(optimizers)
        self._maps = [
            _Maps(f, c, r, g, i)
            for f, c, r, g, i in zip(self.models, self.models[1:], restricts, grads, interps)
        ]
        self.pre_relax, self.post_relax, self.coarse_relax = pre_relax, post_relax, coarse_relax
        self.line_searches, self.alpha, self.alphas = searches, alpha, tuple(alphas)
        self.cycles, self.tol = cycles, tol
        self.tries, self.c1, self.state = tries, c1, state
        self.check_coherence = check_coherence
        self.stats = MGOptStats()

    def step(self, loss_fn: LossFn) -> float:
        """``cycles`` V-cycles on one batch (fewer where ``tol`` is met first).
        ``loss_fn(model)`` returns the batch's loss on the network ``model`` (any level; the
        same value on every rank, as a layer-parallel network's output is).  Returns the fine
        loss before the first cycle."""
        self.stats = MGOptStats(alphas=[0.0] * (len(self.models) - 1))
        gaps: list[float] = []
        for c in range(self.cycles):
            if c > 0 and self.tol is not None and self._objective(0, None, loss_fn) <= self.tol:
                break  # the fine loss is at most tol: the batch is done
            self.stats.alphas = [0.0] * (len(self.models) - 1)
            self._cycle(0, None, loss_fn, gaps)
            self.stats.cycles = c + 1
        if self.check_coherence:
            self.stats.coherence_gap = max(gaps)
        return self.stats.loss

    # ------------------------------------------------------------------ the cycle
    def _cycle(self, level: int, v: Optional[Vec], loss_fn: LossFn, gaps: list[float]) -> None:
        model, opt = self.models[level], self.optimizers[level]
        if level == len(self.models) - 1:
            for _ in range(self.coarse_relax):
                self._relax(level, v, loss_fn)
            return
        for _ in range(self.pre_relax):
            self._relax(level, v, loss_fn)
        loss = self._gradient(level, v, loss_fn)
        g = _grads(model)
        maps, coarse, coarse_opt = (
            self._maps[level],
            self.models[level + 1],
            self.optimizers[level + 1],
        )
        maps.weights_down(opt, coarse_opt, self.state)
        x0 = _values(coarse)
        g_restricted = maps.grad_down(g)
        self._gradient(level + 1, None, loss_fn)
        g_coarse = _grads(coarse)
        v_coarse = {p: g_coarse[p] - g_restricted[p] for p in g_coarse}
        if self.check_coherence:  # grad F_{l+1}(x0) must be g_restricted
            self._gradient(level + 1, v_coarse, loss_fn)
            gaps.append(self._gap(coarse, _grads(coarse), g_restricted))
        self._cycle(level + 1, v_coarse, loss_fn, gaps)
        e = maps.correction_up({p: p.detach() - x0[p] for p in x0})
        self.stats.alphas[level] = self._search(level, v, loss_fn, e, loss, _dot(model, e, g))
        for _ in range(self.post_relax):
            self._relax(level, v, loss_fn)

    def _relax(self, level: int, v: Optional[Vec], loss_fn: LossFn) -> None:
        self._gradient(level, v, loss_fn)
        self.optimizers[level].step()

    def _gradient(self, level: int, v: Optional[Vec], loss_fn: LossFn) -> float:
        """Sets every counted parameter's ``.grad`` to ``grad F_level`` at the current weights
        (the optimizer's gradients are zeroed first); returns ``F_level`` (every rank alike)."""
        model = self.models[level]
        self.optimizers[level].zero_grad()
        loss = loss_fn(model)
        loss.backward()
        if v is not None:
            with torch.no_grad():
                for p, vp in v.items():
                    p.grad = -vp.clone() if p.grad is None else p.grad.sub_(vp)
        value = self._value(model, loss, v)
        if level == 0 and self.stats.loss != self.stats.loss:  # the first fine loss
            self.stats.loss = value
        return value

    def _objective(self, level: int, v: Optional[Vec], loss_fn: LossFn) -> float:
        with torch.no_grad():
            return self._value(self.models[level], loss_fn(self.models[level]), v)

    def _value(self, model: LayerParallelModule, loss: torch.Tensor, v: Optional[Vec]) -> float:
        """``f - <v, x>``, the same on every rank: the first rank's loss and every rank's
        share of the dot product, gathered and summed in rank order.  With data parallelism
        ``f`` is the mean of the data groups' losses (the full batch's loss where the shards
        are equal and the loss a mean, as the averaged gradient is its gradient), so that
        every group's line search decides alike."""
        with torch.no_grad():
            local = (
                sum(float((vp.double() * p.double()).sum()) for p, vp in v.items()) if v else 0.0
            )
        first = float(loss.detach()) if model.comm.Get_rank() == 0 else 0.0
        grid = model._grid
        if grid is not None and grid.data_size > 1 and model.comm.Get_rank() == 0:
            shards = grid.data_comm.allgather_obj(first, "every data group's MG/Opt loss")
            first = math.fsum(shards) / len(shards)
        parts = model.comm.allgather_obj((first, local), "the objective of an MG/Opt level")
        return parts[0][0] - sum(d for _, d in parts)

    def _search(
        self, level: int, v: Optional[Vec], loss_fn: LossFn, e: Vec, old: float, slope: float
    ) -> float:
        """Applies ``x + alpha e`` with the line search's ``alpha``; returns it."""
        move = _Mover(e)
        search = self.line_searches[level]
        if search == "none":
            move.to(self.alpha)
            return self.alpha
        if search == "optimizer":
            self._step_along(level, e)
            return 1.0
        if search == "alphas":
            trials = []
            for a in self.alphas:
                move.to(a)
                trials.append(self._objective(level, v, loss_fn))
            best = min(range(len(trials)), key=trials.__getitem__)
            alpha = self.alphas[best] if trials[best] < old else 0.0
            move.to(alpha)
            return alpha
        if not slope < 0:  # not a descent direction: no step along it lowers F to first order
            return 0.0
        alpha = self.alpha
        for _ in range(self.tries + 1):
            move.to(alpha)
            if self._objective(level, v, loss_fn) <= old + self.c1 * alpha * slope:
                return alpha
            alpha /= 2
        move.to(0.0)
        return 0.0

    def _step_along(self, level: int, e: Vec) -> None:
        """One step of the level's optimizer with ``-e`` as the gradient (``e`` points
        downhill, as a negative gradient does); the parameters ``e`` leaves out (not counted
        on this rank) get no gradient, so the optimizer leaves them as they are."""
        opt = self.optimizers[level]
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, ep in e.items():
                p.grad = -ep.clone()
        opt.step()

    def _gap(self, coarse: LayerParallelModule, g: Vec, want: Vec) -> float:
        num = sum(float((g[p] - want[p]).double().pow(2).sum()) for p in g)
        den = sum(float(want[p].double().pow(2).sum()) for p in g)
        parts = coarse.comm.allgather_obj((num, den), "the coherence check of MG/Opt")
        total = sum(n for n, _ in parts), sum(d for _, d in parts)
        return (total[0] / total[1]) ** 0.5 if total[1] > 0 else total[0] ** 0.5


def _choose(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"MGOpt: {name} must be one of {tuple(allowed)}, got {value!r}")


def _per_level(name: str, value: Levels, pairs: int, allowed: Sequence[str]) -> list[str]:
    """``value`` for each of the ``pairs`` transfers (finest first): one name for all, or a
    sequence of one per pair, as TorchBraid's per-level options."""
    values = [value] * pairs if isinstance(value, str) else list(value)
    if len(values) != pairs:
        raise ValueError(
            f"MGOpt: {name} takes one value or one per coarse level ({pairs}), got {len(values)}"
        )
    for v in values:
        _choose(name, v, allowed)
    return values


# ---------------------------------------------------------------------- vectors
# A vector over a network is a dict over the parameters this rank counts (its steps, the open
# layer on the first rank, the close layer on the last): a sum over the ranks of the
# per-rank dot products counts every parameter of the network once.
def _counted(model: LayerParallelModule) -> list[nn.Parameter]:
    return list(model._counted_parameters())


def _grads(model: LayerParallelModule) -> Vec:
    return {
        p: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for p in _counted(model)
    }


def _values(model: LayerParallelModule) -> Vec:
    return {p: p.detach().clone() for p in _counted(model)}


def _dot(model: LayerParallelModule, a: Vec, b: Vec) -> float:
    local = sum(float((a[p].double() * b[p].double()).sum()) for p in a)
    parts = model.comm.allgather_obj(local, "a dot product of MG/Opt")
    return float(sum(parts))


class _Mover:
    """Moves the weights along ``e`` from where they are: ``to(alpha)`` sets ``x0 + alpha e``."""

    def __init__(self, e: Vec) -> None:
        self.e, self.at = e, 0.0

    def to(self, alpha: float) -> None:
        with torch.no_grad():
            for p, ep in self.e.items():
                p.add_(ep, alpha=alpha - self.at)
        self.at = alpha


def _ends(model: LayerParallelModule) -> list[nn.Parameter]:
    return [p for m in (model.open, model.close) if m is not None for p in m.parameters()]


class _Maps:
    """The transfers between a level (``fine``) and the next (``coarse``)."""

    def __init__(
        self,
        fine: LayerParallelModule,
        coarse: LayerParallelModule,
        restrict: str,
        grad_restrict: str,
        interpolate: str,
    ) -> None:
        if fine.comm.Get_size() != coarse.comm.Get_size():
            raise ValueError("MGOpt: the models span different numbers of ranks")
        self.fine, self.coarse = fine, coarse
        self.restrict = restrict
        self.down = restriction(restrict, fine.num_steps, coarse.num_steps)
        self.grad = restriction(grad_restrict, fine.num_steps, coarse.num_steps)
        self.up = interpolation(interpolate, coarse.num_steps, fine.num_steps)
        self.fine_ends, self.coarse_ends = _ends(fine), _ends(coarse)
        if [p.shape for p in self.fine_ends] != [p.shape for p in self.coarse_ends]:
            raise ValueError("MGOpt: the models' open and close layers differ in shape")

    def weights_down(
        self, fine_opt: torch.optim.Optimizer, coarse_opt: torch.optim.Optimizer, state: str
    ) -> None:
        moving = (fine_opt, coarse_opt) if state == "restrict" else None
        if state == "reset":
            coarse_opt.state.clear()
        move_state(
            self.fine, self.coarse, self.down, moving, f"MG/Opt's restriction ({self.restrict})"
        )
        with torch.no_grad():
            for p, q in zip(self.fine_ends, self.coarse_ends):
                q.copy_(p)
                if moving is not None and p in fine_opt.state:
                    coarse_opt.state[q] = {
                        k: t.clone() if torch.is_tensor(t) else t
                        for k, t in fine_opt.state[p].items()
                    }

    def grad_down(self, g: Vec) -> Vec:
        return self._move(
            self.fine,
            self.coarse,
            self.grad,
            g,
            self.fine_ends,
            self.coarse_ends,
            "MG/Opt's gradient restriction",
        )

    def correction_up(self, e: Vec) -> Vec:
        return self._move(
            self.coarse,
            self.fine,
            self.up,
            e,
            self.coarse_ends,
            self.fine_ends,
            "MG/Opt's correction",
        )

    @staticmethod
    def _move(
        src: LayerParallelModule,
        dst: LayerParallelModule,
        sources,
        vec: Vec,
        src_ends: list[nn.Parameter],
        dst_ends: list[nn.Parameter],
        what: str,
    ) -> Vec:
        out: Vec = {}

        def put(j: int, layer: nn.Module, values: list[torch.Tensor]) -> None:
            out.update(zip(layer.parameters(), values))

        move_steps(
            src,
            dst,
            sources,
            lambda i, layer: [vec[p] for p in layer.parameters()],
            lambda layer: [p.detach() for p in layer.parameters()],
            put,
            what,
        )
        for p, q in zip(src_ends, dst_ends):
            if p in vec:  # the ends are counted on the same rank at every depth
                out[q] = vec[p].clone()
        return out
