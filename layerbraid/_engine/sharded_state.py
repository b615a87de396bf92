"""The state of a network whose step layers are spread over the ranks (each rank holds the
layers of its own steps, the open layer the first rank, the close layer the last): which entries
this rank holds, the whole network gathered, loading a state_dict of any rank count, the serial
copy, and checkpoints.  Mixed into ``LayerParallelModule``."""

from __future__ import annotations

import re
from typing import Any, Callable, cast

import torch
from torch import nn

from .. import checkpoint
from ..nn.batchnorm import _plain_copy, plain_modules
from .ownership import seeded_layer
from .parts import ShardedPart
from .serial import _SerialChain

__all__ = ["ShardedState"]

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


class ShardedState(ShardedPart, nn.Module):
    """What a sharded nn.Module adds to its state_dict handling (a base between the module
    and ``nn.Module``, whose methods ``super()`` reaches)."""

    # what the module provides
    num_steps: int
    dt: float
    open: nn.Module | None
    close: nn.Module | None
    _comm: Any
    _rank: int
    _size: int
    _built: bool
    _chain: Any
    _layer_seed: int
    parameterization: Any

    def _step_factory(self, index: int) -> nn.Module:
        """The module of step ``index`` (the parameterization's)."""
        raise NotImplementedError

    def _custom_rule(self) -> Callable[..., Any] | None:
        """The subclass's own step_rule function, or None for forward Euler."""
        raise NotImplementedError

    def _counted_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradient this rank alone holds (see _holds_key), for
        clip_grad_norm_."""
        return [p for k, p in self.named_parameters() if self._holds_key(k)]

    # ------------------------------------------------------------------ serial view, state
    def _gather_state(self, root: int | None = None) -> dict[str, torch.Tensor] | None:
        """{serial state_dict key: CPU tensor} of the whole network, on every rank (or root)."""
        mine = {k: v.detach().cpu() for k, v in super().state_dict().items() if self._holds_key(k)}
        if self._size == 1:
            return mine
        what = "the weights of every step layer"
        parts = (
            self._comm.allgather_obj(mine, what)
            if root is None
            else self._comm.gather_obj(mine, root, what)
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
        self.parameterization.refresh(self)
        full = self._gather_state()
        assert full is not None  # gathered on every rank
        layers = nn.ModuleList(
            seeded_layer(self._step_factory, i, self._layer_seed) for i in range(self.num_steps)
        )
        serial = _SerialChain(
            _plain_copy(self.open),
            cast(nn.ModuleList, plain_modules(layers)),
            _plain_copy(self.close),
            self.dt,
            self._custom_rule(),
        )
        # assign: each tensor keeps the dtype the model has (after .double(), say), not the
        # fresh layers' default; then the device of this rank's own tensors.
        # (Copies: on one rank the gathered tensors share the model's memory.)
        skip = self.parameterization.serial_skip  # state the serial network has no place for
        serial.load_state_dict(
            {k: v.clone() for k, v in full.items() if not k.startswith(skip)}, assign=True
        )
        ref = next(iter(super().state_dict().values()), None)
        return serial if ref is None else serial.to(ref.device)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a serial (or any rank count's) state_dict: each rank keeps its own layers."""
        owned = set(self._chain.owned) if self._built else None
        keep = {}
        for k, v in state_dict.items():
            m = _LAYER_KEY.match(k)
            if m and owned is not None and int(m.group(1)) not in owned:
                continue
            if self._built and not self.parameterization.loads(self, k):
                continue  # e.g. a coefficient set that no step of this rank uses
            keep[k] = v
        return super().load_state_dict(keep, strict=strict, assign=assign)

    def _holds_key(self, key: str) -> bool:
        """Whether this rank holds the state_dict entry ``key``: a step layer's on its owner,
        the open layer's on the first rank, the close layer's on the last, what the
        parameterization registered where it says, the rest on the first."""
        if _LAYER_KEY.match(key):
            return True  # only the owned layers exist here
        held = self.parameterization.holds(self, key)
        if held is not None:
            return held
        if key.startswith("close."):
            return self._rank == self._size - 1
        return self._rank == 0

    def save_checkpoint(
        self, path: Any, optimizer: Any = None, extra: Any = None, loader: Any = None
    ) -> None:
        """Writes one file that any number of ranks can resume from (collective); see
        :func:`layerbraid.save_checkpoint`."""
        checkpoint.save_checkpoint(self, path, optimizer, extra, loader)

    def load_checkpoint(self, path: Any, optimizer: Any = None, loader: Any = None) -> Any:
        """Resumes from :meth:`save_checkpoint`'s file on any number of ranks; returns ``extra``
        (see :func:`layerbraid.load_checkpoint`)."""
        return checkpoint.load_checkpoint(self, path, optimizer, loader)
