"""Building blocks for layer-parallel networks."""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ConvBlock",
    "LPBatchNorm1d",
    "LPBatchNorm2d",
    "LPBatchNorm3d",
    "LayerParallelGRU",
    "LayerParallelLSTM",
    "LMHead",
    "TokenEmbedding",
    "TransformerStep",
    "layer_parallel_modules",
    "plain_modules",
]


from .batchnorm import (
    LPBatchNorm1d,
    LPBatchNorm2d,
    LPBatchNorm3d,
    layer_parallel_modules,
    plain_modules,
)
from .rnn import LayerParallelGRU, LayerParallelLSTM
from .transformer import LMHead, TokenEmbedding, TransformerStep


class ConvBlock(nn.Module):
    """The residual function of a convolutional ODE step: ``relu(conv2(relu(conv1(x))))``.

    Args:
        channels: input and output channels (the state keeps its shape).
        kernel_size: odd kernel size; padding keeps the spatial size.
        dims: 2 for images (N, C, H, W), 3 for volumes (N, C, D, H, W).
    """

    def __init__(self, channels: int, kernel_size: int = 3, dims: int = 2) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"ConvBlock kernel_size must be odd, got {kernel_size}")
        conv = {2: nn.Conv2d, 3: nn.Conv3d}.get(dims)
        if conv is None:
            raise ValueError(f"ConvBlock dims must be 2 or 3, got {dims}")
        pad = kernel_size // 2
        self.conv1 = conv(channels, channels, kernel_size, padding=pad)
        self.conv2 = conv(channels, channels, kernel_size, padding=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))
