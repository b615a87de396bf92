"""The second transport: a torch.distributed process group (gloo on CPU, NCCL on CUDA) as
layerbraid's communicator.  ``DistComm`` implements ``_comm.base.Transport``; a job started by
torchrun gets one over the default group wherever no communicator is passed (:func:`world`),
and ``comm=dist.group.WORLD`` (any ProcessGroup) is wrapped by :func:`as_comm`.

Note [device-resident messages]: a group whose backend serves CUDA tensors (NCCL) moves states,
tensors and gradient buckets as device tensors: nothing is staged through host memory.  A group
that serves CPU tensors only (gloo) moves CPU tensors, one copy each way for a GPU state, as MPI
does (Note [staging] in _comm/transport.py).  Small values (floats, records, pickled reports)
travel on the CPU where the group allows it, else on the device.

Note [dist waits]: every operation is started asynchronously and finished by :meth:`wait`, which
polls like ``_comm.mpi.wait`` (the stall deadline, the exit notices every 50 ms, Ctrl-C).
Collectives report completion through ``Work.is_completed()``, as do NCCL's point-to-point
operations; gloo's point-to-point ``Work`` reports it only through a blocking ``wait()`` (a
``wait`` with a timeout tears the connection down), so each gloo send or receive is waited on by
a daemon thread that the poll reads.  A thread left waiting when a peer stalls is abandoned with
the job, which is ending.

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

import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RemoteRankError, StallError
from .base import Transport, exited, missing_ranks, poll
from .stream import StateStream

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
    several processes share one GPU, which NCCL refuses)."""
    if not dist.is_initialized():
        backend = os.environ.get("LAYERBRAID_DIST_BACKEND") or None
        if backend not in (None, "gloo", "nccl", "mpi"):
            raise ValueError(f"LAYERBRAID_DIST_BACKEND must be gloo, nccl or mpi, got {backend!r}")
        dist.init_process_group(backend=backend)
    comm = _world[0]
    if comm is None:
        comm = _world[0] = DistComm(dist.group.WORLD)
    return comm


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
    """A gloo point-to-point Work, waited on by a daemon thread."""

    __slots__ = ("work", "done", "error")

    def __init__(self, work):
        self.work, self.done, self.error = work, False, None
        threading.Thread(target=self._run, daemon=True, name="layerbraid-p2p").start()

    def _run(self):
        try:
            self.work.wait()
        except BaseException as exc:  # reported by the poll, on the main thread
            self.error = exc
        self.done = True

    def is_completed(self):
        return self.done

    def wait(self):
        if self.error is not None:
            raise self.error


def _finished(work) -> bool:
    return work.is_completed()


def _settle(work, comm: "DistComm", what: str) -> None:
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


def _mpi_op_name(op: Any) -> str:
    from mpi4py import MPI

    for name, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
        if op == mpi_op:
            return name
    raise ValueError(f"comm.allreduce under torch.distributed takes sum, max or min, got {op!r}")


# ---------------------------------------------------------------- store notices
_STORE_COUNT = "layerbraid/notices"
_notice_seen: dict[str, Any] = {"count": 0, "texts": {}}


def _store():
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


class DistComm(StateStream, Transport):
    """A torch.distributed process group, its ranks in ``members`` order (global ranks): rank k
    of this communicator is global rank ``members[k]``."""

    def __init__(self, group, members: Optional[Sequence[int]] = None, context: int = 0):
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
        self._order = [list(dist.get_process_group_ranks(group)).index(g) for g in self.members]
        self._stream_init()

    def __repr__(self):
        return f"DistComm(rank {self.rank} of {self.size}, members={self.members})"

    # ---- mpi4py's lowercase (pickled objects) calls a training script uses, so that the same
    # script runs under mpiexec and torchrun: comm.allreduce(loss), comm.bcast(obj, root=0)
    def allreduce(self, value: float, op: Any = None) -> float:
        """``value`` (a number) summed over the ranks, or its max or min with ``op`` ("max",
        "min", or mpi4py's MPI.MAX / MPI.MIN)."""
        name = op if isinstance(op, str) or op is None else _mpi_op_name(op)
        return self.allreduce_floats([value], name or "sum", "comm.allreduce")[0]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.bcast_obj(obj, root, "comm.bcast")

    def allgather(self, obj: Any) -> list[Any]:
        return self.allgather_obj(obj, "comm.allgather")

    def gather(self, obj: Any, root: int = 0) -> Optional[list[Any]]:
        return self.gather_obj(obj, root, "comm.gather")

    def Barrier(self) -> None:
        self.barrier("comm.Barrier")

    # ---- ranks and groups
    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def _new_context(self) -> int:
        top = self.allreduce_floats([_contexts[0]], "max", "a new communicator's context")[0]
        _contexts[0] = int(top) % _MAX_CONTEXT + 1
        return _contexts[0]

    def Free(self) -> None:
        """Nothing to free: a process group lives as long as the job."""

    def Dup(self) -> "DistComm":
        return DistComm(self.group, self.members, self._new_context())

    def Split(self, color: int, key: int) -> "DistComm":
        rows = self.allgather_obj((int(color), int(key)), "the colors of a split")
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

    # ---- waits
    def _start_p2p(self, send: bool, t: torch.Tensor, peer: int, tag: int):
        op = dist.isend if send else dist.irecv
        work = op(t, self._global(peer), group=self.group, tag=self._tag(tag))
        return work if t.device.type == "cuda" else _Threaded(work)

    def wait(self, requests: Sequence[Any], what: str) -> None:
        """Waits, polling, for ``requests`` (Works) of this communicator (Note [dist waits])."""
        pending = [r for r in requests if r is not None]

        def done() -> bool:
            for r in [r for r in pending if _finished(r)]:
                _settle(r, self, what)
                pending.remove(r)
            return not pending

        poll(done, lambda: self.check_exits(what), what, self.rank)

    def check_exits(self, what: str, real: Optional[Sequence[int]] = None) -> None:
        """Raises RemoteRankError when a rank of this communicator has left (Note [store
        notices])."""
        texts = _read_notices()
        for g, text in sorted(texts.items()):
            if g in self.members:
                raise exited(self.members.index(g), g, self.rank, text, what, real)

    def barrier(self, what: str) -> None:
        if self.size == 1:
            return
        # a small allreduce: gloo's and NCCL's barriers differ, an allreduce is the same on both
        t = torch.zeros(1, device=self.small)
        self.wait(
            [dist.all_reduce(t, group=self.group, async_op=True)],
            f"every rank of its layer group to reach {what}; at least one never did (it "
            "stopped, or called model(x) or backward() a different number of times, or with "
            "another batch)",
        )

    def arrive(self, what: str) -> None:
        if self.size == 1:
            return
        peers = [p for p in (self.rank - 1, self.rank + 1) if 0 <= p < self.size]
        inbox = {p: torch.zeros(1, dtype=torch.uint8, device=self.device) for p in peers}
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        recvs = {p: self._start_p2p(False, inbox[p], p, _ARRIVE_TAG) for p in peers}
        sends = [self._start_p2p(True, token, p, _ARRIVE_TAG) for p in peers]
        try:
            self.wait(list(recvs.values()) + sends, f"its neighbours to reach {what}")
        except StallError as exc:
            missing = [p for p, r in recvs.items() if not r.is_completed()]
            if not missing:
                raise
            raise missing_ranks(self.rank, missing, what) from exc

    # ---- small values
    def allreduce_floats(self, values: Sequence[float], op: str, what: str) -> list[float]:
        t = torch.tensor(np.asarray(values, dtype=np.float64), device=self.small)
        if self.size > 1:
            self.wait(
                [dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True)],
                f"every rank's part of {what}",
            )
            if op == "sum":  # the same bits everywhere: rank 0's result
                self.wait(
                    [dist.broadcast(t, self._global(0), group=self.group, async_op=True)],
                    f"rank 0's result of {what}",
                )
        return [float(v) for v in t.cpu().tolist()]

    def start_allreduce_sum(self, flat: Any) -> Any:
        t = torch.from_numpy(flat) if isinstance(flat, np.ndarray) else flat
        return dist.all_reduce(t, group=self.group, async_op=True)

    def _allgather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``t`` (the same shape everywhere), in this communicator's rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.wait([dist.all_gather(out, t, group=self.group, async_op=True)], what)
        return [out[k] for k in self._order]

    def allgather_obj(self, obj: Any, what: str) -> list[Any]:
        if self.size == 1:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = self._allgather(
            torch.tensor([len(data)], dtype=torch.int64, device=self.small),
            f"every rank's part of {what}",
        )
        most = max(int(s.item()) for s in sizes)
        buf = torch.zeros(most, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self._allgather(buf.to(self.small), f"every rank's part of {what}")
        return [
            pickle.loads(bytes(r[: int(s.item())].cpu().numpy()))  # the job's own ranks
            for r, s in zip(rows, sizes)
        ]

    def gather_obj(self, obj: Any, root: int, what: str) -> Optional[list[Any]]:
        rows = self.allgather_obj(obj, what)  # gloo and NCCL gather differently: one path
        return rows if self.rank == root else None

    def bcast_obj(self, obj: Any, root: int, what: str) -> Any:
        if self.size == 1:
            return obj
        is_root = self.rank == root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.small)
        src = self._global(root)
        self.wait(
            [dist.broadcast(n, src, group=self.group, async_op=True)], f"rank {root}'s {what}"
        )
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if is_root
            else torch.empty(int(n.item()), dtype=torch.uint8)
        ).to(self.small)
        if buf.numel():
            self.wait(
                [dist.broadcast(buf, src, group=self.group, async_op=True)], f"rank {root}'s {what}"
            )
        return obj if is_root else pickle.loads(bytes(buf.cpu().numpy()))

    def allgather_ints(self, record: Any, what: str) -> Any:
        record = np.ascontiguousarray(record, dtype=np.int64)
        if self.size == 1:
            return record.reshape(1, -1).copy()
        rows = self._allgather(
            torch.from_numpy(record.copy()).to(self.small), f"every rank's part of {what}"
        )
        return np.stack([r.cpu().numpy() for r in rows])

    def bcast_ints(self, record: Any, root: int, what: str) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(record, dtype=np.int64).copy()).to(self.small)
        if self.size > 1:
            self.wait(
                [dist.broadcast(t, self._global(root), group=self.group, async_op=True)],
                f"rank {root}'s {what}",
            )
        return t.cpu().numpy()

    def exchange_bytes(self, sends: dict, recvs: dict, tag: int, what: str) -> None:
        """Point-to-point byte arrays, each preceded by its size (a size that differs from the
        receiver's buffer is RemoteRankError, as under MPI)."""
        sizes = {p: torch.zeros(1, dtype=torch.int64, device=self.device) for p in recvs}
        works = [self._start_p2p(False, sizes[p], p, tag) for p in recvs]
        keep = []
        for p, buf in sends.items():
            n = torch.tensor([buf.size], dtype=torch.int64, device=self.device)
            keep.append(n)
            works.append(self._start_p2p(True, n, p, tag))
        if works:
            self.wait(works, what)
        for p, buf in recvs.items():
            got = int(sizes[p].item())
            if got != buf.size:
                raise RemoteRankError(
                    f"{what} (from rank {p}) came with {got} bytes where {buf.size} were "
                    "expected: the ranks disagree on its shape or dtype",
                    p,
                )
        inbox = {
            p: torch.empty(buf.size, dtype=torch.uint8, device=self.device)
            for p, buf in recvs.items()
        }
        works = [self._start_p2p(False, inbox[p], p, tag + 1) for p in recvs]
        for p, buf in sends.items():
            t = torch.from_numpy(np.ascontiguousarray(buf)).to(self.device)
            keep.append(t)
            works.append(self._start_p2p(True, t, p, tag + 1))
        if works:
            self.wait(works, what)
        for p, buf in recvs.items():
            buf[...] = inbox[p].cpu().numpy()

    # ---- tensors (Note [device-resident messages])
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s bytes, flat and contiguous on the message device: every dtype travels as its
        bytes (bool, complex and bfloat16 included, which not every backend reduces or moves),
        as under MPI (Note [staging] in _comm/transport.py)."""
        return t.detach().reshape(-1).to(self.device).contiguous().view(torch.uint8)

    def _empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A flat byte buffer on the message device for a tensor of ``shape`` and ``dtype``."""
        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def allreduce_sum(self, tensors: Sequence[Any], what: str) -> list[Any]:
        tensors = list(tensors)
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float64) for t in tensors])
        if self.size > 1:
            self.wait(
                [dist.all_reduce(flat, group=self.group, async_op=True)],
                f"every rank's part of {what}",
            )
        out, off = [], 0
        for t in tensors:
            out.append(flat[off : off + t.numel()].view(t.shape).to(t.device, t.dtype))
            off += t.numel()
        return out

    def bcast_tensor(self, t, shape, dtype, device, root, what="a broadcast tensor"):
        buf = self._wire(t) if self.rank == root else self._empty(shape, dtype)
        self.wait(
            [dist.broadcast(buf, self._global(root), group=self.group, async_op=True)],
            f"rank {root}'s {what}",
        )
        return t if self.rank == root else buf.view(dtype).reshape(shape).to(device)

    def send_tensor(self, t, dest, tag, what="a tensor"):
        self.wait([self._start_p2p(True, self._wire(t), dest, tag)], f"rank {dest} to take {what}")

    def recv_tensor(self, shape, dtype, device, source, tag, what="a tensor"):
        buf = self._empty(shape, dtype)
        self.wait([self._start_p2p(False, buf, source, tag)], f"{what} from rank {source}")
        return buf.view(dtype).reshape(shape).to(device)

    def bcast_into(self, tensors, root=0, what="the weights"):
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return
        flat = torch.cat([self._wire(t) for t in tensors])
        self.wait(
            [dist.broadcast(flat, self._global(root), group=self.group, async_op=True)],
            f"rank {root}'s {what}",
        )
        off = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel() * t.element_size()
                t.copy_(flat[off : off + n].view(t.dtype).view(t.shape))
                off += n

    def neighbour_exchange(self, first, last, what):
        works, got, keep = [], {}, []
        for peer, mine, tag, theirs in (
            (self.rank - 1, first, 7401, 7402),
            (self.rank + 1, last, 7402, 7401),
        ):
            if 0 <= peer < self.size:
                out = self._wire(mine)
                keep.append(out)
                works.append(self._start_p2p(True, out, peer, tag))
                got[peer] = torch.empty_like(out)
                works.append(self._start_p2p(False, got[peer], peer, theirs))
        if works:
            self.wait(works, f"its neighbours' layers for {what}")
        left, right = got.get(self.rank - 1), got.get(self.rank + 1)
        return (
            None if left is None else left.view(first.dtype).reshape(first.shape).to(first.device),
            None if right is None else right.view(last.dtype).reshape(last.shape).to(last.device),
        )

    def allgather_rows(self, t, what="every rank's rows"):
        counts = [int(c) for c in self.allgather_obj(int(t.shape[0]), f"the row counts of {what}")]
        most, rest = max(counts), tuple(t.shape[1:])
        padded = torch.zeros((most,) + rest, dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.detach().to(self.device)
        rows = self._allgather(self._wire(padded), f"every rank's part of {what}")
        rows = [r.view(t.dtype).reshape((most,) + rest) for r in rows]
        return torch.cat([r[:c] for r, c in zip(rows, counts)]).to(t.device)

    # ---- the MGRIT core's messages (StateStream's, over this group's point-to-point)
    def _done(self, work: Any) -> bool:
        if not _finished(work):
            return False
        _settle(work, self, "a message of an MGRIT solve")
        return True

    def iallreduce_doubles(self, values: Any, op: str) -> int:
        t = torch.from_numpy(np.array(values, dtype=np.float64)).to(self.small)
        work = dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True)
        return self._handle(("reduce", [work], t))


_ARRIVE_TAG = 7602
