"""Batch norms for layer-parallel networks (Note [batch-norm stats]), and the plain copies a
serial network gets instead of them."""

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._comm.world import resolve
from .._engine.chain import _solve_state

if TYPE_CHECKING:  # the mixin sits before a torch batch norm in every class that uses it
    _BatchNormBase = nn.modules.batchnorm._BatchNorm
else:
    _BatchNormBase = object

__all__ = [
    "LPBatchNorm1d",
    "LPBatchNorm2d",
    "LPBatchNorm3d",
    "layer_parallel_modules",
    "plain_modules",
]


class _AllreduceSum(torch.autograd.Function):
    """Sum over the ranks of comm; the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, comm: Any, t: torch.Tensor) -> Any:
        ctx.comm = comm
        return _allreduce(comm, t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None, _allreduce(ctx.comm, grad)


def _allreduce(comm: Any, t: torch.Tensor) -> torch.Tensor:
    return comm.allreduce_sum([t], "the batch-norm statistics")[0]


class _LayerParallelBatchNorm(_BatchNormBase):
    """Note [batch-norm stats]: inside a forward MGRIT solve a step layer runs many times per
    batch (relaxation sweeps, coarse levels).  It always normalizes with the statistics of the
    batch it is given, but it updates the running statistics only in the final fine relaxation,
    where every step runs exactly once on the converged state, so that they equal what the
    serial network computes.  Outside a solve (open/close layers, the serial network) it is an
    ordinary batch norm.

    With ``sync_comm`` (e.g. ``ProcessGrid.data_comm``) the batch statistics are those of the
    whole batch, summed over the data groups' shards (and so are their gradients)."""

    def __init__(self, *args, sync_comm=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sync_comm = resolve(sync_comm) if sync_comm is not None else None
        self.sync_comm = sync_comm if sync_comm is not None and sync_comm.Get_size() > 1 else None

    def forward(self, x: torch.Tensor) -> Any:
        update = not _solve_state.in_solve or _solve_state.final
        if self.training and self.sync_comm is not None:
            self._check_input_dim(x)
            return self._synced(x, update and self.track_running_stats)
        if self.training and self.track_running_stats and not update:
            self._check_input_dim(x)
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(x)

    def _synced(self, x: torch.Tensor, update: bool) -> torch.Tensor:
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        count = torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)
        stats = _AllreduceSum.apply(
            self.sync_comm, torch.cat([x.sum(dims), (x * x).sum(dims), count])
        )
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean
        if update:
            tracked, running_mean, running_var = (
                self.num_batches_tracked,
                self.running_mean,
                self.running_var,
            )
            assert tracked is not None and running_mean is not None and running_var is not None
            with torch.no_grad():
                tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                running_mean.mul_(1 - m).add_(m * mean.detach())
                running_var.mul_(1 - m).add_(m * var.detach() * n / (n - 1))
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


class LPBatchNorm1d(_LayerParallelBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` for use inside layer-parallel step layers (same arguments, and
    ``sync_comm`` to share batch statistics across data groups)."""


class LPBatchNorm2d(_LayerParallelBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` for use inside layer-parallel step layers (same arguments, and
    ``sync_comm`` to share batch statistics across data groups)."""


class LPBatchNorm3d(_LayerParallelBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` for use inside layer-parallel step layers (same arguments, and
    ``sync_comm`` to share batch statistics across data groups)."""


def plain_modules(module: nn.Module) -> nn.Module:
    """``module`` with every layer-parallel batch norm replaced, in place, by the plain
    ``nn.BatchNorm1d/2d/3d`` with the same arguments and state (no communicator); returns it."""
    if isinstance(module, _LayerParallelBatchNorm):
        return _plain_batch_norm(module)
    for name, child in list(module.named_children()):
        setattr(module, name, plain_modules(child))
    return module


def layer_parallel_modules(module: nn.Module) -> nn.Module:
    """The inverse of :func:`plain_modules`: ``module`` with every plain ``nn.BatchNorm1d/2d/3d``
    replaced, in place, by the layer-parallel one with the same arguments and state (no
    ``sync_comm``); returns it.  What a step layer built from a serial block needs: a plain
    batch norm would update its running statistics at every sweep of a solve."""
    if isinstance(module, _LayerParallelBatchNorm):
        return module
    kind = _LP_OF.get(type(module))
    if kind is not None:
        return _converted(module, kind)
    for name, child in list(module.named_children()):
        setattr(module, name, layer_parallel_modules(child))
    return module


def _plain_copy(module: Optional[nn.Module]) -> Optional[nn.Module]:
    """A deep copy of ``module`` (or None) with plain batch norms and no communicator."""
    if module is None:
        return None
    import copy

    memo = {
        id(m.sync_comm): None
        for m in module.modules()
        if isinstance(m, _LayerParallelBatchNorm) and m.sync_comm is not None
    }
    return plain_modules(copy.deepcopy(module, memo))


def _plain_batch_norm(bn: Any) -> nn.Module:
    kind = next(
        c for c in type(bn).__mro__ if c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    )
    return _converted(bn, kind)


_LP_OF: dict[type, type] = {
    nn.BatchNorm1d: LPBatchNorm1d,
    nn.BatchNorm2d: LPBatchNorm2d,
    nn.BatchNorm3d: LPBatchNorm3d,
}


def _converted(bn: Any, kind: type) -> nn.Module:
    """A batch norm of class ``kind`` with ``bn``'s arguments, state, mode and device."""
    ref = bn.weight if bn.weight is not None else bn.running_mean
    made = kind(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
    )
    made.load_state_dict(bn.state_dict())
    made.train(bn.training)
    return made
