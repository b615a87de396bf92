"""The live MGRIT solver over the compiled core (its options, traces and virtual ranks are
_engine/schedule.py's).

States live in a table kept here (an int id per state); the C core sees only the ids.  The
callbacks below run the vector operations on numpy arrays or torch tensors, and turn a Python
exception into a nonzero return code: the core then stops computing, tells the other ranks, and
returns, and `_Core.solve` re-raises the original exception on this rank (Note [poisoned messages]
in cbridge/src/comm.c).
"""

import re
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI as _MPI

from .._comm.base import Transport
from .._comm.timeouts import timeout, wait_sleep
from ..errors import DivergenceError, MGRITError, RemoteRankError, StallError
from .schedule import configure, ffi, lib, trace_array, trace_entries
from .states import (
    _as_state,
    _from_bytes,
    _from_parts,
    _header,
    _is_torch,
    _norm,
    _payload,
    _raw_bytes,
    _sum,
    _sum_into,
)

__all__ = []


# ---------------------------------------------------------------- the solver handle
def _callback_table(
    coarsen: Any, refine: Any, step_interval: Any, idle: Any, app_transport: bool
) -> Any:
    """The core's callback table: every callback this module defines, the optional ones
    (spatial coarsening, runs of steps, idle work, the application's transport) only where the
    solver has them."""
    cbs = ffi.new("mgrit_callbacks *")
    if app_transport:
        cbs.isend, cbs.try_recv = lib._lb_isend, lib._lb_try_recv
        cbs.iallreduce, cbs.test = lib._lb_iallreduce, lib._lb_test
        cbs.block = lib._lb_block
    cbs.init, cbs.clone, cbs.free = lib._lb_init, lib._lb_clone, lib._lb_free
    cbs.sum, cbs.norm, cbs.step = lib._lb_sum, lib._lb_norm, lib._lb_step
    cbs.bufsize, cbs.pack, cbs.unpack = lib._lb_bufsize, lib._lb_pack, lib._lb_unpack
    cbs.poll, cbs.part = lib._lb_poll, lib._lb_part
    if coarsen is not None:
        cbs.coarsen = lib._lb_coarsen
    if refine is not None:
        cbs.refine = lib._lb_refine
    if step_interval is not None:
        cbs.step_interval = lib._lb_step_interval
    if idle is not None:
        cbs.idle = lib._lb_idle
    return cbs


class _Core:
    """One MGRIT solver over a communicator.

    Args:
        comm: a Transport.  The core calls MPI itself on its ``native_mpi()`` communicator
            where it has one, else its messages go through the transport (Note [application
            transport] in cbridge/src/comm.c).
        num_steps, t_start, t_stop: the fine time grid.
        options: an MGRITOptions.
        init: ``init(app, t, index) -> state``: the initial value at index 0, the guess
            elsewhere.
        step: ``step(app, u, t_start, t_stop, level, index, done) -> state`` (must not modify
            u).  ``app`` is what ``solve(app)`` was given: the context of that one solve, as
            XBraid hands its app to every callback.
        trace: record the schedule.
        coarsen, refine: optional spatial transfers ``coarsen(x, level)`` (level -> level+1)
            and ``refine(e, level)`` (level -> level-1).
        store_all: keep every fine point (else only what the cycles read again).
        mirror: give the extra steps (N % P) to the last ranks instead of the first, for a solve
            backward in time on the reversed communicator.
        real_ranks: the rank each rank of ``comm`` is known by to the user (e.g. in the layer
            group, for the adjoint's reversed communicator); errors name those.
        owns_comm: free ``comm`` with the core (a communicator made for this core alone).
        step_interval: optional ``step_interval(app, u, times, level, index, stride, done,
            keep) -> [state] * n``: the ``n = len(times) - 1`` steps of a run from u, step k
            from fine index ``index + k * stride`` over ``times[k]..times[k+1]``, in one call
            (Note [fused intervals] in cbridge/src/relax.c).  Without ``keep`` only the last
            state is kept and the others may be None.
        idle: optional ``idle(app)``, called at the end of a solve that went well on this rank,
            once its sends were received and before the allreduce that ends the solve (Note
            [idle work] in cbridge/src/cycle.c); its time counts as step time.
    """

    def __init__(
        self,
        comm: Transport,
        num_steps: int,
        t_start: float,
        t_stop: float,
        options: Any,
        init: Callable[..., Any],
        step: Callable[..., Any],
        trace: bool = False,
        mirror: bool = False,
        coarsen: Optional[Callable[..., Any]] = None,
        refine: Optional[Callable[..., Any]] = None,
        store_all: bool = True,
        real_ranks: Optional[list[int]] = None,
        owns_comm: bool = False,
        step_interval: Optional[Callable[..., Any]] = None,
        idle: Optional[Callable[..., Any]] = None,
    ) -> None:
        self._core = None  # what close() frees, set before anything here can fail
        self._messages: Optional[Transport] = None
        self.comm: Optional[Transport] = None
        self._owned: list[Transport] = []  # what close() frees
        # MPI_Comm_dup below is a blocking collective: every rank arrives first, with the
        # deadline, so that one that never builds this solver is reported, not waited for.
        comm.barrier(
            "the construction of an MGRIT solver (every rank builds the same models "
            "and solvers, in the same order)",
        )
        comm.note_peers()
        self._init_fn, self._step_fn, self._interval_fn = init, step, step_interval
        self._idle_fn = idle
        self._app = None
        self._apps: list[Any] = []  # the parts' apps (Note [parts] in cbridge/src/cycle.c)
        self._parts = 1
        self._coarsen_fn, self._refine_fn = coarsen, refine
        self._table: dict[int, Any] = {}
        self._private: set[int] = set()  # Note [private states]
        self._next = 0
        self._error: Optional[BaseException] = None
        self._device = None
        self.step_seconds = 0.0
        self.comm = comm
        if owns_comm:
            self._owned.append(comm)
        self.rank = comm.Get_rank()
        self._real = list(real_ranks) if real_ranks is not None else list(range(comm.Get_size()))
        self._handle = ffi.new_handle(self)
        # The core's messages through Python (Note [application transport] in comm.c): over a
        # torch.distributed group or a CUDA-aware MPI (Note [CUDA-aware MPI] in _comm/mpi.py),
        # on a duplicate of the communicator (its own context, as MPI_Comm_dup gives the core
        # under MPI: Note [contexts] in _comm/dist.py).  Else the core calls MPI itself.
        native = comm.native_mpi()
        self._messages = None
        if native is None:
            self.comm = comm = comm.Dup()
            self._owned.append(comm)
            self._messages = comm
        app_transport = self._messages is not None
        self._reductions: dict[
            int, tuple
        ] = {}  # the application transport's pending allreduces: handle -> out
        self._cbs = _callback_table(coarsen, refine, step_interval, idle, app_transport)
        out = ffi.new("mgrit_core **")
        problem = (int(num_steps), float(t_start), float(t_stop), self._cbs, self._handle, out)
        if app_transport:
            rc = lib.mgrit_create_app(comm.Get_rank(), comm.Get_size(), *problem)
        else:
            comm_ptr = ffi.cast("MPI_Comm *", _MPI._addressof(native))
            rc = lib.mgrit_create(comm_ptr, *problem)
        if rc != lib.MGRIT_OK:
            why = ffi.string(lib.mgrit_create_error()).decode()
            if rc == lib.MGRIT_ERR_MPI:
                raise MGRITError(f"cannot create an MGRIT solver: {why}")
            raise ValueError(
                f"cannot create an MGRIT solver for num_steps={num_steps!r}, "
                f"t_start={t_start!r}, t_stop={t_stop!r}: {why}"
            )
        self._core = out[0]
        self._configure(options, trace, mirror, store_all)

    def _configure(self, options: Any, trace: bool, mirror: bool, store_all: bool) -> None:
        self._set_options(options, trace)
        self._check(lib.mgrit_set_timeout(self._core, timeout()))
        self._check(lib.mgrit_set_wait_sleep(self._core, wait_sleep()))
        self._check(lib.mgrit_set_mirror(self._core, int(bool(mirror))))
        self._check(lib.mgrit_set_store_all(self._core, int(bool(store_all))))

    def _check(self, rc: int) -> None:
        if rc != lib.MGRIT_OK:
            raise ValueError(ffi.string(lib.mgrit_error_message(self._core)).decode())

    def _set_options(self, o: Any, trace: bool) -> None:
        configure(self._core, o, trace)

    @property
    def messages(self) -> Transport:
        """The transport of the core's messages where it calls no MPI itself (Note
        [application transport] in cbridge/src/comm.c)."""
        assert self._messages is not None
        return self._messages

    @property
    def transport(self) -> Transport:
        """The communicator of a core that is not closed."""
        assert self.comm is not None
        return self.comm

    def close(self) -> None:
        """Frees the core, its duplicate of the communicator and (owns_comm) the communicator.
        Safe to call twice, and after MPI has finalized (then nothing is freed: the process is
        ending)."""
        finalized = _MPI.Is_finalized()
        if self._core is not None:
            if not finalized:
                lib.mgrit_destroy(self._core)
            self._core = None
        self._messages = None
        for comm in self._owned:
            comm.Free()  # safe after MPI has finalized: then it frees nothing
        self._owned.clear()
        self.comm = None
        self._table.clear()
        self._private.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # table
    # Note [private states]: the core writes a sum into its second operand (y <- a x + b y).
    # In place is a pass over the state with no allocation, against an allocation (and, at
    # a few hundred kB and up, fresh pages) and a pass for a new state; but a state that the
    # application may hold (a step's input or output, which can be its input itself or a view
    # into a kept autograd graph; init's values; what states() returns) must never change.
    # So a state is private only when this table made it (an unpacked message, a new sum),
    # shares it with no other id (a clone shares until one of the two is written) and has not
    # handed it to application code since (_handed); sums into a private state are in place,
    # the others make a new, private state.
    def _put(self, x: Any, private: bool = False) -> int:
        x = _as_state(x)
        if self._device is None and _is_torch(x):
            self._device = x.device
        i = self._next
        self._next += 1
        self._table[i] = x
        if private:
            self._private.add(i)
        return i

    def _handed(self, i: int) -> Any:
        """State ``i``, for application code, which may keep it: no longer private."""
        self._private.discard(i)
        return self._table[i]

    def _fail(self, exc: BaseException, where: str) -> int:
        if self._error is None:
            if sys.version_info >= (3, 11):  # add_note is new in 3.11
                exc.add_note(
                    f"(raised on rank {self._real[self.rank]} in the MGRIT {where} callback)"
                )
            self._error = exc
        return 1

    def _raise(self, rc: int) -> None:
        """Raise the error of status rc on this rank; with the failing rank's message on all."""
        # The core names ranks of its own communicator: say the ranks the user knows.
        msg = re.sub(
            r"\brank (\d+)",
            lambda m: (
                f"rank {self._real[int(m.group(1))]}"
                if int(m.group(1)) < len(self._real)
                else m.group(0)
            ),
            ffi.string(lib.mgrit_error_message(self._core)).decode(),
        )
        if _escaped and self._error is None:  # Note [callback errors]
            self._error = _escaped.pop()
        _escaped.clear()
        if rc == lib.MGRIT_ERR_INTERRUPT:  # the job ends: no rank is told
            err, self._error = self._error, None
            raise err if err is not None else KeyboardInterrupt(msg)
        if rc == lib.MGRIT_ERR_TIMEOUT:
            raise StallError(
                f"stalled: {msg}; LAYERBRAID_TIMEOUT or layerbraid.set_timeout sets the limit"
            )
        if rc == lib.MGRIT_ERR_MPI:
            err, self._error = self._error, None  # a failed transport callback: its error
            raise err if err is not None else MGRITError(msg)
        if rc == lib.MGRIT_ERR_NOMEM and self._error is None:
            self._error = MemoryError(msg or "the MGRIT core ran out of memory")
        if rc in (lib.MGRIT_ERR_CALLBACK, lib.MGRIT_ERR_REMOTE, lib.MGRIT_ERR_NOMEM):
            # Every rank knows the failing rank now: it tells the others what went wrong.
            failed = lib.mgrit_failed_rank(self._core)
            err, self._error = self._error, None
            text = None
            if err is not None:  # with its notes: which step, on which rank
                text = " ".join([f"{type(err).__name__}: {err}", *getattr(err, "__notes__", [])])
            assert self.comm is not None  # a solve ran: the solver is open
            if 0 <= failed < self.comm.Get_size():
                text = self.comm.bcast_obj(text, failed, "report of the failed callback")
            if rc in (lib.MGRIT_ERR_CALLBACK, lib.MGRIT_ERR_NOMEM) and err is not None:
                raise err
            real = self._real[failed] if 0 <= failed < len(self._real) else -1
            msg = (
                f"a callback failed on rank {real}; rank {self._real[self.rank]} stopped"
                if real >= 0
                else msg
            )
            raise RemoteRankError(f"{msg}: {text}" if text else msg, real)
        if rc == lib.MGRIT_ERR_NAN:
            raise DivergenceError(msg)
        if rc in (lib.MGRIT_ERR_ARG, lib.MGRIT_ERR_MISMATCH):
            raise ValueError(msg)
        raise MGRITError(msg or f"the MGRIT core failed with status {rc}")

    def set_trace(self, on: bool) -> None:
        """Record the schedule of the following solves (see ``trace()``)."""
        self._check(lib.mgrit_set_trace(self._core, int(bool(on))))

    def setup(self) -> None:
        """Checks the options across ranks and builds the levels (collective)."""
        rc = lib.mgrit_setup(self._core)
        if rc != lib.MGRIT_OK:
            self._raise(rc)

    def level_info(self) -> list[tuple[int, int, int]]:
        """[(first owned point, last owned point, stride)] per level, after setup or a solve."""
        out = []
        for level in range(lib.mgrit_num_levels(self._core)):
            lo, hi = self.owned(level)
            out.append((lo, hi, lib.mgrit_level_stride(self._core, level)))
        return out

    # solve
    def solve(
        self, app: Any = None, device: Any = None, parts: Optional[list[Any]] = None
    ) -> tuple[int, list[float]]:
        """Runs the solve, handing ``app`` to the init and step callbacks; returns (iterations,
        residual norms).  ``parts``: solve that many microbatches in lockstep, the callbacks of
        part p getting ``parts[p]`` as their app (Note [parts] in cbridge/src/cycle.c; every
        rank must give as many).  ``device``: where received states land (None: the device of
        the first state this rank makes).  Raises on every rank on error."""
        self._error = None
        self.step_seconds = 0.0
        apps = list(parts) if parts else [app]
        if len(apps) != self._parts:
            self._check(lib.mgrit_set_parts(self._core, len(apps)))
            self._parts = len(apps)
        self._apps, self._app = apps, apps[0]
        # Where unpacked states land (Note [staging]): the solve's device where the caller names
        # one (a rank may receive a state before it makes one, and a model can move between
        # solves), else the device of the first state this rank makes.
        self._device = device
        try:
            rc = lib.mgrit_solve(self._core)
        finally:
            self._app, self._apps = None, []
        if rc != lib.MGRIT_OK:
            self._raise(rc)
        n = lib.mgrit_num_norms(self._core)
        norms = lib.mgrit_norms(self._core)
        return lib.mgrit_iterations(self._core), [norms[k] for k in range(n)]

    def final_residual(self) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """(residual, residual sum, state norm) measured by the last solve's final
        C-relaxation over the level-0 C-points (see mgrit.h), or Nones when it did not measure
        one (one level, no final relaxation)."""
        r = lib.mgrit_final_residual(self._core)
        if r < 0:
            return None, None, None
        return (r, lib.mgrit_final_residual_sum(self._core), lib.mgrit_final_state_norm(self._core))

    def num_c_points(self) -> int:
        """The fine C-points from cfactor on (where residuals are measured); 0 with one level."""
        if lib.mgrit_num_levels(self._core) < 2:
            return 0
        return int(lib.mgrit_level_points(self._core, 1)) - 1

    def set_rtol(self, rtol: float) -> None:
        """The relative tolerance of the following solves (every rank the same)."""
        self._check(lib.mgrit_set_rtol(self._core, float(rtol)))

    def set_skip(self, skip: bool) -> None:
        """Skip the first down-cycle in the following solves (every rank the same)."""
        self._check(lib.mgrit_set_skip(self._core, int(bool(skip))))

    def comm_seconds(self) -> float:
        """Seconds spent in the core's MPI calls (waiting included) in the last solve."""
        return lib.mgrit_comm_seconds(self._core)

    def owned(self, level: int = 0) -> tuple[int, int]:
        lo, hi = ffi.new("int64_t *"), ffi.new("int64_t *")
        lib.mgrit_owned(self._core, level, lo, hi)
        return lo[0], hi[0]

    def num_levels(self) -> int:
        return lib.mgrit_num_levels(self._core)

    def states(self, part: int = 0) -> dict[int, Any]:
        """{fine index: state} of ``part`` for the points this rank owns, after a solve."""
        lo, hi = self.owned(0)
        out = {}
        for i in range(lo, hi + 1):
            vid = lib.mgrit_state_part(self._core, i, part)
            if vid >= 0:
                out[i] = self._handed(vid)
        return out

    def release_states(self) -> None:
        """Frees the states the last solve left in the core: after ``states()`` the caller holds
        what it needs, and the core would otherwise keep the solution until the next solve."""
        if self._core is not None:
            self._check(lib.mgrit_release_states(self._core))

    def trace(self) -> list[Any]:
        """The schedule of the last solve as TraceEntry objects (see trace_entries)."""
        return trace_entries(trace_array(self._core))


# ---------------------------------------------------------------- callbacks
# Note [callback errors]: every callback returns 0, or nonzero after storing its exception on its
# core (_Core._fail), which the core then reports (Note [poisoned messages] in comm.c).  An
# exception that escapes the body (a KeyboardInterrupt delivered between two bytecodes of the
# wrapper) reaches cffi's onerror, which stores it too; the declared error value is 1, so it can
# never pass for success.
_escaped: list[BaseException] = []


def _on_escape(exc_type: Any, exc: Any, tb: Any) -> None:
    _escaped.append(exc if exc is not None else exc_type())


def _callback(name: str, where: str) -> Callable[[Callable[..., int]], Any]:
    def wrap(body: Callable[..., int]) -> Any:
        def callback(app: Any, *args: Any) -> int:
            self = ffi.from_handle(app)
            try:
                return body(self, *args)
            except BaseException as exc:
                return self._fail(exc, where)

        return ffi.def_extern(name=name, error=1, onerror=_on_escape)(callback)

    return wrap


@_callback("_lb_init", "init")
def _init_cb(self: _Core, t: float, index: int, out: Any) -> int:
    out[0] = self._put(self._init_fn(self._app, t, index))
    return 0


@_callback("_lb_clone", "clone")
def _clone_cb(self: _Core, x: int, out: Any) -> int:
    # Note [private states]: a clone shares its state until a sum writes into one of the two,
    # which then makes a new state (the copy the clone would have made, and the sum, in one
    # pass); neither is private while they share.
    self._private.discard(x)
    out[0] = self._put(self._table[x])
    return 0


@_callback("_lb_free", "free")
def _free_cb(self: _Core, x: int) -> int:
    self._table.pop(x, None)
    self._private.discard(x)
    return 0


@_callback("_lb_sum", "sum")
def _sum_cb(self: _Core, alpha: float, x: int, beta: float, y: int) -> int:
    tx, ty = self._table[x], self._table[y]
    # In place only into a private state (Note [private states]).
    if y not in self._private or not _sum_into(alpha, tx, beta, ty):
        self._table[y] = _sum(alpha, tx, beta, ty)
        self._private.add(y)
    return 0


@_callback("_lb_norm", "norm")
def _norm_cb(self: _Core, x: int, out: Any) -> int:
    out[0] = _norm(self._table[x])
    return 0


def _checked(x: Any, y: Any, level: int, index: int, tstart: float, tstop: float) -> Any:
    """y as a state, after checking that the step from x to y kept x's shape and dtype."""
    y = _as_state(y)
    if y.shape != x.shape:
        raise ValueError(
            f"the step at level {level}, fine index {index} (t={tstart:g} to "
            f"{tstop:g}) returned a state of shape {tuple(y.shape)}, but its "
            f"input has shape {tuple(x.shape)}: a step must keep the shape"
        )
    if y.dtype != x.dtype:
        raise TypeError(
            f"the step at level {level}, fine index {index} returned dtype "
            f"{y.dtype}, but its input has dtype {x.dtype}: a step must keep "
            "the dtype"
        )
    return y


@_callback("_lb_step", "step")
def _step_cb(
    self: _Core, u: int, tstart: float, tstop: float, level: int, index: int, done: int, out: Any
) -> int:
    x = self._handed(u)
    t0 = time.perf_counter()
    y = self._step_fn(self._app, x, tstart, tstop, level, index, bool(done))
    self.step_seconds += time.perf_counter() - t0
    out[0] = self._put(_checked(x, y, level, index, tstart, tstop))
    return 0


@_callback("_lb_step_interval", "step_interval")
def _step_interval_cb(
    self: _Core,
    u: int,
    t: Any,
    level: int,
    index: int,
    stride: int,
    n: int,
    done: int,
    keep: int,
    out: Any,
) -> int:
    x = self._handed(u)
    times = ffi.unpack(t, n + 1)
    t0 = time.perf_counter()
    assert self._interval_fn is not None  # registered only where given
    ys = list(self._interval_fn(self._app, x, times, level, index, stride, bool(done), bool(keep)))
    self.step_seconds += time.perf_counter() - t0
    if len(ys) != n:
        raise ValueError(
            f"the step_interval callback of level {level} from fine index {index} "
            f"returned {len(ys)} states for {n} steps"
        )
    states = []
    for k, y in enumerate(ys):
        if y is None and (keep or k == n - 1):
            raise ValueError(
                f"the step_interval callback of level {level} returned no state "
                f"for its step from fine index {index + k * stride}, which the "
                "core keeps"
            )
        states.append(
            None if y is None else _checked(x, y, level, index + k * stride, times[k], times[k + 1])
        )
    for k, y in enumerate(states):
        out[k] = -1 if y is None else self._put(y)
    return 0


@_callback("_lb_idle", "idle")
def _idle_cb(self: _Core) -> int:
    t0 = time.perf_counter()
    assert self._idle_fn is not None  # registered only where given
    self._idle_fn(self._app)
    self.step_seconds += time.perf_counter() - t0
    return 0


@_callback("_lb_bufsize", "bufsize")
def _bufsize_cb(self: _Core, x: int, out: Any) -> int:
    s = self._table[x]
    out[0] = len(_header(s)) + (s.numel() * s.element_size() if _is_torch(s) else s.nbytes)
    return 0


@_callback("_lb_pack", "pack")
def _pack_cb(self: _Core, x: int, buf: Any, nbytes: int) -> int:
    s = self._table[x]
    head = _header(s)
    dst = np.frombuffer(ffi.buffer(buf, nbytes), dtype=np.uint8)
    dst[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    dst[len(head) :] = _raw_bytes(s)
    return 0


@_callback("_lb_unpack", "unpack")
def _unpack_cb(self: _Core, buf: Any, nbytes: int, out: Any) -> int:
    out[0] = self._put(_from_bytes(ffi.buffer(buf, nbytes), self._device), private=True)
    return 0


@_callback("_lb_coarsen", "coarsen")
def _coarsen_cb(self: _Core, x: int, level: int, out: Any) -> int:
    assert self._coarsen_fn is not None  # registered only where given
    out[0] = self._put(self._coarsen_fn(self._handed(x), level))
    return 0


@_callback("_lb_refine", "refine")
def _refine_cb(self: _Core, x: int, level: int, out: Any) -> int:
    assert self._refine_fn is not None  # registered only where given
    out[0] = self._put(self._refine_fn(self._handed(x), level))
    return 0


@_callback("_lb_part", "part")
def _part_cb(self: _Core, part: int) -> int:
    """The callbacks that follow act on microbatch ``part``: they get its app."""
    self._app = self._apps[part]
    return 0


@_callback("_lb_poll", "wait")
def _poll_cb(self: _Core) -> int:
    """Called while the core waits: a pending Ctrl-C is raised here (Python runs signal handlers
    between bytecodes), stored, and stops the wait; so is the notice of a rank of this
    communicator that exited (Note [exit notices] in _comm)."""
    self.transport.check_exits("a message of an MGRIT solve", self._real)
    return 0


# ---------------------------------------------------------------- the application's transport
# Note [application transport] in cbridge/src/comm.c: with a torch.distributed group the core's
# messages go through these four; the state itself travels (on its device where the group
# serves it: Note [device-resident messages] in _comm/dist.py), not a packed host buffer.
_REDUCE_OPS = ("sum", "min", "max")


@_callback("_lb_isend", "isend")
def _isend_cb(self: _Core, dest: int, tag: int, flag: int, x: int, handle: Any) -> int:
    if flag:
        handle[0] = self.messages.isend_state(dest, tag, 1, b"", None)
    else:
        s = self._table[x]
        handle[0] = self.messages.isend_state(dest, tag, 0, _header(s), _payload(s))
    return 0


@_callback("_lb_try_recv", "try_recv")
def _try_recv_cb(self: _Core, src: int, tag: int, found: Any, flag: Any, out: Any) -> int:
    got = self.messages.try_recv_state(src, tag)
    found[0] = 0 if got is None else 1
    if got is not None:
        flag[0] = got[0]
        out[0] = -1 if got[0] else self._put(_from_parts(got[1], got[2], self._device), True)
    return 0


@_callback("_lb_iallreduce", "iallreduce")
def _iallreduce_cb(self: _Core, values: Any, out: Any, n: int, op: int, handle: Any) -> int:
    v = np.frombuffer(ffi.buffer(values, 8 * n), dtype=np.float64).copy()
    h = self.messages.iallreduce_doubles(v, _REDUCE_OPS[op])
    self._reductions[h] = (out, n)
    handle[0] = h
    return 0


@_callback("_lb_test", "test")
def _test_cb(self: _Core, handle: Any, done: Any) -> int:
    result = self.messages.test(handle)
    done[0] = 0 if result is None else 1
    if result is not None and handle in self._reductions:
        out, n = self._reductions.pop(handle)
        ffi.buffer(out, 8 * n)[:] = np.ascontiguousarray(result, dtype=np.float64).tobytes()
    return 0


@_callback("_lb_block", "block")
def _block_cb(self: _Core, src: int, handle: int, seconds: float, blocked: Any) -> int:
    """Sleeps until what the core waits on progresses, where the transport can (gloo's waiter
    threads report completions; the core would starve them by spinning through ``test``)."""
    works = self.messages.waited_on(src, handle)
    blocked[0] = 1 if works and self.messages._block(works, seconds) else 0
    return 0
