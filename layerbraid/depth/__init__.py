"""Moving a layer-parallel network between depths: its step weights, and its optimizer's state,
from N steps to N * cf (interpolation) and back (restriction).  These are the transfers of
training over a hierarchy of depths (nested iteration: train shallow, refine, go on deeper).

Step i of an N-step network sits at time t_i = i * T / N.  Interpolation to N * cf steps gives
fine step j the coarse weights at its time: ``"injection"`` takes the coarse step that starts at
or before it (step j // cf), ``"linear"`` interpolates between that step and the next (with
weight (j % cf) / cf on the next; past the last coarse step, the last one).  Restriction gives
coarse step k the fine step at its time (``"injection"``: step k * cf) or the mean of the cf fine
steps it covers (``"average"``).  Floating-point state (parameters, running statistics, the
optimizer's moments) is combined; integer state (batch-norm counters, Adam's step count) comes
from the first source step.

Collective over the layer group: each rank computes the steps it owns in the target network and
receives, in one exchange with the deadline of every collective, only the source steps that
another rank owns (Note [depth transfers]).
"""

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .._engine.ownership import fetch, plan_fetch
from ..module import LayerParallelModule
from ..parameterization import LinearStepWeights

__all__ = [
    "depths",
    "freeze_inherited",
    "interpolate",
    "nested_hierarchy",
    "nested_iteration",
    "refine",
    "restrict",
]

_DEPTH_TAG = 7311
_SETS_TAG = 7313  # the exchange uses it and the next
_RULES = {
    "interpolate": ("injection", "linear"),
    "restrict": ("injection", "average", "full_weighting"),
}


def interpolate(
    coarse: LayerParallelModule,
    fine: LayerParallelModule,
    rule: str = "linear",
    optimizers: Optional[tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = None,
) -> None:
    """Sets ``fine``'s step weights (N * cf steps) from ``coarse``'s (N steps) by ``rule``
    (``"injection"`` or ``"linear"``); with ``optimizers=(coarse_opt, fine_opt)``, the state of
    ``coarse_opt`` for the coarse steps' parameters (SGD's momentum, Adam's moments) becomes
    ``fine_opt``'s for the fine steps', by the same rule.  The open and close layers are not
    touched (:func:`refine` copies them too).  Both models span the same layer group, with the
    same kind of step layer."""
    sources = interpolation(rule, coarse.num_steps, fine.num_steps)
    move_state(coarse, fine, sources, optimizers, f"interpolate ({rule})")
    _check_replicas(fine, f"interpolate ({rule})")


def restrict(
    fine: LayerParallelModule,
    coarse: LayerParallelModule,
    rule: str = "injection",
    optimizers: Optional[tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = None,
) -> None:
    """Sets ``coarse``'s step weights (N steps) from ``fine``'s (N * cf steps) by ``rule``
    (``"injection"``: fine step k * cf; ``"average"``: the mean of fine steps k * cf .. k * cf +
    cf - 1); with ``optimizers=(fine_opt, coarse_opt)``, the optimizer state too.  See
    :func:`interpolate`."""
    sources = restriction(rule, fine.num_steps, coarse.num_steps)
    move_state(fine, coarse, sources, optimizers, f"restrict ({rule})")
    _check_replicas(coarse, f"restrict ({rule})")


def _check_replicas(model: LayerParallelModule, what: str) -> None:
    """Under data parallelism, the data groups' copies of the weights just set agree (Note
    [replica check] in grid.py): each group transferred its own."""
    averager = model.__dict__.get("_averager")
    if averager is not None and averager.replicas is not None:
        averager.replicas.check(f"the end of {what}")


Sources = Callable[[int], list[tuple[int, float]]]


def interpolation(rule: str, coarse_steps: int, fine_steps: int) -> Sources:
    """``sources(j)``: the coarse steps and weights whose combination is fine step ``j``."""
    cf = _factor(fine_steps, coarse_steps, "interpolate")
    _check_rule(rule, "interpolate")
    n = coarse_steps

    def sources(j: int) -> list[tuple[int, float]]:
        k, s = divmod(j, cf)
        if rule == "injection" or s == 0 or k + 1 >= n:
            return [(k, 1.0)]
        return [(k, 1.0 - s / cf), (k + 1, s / cf)]

    return sources


def restriction(rule: str, fine_steps: int, coarse_steps: int) -> Sources:
    """``sources(k)``: the fine steps and weights whose combination is coarse step ``k``.
    ``rule`` is ``"injection"``, ``"average"``, ``"full_weighting"`` (the transpose of
    linear interpolation with each coarse step's weights scaled to sum to 1: the stencil
    [1/4, 1/2, 1/4] at a factor of 2, renormalized at the ends) or, for gradients,
    ``"adjoint"`` (the transpose of linear interpolation: every fine step's share of each
    coarse step it is interpolated from, summed; see layerbraid.depth.mgopt)."""
    cf = _factor(fine_steps, coarse_steps, "restrict")
    if rule in ("adjoint", "full_weighting"):
        inverse: dict[int, list[tuple[int, float]]] = {}
        for j in range(fine_steps):
            for k, w in interpolation("linear", coarse_steps, fine_steps)(j):
                inverse.setdefault(k, []).append((j, w))
        if rule == "full_weighting":
            for k, ws in inverse.items():
                total = sum(w for _, w in ws)
                inverse[k] = [(j, w / total) for j, w in ws]
        return lambda k: inverse[k]
    _check_rule(rule, "restrict")
    if rule == "injection":
        return lambda k: [(k * cf, 1.0)]
    return lambda k: [(k * cf + s, 1.0 / cf) for s in range(cf)]


def refine(
    coarse: torch.nn.Module,
    fine: torch.nn.Module,
    rule: str = "linear",
    optimizers: Optional[tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = None,
) -> None:
    """One step of nested iteration: ``fine`` takes over the trained ``coarse`` network, each
    layer-parallel module of ``fine`` (N * cf steps) from the one in the same place in
    ``coarse`` (N steps): its step weights interpolated by ``rule`` (:func:`interpolate`);
    every other parameter and buffer (the open and close layers, the layers between
    layer-parallel stages) copied.  With ``optimizers=(coarse_opt, fine_opt)`` the optimizer
    state moves alike.  ``coarse`` and ``fine`` are layer-parallel modules, or models that
    hold them (the stages of a network).  Collective over the layer group."""
    pairs = _parts(coarse, fine)
    for c, f in pairs:
        interpolate(c, f, rule, optimizers)
        _move_sets(c, f, optimizers)
    src, dst = _rest(coarse, pairs, 0), _rest(fine, pairs, 1)
    if [(k, v.shape) for k, v in src.items()] != [(k, v.shape) for k, v in dst.items()]:
        raise ValueError(
            "refine: the networks differ outside their step layers (parameters and buffers "
            f"{sorted(set(src) ^ set(dst)) or 'of other shapes'})"
        )
    with torch.no_grad():
        for name, t in dst.items():
            t.copy_(src[name])
            if optimizers is not None and src[name] in optimizers[0].state:
                optimizers[1].state[t] = {
                    k: v.clone() if torch.is_tensor(v) else v
                    for k, v in optimizers[0].state[src[name]].items()
                }


def free(model: torch.nn.Module) -> None:
    """Frees the MGRIT solvers of every layer-parallel module of ``model``."""
    for part in model.modules():
        if isinstance(part, LayerParallelModule):
            part.free()


def _parts(
    coarse: torch.nn.Module, fine: torch.nn.Module
) -> list[tuple[LayerParallelModule, LayerParallelModule]]:
    def parts(m: torch.nn.Module) -> list[LayerParallelModule]:
        return [p for p in m.modules() if isinstance(p, LayerParallelModule)]

    a, b = parts(coarse), parts(fine)
    if not a or len(a) != len(b):
        raise ValueError(
            f"refine: the coarse network holds {len(a)} layer-parallel module(s) and the fine "
            f"one {len(b)}: they must be the same network at two depths"
        )
    return list(zip(a, b))


def _move_sets(
    src: LayerParallelModule,
    dst: LayerParallelModule,
    optimizers: Optional[tuple[torch.optim.Optimizer, torch.optim.Optimizer]],
) -> None:
    """The coefficient sets of linear step weights (spline steps), which do not depend on the
    depth: each set ``dst`` stores on a rank gets the values of a rank that stores it in
    ``src`` (a rank's sets change with its steps' times), with its optimizer state.
    Collective over the layer group; nothing for other parameterizations."""
    how, dst_how = src.parameterization, dst.parameterization
    if not isinstance(how, LinearStepWeights):
        return
    if not isinstance(dst_how, LinearStepWeights) or dst_how.sets != how.sets:
        raise ValueError("refine: the two networks' steps are not the same coefficient sets")
    mine = dict(how.coefficients(src).items())
    targets = [(int(k), c) for k, c in dst_how.coefficients(dst).items()]
    src_opt, dst_opt = optimizers if optimizers is not None else (None, None)
    # each set from one rank that stores it (the first), to the ranks that lack it
    rank = src.comm.Get_rank()
    provides = [int(k) for k in mine if how._holders[int(k)][0] == rank]
    lacks = [k for k, _ in targets if str(k) not in mine]
    plan = plan_fetch(src.comm, provides, lacks, "refine")
    template = dict(targets)
    got = fetch(
        src.comm,
        plan,
        lambda k: _step_state(mine[str(k)], src_opt),
        lambda k: _step_state(template[k], dst_opt, like=src_opt),
        _SETS_TAG,
        "the coefficient sets of refine",
    )
    for k, c in targets:
        values = got[k] if k in got else _step_state(mine[str(k)], src_opt)
        _set_step_state(c, dst_opt, values, like=src_opt)


def _rest(model: torch.nn.Module, pairs: list, side: int) -> dict[str, torch.Tensor]:
    """{name: tensor} of ``model``'s parameters and buffers outside its step layers (and
    outside the coefficient sets of linear step weights, which :func:`_move_sets` moves)."""
    steps = {id(t) for pair in pairs for t in _tensors(pair[side].layers)}
    for pair in pairs:
        how = pair[side].parameterization
        if isinstance(how, LinearStepWeights):
            steps |= {id(t) for t in _tensors(how.coefficients(pair[side]))}
    return {
        name: t
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if id(t) not in steps
    }


def _tensors(m: torch.nn.Module) -> list[torch.Tensor]:
    return [*m.parameters(), *m.buffers()]


def depths(num_steps: int, levels: int, factor: int = 2, ranks: int = 1) -> list[int]:
    """The depths of nested iteration, coarsest first: ``num_steps / factor**(levels - 1)``,
    ..., ``num_steps``; each at least ``ranks`` (a layer-parallel network needs a step per
    rank).  Raises ``ValueError`` naming the value that does not divide or is too small."""
    if levels < 1:
        raise ValueError(f"nested iteration needs levels >= 1, got {levels}")
    if factor < 2:
        raise ValueError(f"the depth factor must be >= 2, got {factor}")
    out = [num_steps]
    for _ in range(levels - 1):
        if out[0] % factor:
            raise ValueError(
                f"{levels} depth levels with factor {factor}: {out[0]} steps are not a "
                f"multiple of {factor} (num_steps {num_steps})"
            )
        out.insert(0, out[0] // factor)
    if out[0] < ranks:
        raise ValueError(
            f"{levels} depth levels with factor {factor} from {num_steps} steps: the coarsest "
            f"network would have {out[0]} step(s), fewer than the {ranks} layer-parallel ranks "
            "(each rank needs a step): use fewer levels or more steps"
        )
    return out


def nested_iteration(
    build: Callable[[int], torch.nn.Module],
    steps: Sequence[int],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    train: Callable[[torch.nn.Module, torch.optim.Optimizer, int], None],
    rule: str = "linear",
    keep_optimizer_state: bool = True,
    freeze: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Training over a hierarchy of depths: train a shallow network, refine it to a deeper
    one, train that, up to the full depth.

    ``build(n)`` makes the network of ``n`` steps (a layer-parallel module, or a model whose
    layer-parallel stages have ``n`` steps each; on the same layer group each time, the blocks
    of each depth distributed by layerbraid as any network's), ``steps`` the
    depths, coarsest first, each a multiple of the last (:func:`depths` makes them),
    ``make_optimizer(model)`` a model's optimizer, and ``train(model, optimizer, level)``
    trains at depth ``steps[level]``.  Between depths, :func:`refine` moves the weights by
    ``rule`` (``"linear"`` or ``"injection"``) and, with ``keep_optimizer_state``, the
    optimizer's state (SGD's momentum, Adam's moments and step count); each shallower
    network is freed once refined.  With ``freeze``, each refined network trains with its
    inherited steps frozen (:func:`freeze_inherited`: only the steps new at its depth, and
    the layers around them, learn), and every step is trainable again once its ``train``
    returns.  Collective over the layer group.  Returns the full-depth network and its
    optimizer; :func:`nested_hierarchy` keeps every depth instead."""
    models, optimizers = _nested(
        build, steps, make_optimizer, train, rule, keep_optimizer_state, freeze, keep=False
    )
    return models[0], optimizers[0]


def nested_hierarchy(
    build: Callable[[int], torch.nn.Module],
    steps: Sequence[int],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    train: Callable[[torch.nn.Module, torch.optim.Optimizer, int], None],
    rule: str = "linear",
    keep_optimizer_state: bool = True,
    freeze: bool = False,
) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """:func:`nested_iteration` that keeps every depth's trained network and optimizer, as
    TorchBraid's ``initialize_with_nested_iteration`` builds its MG/Opt hierarchy: returns
    ``(models, optimizers)``, finest first, ready for
    ``layerbraid.depth.mgopt.MGOpt(models, optimizers)`` (whose coarse levels then start from
    the networks trained at their depths).  Nothing is freed."""
    return _nested(
        build, steps, make_optimizer, train, rule, keep_optimizer_state, freeze, keep=True
    )


def _nested(
    build: Callable[[int], torch.nn.Module],
    steps: Sequence[int],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    train: Callable[[torch.nn.Module, torch.optim.Optimizer, int], None],
    rule: str,
    keep_optimizer_state: bool,
    freeze: bool,
    keep: bool,
) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """Nested iteration; returns the depths' networks and optimizers, finest first (only the
    finest unless ``keep``: the others are freed as soon as they are refined)."""
    if not steps:
        raise ValueError("nested_iteration needs at least one depth")
    for a, b in zip(steps, steps[1:]):
        _factor(b, a, "nested_iteration")
    _check_rule(rule, "interpolate")
    model = build(steps[0])
    optimizer = make_optimizer(model)
    models, optimizers = [model], [optimizer]
    for level, n in enumerate(steps):
        frozen: list[torch.nn.Parameter] = []
        if level:
            finer = build(n)
            finer_opt = make_optimizer(finer)
            refine(model, finer, rule, (optimizer, finer_opt) if keep_optimizer_state else None)
            if not keep:
                free(model)
            model, optimizer = finer, finer_opt
            models.insert(0, model)
            optimizers.insert(0, optimizer)
            if freeze:
                frozen = freeze_inherited(model, n // steps[level - 1])
        train(model, optimizer, level)
        for p in frozen:
            p.requires_grad_(True)
    return (models, optimizers) if keep else (models[:1], optimizers[:1])


def freeze_inherited(model: torch.nn.Module, factor: int) -> list[torch.nn.Parameter]:
    """Freezes the steps that a refinement by ``factor`` inherited from the shallower network:
    in every layer-parallel module of ``model``, step ``j`` sits at a shallower step's time
    where ``j % factor == 0`` (its weights are that step's, whichever rule refined them); their
    parameters stop requiring gradients, so that training moves only the new steps (and the
    layers around the chain).  Not collective: each rank freezes the steps it owns.  Returns
    the parameters it froze; ``p.requires_grad_(True)`` on each makes them trainable again.
    Spline steps are refused: their weights are the coefficient sets, which every step
    shares."""
    if not isinstance(factor, int) or factor < 2:
        raise ValueError(f"freeze_inherited: factor must be an int >= 2, got {factor!r}")
    frozen = []
    for part in model.modules():
        if not isinstance(part, LayerParallelModule):
            continue
        if isinstance(part.parameterization, LinearStepWeights):
            raise ValueError(
                f"freeze_inherited: {type(part).__name__}'s steps are evaluated from "
                "coefficient sets that every step shares; there are no inherited steps to freeze"
            )
        if part.num_steps % factor:
            raise ValueError(
                f"freeze_inherited: {part.num_steps} steps are not a refinement by {factor}"
            )
        for j, layer in part.owned_steps():
            if j % factor == 0:
                for p in layer.parameters():
                    if p.requires_grad:
                        p.requires_grad_(False)
                        frozen.append(p)
    return frozen


def _factor(fine_steps: int, coarse_steps: int, what: str) -> int:
    if fine_steps % coarse_steps or fine_steps < coarse_steps:
        raise ValueError(
            f"{what}: the fine network's {fine_steps} steps are not a multiple of the coarse "
            f"network's {coarse_steps}"
        )
    return fine_steps // coarse_steps


def _check_rule(rule: str, what: str) -> None:
    if rule not in _RULES[what]:
        raise ValueError(f"{what}: rule must be one of {_RULES[what]}, got {rule!r}")


# Note [depth transfers]: every rank reports the source steps it owns and the ones its target
# steps read (one allgather of index lists); each source step then goes once from its owner to
# every other rank that reads it, as the bytes of its tensors, in one exchange.  A rank's
# target steps are computed from its own and the received source tensors, so every target
# step is computed once, by its owner, and a distribution that changes with the depth (the
# blocks move between ranks) costs only the steps that cross.  What moves is a step's list of
# tensors: its state and optimizer state (interpolate, restrict), or a vector over the
# parameters (MG/Opt's gradients and corrections, layerbraid.depth.mgopt).
Tensors = list[torch.Tensor]


def move_state(
    src: LayerParallelModule,
    dst: LayerParallelModule,
    sources: Callable[[int], list[tuple[int, float]]],
    optimizers: Optional[tuple[Any, Any]],
    what: str,
) -> None:
    src_opt, dst_opt = optimizers if optimizers is not None else (None, None)
    move_steps(
        src,
        dst,
        sources,
        lambda i, layer: _step_state(layer, src_opt),
        lambda layer: _step_state(layer, dst_opt, like=src_opt),
        lambda j, layer, values: _set_step_state(layer, dst_opt, values, like=src_opt),
        what,
    )


def move_steps(
    src: LayerParallelModule,
    dst: LayerParallelModule,
    sources: Callable[[int], list[tuple[int, float]]],
    get: Callable[[int, torch.nn.Module], Tensors],
    like: Callable[[torch.nn.Module], Tensors],
    put: Callable[[int, torch.nn.Module, Tensors], None],
    what: str,
) -> None:
    """Collective over the layer group: for every step ``j`` that this rank owns in ``dst``,
    ``put(j, layer, values)`` with ``values`` the weighted sum, by ``sources(j) = [(i, w)]``,
    of ``get(i, layer)`` over steps ``i`` of ``src`` (fetched from the rank that owns each;
    integer tensors come from the first source).  ``like(layer)`` gives the shapes and dtypes
    of the tensors ``get`` returns, for a step of ``dst``."""
    comm = src.comm
    if dst.comm.Get_size() != comm.Get_size():
        raise ValueError(f"{what}: the two networks span different numbers of ranks")
    mine = {i: layer for i, layer in src.owned_steps()}
    targets = dst.owned_steps()
    reads = sorted({i for j, _ in targets for i, _ in sources(j)})
    plan = plan_fetch(comm, sorted(mine), reads, what)
    template = like(targets[0][1]) if targets else []
    got = fetch(
        comm,
        plan,
        lambda i: get(i, mine[i]),
        lambda i: template,
        _DEPTH_TAG,
        f"the steps of {what}",
    )
    got.update({i: get(i, mine[i]) for i in reads if i in mine})
    for j, layer in targets:
        put(j, layer, _combine([(got[i], w) for i, w in sources(j)]))


def _slots(opt: Any) -> list[str]:
    """The per-parameter state an optimizer keeps that moves between depths."""
    if opt is None:
        return []
    if isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
        return ["step", "exp_avg", "exp_avg_sq"]
    if isinstance(opt, torch.optim.SGD):
        return ["momentum_buffer"]
    raise TypeError(
        f"moving the state of {type(opt).__name__} between depths is not supported: pass SGD "
        "or Adam/AdamW, or leave optimizers out and start the new optimizer afresh"
    )


def _step_state(layer: torch.nn.Module, opt: Any, like: Any = None) -> list[torch.Tensor]:
    """A step layer's state as a list of tensors: its state_dict, then, per parameter, the
    optimizer's slots (zeros where the optimizer has none yet, as a fresh SGD or Adam would
    start).  ``like``: whose slots (the source's optimizer) the list follows."""
    out = [t.detach() for t in layer.state_dict().values()]
    for name in _slots(like if like is not None else opt):
        for p in layer.parameters():
            have = opt.state.get(p, {}).get(name) if opt is not None else None
            if have is None:
                have = torch.zeros(() if name == "step" else p.shape)
            # float64 on the wire: the optimizers keep their step count as float32 or float64
            out.append(have.detach().to(p.device, torch.float64))
    return out


def _set_step_state(
    layer: torch.nn.Module, opt: Any, values: Sequence[torch.Tensor], like: Any
) -> None:
    states = list(layer.state_dict().values())
    with torch.no_grad():
        for t, v in zip(states, values):
            t.copy_(v.to(t.device, t.dtype))
    rest = list(values[len(states) :])
    if opt is None or like is None:
        return
    params = list(layer.parameters())
    for s, name in enumerate(_slots(like)):
        for p, v in zip(params, rest[s * len(params) : (s + 1) * len(params)]):
            slot = opt.state.setdefault(p, {})
            if name == "step":  # as the optimizer would have made it: a whole count
                old = slot.get(name)
                dtype = old.dtype if old is not None else torch.get_default_dtype()
                # a weighted mean of equal counts is the count only up to round-off (e.g.
                # 6.999999999999999 from averaging 7s); a count is whole
                slot[name] = v.detach().round().to("cpu", dtype).clone()
            else:
                slot[name] = v.detach().to(p.device, p.dtype).clone()


def _combine(parts: list[tuple[list[torch.Tensor], float]]) -> list[torch.Tensor]:
    """The weighted sum of the sources' float tensors; the first source's others."""
    first = parts[0][0]
    out = []
    for k, t in enumerate(first):
        if not t.is_floating_point() and not t.is_complex():
            out.append(t.clone())
            continue
        total = parts[0][1] * t
        for values, w in parts[1:]:
            total = total + w * values[k]
        out.append(total)
    return out
