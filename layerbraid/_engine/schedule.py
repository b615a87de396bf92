"""The core's schedule as data: the options a core runs with, the trace it records (every
action of every level, per rank), and virtual ranks that produce a rank's trace without running
a step or sending a message.  The planner (plan.py) reads schedules from here; the live solver
(_engine/bridge.py) configures its cores and reads their traces through the same functions.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

# MPI's library first, through the communication layer's mpi4py: the extension then links to
# that same library by soname (Note [finding libmpi at run time] in cbridge/build_mgrit.py).
# This is the one import of the extension; _bridge takes ffi and lib from here.
from .._comm import mpi as _comm
from .._mgrit_core import ffi, lib

del _comm  # imported for the load order only

__all__ = [
    "OPS",
    "TRACE_DTYPE",
    "TraceEntry",
    "configure",
    "trace_array",
    "trace_entries",
    "virtual_schedule",
]

# The trace's operation names, indexed by the header's MGRIT_OP_* codes.
OPS = tuple(
    name.lower()
    for name, code in sorted(
        ((n[len("MGRIT_OP_") :], getattr(lib, n)) for n in dir(lib) if n.startswith("MGRIT_OP_")),
        key=lambda item: item[1],
    )
)


@dataclass(frozen=True)
class TraceEntry:
    """One action of the schedule: (level, op, point index, peer rank, done)."""

    level: int
    op: str
    index: int
    peer: int
    done: bool


TRACE_DTYPE = np.dtype(
    [("level", "<i4"), ("op", "<i4"), ("index", "<i8"), ("peer", "<i4"), ("done", "<i4")]
)


def trace_array(core: Any) -> Any:
    """A core's trace as a structured array (TRACE_DTYPE), copied out of the core: the one
    representation of a schedule; trace_entries() presents it as objects."""
    if TRACE_DTYPE.itemsize != ffi.sizeof("mgrit_trace_entry"):
        raise RuntimeError("trace entry layout mismatch")
    n = lib.mgrit_trace_length(core)
    if n == 0:
        return np.zeros(0, dtype=TRACE_DTYPE)
    buf = ffi.buffer(lib.mgrit_trace(core), n * TRACE_DTYPE.itemsize)
    return np.frombuffer(buf, dtype=TRACE_DTYPE).copy()


def trace_entries(array: Any) -> list[Any]:
    """TraceEntry objects (op by name) from a TRACE_DTYPE array."""
    return [
        TraceEntry(int(e["level"]), OPS[e["op"]], int(e["index"]), int(e["peer"]), bool(e["done"]))
        for e in array
    ]


def virtual_schedule(num_steps, size, options, mirror: bool = False, parts: int = 1):
    """The schedule each of ``size`` ranks would run (without running it): a list, per rank, of
    structured arrays (TRACE_DTYPE; `op` indexes OPS).  Every solve runs options.max_iters
    iterations (a virtual rank has no residual to stop on).  ``parts``: the batch in that many
    microbatches (Note [parts] in cbridge/src/cycle.c): every action once per microbatch."""
    out = []
    ptr = ffi.new("mgrit_core **")
    for rank in range(size):
        rc = lib.mgrit_create_virtual(int(num_steps), 0.0, 1.0, rank, int(size), ptr)
        if rc != lib.MGRIT_OK:
            raise ValueError(f"cannot plan num_steps={num_steps!r} on {size!r} ranks")
        core = ptr[0]
        try:
            configure(core, options, trace=True)
            lib.mgrit_set_mirror(core, int(bool(mirror)))
            if lib.mgrit_set_parts(core, int(parts)) != lib.MGRIT_OK:
                raise ValueError(ffi.string(lib.mgrit_error_message(core)).decode())
            rc = lib.mgrit_solve(core)
            if rc != lib.MGRIT_OK:
                raise ValueError(ffi.string(lib.mgrit_error_message(core)).decode())
            out.append(trace_array(core))
        finally:
            lib.mgrit_destroy(core)
    return out


def configure(c: Any, o: Any, trace: bool) -> None:
    """Sets the core ``c``'s options from the MGRITOptions ``o`` (ValueError with the core's
    message for a value it refuses); ``trace``: record the schedule."""

    def check(rc: int) -> None:
        if rc != lib.MGRIT_OK:
            raise ValueError(ffi.string(lib.mgrit_error_message(c)).decode())

    check(lib.mgrit_set_max_levels(c, o.max_levels))
    cfs, nrs = o.cfactors(), o.nrelaxes()
    check(lib.mgrit_set_cfactors(c, len(cfs), ffi.new("int[]", list(cfs))))
    check(lib.mgrit_set_nrelax(c, len(nrs), ffi.new("int[]", list(nrs))))
    check(lib.mgrit_set_max_iters(c, o.max_iters))
    check(lib.mgrit_set_tol(c, o.tol))
    check(lib.mgrit_set_rtol(c, o.rtol))
    check(lib.mgrit_set_skip(c, int(o.skip_first_downcycle)))
    check(lib.mgrit_set_cycle(c, lib.MGRIT_CYCLE_F if o.cycle == "F" else lib.MGRIT_CYCLE_V))
    check(lib.mgrit_set_min_coarse(c, o.min_coarse))
    check(lib.mgrit_set_final_fc(c, int(o.final_fc_relax)))
    check(lib.mgrit_set_trace(c, int(bool(trace))))
