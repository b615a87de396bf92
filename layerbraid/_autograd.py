"""The autograd Functions of a layer-parallel forward: the MGRIT chain and the output broadcast.

Note [every rank runs backward]: the adjoint solve is collective, so ``_ChainFn.backward`` must run
on every rank of the layer group.  Its output always requires grad (an anchor tensor that requires
grad is one of its inputs), and on ranks other than the last it is a dummy that feeds
``_BroadcastFn``, whose output every rank uses; so whenever the loss depends on the model's output,
autograd reaches ``_ChainFn.backward`` everywhere.
"""
import torch

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
        ctx.run = None  # the stored forward graphs are consumed
        assert len(param_grads) == ctx.num_params
        return (None, grad_h0, None, *param_grads)


class _BroadcastFn(torch.autograd.Function):
    """The root's tensor on every rank of comm; backward keeps the root's gradient (every rank
    computes the same loss from the same output, so counting it once is right)."""

    @staticmethod
    def forward(ctx, comm, root, y):
        ctx.root, ctx.is_root = root, comm.Get_rank() == root
        ctx.dummy_shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if comm.Get_size() == 1:
            return y.clone()
        payload = y.detach().cpu() if ctx.is_root else None
        payload = comm.bcast(payload, root=root)
        return payload.to(y.device) if not ctx.is_root else y.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.is_root:
            return None, None, grad
        return None, None, torch.zeros(ctx.dummy_shape, dtype=ctx.dtype, device=ctx.device)


class _ToFirstFn(torch.autograd.Function):
    """The last rank's tensor on the first rank (a dummy elsewhere), to feed another
    layer-parallel stage; backward sends the first rank's gradient back to the last rank."""

    TAG = 7302

    @staticmethod
    def forward(ctx, comm, y):
        size, rank = comm.Get_size(), comm.Get_rank()
        ctx.comm, ctx.first, ctx.last = comm, rank == 0, rank == size - 1
        ctx.shape, ctx.dtype, ctx.device = y.shape, y.dtype, y.device
        if size == 1:
            return y.clone()
        if ctx.last:
            comm.send(y.detach().cpu(), dest=0, tag=_ToFirstFn.TAG)
            return torch.zeros((), dtype=y.dtype, device=y.device)
        if ctx.first:
            return comm.recv(source=size - 1, tag=_ToFirstFn.TAG).to(y.device)
        return torch.zeros((), dtype=y.dtype, device=y.device)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        if comm.Get_size() == 1:
            return None, grad
        if ctx.first:
            comm.send(grad.detach().cpu(), dest=comm.Get_size() - 1, tag=_ToFirstFn.TAG)
        if ctx.last:
            return None, comm.recv(source=0, tag=_ToFirstFn.TAG).to(ctx.device)
        return None, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
