"""The stall timeout that bounds every wait between ranks (Python's and the MGRIT core's), and
how long the core's waits sleep between tests."""

import os
from typing import Optional

__all__ = ["set_timeout", "timeout", "wait_sleep"]

_DEFAULT_TIMEOUT = 600.0
_timeout: list[Optional[float]] = [None]


def set_timeout(seconds: float) -> None:
    """Seconds a rank may wait for another, in layerbraid's collectives and in the MGRIT core's
    waits, before it raises :class:`layerbraid.StallError` saying what it waited for (and, for
    the core's messages, from which rank); uncaught, that ends the job.  The default is 600 s,
    or the environment variable ``LAYERBRAID_TIMEOUT``; 0 waits forever.  Applies to solvers
    built afterwards; every rank must use the same value."""
    seconds = float(seconds)
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"the timeout must be a finite number of seconds >= 0, got {seconds!r}")
    _timeout[0] = seconds


def timeout() -> float:
    """The stall timeout in seconds now in force (see :func:`set_timeout`)."""
    if _timeout[0] is not None:
        return _timeout[0]
    text = os.environ.get("LAYERBRAID_TIMEOUT")
    if text is None:
        return _DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"LAYERBRAID_TIMEOUT must be a number of seconds >= 0, got {text!r}")
    return value


# Seconds a long wait of the MGRIT core sleeps between tests when this node runs more ranks than
# it has cores (Note [polled waits] in cbridge/src/comm.c).
_OVERSUBSCRIBED_SLEEP = 1e-4


def wait_sleep() -> float:
    """Seconds the MGRIT core's waits sleep at least between tests once a short spin has not
    ended them (up to a tenth of the time waited, at most 1 ms; 0: they yield the core
    instead).  ``LAYERBRAID_WAIT_SLEEP`` sets it; by default it is 0.1 ms when this node runs
    more ranks (as the launcher reports them: MPICH's MPI_LOCALNRANKS, Open MPI's
    OMPI_COMM_WORLD_LOCAL_SIZE) than this process may use cores, where yielding ranks would take
    turns on the CPU with the ranks that compute, else 0."""
    text = os.environ.get("LAYERBRAID_WAIT_SLEEP")
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 1e-3:
            raise ValueError(
                f"LAYERBRAID_WAIT_SLEEP must be a number of seconds between 0 and "
                f"0.001, got {text!r}"
            )
        return value
    local = 1
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            local = int(os.environ[name])
            break
    try:
        cores: Optional[int] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count()
    return _OVERSUBSCRIBED_SLEEP if local > (cores or 1) else 0.0
