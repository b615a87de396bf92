"""Moving data between ranks without torch: the polled wait that gives every collective its
deadline, the barrier, small Python values, reductions of floats, the relay that raises one
rank's error on every rank, byte exchanges, and the exit notices.  Tensors go through
``_transport``, which builds on this.  These two, ``_bridge`` (the core's communicator) and the
launch code are the only modules that import mpi4py.

Note [deadlines]: every call here is a non-blocking MPI operation finished by :func:`wait`,
which polls: Ctrl-C gets through, a rank that waits longer than the stall timeout raises
:class:`layerbraid.StallError` naming what it waited for, and a rank that learns that another
rank of the communicator exited (Note [exit notices]) raises :class:`RemoteRankError` saying so.
Nothing here blocks in MPI.
"""

import pickle
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..errors import RemoteRankError, StallError
from .base import Transport, exited, missing_ranks, poll

__all__ = ["Comm"]

# The communicators layerbraid takes: an mpi4py one (COMM_WORLD, a Split of it, ...) or another
# transport's (_comm/base.py: a torch.distributed group, _comm/dist.py).  Every function below
# that takes one hands a Transport to its method of the same name.
Comm = Any

_INT_MAX = 2**31 - 1


# ---------------------------------------------------------------- communicators
def torch_launch() -> bool:
    """Whether this job's ranks talk through torch.distributed: started by torchrun (its MPI
    world then has one rank), or with a default process group that the program made itself."""
    if MPI.COMM_WORLD.Get_size() > 1:
        return False
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        return True
    from . import dist

    return dist.launched_by_torchrun()


def world():
    """The default communicator: MPI's COMM_WORLD, or under torchrun the default process group
    (made from the launcher's environment if the program has not made it)."""
    if torch_launch():
        from . import dist

        return dist.world()
    return MPI.COMM_WORLD


def resolve(comm):
    """The communicator a user passed: None is :func:`world`, a torch.distributed ProcessGroup
    becomes a DistComm (_comm/dist.py), anything else is returned as it is."""
    if comm is None:
        return world()
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and isinstance(comm, dist_mod.ProcessGroup):
        from . import dist

        return dist.as_comm(comm)
    return comm


def is_comm(obj):
    """Whether ``obj`` is a communicator layerbraid takes (mpi4py's or a Transport)."""
    return isinstance(obj, (MPI.Intracomm, Transport))


def is_null(comm):
    return not isinstance(comm, Transport) and comm == MPI.COMM_NULL


def finalized():
    return MPI.Is_finalized()


def split(comm, color, key, what):
    """``comm.Split(color, key)`` (a blocking collective), entered only once every rank has
    arrived, with the deadline."""
    barrier(comm, what)
    if isinstance(comm, Transport):
        return comm.Split(color, key)
    new = comm.Split(color, key)
    add_peers(new)
    return new


# ---------------------------------------------------------------- the polled wait
def wait(requests, comm, what, statuses=None):
    """Waits, polling, for MPI ``requests`` of ``comm`` (Note [deadlines]), the way the MGRIT
    core waits (Note [polled waits] in cbridge/src/comm.c): see :func:`poll`."""
    if isinstance(comm, Transport):
        return comm.wait(requests, what)
    if statuses is not None:
        done = lambda: MPI.Request.Testall(requests, statuses)  # noqa: E731
    else:
        done = lambda: MPI.Request.Testall(requests)  # noqa: E731
    poll(done, lambda: check_exits(comm, what), what, comm.Get_rank())


def barrier(comm, what):
    """Waits until every rank of ``comm`` has reached this point (a non-blocking barrier, with
    the deadline): after the timeout, :class:`layerbraid.StallError` names ``what``."""
    if isinstance(comm, Transport):
        return comm.barrier(what)
    if comm.Get_size() == 1:
        return
    wait(
        [comm.Ibarrier()],
        comm,
        f"every rank of its layer group to reach {what}; at least one never did (it stopped, "
        "or called model(x) or backward() a different number of times, or with another batch)",
    )


_ARRIVE_TAG = 7602


def arrive(comm, what):
    """Waits until this rank's neighbours in ``comm`` (ranks r - 1 and r + 1) have reached this
    point too: one empty message each way, so that a stall names the rank that never came
    (a barrier cannot tell who is missing).  The collective that follows covers the others,
    with its own deadline."""
    if isinstance(comm, Transport):
        return comm.arrive(what)
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    peers = [p for p in (rank - 1, rank + 1) if 0 <= p < size]
    token = np.zeros(1, dtype=np.uint8)
    inbox = {p: np.empty(1, dtype=np.uint8) for p in peers}
    recvs = {p: comm.Irecv([inbox[p], MPI.BYTE], source=p, tag=_ARRIVE_TAG) for p in peers}
    sends = [comm.Isend([token, MPI.BYTE], dest=p, tag=_ARRIVE_TAG) for p in peers]
    try:
        wait(list(recvs.values()) + sends, comm, f"its neighbours to reach {what}")
    except StallError as exc:
        missing = [p for p, r in recvs.items() if not r.Test()]
        if not missing:
            raise
        raise missing_ranks(rank, missing, what) from exc


# ---------------------------------------------------------------- reductions
_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def allreduce_floats(comm, values, op, what):
    """``values`` (floats) reduced over ``comm`` with ``op`` ("sum", "max" or "min"), the same
    on every rank bit for bit (the reduction, then rank 0's result broadcast: MPI does not
    promise the same rounding everywhere)."""
    if isinstance(comm, Transport):
        return comm.allreduce_floats(values, op, what)
    values = np.asarray(values, dtype=np.float64)
    if comm.Get_size() == 1:
        return [float(v) for v in values]
    out = np.empty_like(values)
    wait([comm.Iallreduce(values, out, op=_OPS[op])], comm, f"every rank's part of {what}")
    if op == "sum":
        wait([comm.Ibcast(out, root=0)], comm, f"rank 0's result of {what}")
    return [float(v) for v in out]


def start_allreduce_sum(comm, flat):
    """Starts summing the numpy array ``flat`` over ``comm`` in place; returns the request
    (finish it with :func:`wait`)."""
    if isinstance(comm, Transport):
        return comm.start_allreduce_sum(flat)
    return comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM)


def first_rank_where(comm, bad, what):
    """The lowest rank of ``comm`` on which ``bad`` is true, or None (the same on every
    rank)."""
    size = comm.Get_size()
    if size == 1:
        return 0 if bad else None
    first = int(allreduce_floats(comm, [comm.Get_rank() if bad else size], "min", what)[0])
    return first if first < size else None


def raise_on_every_rank(comm, error, what):
    """The relay: when ``error`` (an exception or None) is set on any rank of ``comm``, raises
    on every rank: the rank's own error where it has one, elsewhere a
    :class:`RemoteRankError` naming the lowest failing rank and its message.  A no-op (one
    reduction) when no rank failed."""
    failed = first_rank_where(comm, error is not None, f"the error check of {what}")
    if failed is None:
        return
    text = bcast_obj(
        comm,
        None if error is None else f"{type(error).__name__}: {error}",
        failed,
        f"rank {failed}'s error in {what}",
    )
    if error is not None:
        raise error
    raise RemoteRankError(f"{what} failed on rank {failed}: {text}", failed)


# ---------------------------------------------------------------- Python values
def check_same_settings(settings):
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


def _dumps(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _loads(buf):
    return pickle.loads(buf.tobytes())  # the job's own ranks: the same trust as its code


def _check_counts(sizes, what):
    total = int(np.sum(sizes))
    if total > _INT_MAX:
        raise ValueError(
            f"{what} would move {total} bytes in one MPI call, more than its 2 GiB "
            "limit (2**31 - 1 bytes)"
        )


def allgather_obj(comm, obj, what):
    """Every rank's ``obj`` (picklable, small: metadata and reports), in rank order."""
    if isinstance(comm, Transport):
        return comm.allgather_obj(obj, what)
    size = comm.Get_size()
    if size == 1:
        return [obj]
    data = _dumps(obj)
    sizes = np.empty(size, dtype=np.int64)
    wait(
        [comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)],
        comm,
        f"every rank's part of {what}",
    )
    _check_counts(sizes, what)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(
        [comm.Iallgatherv(data, [out, (sizes.tolist(), displs.tolist()), MPI.BYTE])],
        comm,
        f"every rank's part of {what}",
    )
    return [_loads(out[d : d + s]) for d, s in zip(displs, sizes)]


def gather_obj(comm, obj, root, what):
    """Every rank's ``obj`` in rank order on ``root``; None elsewhere."""
    if isinstance(comm, Transport):
        return comm.gather_obj(obj, root, what)
    size = comm.Get_size()
    if size == 1:
        return [obj]
    data = _dumps(obj)
    is_root = comm.Get_rank() == root
    sizes = np.empty(size if is_root else 1, dtype=np.int64)
    wait(
        [
            comm.Igather(
                np.array([data.size], dtype=np.int64), sizes if is_root else None, root=root
            )
        ],
        comm,
        f"every rank's part of {what}",
    )
    if not is_root:
        wait([comm.Igatherv(data, None, root=root)], comm, f"rank {root} to take {what}")
        return None
    _check_counts(sizes, what)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(
        [comm.Igatherv(data, [out, (sizes.tolist(), displs.tolist()), MPI.BYTE], root=root)],
        comm,
        f"every rank's part of {what}",
    )
    return [_loads(out[d : d + s]) for d, s in zip(displs, sizes)]


def bcast_obj(comm, obj, root, what):
    """``root``'s ``obj`` on every rank of ``comm``."""
    if isinstance(comm, Transport):
        return comm.bcast_obj(obj, root, what)
    if comm.Get_size() == 1:
        return obj
    is_root = comm.Get_rank() == root
    data = _dumps(obj) if is_root else None
    n = np.array([data.size if is_root else 0], dtype=np.int64)
    wait([comm.Ibcast(n, root=root)], comm, f"rank {root}'s {what}")
    _check_counts(n, what)
    if not is_root:
        data = np.empty(int(n[0]), dtype=np.uint8)
    wait([comm.Ibcast(data, root=root)], comm, f"rank {root}'s {what}")
    return obj if is_root else _loads(data)


def allgather_ints(comm, record: np.ndarray, what: str) -> np.ndarray:
    """Every rank's fixed-size int64 ``record``, as rows in rank order: one round, no pickle
    (the hot path's handshake)."""
    if isinstance(comm, Transport):
        return comm.allgather_ints(record, what)
    record = np.ascontiguousarray(record, dtype=np.int64)
    out = np.empty((comm.Get_size(), record.size), dtype=np.int64)
    if comm.Get_size() == 1:
        out[0] = record
        return out
    wait([comm.Iallgather(record, out)], comm, f"every rank's part of {what}")
    return out


def bcast_ints(comm, record: np.ndarray, root: int, what: str) -> np.ndarray:
    """``root``'s fixed-size int64 ``record`` (every rank passes one of the same size)."""
    if isinstance(comm, Transport):
        return comm.bcast_ints(record, root, what)
    record = np.ascontiguousarray(record, dtype=np.int64).copy()
    if comm.Get_size() > 1:
        wait([comm.Ibcast(record, root=root)], comm, f"rank {root}'s {what}")
    return record


# ---------------------------------------------------------------- bytes
def _check_received(status, expected, what):
    got = status.Get_count(MPI.BYTE)
    if got != expected:
        raise RemoteRankError(
            f"{what} came with {got} bytes where {expected} were expected: the "
            "ranks disagree on its shape or dtype",
            status.Get_source(),
        )


def exchange_bytes(comm, sends, recvs, tag, what):
    """Point-to-point: ``sends`` {dest: uint8 array} go out, ``recvs`` {source: uint8 array}
    are filled; each received message must have exactly its buffer's size (else
    RemoteRankError: the ranks disagree on what they exchange)."""
    if isinstance(comm, Transport):
        return comm.exchange_bytes(sends, recvs, tag, what)
    reqs, statuses, sizes = [], [], []
    for dest, buf in sends.items():
        reqs.append(comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag))
    for src, buf in recvs.items():
        reqs.append(comm.Irecv([buf, MPI.BYTE], source=src, tag=tag))
        sizes.append((src, buf.size))
    statuses = [MPI.Status() for _ in reqs]
    if reqs:
        wait(reqs, comm, what, statuses)
    for (src, size), status in zip(sizes, statuses[len(sends) :]):
        _check_received(status, size, f"{what} (from rank {src})")


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


def _start_notices():
    """Called once by ``launch.install_process_hooks`` in a job of 2+ ranks: the notice
    communicator (the exit handler and the sys.exit wrapper are installed there)."""
    if _notices["comm"] is not None:
        return
    # MPI_Comm_dup is collective: non-blocking here, with the deadline, so that a rank that
    # never builds anything of layerbraid's is reported instead of waited for.
    side, req = MPI.COMM_WORLD.Idup()
    wait(
        [req],
        MPI.COMM_WORLD,
        "every rank to build its first layer-parallel model, grid, "
        "solver or loader (each rank builds the same ones, in the same order)",
    )
    _notices["comm"] = side
    side.Set_name("layerbraid notices")


def add_peers(comm):
    """Records the world ranks of ``comm``: they are told when this rank exits early."""
    if isinstance(comm, Transport):
        return None
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


def _members(comm):
    """The world ranks of ``comm``."""
    if comm is MPI.COMM_WORLD or comm == MPI.COMM_WORLD:
        return None  # everyone
    world = MPI.COMM_WORLD.Get_group()
    group = comm.Get_group()
    try:
        return set(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def check_exits(comm, what, real=None):
    """Raises RemoteRankError when a rank of ``comm`` has said that it exited
    (Note [exit notices]).  ``real``: the ranks the user knows, by rank of ``comm`` (the MGRIT
    core's communicators may order the ranks otherwise)."""
    if isinstance(comm, Transport):
        return comm.check_exits(what, real)
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
    members = _members(comm)
    for src, text in sorted(_notices["seen"].items()):
        if members is None or src in members:
            local = src
            if members is not None:
                world = MPI.COMM_WORLD.Get_group()
                group = comm.Get_group()
                local = MPI.Group.Translate_ranks(world, [src], group)[0]
                group.Free()
                world.Free()
            raise exited(local, src, comm.Get_rank(), text, what, real)


def _describe_exit():
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


def _drain():
    """Receives the notices that arrived, so that none is left pending at MPI_Finalize."""
    side = _notices["comm"]
    status = MPI.Status()
    while side.Iprobe(source=MPI.ANY_SOURCE, tag=_EXIT_TAG, status=status):
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        side.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=_EXIT_TAG)
