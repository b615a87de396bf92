"""Building blocks for layer-parallel networks."""
import threading

import torch.nn.functional as F
from torch import nn

__all__ = ["ConvBlock", "LPBatchNorm1d", "LPBatchNorm2d", "LPBatchNorm3d"]


class _SolveState(threading.local):
    """Set by LayerParallelModule while its forward MGRIT solve runs (Note [batch-norm stats])."""

    in_solve = False
    final = False


_solve_state = _SolveState()


class _LayerParallelBatchNorm:
    """Note [batch-norm stats]: inside a forward MGRIT solve a step layer runs many times per
    batch (relaxation sweeps, coarse levels).  It always normalizes with the statistics of the
    batch it is given, but it updates the running statistics only in the final fine relaxation,
    where every step runs exactly once on the converged state, so that they equal what the
    serial network computes.  Outside a solve (open/close layers, the serial network) it is an
    ordinary batch norm."""

    def forward(self, x):
        if self.training and self.track_running_stats and _solve_state.in_solve \
                and not _solve_state.final:
            self._check_input_dim(x)
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(x)


class LPBatchNorm1d(_LayerParallelBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` for use inside layer-parallel step layers (same arguments)."""


class LPBatchNorm2d(_LayerParallelBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` for use inside layer-parallel step layers (same arguments)."""


class LPBatchNorm3d(_LayerParallelBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` for use inside layer-parallel step layers (same arguments)."""


class ConvBlock(nn.Module):
    """The residual function of a convolutional ODE step: ``relu(conv2(relu(conv1(x))))``.

    Args:
        channels: input and output channels (the state keeps its shape).
        kernel_size: odd kernel size; padding keeps the spatial size.
        dims: 2 for images (N, C, H, W), 3 for volumes (N, C, D, H, W).
    """

    def __init__(self, channels: int, kernel_size: int = 3, dims: int = 2):
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"ConvBlock kernel_size must be odd, got {kernel_size}")
        conv = {2: nn.Conv2d, 3: nn.Conv3d}.get(dims)
        if conv is None:
            raise ValueError(f"ConvBlock dims must be 2 or 3, got {dims}")
        pad = kernel_size // 2
        self.conv1 = conv(channels, channels, kernel_size, padding=pad)
        self.conv2 = conv(channels, channels, kernel_size, padding=pad)

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))))
