"""Tensors between ranks as raw bytes: MPI sends the tensor's memory, never a pickle.

MPI here is not assumed to be CUDA-aware: a tensor on a GPU is staged through host memory (one
copy each way), and arrives on the device the receiver names.  Every dtype travels as its bytes,
so float64 stays float64 and bfloat16 needs no numpy type.
"""
import torch

__all__ = []


def _host_bytes(t):
    """A contiguous CPU copy of ``t`` (or ``t`` itself when it is one) and its uint8 view."""
    host = t.detach().to("cpu").contiguous().reshape(-1)
    return host, host.view(torch.uint8).numpy()


def _empty(shape, dtype):
    host = torch.empty(shape, dtype=dtype).reshape(-1)
    return host, host.view(torch.uint8).numpy()


def bcast_tensor(comm, t, shape, dtype, device, root):
    """``t`` of the root on every rank of ``comm`` (shape and dtype known everywhere)."""
    if comm.Get_rank() == root:
        _, buf = _host_bytes(t)
        comm.Bcast(buf, root=root)
        return t
    host, buf = _empty(shape, dtype)
    comm.Bcast(buf, root=root)
    return host.reshape(shape).to(device)


def send_tensor(comm, t, dest, tag):
    _, buf = _host_bytes(t)
    comm.Send(buf, dest=dest, tag=tag)


def recv_tensor(comm, shape, dtype, device, source, tag):
    host, buf = _empty(shape, dtype)
    comm.Recv(buf, source=source, tag=tag)
    return host.reshape(shape).to(device)
