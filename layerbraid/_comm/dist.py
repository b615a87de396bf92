"""The second transport: a torch.distributed process group (gloo on CPU, NCCL on CUDA) as
layerbraid's communicator.  ``DistComm`` implements ``_comm.base.Transport``; a job started by
torchrun gets one over the default group wherever no communicator is passed (:func:`world`),
and ``comm=dist.group.WORLD`` (any ProcessGroup) is wrapped by :func:`as_comm`.

Note [device-resident messages]: a group whose backend serves CUDA tensors (NCCL) moves states,
tensors and gradient buckets as device tensors: nothing is staged through host memory.  A group
that serves CPU tensors only (gloo) moves CPU tensors, one copy each way for a GPU state, as MPI
does (Note [staging] in _comm/mpi.py).  Small values (floats, records, pickled reports)
travel on the CPU where the group allows it, else on the device.

Note [dist waits]: every operation is started asynchronously and finished by ``Transport.wait``,
which polls (the stall deadline, the exit notices every 50 ms, Ctrl-C).
Collectives report completion through ``Work.is_completed()``, as do NCCL's point-to-point
operations; gloo's point-to-point ``Work`` reports it only through a blocking ``wait()`` (a
``wait`` with a timeout tears the connection down), so each gloo send or receive is waited on by
a daemon thread (reused from message to message) that sets an event; the poll waits on that
event in slices up to its next check, with the interpreter's lock released (spinning, it held
the lock the thread needs to report: a message took about 0.4 ms one way, against 0.03 for a
blocking wait).  A thread left waiting when a peer stalls is abandoned with the job, which is
ending.  A finished gloo ``Work`` is kept a few messages longer than its message
(``_RETIRED``): freed at once, as the exact path's messages were, its destructor waited for
gloo's own thread, and with each rank on one core of its own a message took 1.9 ms one way
instead of 0.08 (on every message of a ping-pong that freed its ``Work`` at once, on none that
freed it a message later).

Note [contexts]: MPI isolates the messages of two communicators over the same ranks; a process
group does not.  Each DistComm made by Dup or Split gets a context number, agreed on by its
ranks, that prefixes every tag it sends with, so that two models' solves, or a forward and its
adjoint, never take each other's messages.  NCCL ignores tags and matches a pair's messages in
the order they were posted: there the isolation is the program order itself (a solve receives
every message it was sent before it ends, in its final allreduce, and the Python-level exchanges
happen between solves in the same order on every rank), and Note [state streams] in
_comm/stream.py orders the messages within a solve.

Note [store notices]: the exit notices (Note [exit notices] in _comm/mpi.py) and the failure
notices of the abort hook go through the job's key-value store (the one torchrun's rendezvous
made): a rank that exits early or dies of an exception writes its cause under its rank and bumps
a counter; a waiting rank reads the counter every 50 ms and raises RemoteRankError naming it.
"""

import collections
import os
import queue
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import RemoteRankError, StallError
from .base import Transport
from .timeouts import timeout
from .waits import exited

__all__ = ["DistComm", "as_comm", "is_process_group", "launched_by_torchrun", "world"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_TAG_BITS = 16  # Note [contexts]: tag = context << 16 | tag
_MAX_CONTEXT = (2**31 - 1) >> _TAG_BITS


# ---------------------------------------------------------------- the default group
def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the
    torch.distributed environment: MASTER_ADDR, RANK and WORLD_SIZE)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(
        k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    )


_world: list[Optional["DistComm"]] = [None]


def world() -> "DistComm":
    """The default process group as a DistComm; ``init_process_group`` from the launcher's
    environment first when the program has not called it: gloo for CPU tensors, and NCCL for
    CUDA tensors where CUDA is available (torch's default), or the backend that
    ``LAYERBRAID_DIST_BACKEND`` names ("gloo": CUDA states staged through the host, as when
    several processes share one GPU, which NCCL refuses).  The rendezvous has the stall
    deadline (Note [rendezvous deadline])."""
    if not dist.is_initialized():
        backend = os.environ.get("LAYERBRAID_DIST_BACKEND") or None
        if backend not in (None, "gloo", "nccl", "mpi"):
            raise ValueError(f"LAYERBRAID_DIST_BACKEND must be gloo, nccl or mpi, got {backend!r}")
        _init_default_group(backend)
    comm = _world[0]
    if comm is None:
        comm = _world[0] = DistComm(dist.group.WORLD)
    return comm


# Note [rendezvous deadline]: init_process_group waits for every process of WORLD_SIZE to join
# its store, by default for 30 minutes, silently.  Started here it waits the stall timeout
# (plus a margin, so that a collective's own poll, which names what it waited for, always raises
# before the backend's timeout of the same operation), and a peer that never comes ends the
# process with StallError naming the rendezvous, the world size and how many arrived.  A rank
# other than 0 first waits, polling, until rank 0's store accepts a connection: torch's client
# retries with backoff and overran the timeout by 5-10 s.
_BACKEND_MARGIN = 5.0


def _init_default_group(backend: Optional[str]) -> None:
    limit = timeout()
    deadline = timedelta(seconds=limit + _BACKEND_MARGIN) if limit else None
    if limit and os.environ.get("RANK", "0") != "0" and not _store_reachable(limit):
        why = "the store never accepted a connection"
        raise StallError(_rendezvous_stalled(why, limit))
    try:
        store = _attempt_store(deadline)
        if store is None:
            dist.init_process_group(backend=backend, timeout=deadline)
        else:
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=size, timeout=deadline
            )
    except dist.DistError as exc:
        raise StallError(_rendezvous_stalled(str(exc), limit + _BACKEND_MARGIN)) from exc


# Note [restart attempts]: torchrun --max-restarts starts the processes again after one fails,
# with the same store (the agent's) and TORCHELASTIC_RESTART_COUNT one higher.  The backend's
# rendezvous keys of the failed attempt are still there: gloo then connects to the dead
# process's old address and the restart fails (torch 2.13, tried).  Under torchrun the default
# group is made on the store seen through a prefix of the attempt, so every attempt, and its
# exit notices (Note [store notices]), starts clean.
def _attempt_store(deadline: Optional[timedelta]) -> Any:
    """The rendezvous store of this torchrun attempt, or None outside torchrun's restarts."""
    env = os.environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if attempt is None or not all(env.get(k) for k in needed):
        return None
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    hosted_by_agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        size,
        is_master=not hosted_by_agent and rank == 0,
        timeout=deadline or timedelta(minutes=30),
    )
    return dist.PrefixStore(f"layerbraid/attempt_{attempt}", store)


def _store_reachable(limit: float) -> bool:
    """Whether MASTER_ADDR:MASTER_PORT accepts a TCP connection within ``limit`` seconds (True
    where the environment names no such address: another rendezvous, torch's to time)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return True
    end = time.monotonic() + limit
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(min(left, 1.0), 0.05)):
                return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(min(0.1, max(left, 0.0)))


def _rendezvous_stalled(why: str, waited: float) -> str:
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    size = env.get("WORLD_SIZE", "?")
    joined = re.search(r"(\d+)/(\d+) clients joined", why)
    if joined:
        came = f"{joined.group(1)} of {joined.group(2)} processes arrived"
    else:
        came = "it could not reach the store that rank 0 hosts (rank 0 never started it)"
    return (
        f"stalled: rank {env.get('RANK', '?')} waited {waited:.0f} s for the torch.distributed "
        f"rendezvous at {where} (WORLD_SIZE={size}): {came}.  Start every process of the job "
        f"(torchrun --nproc-per-node {size}, or one per rank with the same MASTER_ADDR and "
        "MASTER_PORT); LAYERBRAID_TIMEOUT or layerbraid.set_timeout sets the limit"
    )


def is_process_group(obj: Any) -> bool:
    return isinstance(obj, dist.ProcessGroup)


def as_comm(obj: Any) -> Any:
    """A ProcessGroup as a DistComm (the default group's is shared); anything else as it is."""
    if is_process_group(obj):
        if obj == dist.group.WORLD:
            return world()
        return DistComm(obj)
    return obj


# ---------------------------------------------------------------- waits (Note [dist waits])
class _Threaded:
    """A gloo point-to-point Work, waited on by a daemon thread of :class:`_Waiters`; ``ended``
    is set when the wait returned."""

    __slots__ = ("work", "ended", "error")

    def __init__(self, work: Any, waiters: Optional["_Waiters"] = None) -> None:
        self.work, self.ended = work, threading.Event()
        self.error: Optional[BaseException] = None
        (waiters or _WAITERS).submit(self)

    def run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # reported by the poll, on the main thread
            self.error = exc
        self.ended.set()

    def is_completed(self) -> bool:
        if not self.ended.is_set():
            return False
        if self.work is not None:  # finished: freed a few messages later (Note [dist waits])
            _RETIRED.append(self.work)
            self.work = None
        return True

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class _Waiters:
    """Daemon threads that each wait on one gloo Work at a time, as many as are waited on at
    once (a thread started per message cost about as much as the message itself); idle ones
    take the next.  Daemons: one left waiting for a peer that stalled does not hold the
    process at exit."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Threaded] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0

    def submit(self, task: _Threaded) -> None:
        with self.lock:
            start = self.idle == 0
            self.idle -= not start
        self.queue.put(task)
        if start:
            threading.Thread(target=self._serve, daemon=True, name="layerbraid-p2p").start()

    def _serve(self) -> None:
        while True:
            self.queue.get().run()
            with self.lock:
                self.idle += 1


_WAITERS = _Waiters()
# finished gloo Works, the last few: the oldest is freed as another finishes (Note [dist waits])
_RETIRED: "collections.deque[Any]" = collections.deque(maxlen=4)


def _fresh_waiters() -> None:  # a forked child has none of its parent's threads
    global _WAITERS
    _WAITERS = _Waiters()


os.register_at_fork(after_in_child=_fresh_waiters)


def _settle(work: Any, comm: "DistComm", what: str) -> None:
    """Raises the failure of a completed ``work`` (a peer that crashed) as RemoteRankError."""
    try:
        work.wait()
    except Exception as exc:
        comm.check_exits(what)
        raise RemoteRankError(
            f"the transport failed on rank {comm.Get_rank()} while it waited for {what} "
            f"(another rank crashed or closed its connection): {exc}",
            -1,
            origin_raised=False,
        ) from exc


# ---------------------------------------------------------------- store notices
_STORE_COUNT = "layerbraid/notices"
_notice_seen: dict[str, Any] = {"count": 0, "texts": {}}


def _store() -> Any:
    """The job's key-value store (torchrun's rendezvous store), or None."""
    try:
        return dist.distributed_c10d._get_default_store()  # no public accessor
    except Exception:
        return None


def post_notice(text: str) -> None:
    """Tells every rank of the job that this one is leaving, and why (Note [store notices])."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"layerbraid/notice/{dist.get_rank()}", text)
        store.add(_STORE_COUNT, 1)
    except Exception:  # the store's host is gone: the job is ending anyway
        pass


_EXIT_GRACE = 0.5


def at_exit(text: str, failed: bool = False) -> None:
    """The exit handler under torch.distributed (Note [exit notices] in _comm/mpi.py): every
    rank counts itself out in the store; one whose peers have not all done so within the grace
    posts its notice, so that those that wait for it are told (and, ``failed``: an exit status
    other than 0, says so)."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    try:
        n = dist.get_world_size()
        store.add("layerbraid/exited", 1)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < _EXIT_GRACE:
            if store.add("layerbraid/exited", 0) >= n:
                return
            time.sleep(0.01)
    except Exception:  # the store's host has gone: the job is over
        return
    if failed:
        print(
            f"layerbraid: rank {dist.get_rank()} is exiting ({text}) while other ranks still "
            "run; ranks that wait for it will be told",
            file=sys.stderr,
            flush=True,
        )
    post_notice(text)


def _read_notices() -> dict[int, str]:
    store = _store()
    if store is None:
        return _notice_seen["texts"]
    try:
        count = store.add(_STORE_COUNT, 0)
    except Exception:
        return _notice_seen["texts"]
    if count > _notice_seen["count"]:
        _notice_seen["count"] = count
        me = dist.get_rank()
        for r in range(dist.get_world_size()):
            key = f"layerbraid/notice/{r}"
            if r != me and r not in _notice_seen["texts"] and store.check([key]):
                _notice_seen["texts"][r] = store.get(key).decode(errors="replace")
    return _notice_seen["texts"]


# ---------------------------------------------------------------- the communicator
_groups: dict[tuple[int, ...], Any] = {}
_contexts = [0]


class DistComm(Transport):
    """A torch.distributed process group, its ranks in ``members`` order (global ranks): rank k
    of this communicator is global rank ``members[k]``."""

    # gloo's and MPI's receives take a shorter message (Note [inline records] in stream.py);
    # NCCL's device messages never go inline
    oversized_receives = True

    def __init__(self, group, members: Optional[Sequence[int]] = None, context: int = 0) -> None:
        self.group = group
        self.members = list(dist.get_process_group_ranks(group) if members is None else members)
        self.me = dist.get_rank()
        self.rank = self.members.index(self.me)
        self.size = len(self.members)
        self.context = context
        backend = str(dist.get_backend(group)).lower()
        has_cpu = "gloo" in backend or "mpi" in backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend and torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.small = torch.device("cpu") if has_cpu else self.device
        group_ranks = list(dist.get_process_group_ranks(group))
        # this communicator's rank of each of the group's ranks (the order all_gather fills)
        self._by_group = [self.members.index(g) for g in group_ranks]
        self._stream_init()

    def __repr__(self) -> str:
        return f"DistComm(rank {self.rank} of {self.size}, members={self.members})"

    # ---- ranks and groups
    def _new_context(self) -> int:
        top = self.allreduce_floats([_contexts[0]], "max", "a new communicator's context")[0]
        _contexts[0] = int(top) % _MAX_CONTEXT + 1
        return _contexts[0]

    def Free(self) -> None:
        """Nothing to free: a process group lives as long as the job."""

    def Dup(self) -> "DistComm":
        return DistComm(self.group, self.members, self._new_context())

    def Split(self, color: int, key: int, what: str = "a split of a communicator") -> "DistComm":
        self.barrier(what)
        rows = self.allgather_obj((int(color), int(key)), f"the colors of {what}")
        context = self._new_context()
        mine = sorted((k, r) for r, (c, k) in enumerate(rows) if c == color)
        members = [self.members[r] for _, r in mine]
        if sorted(members) == sorted(self.members):
            return DistComm(self.group, members, context)
        ranks = tuple(sorted(members))
        if ranks not in _groups:
            # only the new group's ranks take part (each group is made once per process)
            _groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return DistComm(_groups[ranks], members, context)

    def _global(self, rank: int) -> int:
        return self.members[rank]

    def _tag(self, tag: int) -> int:
        return (self.context << _TAG_BITS) | tag

    # ---- the primitives (Note [dist waits])
    def _start_p2p(self, send: bool, t: torch.Tensor, peer: int, tag: int) -> Any:
        op = dist.isend if send else dist.irecv
        work = op(t, self._global(peer), group=self.group, tag=self._tag(tag))
        return work if t.device.type == "cuda" else _Threaded(work)

    def _start_allreduce(self, t: torch.Tensor, op: str) -> Any:
        return dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True)

    def _start_bcast(self, t: torch.Tensor, root: int) -> Any:
        return dist.broadcast(t, self._global(root), group=self.group, async_op=True)

    def _start_allgather(self, t: torch.Tensor, out: torch.Tensor) -> Any:
        rows = [out[k] for k in self._by_group]
        return dist.all_gather(rows, t, group=self.group, async_op=True)

    def _start_barrier(self) -> Any:
        # a small allreduce: gloo's and NCCL's barriers differ, an allreduce is the same on both
        return self._start_allreduce(torch.zeros(1, device=self.small), "sum")

    def _block(self, pending: Sequence[Any], seconds: float) -> bool:
        for work in pending:
            if isinstance(work, _Threaded) and not work.ended.is_set():
                work.ended.wait(seconds)
                return True
        return False

    def _done(self, work: Any, what: str = "a message of an MGRIT solve") -> bool:
        if not work.is_completed():
            return False
        _settle(work, self, what)
        return True

    def check_exits(self, what: str, real: Optional[Sequence[int]] = None) -> None:
        """Raises RemoteRankError when a rank of this communicator has left (Note [store
        notices])."""
        texts = _read_notices()
        for g, text in sorted(texts.items()):
            if g in self.members:
                raise exited(self.members.index(g), g, self.rank, text, what, real)
