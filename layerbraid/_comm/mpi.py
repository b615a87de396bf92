"""The MPI backend: an mpi4py communicator as a :class:`Transport` (Note [deadlines] in
_comm/base.py), and the exit notices of a job started by mpiexec.  This module, ``_comm.world``
and the launch code are the only ones that import mpi4py.

Note [staging]: MPI here is not assumed to be CUDA-aware.  A tensor on a GPU is staged through
host memory (one copy each way: the transport's ``device`` is the CPU) and arrives on the
device the receiver names.

Note [CUDA-aware MPI]: ``LAYERBRAID_CUDA_AWARE_MPI=1`` says the MPI is CUDA-aware (checked
against mpi4py's ``Query_cuda_support`` where the MPI offers one).  Then the transport's
``device`` is the GPU: tensors are handed to MPI as the device tensors they are, and the MGRIT
core's state messages go through the transport (the core's application transport, Note
[application transport] in cbridge/src/comm.c) instead of the core's own MPI calls on host
buffers.  Small values stay on the host.
"""

import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from mpi4py import MPI

from ..errors import RemoteRankError
from .base import Transport
from .waits import exited

__all__ = ["MPIComm", "cuda_aware", "wrap"]

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


# ---------------------------------------------------------------- Note [CUDA-aware MPI]
_aware: list[bool] = []


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


def _buffer(t: torch.Tensor) -> Any:
    """What mpi4py takes for the contiguous tensor ``t``: a numpy view of host memory, or the
    device tensor itself (``__cuda_array_interface__``)."""
    return t.numpy() if t.device.type == "cpu" else t


class _Recv:
    """A receive and the size its message must have: MPI tells the size of what arrived, and
    one of another size means the ranks disagree on what they exchange."""

    __slots__ = ("request", "status", "nbytes", "peer", "finished")

    def __init__(self, request: Any, nbytes: int, peer: int) -> None:
        self.request, self.nbytes, self.peer = request, nbytes, peer
        self.status = MPI.Status()
        self.finished = False

    def test(self, what: str) -> bool:
        if self.finished:
            return True
        if not self.request.Test(self.status):
            return False
        self.finished = True
        got = self.status.Get_count(MPI.BYTE)
        if got != self.nbytes:
            raise RemoteRankError(
                f"{what} (from rank {self.peer}) came with {got} bytes where {self.nbytes} were "
                "expected: the ranks disagree on its shape or dtype",
                self.peer,
            )
        return True


# ---------------------------------------------------------------- the communicator
class MPIComm(Transport):
    """An mpi4py intracommunicator as a transport.  ``owned``: :meth:`Free` frees it (one this
    package made by Split or Dup; never a user's)."""

    def __init__(self, comm: Any, owned: bool = False) -> None:
        self.comm, self.owned = comm, owned
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cuda_aware() and torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.small = torch.device("cpu")
        self._members: Optional[set[int]] = None
        self._stream_init()

    def __repr__(self) -> str:
        return f"MPIComm(rank {self.rank} of {self.size})"

    # ---- ranks and groups
    def Split(self, color: int, key: int, what: str = "a split of a communicator") -> "MPIComm":
        self.barrier(what)  # MPI_Comm_split is a blocking collective: arrive first
        new = MPIComm(self.comm.Split(color, key), owned=True)
        new.note_peers()
        return new

    def Dup(self) -> "MPIComm":
        self.barrier("the duplication of a communicator")
        new = MPIComm(self.comm.Dup(), owned=True)
        new.note_peers()
        return new

    def Free(self) -> None:
        if self.owned and not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.owned = False

    def native_mpi(self) -> Any:
        return None if cuda_aware() else self.comm

    def note_peers(self) -> None:
        _add_peers(self.comm)

    def _sizes_checked(self) -> bool:
        return True

    # ---- the primitives
    def _start_p2p(self, send: bool, t: torch.Tensor, peer: int, tag: int) -> Any:
        buf = [_buffer(t), MPI.BYTE] if t.dtype == torch.uint8 else _buffer(t)
        if send:
            return self.comm.Isend(buf, dest=peer, tag=tag)
        return _Recv(self.comm.Irecv(buf, source=peer, tag=tag), t.numel() * t.element_size(), peer)

    def _start_allreduce(self, t: torch.Tensor, op: str) -> Any:
        return self.comm.Iallreduce(MPI.IN_PLACE, _buffer(t), op=_OPS[op])

    def _start_bcast(self, t: torch.Tensor, root: int) -> Any:
        return self.comm.Ibcast(_buffer(t), root=root)

    def _start_allgather(self, t: torch.Tensor, out: torch.Tensor) -> Any:
        return self.comm.Iallgather(_buffer(t), _buffer(out))

    def _start_barrier(self) -> Any:
        return self.comm.Ibarrier()

    def _done(self, work: Any, what: str = "a message of an MGRIT solve") -> bool:
        if isinstance(work, _Recv):
            return work.test(what)
        return work.Test()

    def check_exits(self, what: str, real: Optional[Sequence[int]] = None) -> None:
        side = _notices["comm"]
        if side is None:
            return
        status = MPI.Status()
        while side.Iprobe(source=MPI.ANY_SOURCE, tag=_EXIT_TAG, status=status):
            src = status.Get_source()
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            side.Recv([buf, MPI.BYTE], source=src, tag=_EXIT_TAG)
            _notices["seen"][src] = buf.tobytes().decode(errors="replace")
        if not _notices["seen"]:
            return
        if self._members is None:
            self._members = _members(self.comm)
        for src, text in sorted(_notices["seen"].items()):
            if src in self._members:
                raise exited(self._local(src), src, self.rank, text, what, real)

    def _local(self, world_rank: int) -> int:
        world = MPI.COMM_WORLD.Get_group()
        group = self.comm.Get_group()
        try:
            return MPI.Group.Translate_ranks(world, [world_rank], group)[0]
        finally:
            group.Free()
            world.Free()


_world: list[Optional[MPIComm]] = [None]


def world() -> MPIComm:
    """MPI's COMM_WORLD as a transport (one object for the process)."""
    comm = _world[0]
    if comm is None:
        comm = _world[0] = MPIComm(MPI.COMM_WORLD)
    return comm


def wrap(comm: Any) -> MPIComm:
    """A user's mpi4py communicator as a transport (COMM_WORLD's is shared); never freed by
    layerbraid."""
    if comm == MPI.COMM_WORLD:
        return world()
    return MPIComm(comm)


# ---------------------------------------------------------------- exit notices
# Note [exit notices]: a rank that leaves the interpreter (sys.exit, the end of its script)
# while its peers still run would otherwise leave them waiting for it until the stall timeout
# (it blocks in MPI_Finalize, and a SystemExit skips the abort hook).  At exit, a rank of a
# multi-rank job first waits, briefly, in a barrier of every rank's exit (a normal end: every
# rank arrives, nothing else happens).  When that grace ends without the others, it sends a
# notice (its exit status) to every rank it shares a layerbraid communicator with, then waits
# for the barrier as MPI_Finalize would have.  A peer that is waiting in
# layerbraid (a collective here, or the MGRIT core, whose poll callback checks) raises
# RemoteRankError "rank r exited (...)", which, uncaught, ends the job with that cause.  A notice
# from a rank outside the communicator being waited on is left alone: that wait does not need
# the rank.
_EXIT_TAG = 7601
_EXIT_GRACE = 0.5
_notices: dict[str, Any] = {"comm": None, "peers": set(), "exit": None, "seen": {}}


def notices_started() -> bool:
    return _notices["comm"] is not None


def record_exit_status(status: Any) -> None:
    """The status ``sys.exit`` was called with, for the exit notice."""
    _notices["exit"] = status


def _start_notices() -> None:
    """Called once by ``launch.install_process_hooks`` in a job of 2+ ranks: the notice
    communicator (the exit handler and the sys.exit wrapper are installed there)."""
    if _notices["comm"] is not None:
        return
    # MPI_Comm_dup is collective: non-blocking here, with the deadline, so that a rank that
    # never builds anything of layerbraid's is reported instead of waited for.
    side, req = MPI.COMM_WORLD.Idup()
    world().wait(
        [req],
        "every rank to build its first layer-parallel model, grid, "
        "solver or loader (each rank builds the same ones, in the same order)",
    )
    _notices["comm"] = side
    side.Set_name("layerbraid notices")


def _add_peers(comm: Any) -> None:
    """Records the world ranks of the mpi4py ``comm``: they are told when this rank exits
    early."""
    if _notices["comm"] is None or comm.Get_size() == 1:
        return
    world = MPI.COMM_WORLD.Get_group()
    group = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    me = MPI.COMM_WORLD.Get_rank()
    _notices["peers"].update(r for r in ranks if r >= 0 and r != me)


def _members(comm: Any) -> set[int]:
    """The world ranks of ``comm``."""
    world = MPI.COMM_WORLD.Get_group()
    group = comm.Get_group()
    try:
        return set(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def _describe_exit() -> str:
    status = _notices["exit"]
    if status is None:
        return "the end of its script"
    if isinstance(status, int):
        return f"SystemExit {status}"
    return f"SystemExit {status!r}"


def at_exit() -> None:
    """The exit handler: the exit barrier, and the notices when it does not end in time."""
    side = _notices["comm"]
    if side is None or MPI.Is_finalized():
        return
    req = side.Ibarrier()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < _EXIT_GRACE:
        if req.Test():
            return _drain()
        time.sleep(1e-3)
    # The others still run: tell them (one that waits for this rank in layerbraid raises),
    # then wait for them as MPI_Finalize would.  A rank that goes on working alone (say, rank 0
    # evaluating) is not disturbed: it reads the notice only when it waits.
    text = _describe_exit().encode()
    peers = sorted(_notices["peers"])
    if _notices["exit"] not in (None, 0):  # a failure status: say it here too (a normal end
        # while rank 0 still writes its reports is not worth a line)
        print(
            f"layerbraid: rank {MPI.COMM_WORLD.Get_rank()} is exiting ({text.decode()}) "
            "while other ranks still run; ranks that wait for it will be told",
            file=sys.stderr,
            flush=True,
        )
    sends = [
        side.Isend([np.frombuffer(text, dtype=np.uint8), MPI.BYTE], dest=r, tag=_EXIT_TAG)
        for r in peers
    ]
    while not req.Test():
        time.sleep(1e-3)
    MPI.Request.Waitall(sends)
    _drain()


def _drain() -> None:
    """Receives the notices that arrived, so that none is left pending at MPI_Finalize."""
    side = _notices["comm"]
    status = MPI.Status()
    while side.Iprobe(source=MPI.ANY_SOURCE, tag=_EXIT_TAG, status=status):
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        side.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=_EXIT_TAG)
