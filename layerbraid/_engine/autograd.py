"""The autograd Functions that move a layer-parallel chain's output: to every rank of the layer
group (``_BroadcastFn``), or to its first rank for the next stage (``_ToFirstFn``).  The chain
itself is ``_chain._ChainFn`` (see Note [every rank runs backward] there)."""

from typing import Any

import torch

__all__ = []


class _BroadcastFn(torch.autograd.Function):
    """The root's tensor (of a known shape and dtype) on every rank of comm; backward keeps the
    root's gradient (every rank computes the same loss from the same output, so counting it
    once is right)."""

    @staticmethod
    def forward(ctx: Any, comm: Any, root: int, y: Any, shape: Any, dtype: Any) -> Any:
        ctx.root, ctx.is_root = root, comm.Get_rank() == root
        ctx.dummy_shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if comm.Get_size() == 1:
            return y.clone()
        out = comm.bcast_tensor(y if ctx.is_root else None, shape, dtype, y.device, root)
        return y.clone() if ctx.is_root else out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if ctx.is_root:
            return None, None, grad, None, None
        return (
            None,
            None,
            torch.zeros(ctx.dummy_shape, dtype=ctx.dtype, device=ctx.device),
            None,
            None,
        )


class _ToFirstFn(torch.autograd.Function):
    """The last rank's tensor (of a known shape and dtype) on the first rank (a dummy
    elsewhere), to feed another layer-parallel stage; backward sends the first rank's gradient
    back to the last rank."""

    TAG = 7302

    @staticmethod
    def forward(ctx: Any, comm: Any, y: Any, shape: Any, dtype: Any) -> Any:
        size, rank = comm.Get_size(), comm.Get_rank()
        ctx.comm, ctx.first, ctx.last = comm, rank == 0, rank == size - 1
        ctx.shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if size == 1:
            return y.clone()
        if ctx.last:
            comm.send_tensor(y, 0, _ToFirstFn.TAG)
            return torch.zeros((), dtype=y.dtype, device=y.device)
        if ctx.first:
            ctx.out_shape, ctx.out_dtype = shape, dtype
            return comm.recv_tensor(shape, dtype, y.device, size - 1, _ToFirstFn.TAG)
        return torch.zeros((), dtype=y.dtype, device=y.device)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        comm = ctx.comm
        if comm.Get_size() == 1:
            return None, grad, None, None
        if ctx.first:
            g = grad if grad is not None else torch.zeros(ctx.out_shape, dtype=ctx.out_dtype)
            comm.send_tensor(g.to(ctx.out_dtype), comm.Get_size() - 1, _ToFirstFn.TAG)
        if ctx.last:
            return (
                None,
                comm.recv_tensor(ctx.shape, ctx.dtype, ctx.device, 0, _ToFirstFn.TAG),
                None,
                None,
            )
        return None, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device), None, None
