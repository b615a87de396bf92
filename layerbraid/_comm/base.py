"""The transport interface: what a communicator other than an mpi4py one must provide.

layerbraid talks to other ranks through the functions of ``_comm.mpi`` (small values, records,
barriers, byte exchanges, exit notices) and ``_comm.transport`` (tensors).  Called with an mpi4py
communicator they run on MPI, as they always did; called with a :class:`Transport` they hand the
work to its methods, which have the same names and meaning.  ``_comm.dist.DistComm`` (a
torch.distributed process group) is the second implementation.  Every method waits by polling,
with the stall deadline and the exit notices (Note [deadlines] in _comm/mpi.py).
"""

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..errors import RemoteRankError, StallError
from .timeouts import timeout, wait_sleep

__all__ = ["Transport"]


def poll(done: Callable[[], bool], check: Callable[[], None], what: str, rank: int) -> None:
    """Calls ``done()`` until it is true: a short spin, then, between tests, a yield of the
    core when every rank of this node has a core of its own (a nap would wake late by up to
    its length, on every wait of a pipeline), else a nap of a tenth of the time waited so far,
    between ``wait_sleep()`` and 1 ms; several tests per wake (MPI's progress can need more
    than one call to finish what arrived during a nap); ``check()`` (the exit notices) and the
    timeout about every 50 ms.  Every wait of either transport goes through here (Note
    [deadlines] in _comm/mpi.py)."""
    limit = timeout()
    t0 = time.perf_counter()
    spins, sleep, next_check = 0, None, t0 + 0.05
    while True:
        for _ in range(4):
            if done():
                return
        spins += 1
        if spins <= 100:
            continue
        now = time.perf_counter()
        if sleep is None:
            sleep = wait_sleep()
        if sleep > 0:
            time.sleep(min(max((now - t0) / 10, sleep), 1e-3))
        else:
            os.sched_yield()
        if now < next_check:
            continue
        next_check = now + 0.05
        check()
        waited = now - t0
        if limit and waited > limit:
            raise StallError(
                f"stalled: rank {rank} waited {waited:.0f} s for {what}.  "
                "LAYERBRAID_TIMEOUT or layerbraid.set_timeout sets the limit"
            )


def exited(local: int, src: int, me: int, text: str, what: str, real=None) -> RemoteRankError:
    """The error of rank ``me`` told that rank ``local`` (``src`` in the whole job) exited with
    ``text`` while it waited for ``what``; ``real``: the ranks the user knows, by rank of the
    communicator waited on (the MGRIT core's may order them otherwise)."""
    if real is not None:
        local, me = real[local], real[me]
    name = f"rank {local}" if local == src else f"rank {local} (world rank {src})"
    return RemoteRankError(
        f"{name} exited ({text}) while rank {me} waited for {what}", local, origin_raised=False
    )


def missing_ranks(rank: int, missing: Sequence[int], what: str) -> StallError:
    """The StallError of a rank whose neighbours ``missing`` never reached ``what``."""
    who = " and ".join(f"rank {p}" for p in missing)
    return StallError(
        f"stalled: rank {rank} waited {timeout():.0f} s for {who} to reach {what}; "
        f"{'it' if len(missing) == 1 else 'they'} never did (stopped, or called model(x) "
        "or backward() a different number of times, or with another batch).  "
        "LAYERBRAID_TIMEOUT or layerbraid.set_timeout sets the limit"
    )


class Transport(ABC):
    """A communicator: ranks 0..size-1, in the order this object gives them.  ``device``: where
    its messages' tensors live (the CPU, or the GPU of a transport that moves device memory)."""

    device: Any

    # ---- what mpi4py's Intracomm offers and the package calls
    @abstractmethod
    def Get_rank(self) -> int: ...

    @abstractmethod
    def Get_size(self) -> int: ...

    @abstractmethod
    def Split(self, color: int, key: int) -> "Transport": ...

    @abstractmethod
    def Dup(self) -> "Transport": ...

    @abstractmethod
    def Free(self) -> None: ...

    # ---- _comm.mpi
    @abstractmethod
    def wait(self, requests: Sequence[Any], what: str) -> None: ...

    @abstractmethod
    def barrier(self, what: str) -> None: ...

    @abstractmethod
    def arrive(self, what: str) -> None: ...

    @abstractmethod
    def allreduce_floats(self, values: Sequence[float], op: str, what: str) -> list[float]: ...

    @abstractmethod
    def start_allreduce_sum(self, flat: Any) -> Any: ...

    @abstractmethod
    def allgather_obj(self, obj: Any, what: str) -> list[Any]: ...

    @abstractmethod
    def gather_obj(self, obj: Any, root: int, what: str) -> Optional[list[Any]]: ...

    @abstractmethod
    def bcast_obj(self, obj: Any, root: int, what: str) -> Any: ...

    @abstractmethod
    def allgather_ints(self, record: Any, what: str) -> Any: ...

    @abstractmethod
    def bcast_ints(self, record: Any, root: int, what: str) -> Any: ...

    @abstractmethod
    def exchange_bytes(self, sends: dict, recvs: dict, tag: int, what: str) -> None: ...

    @abstractmethod
    def check_exits(self, what: str, real: Optional[Sequence[int]] = None) -> None: ...

    # ---- _comm.transport
    @abstractmethod
    def allreduce_sum(self, tensors: Sequence[Any], what: str) -> list[Any]: ...

    @abstractmethod
    def bcast_tensor(self, t: Any, shape: Any, dtype: Any, device: Any, root: int, what: str): ...

    @abstractmethod
    def send_tensor(self, t: Any, dest: int, tag: int, what: str) -> None: ...

    @abstractmethod
    def recv_tensor(
        self, shape: Any, dtype: Any, device: Any, source: int, tag: int, what: str
    ): ...

    @abstractmethod
    def bcast_into(self, tensors: Sequence[Any], root: int, what: str) -> None: ...

    @abstractmethod
    def neighbour_exchange(self, first: Any, last: Any, what: str) -> tuple[Any, Any]: ...

    @abstractmethod
    def allgather_rows(self, t: Any, what: str) -> Any: ...

    # ---- the MGRIT core's messages (Note [application transport] in cbridge/src/comm.c)
    @abstractmethod
    def isend_state(self, dest: int, tag: int, flag: int, head: bytes, payload: Any) -> int: ...

    @abstractmethod
    def try_recv_state(self, src: int, tag: int) -> Optional[tuple[int, bytes, Any]]: ...

    @abstractmethod
    def iallreduce_doubles(self, values: Any, op: str) -> int: ...

    @abstractmethod
    def test(self, handle: int) -> Optional[Any]: ...
