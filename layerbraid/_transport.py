"""Tensors between ranks as raw bytes: MPI sends the tensor's memory, never a pickle.

MPI here is not assumed to be CUDA-aware: a tensor on a GPU is staged through host memory (one
copy each way), and arrives on the device the receiver names.  Every dtype travels as its bytes,
so float64 stays float64 and bfloat16 needs no numpy type.
"""
import time

import torch

__all__ = []


def wait(requests, comm, what):
    """Waits, polling, for MPI ``requests`` of ``comm``: Ctrl-C gets through, and a rank that
    waits longer than the stall timeout raises :class:`layerbraid.StallError` saying it waited
    for ``what``.  Several tests per wake: MPI's progress can need more than one call to finish
    what arrived during a nap (Note [polled waits] in cbridge/src/comm.c)."""
    from mpi4py import MPI

    from .errors import StallError
    from .launch import timeout

    limit = timeout()
    t0 = time.perf_counter()
    spins, nap = 0, 1e-5
    while not any(MPI.Request.Testall(requests) for _ in range(4)):
        spins += 1
        if spins > 100:
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)
        waited = time.perf_counter() - t0
        if limit and waited > limit:
            raise StallError(
                f"stalled: rank {comm.Get_rank()} waited {waited:.0f} s for {what}.  "
                "LAYERBRAID_TIMEOUT or layerbraid.set_timeout sets the limit")


def _host_bytes(t):
    """A contiguous CPU copy of ``t`` (or ``t`` itself when it is one) and its uint8 view."""
    host = t.detach().to("cpu").contiguous().reshape(-1)
    return host, host.view(torch.uint8).numpy()


def _empty(shape, dtype):
    host = torch.empty(shape, dtype=dtype).reshape(-1)
    return host, host.view(torch.uint8).numpy()


def allreduce_floats(comm, values, op, what):
    """``values`` (floats) reduced over ``comm`` with ``op`` ("sum" or "max"), the same on every
    rank bit for bit (the reduction, then rank 0's result broadcast: MPI does not promise the
    same rounding everywhere), with the stall deadline."""
    import numpy as np
    from mpi4py import MPI

    values = np.asarray(values, dtype=np.float64)
    if comm.Get_size() == 1:
        return [float(v) for v in values]
    out = np.empty_like(values)
    wait([comm.Iallreduce(values, out, op={"sum": MPI.SUM, "max": MPI.MAX}[op])], comm,
         f"every rank's part of {what}")
    wait([comm.Ibcast(out, root=0)], comm, f"rank 0's result of {what}")
    return [float(v) for v in out]


def neighbour_exchange(comm, first, last, what):
    """``(left's last, right's first)``: each rank sends ``first`` to the rank before it and
    ``last`` to the one after it (same shape and dtype everywhere), and receives theirs; None
    at the ends.  With the stall deadline."""
    rank, size = comm.Get_rank(), comm.Get_size()
    reqs, got = [], {}
    keep = []
    for peer, mine, tag in ((rank - 1, first, 7401), (rank + 1, last, 7402)):
        if 0 <= peer < size:
            host, buf = _host_bytes(mine)
            keep.append(host)
            reqs.append(comm.Isend(buf, dest=peer, tag=tag))
            into, ibuf = _empty(mine.shape, mine.dtype)
            # the left neighbour sends its last (tag 7402), the right one its first (7401)
            reqs.append(comm.Irecv(ibuf, source=peer, tag=7402 if peer < rank else 7401))
            got[peer] = into
    if reqs:
        wait(reqs, comm, f"its neighbours' layers for {what}")
    left = got.get(rank - 1)
    right = got.get(rank + 1)
    return (None if left is None else left.reshape(first.shape).to(first.device),
            None if right is None else right.reshape(last.shape).to(last.device))


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
    trailing shape and dtype everywhere) along dimension 0, on every rank.

    Every rank sends as many rows as the largest block (a shorter block is padded), through
    MPI_Allgather: MPICH's Allgatherv of the same bytes took 25x longer on one node (40 ms
    against 1.5 ms for 4 MB per rank, 2 ranks)."""
    from mpi4py import MPI

    counts = comm.allgather(int(t.shape[0]))
    most, rest = max(counts), tuple(t.shape[1:])
    if t.shape[0] == most:
        _, send = _host_bytes(t)
    else:
        padded = torch.zeros((most,) + rest, dtype=t.dtype)
        padded[:t.shape[0]] = t.detach().to("cpu")
        _, send = _host_bytes(padded)
    host, recv = _empty((len(counts) * most,) + rest, t.dtype)
    comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
    host = host.reshape((len(counts), most) + rest)
    rows = host.reshape((-1,) + rest) if min(counts) == most else \
        torch.cat([host[k, :c] for k, c in enumerate(counts)])
    return rows.to(t.device)
