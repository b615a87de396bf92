"""``from_serial``: a layer-parallel model built from a serial network you already have, keeping
its weights; the inverse of ``LayerParallelModule.to_serial()``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ._engine.serial import _SerialChain
from .grid import ProcessGrid
from .module import LayerParallelModule
from .nn.batchnorm import layer_parallel_modules
from .parameterization import ParameterizedModel, StepParameterization

__all__ = ["from_serial", "own_skip_rule"]

Rule = Callable[[nn.Module, nn.Module, torch.Tensor, float, int], torch.Tensor]

# Note [own skip]: a residual block that adds its own skip computes the next state itself,
# ``y = x + g(x)`` (a torchvision BasicBlock without downsample computes relu(x + g(x)), the
# same form: ``y = x + (block(x) - x)``).  On the fine level a step is the block: ``block(x)``,
# bit for bit the serial network's.  A coarse MGRIT step spans ``m`` fine steps (its dt is m
# times the fine one); stepping it as one block would ignore that and solve a different chain
# (a hand-made rule that did so differed from serial by 0.18 at two levels).  So the coarse
# step scales the block's increment by the ratio of the step sizes: ``x + (dt / h) * (block(x)
# - x)``, the forward Euler step of the ODE whose fine discretization the blocks are.


def own_skip_rule(
    module: nn.Module, layer: nn.Module, x: torch.Tensor, dt: float, index: int
) -> torch.Tensor:
    """The step rule of blocks that add their own skip (Note [own skip]): ``layer(x)`` on the
    fine level, ``x + (dt / h) * (layer(x) - x)`` on a level whose step ``dt`` spans ``dt / h``
    fine steps of size ``h = module.dt``."""
    y = layer(x)
    ratio = dt / float(module.dt)  # type: ignore[arg-type]
    if abs(ratio - 1.0) < 1e-9:  # the fine level (its step sizes differ from h by round-off)
        return y
    return x + ratio * (y - x)


class _SerialBlocks(StepParameterization):
    """Steps built from the blocks of a serial network.  Each rank keeps copies of only the
    blocks it owns (and of the few its coarse steps inject); for every other step it keeps a
    skeleton on the meta device (no memory), which ``to_serial()`` and the injected copies
    build from."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.source: list[nn.Module] | None = list(blocks)  # until the owned ones are copied
        self.skeletons = [_skeleton(b) for b in blocks]

    def layer(self, model: ParameterizedModel, index: int) -> nn.Module:
        if self.source is not None:
            return layer_parallel_modules(copy.deepcopy(self.source[index]))
        return _materialize(self.skeletons[index])

    def attach(self, model: ParameterizedModel) -> None:
        self.source = None  # the model shares no tensor with the user's blocks


class _FromSerial(LayerParallelModule):
    """A LayerParallelModule whose open layer, step blocks and close layer came from a serial
    network (its parameterization is _SerialBlocks), stepped by ``rule`` if one is given."""

    def __init__(
        self,
        open: nn.Module | None,
        blocks: Sequence[nn.Module],
        close: nn.Module | None,
        t_final: float,
        rule: Rule | None,
        comm: Any,
        options: dict[str, Any],
    ) -> None:
        super().__init__(
            len(blocks), t_final, comm, parameterization=_SerialBlocks(blocks), **options
        )
        self.open = copy.deepcopy(open)
        self.close = copy.deepcopy(close)
        self._rule = rule

    def step_rule(self, layer: nn.Module, x: torch.Tensor, dt: float, index: int) -> torch.Tensor:
        if self._rule is None:
            return super().step_rule(layer, x, dt, index)
        return self._rule(self, layer, x, dt, index)

    def _custom_rule(self) -> Rule | None:
        return self._rule


def from_serial(
    serial: nn.Module | None = None,
    *,
    open: nn.Module | None = None,
    steps: Sequence[nn.Module] | None = None,
    close: nn.Module | None = None,
    dt: float | None = None,
    t_final: float | None = None,
    own_skip: bool = False,
    step_rule: Rule | None = None,
    comm: Any | ProcessGrid | None = None,
    **options: Any,
) -> LayerParallelModule:
    """A layer-parallel model computing the same function as a serial network, with its weights.

    Either ``serial``, the network :meth:`LayerParallelModule.to_serial` returns (its open
    layer, step layers, close layer, step size and step rule are taken over), or the parts:

    Args:
        serial: a network returned by ``to_serial()``.
        open: the module run before the steps (on the first rank), or None.
        steps: the step blocks ``f_0 .. f_{N-1}`` (a list, ``nn.ModuleList`` or
            ``nn.Sequential``); step ``i`` is ``x <- x + dt * f_i(x)``.
        close: the module run after the steps (on the last rank), or None.
        dt, t_final: the step size, or the final time ``N * dt`` (give one).
        own_skip: True when each block adds its own skip connection and returns the next state,
            ``x + g(x)`` (a ResNet's residual block without downsampling): the fine step is then
            the block itself, and coarse levels scale its increment (:func:`own_skip_rule`);
            ``dt`` defaults to 1.
        step_rule: a custom rule ``rule(model, layer, x, dt, index)``, as
            ``LayerParallelModule.step_rule`` (a module-level function, so that the model's
            serial copy pickles).
        comm: an mpi4py communicator, a torch.distributed process group (or
            ``layerbraid.launch.world()``, which is either, as the launcher made it) or a
            :class:`layerbraid.ProcessGrid` (default: the world).
        **options: the other keyword arguments of :class:`LayerParallelModule`
            (``forward_options``, ``backward_options``, ``warm_start``, ``target_error``, ...).

    Collective over the layer group.  The parts are not changed and the model shares no tensor
    with them: each rank copies the open and close layers and the blocks it owns; plain batch
    norms in the blocks become layer-parallel ones (``layerbraid.nn.LPBatchNorm2d``, ...) with
    the same state.  Every rank must pass the same network (the same weights, e.g. loaded
    from one file or built under one seed).

    ``model(x)`` returns the close layer's output on every rank.  The open layer's parameters
    get gradients on the first rank, the close layer's on the last, each block's on the rank
    that owns it (``to_serial()`` gathers the weights; ``layerbraid.clip_grad_norm_`` and the
    optimizers need nothing more).  A block whose input or output does not chain (a channel
    count unlike the open layer's or the last block's) fails at the first forward, on every
    rank, naming the block and the state's shape."""
    if serial is not None:
        parts = (open, steps, close, dt, t_final, step_rule)
        if any(p is not None for p in parts) or own_skip:
            raise TypeError("from_serial takes either a serial network or its parts, not both")
        if not isinstance(serial, _SerialChain):
            raise TypeError(
                "from_serial(serial) takes the network LayerParallelModule.to_serial() returns, "
                f"got {type(serial).__name__}; pass any other network as its parts: "
                "from_serial(open=..., steps=..., close=..., dt=...)"
            )
        open, steps, close = serial.open, list(serial.layers), serial.close
        dt, step_rule = serial.dt, serial.rule
    blocks = _check_blocks(steps)
    if own_skip:
        if step_rule is not None:
            raise TypeError("give own_skip=True or a step_rule, not both")
        step_rule = own_skip_rule
        if dt is None and t_final is None:
            dt = 1.0
    final = _final_time(dt, t_final, len(blocks))
    for name, part in (("open", open), ("close", close)):
        if part is not None and not isinstance(part, nn.Module):
            raise TypeError(f"{name} must be an nn.Module or None, got {type(part).__name__}")
    if step_rule is not None and not callable(step_rule):
        raise TypeError(f"step_rule must be a function, got {type(step_rule).__name__}")
    return _FromSerial(open, blocks, close, final, step_rule, comm, options)


def _check_blocks(steps: Sequence[nn.Module] | None) -> list[nn.Module]:
    if steps is None:
        raise TypeError("from_serial needs a serial network or its step blocks (steps=...)")
    if isinstance(steps, nn.Module) and not isinstance(steps, (nn.Sequential, nn.ModuleList)):
        raise TypeError(
            f"steps must be a sequence of step blocks, got one {type(steps).__name__}: wrap "
            "a single block in a list"
        )
    blocks = list(steps)
    if not blocks:
        raise ValueError("steps is empty: a layer-parallel model needs at least one step")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"steps[{i}] must be an nn.Module, got {type(b).__name__}")
    return blocks


def _final_time(dt: float | None, t_final: float | None, n: int) -> float:
    """T, from the step size or T itself (given as T, it is kept to the bit)."""
    if (dt is None) == (t_final is None):
        raise TypeError(f"give exactly one of dt and t_final (got dt={dt!r}, t_final={t_final!r})")
    value, name = (dt, "dt") if dt is not None else (t_final, "t_final")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value) * n if dt is not None else float(value)


def _skeleton(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose parameters and persistent buffers are on the meta device (no
    memory): what the block is, without its numbers, made without copying their data.  The
    non-persistent buffers (constants no state_dict carries) keep theirs."""
    memo: dict[int, Any] = {}
    for p in block.parameters():
        memo[id(p)] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    for m in block.modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                memo[id(b)] = b.to("meta")
    skeleton = copy.deepcopy(block, memo)
    devices = {t.device for t in [*block.parameters(), *block.buffers()]}
    skeleton._lb_device = devices.pop() if len(devices) == 1 else None  # type: ignore[assignment]
    return skeleton


def _materialize(skeleton: nn.Module) -> nn.Module:
    """A block built from its skeleton, its meta tensors replaced by uninitialized ones on the
    block's device (tied ones stay tied): every use fills them (``to_serial()`` and the injected
    copies load the owners' weights)."""
    device = getattr(skeleton, "_lb_device", None) or torch.device("cpu")
    block = copy.deepcopy(skeleton)
    made: dict[int, Any] = {}
    for m in block.modules():
        tables: list[dict[str, Any]] = [m._parameters, m._buffers]
        for table in tables:
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = (
                        nn.Parameter(empty, requires_grad=t.requires_grad)
                        if isinstance(t, nn.Parameter)
                        else empty
                    )
                table[name] = made[id(t)]
    return layer_parallel_modules(block)
