"""Tensors between ranks as raw bytes: MPI sends the tensor's memory, never a pickle; every
call has the stall deadline (Note [deadlines] in _comm/mpi.py).

Note [staging]: MPI here is not assumed to be CUDA-aware.  A tensor on a GPU is staged through
host memory (one copy each way) and arrives on the device the receiver names.  Every dtype
travels as its bytes (bool as one byte each), so float64 stays float64 and bfloat16 needs no
numpy type.

Note [CUDA-aware MPI]: ``LAYERBRAID_CUDA_AWARE_MPI=1`` says the MPI is CUDA-aware (checked
against mpi4py's ``Query_cuda_support`` where the MPI offers one).  Then the MGRIT core's state
messages go through :class:`DeviceMessages` (the core's application transport, Note
[application transport] in cbridge/src/comm.c): each state is handed to MPI as the device
tensor it is, nothing staged; so are the tensors sent, received and broadcast here.  Small
values and the weights' broadcast stay on the host.
"""

import os

import numpy as np
import torch
from mpi4py import MPI

from .base import Transport
from .mpi import _OPS, _check_received, allgather_obj, start_allreduce_sum, wait
from .stream import StateStream

__all__ = []


# ---------------------------------------------------------------- staging (Note [staging])
_aware: list = []


def cuda_aware() -> bool:
    """Whether MPI may be handed device memory (Note [CUDA-aware MPI])."""
    if not _aware:
        on = os.environ.get("LAYERBRAID_CUDA_AWARE_MPI", "0") not in ("", "0")
        query = getattr(MPI, "Query_cuda_support", None)
        if on and query is not None and not query():
            raise RuntimeError(
                "LAYERBRAID_CUDA_AWARE_MPI=1, but this MPI says it is not CUDA-aware "
                f"(mpi4py's Query_cuda_support(): False; {MPI.Get_library_version()[:60]!r}): "
                "unset it, or use an MPI built with CUDA support"
            )
        _aware.append(on)
    return _aware[0]


def host_bytes(t):
    """A contiguous copy of ``t`` that MPI can read (``t`` itself when it is one: on the CPU,
    or on the GPU with a CUDA-aware MPI) and its bytes (a uint8 numpy array sharing its
    memory, or the device tensor's uint8 view)."""
    host = t.detach().reshape(-1)
    if host.device.type != "cpu" and not cuda_aware():
        host = host.to("cpu")
    host = host.contiguous()
    raw = host.view(torch.uint8)
    return host, raw.numpy() if raw.device.type == "cpu" else raw


def empty_bytes(shape, dtype, device=None):
    """A new tensor of ``shape`` and ``dtype`` (flat) and its bytes, to receive into: on the
    CPU, or on ``device`` when that is a GPU and MPI is CUDA-aware."""
    on = (
        device
        if device is not None and torch.device(device).type != "cpu" and cuda_aware()
        else "cpu"
    )
    host = torch.empty(shape, dtype=dtype, device=on).reshape(-1)
    raw = host.view(torch.uint8)
    return host, raw.numpy() if raw.device.type == "cpu" else raw


def nbytes(t):
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- reductions
def allreduce_sum(comm, tensors, what):
    """The sums over ``comm`` of ``tensors`` (one message, in float64), as new tensors of their
    shapes, dtypes and devices."""
    if isinstance(comm, Transport):
        return comm.allreduce_sum(tensors, what)
    tensors = list(tensors)
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors]).numpy()
    if comm.Get_size() > 1:
        wait([start_allreduce_sum(comm, flat)], comm, f"every rank's part of {what}")
    out, off = [], 0
    for t in tensors:
        out.append(
            torch.from_numpy(flat[off : off + t.numel()]).view(t.shape).to(t.device, t.dtype)
        )
        off += t.numel()
    return out


# ---------------------------------------------------------------- tensors
def bcast_tensor(comm, t, shape, dtype, device, root, what="a broadcast tensor"):
    """``t`` of the root on every rank of ``comm`` (shape and dtype known everywhere)."""
    if isinstance(comm, Transport):
        return comm.bcast_tensor(t, shape, dtype, device, root, what)
    if comm.Get_rank() == root:
        _, buf = host_bytes(t)
        wait([comm.Ibcast(buf, root=root)], comm, f"rank {root}'s {what}")
        return t
    host, buf = empty_bytes(shape, dtype, device)
    wait([comm.Ibcast(buf, root=root)], comm, f"rank {root}'s {what}")
    return host.reshape(shape).to(device)


def send_tensor(comm, t, dest, tag, what="a tensor"):
    if isinstance(comm, Transport):
        return comm.send_tensor(t, dest, tag, what)
    host, buf = host_bytes(t)
    wait([comm.Isend(buf, dest=dest, tag=tag)], comm, f"rank {dest} to take {what}")


def recv_tensor(comm, shape, dtype, device, source, tag, what="a tensor"):
    if isinstance(comm, Transport):
        return comm.recv_tensor(shape, dtype, device, source, tag, what)
    host, buf = empty_bytes(shape, dtype, device)
    status = MPI.Status()
    wait([comm.Irecv(buf, source=source, tag=tag)], comm, f"{what} from rank {source}", [status])
    _check_received(status, host.numel() * host.element_size(), f"{what} from rank {source}")
    return host.reshape(shape).to(device)


def bcast_into(comm, tensors, root=0, what="the weights"):
    """Overwrites ``tensors`` (the same shapes and dtypes on every rank) with the root's, in
    one message."""
    if isinstance(comm, Transport):
        return comm.bcast_into(tensors, root, what)
    tensors = list(tensors)
    if comm.Get_size() == 1 or not tensors:
        return
    flat = torch.cat([host_bytes(t)[0].view(torch.uint8) for t in tensors]).contiguous()
    wait([comm.Ibcast(flat.numpy(), root=root)], comm, f"rank {root}'s {what}")
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = nbytes(t)
            t.copy_(flat[off : off + n].view(t.dtype).view(t.shape).to(t.device))
            off += n


def neighbour_exchange(comm, first, last, what):
    """``(left's last, right's first)``: each rank sends ``first`` to the rank before it and
    ``last`` to the one after it (same shape and dtype everywhere), and receives theirs; None
    at the ends."""
    if isinstance(comm, Transport):
        return comm.neighbour_exchange(first, last, what)
    rank, size = comm.Get_rank(), comm.Get_size()
    reqs, got, keep, checks = [], {}, [], []
    for peer, mine, tag in ((rank - 1, first, 7401), (rank + 1, last, 7402)):
        if 0 <= peer < size:
            host, buf = host_bytes(mine)
            keep.append(host)
            reqs.append(comm.Isend(buf, dest=peer, tag=tag))
            into, ibuf = empty_bytes(mine.shape, mine.dtype, mine.device)
            # the left neighbour sends its last (tag 7402), the right one its first (7401)
            reqs.append(comm.Irecv(ibuf, source=peer, tag=7402 if peer < rank else 7401))
            checks.append((len(reqs) - 1, peer, into.numel() * into.element_size()))
            got[peer] = into
    statuses = [MPI.Status() for _ in reqs]
    if reqs:
        wait(reqs, comm, f"its neighbours' layers for {what}", statuses)
    for k, peer, n in checks:
        _check_received(statuses[k], n, f"rank {peer}'s layer for {what}")
    left = got.get(rank - 1)
    right = got.get(rank + 1)
    return (
        None if left is None else left.reshape(first.shape).to(first.device),
        None if right is None else right.reshape(last.shape).to(last.device),
    )


def allgather_rows(comm, t, what="every rank's rows"):
    """The concatenation, in rank order, of every rank's ``t`` (shape (n_rank, ...), the same
    trailing shape and dtype everywhere) along dimension 0, on every rank.

    Every rank sends as many rows as the largest block (a shorter block is padded), through
    MPI_Allgather: MPICH's Allgatherv of the same bytes was many times slower on one node."""
    if isinstance(comm, Transport):
        return comm.allgather_rows(t, what)
    counts = [int(c) for c in allgather_obj(comm, int(t.shape[0]), f"the row counts of {what}")]
    most, rest = max(counts), tuple(t.shape[1:])
    if t.shape[0] == most:
        _, send = host_bytes(t)
    else:
        padded = torch.zeros((most,) + rest, dtype=t.dtype)
        padded[: t.shape[0]] = t.detach().to("cpu")
        _, send = host_bytes(padded)
    host, recv = empty_bytes((len(counts) * most,) + rest, t.dtype)
    wait(
        [comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])], comm, f"every rank's part of {what}"
    )
    host = host.reshape((len(counts), most) + rest)
    rows = (
        host.reshape((-1,) + rest)
        if min(counts) == most
        else torch.cat([host[k, :c] for k, c in enumerate(counts)])
    )
    return rows.to(t.device)


# ---------------------------------------------------------------- Note [CUDA-aware MPI]
class DeviceMessages(StateStream):
    """The MGRIT core's messages over an mpi4py communicator (its own: the core's duplicate)
    with device buffers: the application transport of a core under CUDA-aware MPI.  MPI
    matches a pair's messages of one tag in order, as the stream needs."""

    def __init__(self, comm):
        self.comm = comm
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._stream_init()

    def _start_p2p(self, send, t, peer, tag):
        buf = t.numpy() if t.device.type == "cpu" else t
        op = self.comm.Isend if send else self.comm.Irecv
        return op(buf, peer, tag)

    def _done(self, work):
        return work.Test()

    def iallreduce_doubles(self, values, op):
        values = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty_like(values)
        req = self.comm.Iallreduce(values, out, op=_OPS[op])
        return self._handle(("reduce", [req], out))

    def free(self):
        if not MPI.Is_finalized():
            self.comm.Free()
