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


def bcast_into(comm, tensors, root=0):
    """Overwrites ``tensors`` (the same shapes and dtypes on every rank) with the root's, in
    one message."""
    tensors = list(tensors)
    if comm.Get_size() == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to("cpu").view(torch.uint8)
                      if t.dtype != torch.bool else t.detach().reshape(-1).to("cpu", torch.uint8)
                      for t in tensors]).contiguous()
    comm.Bcast(flat.numpy(), root=root)
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            part = flat[off:off + n]
            t.copy_((part.view(t.dtype) if t.dtype != torch.bool else part.to(torch.bool))
                    .view(t.shape).to(t.device))
            off += n


def allgather_rows(comm, t):
    """The concatenation, in rank order, of every rank's ``t`` (shape (n_rank, ...), the same
    trailing shape and dtype everywhere) along dimension 0, on every rank."""
    from mpi4py import MPI

    counts = comm.allgather(int(t.shape[0]))
    rest = tuple(t.shape[1:])
    row = t.element_size() * int(torch.tensor(rest).prod().item() if rest else 1)
    _, send = _host_bytes(t)
    host, recv = _empty((sum(counts),) + rest, t.dtype)
    sizes = [c * row for c in counts]
    displs = [sum(sizes[:k]) for k in range(len(sizes))]
    comm.Allgatherv([send, MPI.BYTE], [recv, sizes, displs, MPI.BYTE])
    return host.reshape((sum(counts),) + rest).to(t.device)
