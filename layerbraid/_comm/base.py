"""The transport: how layerbraid's ranks talk, whatever carries the bytes.

A :class:`Transport` is a communicator (ranks 0..size-1) with a few primitives: start a
point-to-point send or receive of a contiguous tensor, an in-place allreduce, a broadcast, an
allgather, a barrier; test whether one finished; read the exit notices.  Everything layerbraid
does between ranks (the arrival handshake, reductions of floats that every rank gets bit for
bit, small Python values, tensors and lists of tensors, the neighbour exchange, the step
weights' fetch, the MGRIT core's messages when they go through Python) is written once here, on
those primitives.  ``_comm.mpi.MPIComm`` (mpi4py) and ``_comm.dist.DistComm``
(torch.distributed: gloo, NCCL) are the two backends; ``_comm.world.resolve`` turns what a user
passes as ``comm=`` into one.

Note [deadlines]: every operation is started non-blocking and finished by :meth:`Transport.wait`,
which polls (``_comm.waits.poll``): Ctrl-C gets through, a rank that waits longer than the stall
timeout raises :class:`layerbraid.StallError` naming what it waited for, and a rank that learns
that another rank of the communicator exited (Note [exit notices] in _comm/mpi.py) raises
:class:`RemoteRankError` saying so.  Nothing here blocks.

Tensors travel on the transport's ``device`` (``_comm.wire``): the CPU, or the GPU of a
transport that moves device memory; small values on ``small`` (the CPU where the backend
allows it).
"""

import pickle
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch

from ..errors import RemoteRankError, StallError
from .stream import StateStream
from .waits import missing_ranks, poll
from .wire import nbytes, pack, unpack, unpack_into

__all__ = ["Message", "Transport", "check_same_settings"]

_ARRIVE_TAG = 7602
_LEFT_TAG, _RIGHT_TAG = 7401, 7402  # a neighbour exchange: what goes left, what goes right
_GATHER_TAG = 7603
_INT_MAX = 2**31 - 1


# The requests of waits that gave up (stalled, interrupted) while messages were in flight.
_ABANDONED: list[Any] = []


class Transport(StateStream, ABC):
    """A communicator: ranks 0..size-1, in the order this object gives them.

    Attributes:
        device: where its tensors travel (the CPU, or the GPU of a transport that moves device
            memory).
        small: where small values (floats, records, pickles) travel.
        rank, size: this rank and the number of ranks.
    """

    device: torch.device
    small: torch.device
    rank: int
    size: int

    # ---------------------------------------------------------------- the primitives
    @abstractmethod
    def Split(self, color: int, key: int, what: str = "a split of a communicator") -> "Transport":
        """A new communicator of the ranks with the same ``color``, ordered by ``key``; every
        rank arrives first, with the deadline (a stall names ``what``)."""

    @abstractmethod
    def Dup(self) -> "Transport":
        """A new communicator of the same ranks whose messages never meet this one's."""

    @abstractmethod
    def Free(self) -> None:
        """Releases what the transport made (a no-op for one it does not own)."""

    @abstractmethod
    def _start_p2p(self, send: bool, t: torch.Tensor, peer: int, tag: int) -> Any:
        """Starts sending (or receiving into) the contiguous tensor ``t`` on ``device``."""

    @abstractmethod
    def _start_allreduce(self, t: torch.Tensor, op: str) -> Any:
        """Starts reducing the contiguous ``t`` in place with ``op`` ("sum", "max", "min")."""

    @abstractmethod
    def _start_bcast(self, t: torch.Tensor, root: int) -> Any:
        """Starts overwriting the contiguous ``t`` with the root's."""

    @abstractmethod
    def _start_allgather(self, t: torch.Tensor, out: torch.Tensor) -> Any:
        """Starts gathering every rank's ``t`` into ``out`` (shape (size, *t.shape)), by rank."""

    @abstractmethod
    def _start_barrier(self) -> Any:
        """Starts a barrier."""

    @abstractmethod
    def _done(self, work: Any, what: str = "a message of an MGRIT solve") -> bool:
        """Whether ``work`` finished; raises the transport's failure of it (a peer that
        crashed, or a message of another size than its buffer) as RemoteRankError."""

    def _block(self, pending: Sequence[Any], seconds: float) -> bool:
        """Waits up to ``seconds`` for one of ``pending`` to complete with the interpreter's
        lock released, where a thread reports its completion; False where none does (the
        poll then spins and naps)."""
        return False

    @abstractmethod
    def check_exits(self, what: str, real: Optional[Sequence[int]] = None) -> None:
        """Raises RemoteRankError when a rank of this communicator has said that it exited
        (Note [exit notices] in _comm/mpi.py).  ``real``: the ranks the user knows, by rank of
        this communicator (the MGRIT core's may order them otherwise)."""

    # ---------------------------------------------------------------- capabilities
    def native_mpi(self) -> Any:
        """The mpi4py communicator the MGRIT core may call MPI on itself, or None: then the
        core's messages go through this transport (Note [application transport] in
        cbridge/src/comm.c)."""
        return None

    def note_peers(self) -> None:
        """Records that this rank shares a communicator with its ranks (they are told when it
        exits early, Note [exit notices] in _comm/mpi.py); a no-op where the backend tells
        every rank of the job."""

    def _sizes_checked(self) -> bool:
        """Whether a receive of a message of another size than its buffer raises by itself
        (else :meth:`exchange` sends every message's size first)."""
        return False

    # ---------------------------------------------------------------- ranks
    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    # ---------------------------------------------------------------- waits
    def wait(self, works: Sequence[Any], what: str) -> None:
        """Waits, polling, for ``works`` of this communicator (Note [deadlines])."""
        pending = [w for w in works if w is not None]

        def done() -> bool:
            pending[:] = [w for w in pending if not self._done(w, what)]
            return not pending

        try:
            poll(
                done,
                lambda: self.check_exits(what),
                what,
                self.rank,
                lambda seconds: self._block(pending, seconds),
            )
        except BaseException:
            # A receive still posted writes into its buffer whenever its message comes (a late
            # rank sends it after this one gave up): freeing the request now would free the
            # buffer under it and corrupt this process's memory.  Each request holds its
            # buffer, so keeping the requests keeps both for the rest of the process.
            _ABANDONED.extend(pending)
            raise

    def barrier(self, what: str) -> None:
        """Waits until every rank has reached this point; after the timeout,
        :class:`layerbraid.StallError` names ``what``."""
        if self.size == 1:
            return
        self.wait(
            [self._start_barrier()],
            f"every rank of its layer group to reach {what}; at least one never did (it "
            "stopped, or called model(x) or backward() a different number of times, or with "
            "another batch)",
        )

    def arrive(self, what: str) -> None:
        """Waits until this rank's neighbours (ranks r - 1 and r + 1) have reached this point
        too: a token each way, so that a stall names the rank that never came (a barrier
        cannot tell who is missing).  The collective that follows covers the others, with its
        own deadline."""
        if self.size == 1:
            return
        peers = [p for p in (self.rank - 1, self.rank + 1) if 0 <= p < self.size]
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        inbox = {p: torch.zeros(1, dtype=torch.uint8, device=self.device) for p in peers}
        recvs = {p: self._start_p2p(False, inbox[p], p, _ARRIVE_TAG) for p in peers}
        sends = [self._start_p2p(True, token, p, _ARRIVE_TAG) for p in peers]
        came = set()
        try:
            self.wait(list(recvs.values()) + sends, f"its neighbours to reach {what}")
        except StallError as exc:
            came = {p for p, w in recvs.items() if self._done(w, what)}
            missing = [p for p in peers if p not in came]
            if not missing:
                raise
            raise missing_ranks(self.rank, missing, what) from exc

    # ---------------------------------------------------------------- small values
    def allreduce_floats(self, values: Sequence[float], op: str, what: str) -> list[float]:
        """``values`` reduced with ``op`` ("sum", "max" or "min"), the same on every rank bit
        for bit (a sum is rank 0's result, broadcast: the backends do not promise the same
        rounding everywhere)."""
        t = torch.tensor(np.asarray(values, dtype=np.float64), device=self.small)
        if self.size > 1:
            self.wait([self._start_allreduce(t, op)], f"every rank's part of {what}")
            if op == "sum":
                self.wait([self._start_bcast(t, 0)], f"rank 0's result of {what}")
        return [float(v) for v in t.cpu().tolist()]

    def first_rank_where(self, bad: bool, what: str) -> Optional[int]:
        """The lowest rank on which ``bad`` is true, or None (the same on every rank)."""
        return self.first_ranks_where([bad], what)[0]

    def first_ranks_where(self, flags: Sequence[bool], what: str) -> list[Optional[int]]:
        """For each of ``flags``, the lowest rank on which it is true, or None (the same on
        every rank; one reduction for them all)."""
        if self.size == 1:
            return [0 if bad else None for bad in flags]
        mine = [self.rank if bad else self.size for bad in flags]
        firsts = [int(v) for v in self.allreduce_floats(mine, "min", what)]
        return [first if first < self.size else None for first in firsts]

    def raise_on_every_rank(
        self, error: Optional[BaseException], what: str, flags: Sequence[bool] = ()
    ) -> list[Optional[int]]:
        """When ``error`` is set on any rank, raises on every rank: the rank's own error where
        it has one, elsewhere a :class:`RemoteRankError` naming the lowest failing rank and its
        message.  One reduction when no rank failed, which also answers ``flags``: returns,
        for each, the lowest rank where it is true (:meth:`first_ranks_where`), so that a check
        that follows an error check costs no reduction of its own."""
        failed, *firsts = self.first_ranks_where(
            [error is not None, *flags], f"the error check of {what}"
        )
        if failed is None:
            return firsts
        text = self.bcast_obj(
            None if error is None else f"{type(error).__name__}: {error}",
            failed,
            f"rank {failed}'s error in {what}",
        )
        if error is not None:
            raise error
        raise RemoteRankError(f"{what} failed on rank {failed}: {text}", failed)

    def allgather_ints(self, record: Any, what: str) -> np.ndarray:
        """Every rank's fixed-size int64 ``record``, as rows in rank order: one round, no
        pickle (the hot path's handshake)."""
        mine = torch.from_numpy(np.array(record, dtype=np.int64).reshape(-1)).to(self.small)
        if self.size == 1:
            return mine.cpu().numpy().reshape(1, -1)
        out = torch.empty((self.size, mine.numel()), dtype=torch.int64, device=self.small)
        self.wait([self._start_allgather(mine, out)], f"every rank's part of {what}")
        return out.cpu().numpy()

    def bcast_ints(self, record: Any, root: int, what: str) -> np.ndarray:
        """``root``'s fixed-size int64 ``record`` (every rank passes one of the same size)."""
        t = torch.from_numpy(np.array(record, dtype=np.int64).reshape(-1)).to(self.small)
        if self.size > 1:
            self.wait([self._start_bcast(t, root)], f"rank {root}'s {what}")
        return t.cpu().numpy()

    def allgather_obj(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable, small: metadata and reports), in rank order."""
        if self.size == 1:
            return [obj]
        data = _dumps(obj)
        sizes = self.allgather_ints([data.numel()], what)[:, 0]
        _check_counts(int(sizes.max()) * self.size, what)
        rows = torch.zeros((self.size, int(sizes.max())), dtype=torch.uint8, device=self.small)
        buf = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=self.small)
        buf[: data.numel()] = data.to(self.small)
        self.wait([self._start_allgather(buf, rows)], f"every rank's part of {what}")
        return [_loads(rows[r, : int(n)]) for r, n in enumerate(sizes)]

    def gather_obj(self, obj: Any, root: int, what: str) -> Optional[list[Any]]:
        """Every rank's ``obj`` in rank order on ``root``; None elsewhere (point to point: only
        the root holds them all, as a checkpoint's state needs)."""
        if self.size == 1:
            return [obj]
        data = _dumps(obj).to(self.device)
        others = [r for r in range(self.size) if r != root]
        if self.rank != root:
            size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
            self.wait(
                [
                    self._start_p2p(True, size, root, _GATHER_TAG),
                    self._start_p2p(True, data, root, _GATHER_TAG + 1),
                ],
                f"rank {root} to take {what}",
            )
            return None
        sizes = {r: torch.zeros(1, dtype=torch.int64, device=self.device) for r in others}
        self.wait(
            [self._start_p2p(False, sizes[r], r, _GATHER_TAG) for r in others],
            f"every rank's part of {what}",
        )
        got = {
            r: torch.empty(int(sizes[r].item()), dtype=torch.uint8, device=self.device)
            for r in others
        }
        self.wait(
            [self._start_p2p(False, got[r], r, _GATHER_TAG + 1) for r in others],
            f"every rank's part of {what}",
        )
        return [obj if r == root else _loads(got[r]) for r in range(self.size)]

    def bcast_obj(self, obj: Any, root: int, what: str) -> Any:
        """``root``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj
        is_root = self.rank == root
        data = _dumps(obj).to(self.small) if is_root else None
        n = self.bcast_ints([0 if data is None else data.numel()], root, what)
        _check_counts(int(n[0]), what)
        if data is None:
            data = torch.empty(int(n[0]), dtype=torch.uint8, device=self.small)
        if data.numel():
            self.wait([self._start_bcast(data, root)], f"rank {root}'s {what}")
        return obj if is_root else _loads(data)

    # ---- what mpi4py's lowercase (pickled objects) calls give a training script, so that the
    # same script runs under mpiexec and torchrun: comm.allreduce(loss), comm.bcast(obj)
    def allreduce(self, value: float, op: Any = None) -> float:
        """``value`` (a number) summed over the ranks, or its max or min with ``op`` ("max",
        "min", or mpi4py's MPI.MAX / MPI.MIN)."""
        name = op if isinstance(op, str) or op is None else _op_name(op)
        return self.allreduce_floats([value], name or "sum", "comm.allreduce")[0]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.bcast_obj(obj, root, "comm.bcast")

    def allgather(self, obj: Any) -> list[Any]:
        return self.allgather_obj(obj, "comm.allgather")

    def gather(self, obj: Any, root: int = 0) -> Optional[list[Any]]:
        return self.gather_obj(obj, root, "comm.gather")

    def Barrier(self) -> None:
        self.barrier("comm.Barrier")

    # ---------------------------------------------------------------- tensors
    def allreduce_sum(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The sums of ``tensors`` over the ranks (one message, in float64), as new tensors of
        their shapes, dtypes and devices."""
        tensors = list(tensors)
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float64) for t in tensors])
        if self.size > 1:
            self.wait([self.start_allreduce_sum(flat)], f"every rank's part of {what}")
        out, off = [], 0
        for t in tensors:
            out.append(flat[off : off + t.numel()].view(t.shape).to(t.device, t.dtype))
            off += t.numel()
        return out

    def start_allreduce_sum(self, flat: torch.Tensor) -> Any:
        """Starts summing the contiguous ``flat`` (on ``device``) in place; finish it with
        :meth:`wait`."""
        return self._start_allreduce(flat, "sum")

    def bcast_tensor(
        self,
        t: Optional[torch.Tensor],
        shape: Any,
        dtype: torch.dtype,
        device: Any,
        root: int,
        what: str = "a broadcast tensor",
    ) -> torch.Tensor:
        """``t`` of the root on every rank (shape and dtype known everywhere), on ``device``."""
        if self.rank == root:
            assert t is not None
            self.wait([self._start_bcast(pack([t], self.device), root)], f"rank {root}'s {what}")
            return t
        template = torch.empty(shape, dtype=dtype, device="meta")
        buf = torch.empty(nbytes([template]), dtype=torch.uint8, device=self.device)
        self.wait([self._start_bcast(buf, root)], f"rank {root}'s {what}")
        return unpack(buf, [template])[0].to(device)

    def send_tensor(self, t: torch.Tensor, dest: int, tag: int, what: str = "a tensor") -> None:
        self.start_send(t, dest, tag, what).wait()

    def start_send(self, t: torch.Tensor, dest: int, tag: int, what: str = "a tensor") -> "Message":
        """Starts sending ``t`` to ``dest``; the returned message's ``wait()`` finishes it.
        Messages between two ranks with the same tag arrive in the order they were started."""
        buf = pack([t], self.device)
        work = self._start_p2p(True, buf, dest, tag)
        return Message(self, work, buf, f"rank {dest} to take {what}")

    def start_recv(
        self,
        shape: Any,
        dtype: torch.dtype,
        device: Any,
        source: int,
        tag: int,
        what: str = "a tensor",
    ) -> "Message":
        """Starts receiving a tensor of ``shape`` and ``dtype`` from ``source``; the returned
        message's ``wait()`` gives it, on ``device``."""
        template = torch.empty(shape, dtype=dtype, device="meta")
        buf = torch.empty(nbytes([template]), dtype=torch.uint8, device=self.device)
        work = self._start_p2p(False, buf, source, tag)
        return Message(self, work, buf, f"{what} from rank {source}", template, device)

    def recv_tensor(
        self,
        shape: Any,
        dtype: torch.dtype,
        device: Any,
        source: int,
        tag: int,
        what: str = "a tensor",
    ) -> torch.Tensor:
        got = self.start_recv(shape, dtype, device, source, tag, what).wait()
        assert got is not None
        return got

    def bcast_into(
        self, tensors: Sequence[torch.Tensor], root: int = 0, what: str = "the weights"
    ) -> None:
        """Overwrites ``tensors`` (the same shapes and dtypes on every rank) with the root's,
        in one message."""
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return
        flat = pack(tensors, self.device)
        self.wait([self._start_bcast(flat, root)], f"rank {root}'s {what}")
        if self.rank != root:
            unpack_into(flat, tensors)

    def neighbour_exchange(
        self, first: torch.Tensor, last: torch.Tensor, what: str
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(left's last, right's first)``: each rank sends ``first`` to the rank before it
        and ``last`` to the one after it (same shape and dtype everywhere), and receives
        theirs; None at the ends."""
        works, got, keep = [], {}, []
        for peer, mine, out_tag, in_tag in (
            (self.rank - 1, first, _LEFT_TAG, _RIGHT_TAG),
            (self.rank + 1, last, _RIGHT_TAG, _LEFT_TAG),
        ):
            if 0 <= peer < self.size:
                out = pack([mine], self.device)
                keep.append(out)
                works.append(self._start_p2p(True, out, peer, out_tag))
                got[peer] = torch.empty_like(out)
                works.append(self._start_p2p(False, got[peer], peer, in_tag))
        if works:
            self.wait(works, f"its neighbours' layers for {what}")
        left, right = got.get(self.rank - 1), got.get(self.rank + 1)
        return (
            None if left is None else unpack(left, [first])[0].to(first.device),
            None if right is None else unpack(right, [last])[0].to(last.device),
        )

    def allgather_rows(self, t: torch.Tensor, what: str = "every rank's rows") -> torch.Tensor:
        """The concatenation, in rank order, of every rank's ``t`` (shape (n_rank, ...), the
        same trailing shape and dtype everywhere) along dimension 0, on every rank.  Every rank
        sends as many rows as the largest block (a shorter one is padded): one allgather
        (MPICH's Allgatherv of the same bytes was many times slower on one node)."""
        counts = [
            int(c) for c in self.allgather_ints([t.shape[0]], f"the row counts of {what}")[:, 0]
        ]
        most, rest = max(counts), tuple(t.shape[1:])
        padded = torch.zeros((most,) + rest, dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.detach().to(self.device)
        mine = pack([padded], self.device)
        rows = torch.empty((self.size, mine.numel()), dtype=torch.uint8, device=self.device)
        self.wait([self._start_allgather(mine, rows)], f"every rank's part of {what}")
        blocks = [unpack(rows[k], [padded])[0][:c] for k, c in enumerate(counts)]
        return torch.cat(blocks).to(t.device)

    def exchange(
        self,
        sends: Mapping[int, Sequence[torch.Tensor]],
        recvs: Mapping[int, Sequence[torch.Tensor]],
        tag: int,
        what: str,
    ) -> dict[int, list[torch.Tensor]]:
        """Point to point, lists of tensors: ``sends`` {dest: tensors} go out, each list as one
        message on ``device``; ``recvs`` {source: templates} says what comes from whom.
        Returns {source: tensors} with the templates' shapes and dtypes, on ``device`` (nothing
        passes through numpy).  A message whose size differs from its templates' raises
        RemoteRankError: the ranks disagree on what they exchange."""
        if not self._sizes_checked():
            self._agree_sizes(sends, recvs, tag, what)
        works, keep = [], []
        inbox = {
            src: torch.empty(nbytes(ts), dtype=torch.uint8, device=self.device)
            for src, ts in recvs.items()
        }
        works = [self._start_p2p(False, inbox[src], src, tag + 1) for src in recvs]
        for dest, ts in sends.items():
            keep.append(pack(ts, self.device))
            works.append(self._start_p2p(True, keep[-1], dest, tag + 1))
        if works:
            self.wait(works, what)
        return {src: unpack(inbox[src], recvs[src]) for src in recvs}

    def _agree_sizes(
        self,
        sends: Mapping[int, Sequence[torch.Tensor]],
        recvs: Mapping[int, Sequence[torch.Tensor]],
        tag: int,
        what: str,
    ) -> None:
        """Every message's size, sent ahead of it, against the receiver's templates."""
        sizes = {p: torch.zeros(1, dtype=torch.int64, device=self.device) for p in recvs}
        works = [self._start_p2p(False, sizes[p], p, tag) for p in recvs]
        keep = [
            torch.tensor([nbytes(ts)], dtype=torch.int64, device=self.device)
            for ts in sends.values()
        ]
        works += [self._start_p2p(True, n, p, tag) for n, p in zip(keep, sends)]
        if works:
            self.wait(works, what)
        for p, ts in recvs.items():
            got, want = int(sizes[p].item()), nbytes(ts)
            if got != want:
                raise RemoteRankError(
                    f"{what} (from rank {p}) came with {got} bytes where {want} were "
                    "expected: the ranks disagree on its shape or dtype",
                    p,
                )

    # ---------------------------------------------------------------- the MGRIT core's
    def iallreduce_doubles(self, values: Any, op: str) -> int:
        """Starts reducing the core's float64 ``values`` (Note [application transport] in
        cbridge/src/comm.c); :meth:`test` gives the result."""
        t = torch.from_numpy(np.array(values, dtype=np.float64)).to(self.small)
        return self._handle(("reduce", [self._start_allreduce(t, op)], t))


# ---------------------------------------------------------------- helpers
def check_same_settings(settings: Sequence[Mapping[str, Any]]) -> None:
    """``settings``: every rank's {name: value} (gathered).  Raises the same ValueError on every
    rank when the ranks' values differ, naming the setting, rank 0's value and the first
    rank's that differs."""
    for name, value in settings[0].items():
        other = next(((r, s[name]) for r, s in enumerate(settings) if s[name] != value), None)
        if other is not None:
            r, theirs = other
            raise ValueError(
                f"the layer-parallel ranks disagree on {name}: rank 0 has {value!r}, rank {r} "
                f"has {theirs!r}.  Every rank of a layer group runs the same solve: set it alike "
                "on every rank"
            )


def _dumps(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _loads(buf: torch.Tensor) -> Any:
    return pickle.loads(buf.cpu().numpy().tobytes())  # the job's own ranks: as trusted as its code


def _check_counts(total: int, what: str) -> None:
    if total > _INT_MAX:
        raise ValueError(
            f"{what} would move {total} bytes in one message, more than its 2 GiB limit "
            "(2**31 - 1 bytes)"
        )


def _op_name(op: Any) -> str:
    """The name of mpi4py's MPI.SUM, MPI.MAX or MPI.MIN."""
    from mpi4py import MPI

    for name, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
        if op == mpi_op:
            return name
    raise ValueError(f"comm.allreduce takes sum, max or min, got {op!r}")


class Message:
    """A point-to-point message under way (:meth:`Transport.start_send`, ``start_recv``): it
    holds its buffer until :meth:`wait` finishes it with the deadline (Note [deadlines])."""

    def __init__(
        self,
        comm: Transport,
        work: Any,
        buf: torch.Tensor,
        what: str,
        template: Optional[torch.Tensor] = None,
        device: Any = None,
    ) -> None:
        self.comm, self.work, self.buf, self.what = comm, work, buf, what
        self.template, self.device = template, device

    def arrived(self) -> bool:
        """Whether the message is complete (a test, no waiting): :meth:`wait` then returns
        at once."""
        if self.work is not None and self.comm._done(self.work, self.what):
            self.work = None
        return self.work is None

    def wait(self) -> Optional[torch.Tensor]:
        """Finishes the message: None for a send, the tensor for a receive."""
        if self.work is not None:
            self.comm.wait([self.work], self.what)
            self.work = None
        if self.template is None:
            return None
        return unpack(self.buf, [self.template])[0].to(self.device)
