"""The autograd Functions of a layer-parallel forward: the MGRIT chain and the output broadcast.

Note [every rank runs backward]: the adjoint solve is collective, so ``_ChainFn.backward`` must run
on every rank of the layer group.  Its output always requires grad (an anchor tensor that requires
grad is one of its inputs), and on ranks other than the last it is a dummy that feeds
``_BroadcastFn``, whose output every rank uses; so whenever the loss depends on the model's output,
autograd reaches ``_ChainFn.backward`` everywhere.
"""
import torch

from ._transport import bcast_tensor, recv_tensor, send_tensor

__all__ = []


class _ChainFn(torch.autograd.Function):
    """h0 (first rank) -> u_N (last rank) by a forward MGRIT solve; backward by an adjoint solve."""

    @staticmethod
    def forward(ctx, model, h0, anchor, *params):
        run = model._forward_solve(h0)
        ctx.model, ctx.run = model, run
        ctx.num_params = len(params)
        return run.output

    @staticmethod
    def backward(ctx, grad_out):
        model, run = ctx.model, ctx.run
        grad_h0, param_grads = model._backward_solve(run, grad_out)
        if not model.retain_graphs:
            ctx.run = None  # the stored forward graphs are consumed
        assert len(param_grads) == ctx.num_params
        return (None, grad_h0, None, *param_grads)


class _BroadcastFn(torch.autograd.Function):
    """The root's tensor (of a known shape and dtype) on every rank of comm; backward keeps the
    root's gradient (every rank computes the same loss from the same output, so counting it
    once is right)."""

    @staticmethod
    def forward(ctx, comm, root, y, shape, dtype):
        ctx.root, ctx.is_root = root, comm.Get_rank() == root
        ctx.dummy_shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if comm.Get_size() == 1:
            return y.clone()
        out = bcast_tensor(comm, y if ctx.is_root else None, shape, dtype, y.device, root)
        return y.clone() if ctx.is_root else out

    @staticmethod
    def backward(ctx, grad):
        if ctx.is_root:
            return None, None, grad, None, None
        return None, None, torch.zeros(ctx.dummy_shape, dtype=ctx.dtype, device=ctx.device), \
            None, None


class _ToFirstFn(torch.autograd.Function):
    """The last rank's tensor (of a known shape and dtype) on the first rank (a dummy
    elsewhere), to feed another layer-parallel stage; backward sends the first rank's gradient
    back to the last rank."""

    TAG = 7302

    @staticmethod
    def forward(ctx, comm, y, shape, dtype):
        size, rank = comm.Get_size(), comm.Get_rank()
        ctx.comm, ctx.first, ctx.last = comm, rank == 0, rank == size - 1
        ctx.shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if size == 1:
            return y.clone()
        if ctx.last:
            send_tensor(comm, y, 0, _ToFirstFn.TAG)
            return torch.zeros((), dtype=y.dtype, device=y.device)
        if ctx.first:
            ctx.out_shape, ctx.out_dtype = shape, dtype
            return recv_tensor(comm, shape, dtype, y.device, size - 1, _ToFirstFn.TAG)
        return torch.zeros((), dtype=y.dtype, device=y.device)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        if comm.Get_size() == 1:
            return None, grad, None, None
        if ctx.first:
            g = grad if grad is not None else torch.zeros(ctx.out_shape, dtype=ctx.out_dtype)
            send_tensor(comm, g.to(ctx.out_dtype), comm.Get_size() - 1, _ToFirstFn.TAG)
        if ctx.last:
            return None, recv_tensor(comm, ctx.shape, ctx.dtype, ctx.device, 0,
                                     _ToFirstFn.TAG), None, None
        return None, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device), None, None
