"""The waits every transport shares: the polled wait with the stall deadline (Note [deadlines]
in _comm/base.py) and the errors a wait raises when a peer exited or never came."""

import os
import time
from collections.abc import Callable, Sequence
from typing import Optional

from ..errors import RemoteRankError, StallError
from .timeouts import timeout, wait_sleep

__all__ = ["exited", "missing_ranks", "poll", "wait_cpu_seconds"]

_WAIT_CPU = [0.0]  # this thread's CPU seconds in polls beyond their first tests


def wait_cpu_seconds() -> float:
    """The CPU seconds this process's polls have spent waiting (beyond each wait's first
    tests) since it started: a rank's CPU time less this, and less the MGRIT core's own
    (``mgrit_wait_cpu_seconds``), is its work's."""
    return _WAIT_CPU[0]


def poll(
    done: Callable[[], bool],
    check: Callable[[], None],
    what: str,
    rank: int,
    block: Optional[Callable[[float], bool]] = None,
) -> None:
    """Calls ``done()`` until it is true: a short spin, then, between tests, a yield of the
    core when every rank of this node has a core of its own (a nap would wake late by up to
    its length, on every wait of a pipeline), else a nap of a tenth of the time waited so far,
    between ``wait_sleep()`` and 1 ms; several tests per wake (MPI's progress can need more
    than one call to finish what arrived during a nap); ``check()`` (the exit notices) and the
    timeout about every 50 ms.  ``block(seconds)``, where given, replaces the spin and the
    naps whenever it can: it waits for a completion that a thread reports, at most that long,
    with the interpreter's lock released (a spinning main thread would keep the reporting
    thread from running), and says whether it could.  Every wait of either transport goes
    through here (Note [deadlines] in _comm/base.py); its CPU time beyond the first tests
    is counted (:func:`wait_cpu_seconds`)."""
    for _ in range(4):
        if done():
            return
    cpu0 = time.thread_time()
    try:
        _poll(done, check, what, rank, block)
    finally:
        _WAIT_CPU[0] += time.thread_time() - cpu0


def _poll(
    done: Callable[[], bool],
    check: Callable[[], None],
    what: str,
    rank: int,
    block: Optional[Callable[[float], bool]],
) -> None:
    limit = timeout()
    t0 = time.perf_counter()
    spins, sleep, next_check = 0, None, t0 + 0.05
    while True:
        for _ in range(4):
            if done():
                return
        now = time.perf_counter()
        if block is not None and block(max(next_check - now, 1e-4)):
            now = time.perf_counter()
        else:
            spins += 1
            if spins <= 100:
                continue
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


def exited(
    local: int, src: int, me: int, text: str, what: str, real: Optional[Sequence[int]] = None
) -> RemoteRankError:
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
