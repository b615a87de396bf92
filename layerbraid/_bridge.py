"""The only module that touches the compiled MGRIT core.

States live in a table kept here (an int id per state); the C core sees only the ids.  The
callbacks below run the vector operations on numpy arrays or torch tensors, and turn a Python
exception into a nonzero return code: the core then stops computing, tells the other ranks, and
returns, and `_Core.solve` re-raises the original exception on this rank (Note [poisoned messages]
in cbridge/src/comm.c).
"""
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np

# mpi4py first: it loads the MPI library, which the extension then links to by soname (Note
# [finding libmpi at run time] in cbridge/build_mgrit.py).
from mpi4py import MPI as _MPI  # noqa: F401

from ._mgrit_core import ffi, lib  # noqa: E402
from .errors import DivergenceError, MGRITError, RemoteRankError

__all__ = []

_OPS = ("fstep", "cstep", "rstep", "gstep", "correct", "send", "recv", "norm", "init", "seqstep")


@dataclass(frozen=True)
class TraceEntry:
    """One action of the schedule: (level, op, point index, peer rank, done)."""

    level: int
    op: str
    index: int
    peer: int
    done: bool


# ---------------------------------------------------------------- vector operations
_NP_DTYPES = [np.dtype(t) for t in ("float64", "float32", "float16", "complex128", "complex64",
                                    "int64", "int32", "int16", "int8", "uint8", "bool")]
_TORCH_DTYPE_NAMES = ["float64", "float32", "float16", "bfloat16", "complex128", "complex64",
                      "int64", "int32", "int16", "int8", "uint8", "bool"]


def _torch():
    """torch if the program imported it (a state can only be a tensor then), else None.  Keeps
    numpy-only users from paying for torch's import."""
    return sys.modules.get("torch")


def _is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _as_state(x):
    """numpy scalars and Python numbers become 0-d arrays; arrays and tensors pass."""
    if _is_torch(x) or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (np.generic, int, float, complex)):
        return np.asarray(x)
    raise TypeError(f"an MGRIT state must be a numpy array or a torch tensor, got {type(x).__name__}")


def _clone(x):
    return x.clone() if _is_torch(x) else x.copy()


def _norm(x):
    if _is_torch(x):
        torch = _torch()
        return float(torch.linalg.vector_norm(x.detach().reshape(-1), dtype=torch.float64)
                     if x.is_floating_point() else torch.linalg.vector_norm(x.double()))
    return float(np.linalg.norm(np.asarray(x, dtype=np.complex128 if np.iscomplexobj(x)
                                          else np.float64).reshape(-1)))


def _header(x):
    """kind, dtype code and shape, padded to a multiple of 8 bytes."""
    if _is_torch(x):
        kind, code = 1, _TORCH_DTYPE_NAMES.index(str(x.dtype).replace("torch.", ""))
    else:
        kind, code = 0, _NP_DTYPES.index(x.dtype)
    head = struct.pack(f"<BBH{x.ndim}q", kind, code, x.ndim, *x.shape)
    return head + b"\0" * (-len(head) % 8)


def _raw_bytes(x):
    """The state's bytes as a uint8 numpy array (CUDA tensors are staged through host memory)."""
    if _is_torch(x):
        torch = _torch()
        flat = x.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        return flat.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _from_bytes(buf, device):
    kind, code, ndim = struct.unpack_from("<BBH", buf, 0)
    shape = struct.unpack_from(f"<{ndim}q", buf, 4)
    off = 4 + 8 * ndim
    off += -off % 8
    payload = np.frombuffer(buf, dtype=np.uint8, offset=off).copy()
    if kind == 0:
        return payload.view(_NP_DTYPES[code]).reshape(shape)
    import torch

    dtype = getattr(torch, _TORCH_DTYPE_NAMES[code])
    t = torch.from_numpy(payload)
    t = t.to(torch.bool) if dtype == torch.bool else t.view(dtype)
    t = t.reshape(shape)
    return t.to(device) if device is not None and device.type != "cpu" else t


# ---------------------------------------------------------------- the solver handle
class _Core:
    """One MGRIT solver over a communicator.

    Args:
        comm: an mpi4py communicator.
        num_steps, t_start, t_stop: the fine time grid.
        options: an MGRITOptions.
        init: ``init(t, index) -> state``: the initial value at index 0, the guess elsewhere.
        step: ``step(u, t_start, t_stop, level, index, done) -> state`` (must not modify u).
        trace: record the schedule.
        coarsen, refine: optional spatial transfers ``coarsen(x, level)`` (level -> level+1)
            and ``refine(e, level)`` (level -> level-1).
        store_all: keep every fine point (else only what the cycles read again).
        mirror: give the extra steps (N % P) to the last ranks instead of the first, for a solve
            backward in time on the reversed communicator.
    """

    def __init__(self, comm, num_steps, t_start, t_stop, options, init, step, trace=False,
                 mirror=False, coarsen=None, refine=None, store_all=True):
        from mpi4py import MPI

        self._init_fn, self._step_fn = init, step
        self._coarsen_fn, self._refine_fn = coarsen, refine
        self._table = {}
        self._next = 0
        self._error = None
        self._device = None
        self.step_seconds = 0.0
        self.comm = comm
        self.rank = comm.Get_rank()
        self._handle = ffi.new_handle(self)
        cbs = ffi.new("mgrit_callbacks *")
        cbs.init, cbs.clone, cbs.free = lib._lb_init, lib._lb_clone, lib._lb_free
        cbs.sum, cbs.norm, cbs.step = lib._lb_sum, lib._lb_norm, lib._lb_step
        cbs.bufsize, cbs.pack, cbs.unpack = lib._lb_bufsize, lib._lb_pack, lib._lb_unpack
        if coarsen is not None:
            cbs.coarsen = lib._lb_coarsen
        if refine is not None:
            cbs.refine = lib._lb_refine
        self._cbs = cbs
        out = ffi.new("mgrit_core **")
        comm_ptr = ffi.cast("MPI_Comm *", MPI._addressof(comm))
        rc = lib.mgrit_create(comm_ptr, int(num_steps), float(t_start), float(t_stop), cbs,
                              self._handle, out)
        if rc != lib.MGRIT_OK:
            raise ValueError(f"cannot create an MGRIT solver for num_steps={num_steps!r}, "
                             f"t_start={t_start!r}, t_stop={t_stop!r}")
        self._core = out[0]
        self._set_options(options, trace)
        self._check(lib.mgrit_set_mirror(self._core, int(bool(mirror))))
        self._check(lib.mgrit_set_store_all(self._core, int(bool(store_all))))

    def _check(self, rc):
        if rc != lib.MGRIT_OK:
            raise ValueError(ffi.string(lib.mgrit_error_message(self._core)).decode())

    def _set_options(self, o, trace):
        _configure(self._core, o, trace)

    def close(self):
        if getattr(self, "_core", None) is not None:
            lib.mgrit_destroy(self._core)
            self._core = None
        self._table.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # table
    def _put(self, x):
        x = _as_state(x)
        if self._device is None and _is_torch(x):
            self._device = x.device
        i = self._next
        self._next += 1
        self._table[i] = x
        return i

    def _fail(self, exc, where):
        if self._error is None:
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {self.rank} in the MGRIT {where} callback)")
            self._error = exc
        return 1

    def _raise(self, rc):
        """Raise the error of status rc on this rank; with the failing rank's message on all."""
        msg = ffi.string(lib.mgrit_error_message(self._core)).decode()
        if rc in (lib.MGRIT_ERR_CALLBACK, lib.MGRIT_ERR_REMOTE):
            # Every rank knows the failing rank now: it tells the others what went wrong.
            failed = lib.mgrit_failed_rank(self._core)
            err, self._error = self._error, None
            text = None
            if err is not None:
                text = f"{type(err).__name__}: {err}"
            if 0 <= failed < self.comm.Get_size():
                text = self.comm.bcast(text, root=failed)
            if rc == lib.MGRIT_ERR_CALLBACK and err is not None:
                raise err
            raise RemoteRankError(f"{msg}: {text}" if text else msg, failed)
        if rc == lib.MGRIT_ERR_NAN:
            raise DivergenceError(msg)
        if rc in (lib.MGRIT_ERR_ARG, lib.MGRIT_ERR_MISMATCH):
            raise ValueError(msg)
        if rc == lib.MGRIT_ERR_NOMEM:
            raise MemoryError(msg or "the MGRIT core ran out of memory")
        raise MGRITError(msg or f"the MGRIT core failed with status {rc}")

    def set_trace(self, on):
        """Record the schedule of the following solves (see ``trace()``)."""
        self._check(lib.mgrit_set_trace(self._core, int(bool(on))))

    def setup(self):
        """Checks the options across ranks and builds the levels (collective)."""
        rc = lib.mgrit_setup(self._core)
        if rc != lib.MGRIT_OK:
            self._raise(rc)

    def level_info(self):
        """[(first owned point, last owned point, stride)] per level, after setup or a solve."""
        out = []
        for level in range(lib.mgrit_num_levels(self._core)):
            lo, hi = self.owned(level)
            out.append((lo, hi, lib.mgrit_level_stride(self._core, level)))
        return out

    # solve
    def solve(self):
        """Runs the solve; returns (iterations, residual norms).  Raises on every rank on error."""
        self._error = None
        self.step_seconds = 0.0
        rc = lib.mgrit_solve(self._core)
        if rc != lib.MGRIT_OK:
            self._raise(rc)
        n = lib.mgrit_num_norms(self._core)
        norms = lib.mgrit_norms(self._core)
        return lib.mgrit_iterations(self._core), [norms[k] for k in range(n)]

    def comm_seconds(self):
        """Seconds spent in the core's MPI calls (waiting included) in the last solve."""
        return lib.mgrit_comm_seconds(self._core)

    def owned(self, level=0):
        lo, hi = ffi.new("int64_t *"), ffi.new("int64_t *")
        lib.mgrit_owned(self._core, level, lo, hi)
        return lo[0], hi[0]

    def num_levels(self):
        return lib.mgrit_num_levels(self._core)

    def states(self):
        """{fine index: state} for the points this rank owns, after a solve."""
        lo, hi = self.owned(0)
        out = {}
        for i in range(lo, hi + 1):
            vid = lib.mgrit_state(self._core, i)
            if vid >= 0:
                out[i] = self._table[vid]
        return out

    def trace(self):
        n = lib.mgrit_trace_length(self._core)
        t = lib.mgrit_trace(self._core)
        return [TraceEntry(t[k].level, _OPS[t[k].op], t[k].index, t[k].peer, bool(t[k].done))
                for k in range(n)]


# ---------------------------------------------------------------- virtual ranks
TRACE_DTYPE = np.dtype([("level", "<i4"), ("op", "<i4"), ("index", "<i8"), ("peer", "<i4"),
                        ("done", "<i4")])
OPS = _OPS


def virtual_schedule(num_steps, size, options, mirror=False):
    """The schedule each of ``size`` ranks would run (without running it): a list, per rank, of
    structured arrays (TRACE_DTYPE; `op` indexes OPS).  Every solve runs options.max_iters
    iterations (a virtual rank has no residual to stop on)."""
    if TRACE_DTYPE.itemsize != ffi.sizeof("mgrit_trace_entry"):
        raise RuntimeError("trace entry layout mismatch")
    out = []
    ptr = ffi.new("mgrit_core **")
    for rank in range(size):
        rc = lib.mgrit_create_virtual(int(num_steps), 0.0, 1.0, rank, int(size), ptr)
        if rc != lib.MGRIT_OK:
            raise ValueError(f"cannot plan num_steps={num_steps!r} on {size!r} ranks")
        core = ptr[0]
        try:
            _configure(core, options, trace=True)
            lib.mgrit_set_mirror(core, int(bool(mirror)))
            rc = lib.mgrit_solve(core)
            if rc != lib.MGRIT_OK:
                raise ValueError(ffi.string(lib.mgrit_error_message(core)).decode())
            n = lib.mgrit_trace_length(core)
            buf = ffi.buffer(lib.mgrit_trace(core), n * TRACE_DTYPE.itemsize)
            out.append(np.frombuffer(buf, dtype=TRACE_DTYPE).copy())
        finally:
            lib.mgrit_destroy(core)
    return out


def _configure(c, o, trace):
    def check(rc):
        if rc != lib.MGRIT_OK:
            raise ValueError(ffi.string(lib.mgrit_error_message(c)).decode())
    check(lib.mgrit_set_max_levels(c, o.max_levels))
    cfs, nrs = o.cfactors(), o.nrelaxes()
    check(lib.mgrit_set_cfactors(c, len(cfs), ffi.new("int[]", list(cfs))))
    check(lib.mgrit_set_nrelax(c, len(nrs), ffi.new("int[]", list(nrs))))
    check(lib.mgrit_set_max_iters(c, o.max_iters))
    check(lib.mgrit_set_tol(c, o.tol))
    check(lib.mgrit_set_skip(c, int(o.skip_first_downcycle)))
    check(lib.mgrit_set_cycle(c, lib.MGRIT_CYCLE_F if o.cycle == "F" else lib.MGRIT_CYCLE_V))
    check(lib.mgrit_set_min_coarse(c, o.min_coarse))
    check(lib.mgrit_set_final_fc(c, int(o.final_fc_relax)))
    check(lib.mgrit_set_trace(c, int(bool(trace))))


# ---------------------------------------------------------------- callbacks
@ffi.def_extern()
def _lb_init(app, t, index, out):
    self = ffi.from_handle(app)
    try:
        out[0] = self._put(self._init_fn(t, index))
        return 0
    except BaseException as exc:
        return self._fail(exc, "init")


@ffi.def_extern()
def _lb_clone(app, x, out):
    self = ffi.from_handle(app)
    try:
        out[0] = self._put(_clone(self._table[x]))
        return 0
    except BaseException as exc:
        return self._fail(exc, "clone")


@ffi.def_extern()
def _lb_free(app, x):
    self = ffi.from_handle(app)
    self._table.pop(x, None)
    return 0


@ffi.def_extern()
def _lb_sum(app, alpha, x, beta, y):
    self = ffi.from_handle(app)
    try:
        tx, ty = self._table[x], self._table[y]
        # Out of place: a step may return its input, so two ids can share one object.
        if alpha == 1.0 and beta == 1.0:
            self._table[y] = tx + ty
        elif beta == 1.0:
            self._table[y] = ty + alpha * tx
        else:
            self._table[y] = alpha * tx + beta * ty
        return 0
    except BaseException as exc:
        return self._fail(exc, "sum")


@ffi.def_extern()
def _lb_norm(app, x, out):
    self = ffi.from_handle(app)
    try:
        out[0] = _norm(self._table[x])
        return 0
    except BaseException as exc:
        return self._fail(exc, "norm")


@ffi.def_extern()
def _lb_step(app, u, tstart, tstop, level, index, done, out):
    self = ffi.from_handle(app)
    try:
        x = self._table[u]
        t0 = time.perf_counter()
        y = _as_state(self._step_fn(x, tstart, tstop, level, index, bool(done)))
        self.step_seconds += time.perf_counter() - t0
        if y.shape != x.shape:
            raise ValueError(f"the step at level {level}, fine index {index} (t={tstart:g} to "
                             f"{tstop:g}) returned a state of shape {tuple(y.shape)}, but its "
                             f"input has shape {tuple(x.shape)}: a step must keep the shape")
        if y.dtype != x.dtype:
            raise TypeError(f"the step at level {level}, fine index {index} returned dtype "
                            f"{y.dtype}, but its input has dtype {x.dtype}: a step must keep "
                            "the dtype")
        out[0] = self._put(y)
        return 0
    except BaseException as exc:
        return self._fail(exc, "step")


@ffi.def_extern()
def _lb_bufsize(app, x, out):
    self = ffi.from_handle(app)
    try:
        s = self._table[x]
        out[0] = len(_header(s)) + s.nbytes if not _is_torch(s) else \
            len(_header(s)) + s.numel() * s.element_size()
        return 0
    except BaseException as exc:
        return self._fail(exc, "bufsize")


@ffi.def_extern()
def _lb_pack(app, x, buf, nbytes):
    self = ffi.from_handle(app)
    try:
        s = self._table[x]
        head = _header(s)
        dst = np.frombuffer(ffi.buffer(buf, nbytes), dtype=np.uint8)
        dst[:len(head)] = np.frombuffer(head, dtype=np.uint8)
        dst[len(head):] = _raw_bytes(s)
        return 0
    except BaseException as exc:
        return self._fail(exc, "pack")


@ffi.def_extern()
def _lb_unpack(app, buf, nbytes, out):
    self = ffi.from_handle(app)
    try:
        out[0] = self._put(_from_bytes(ffi.buffer(buf, nbytes), self._device))
        return 0
    except BaseException as exc:
        return self._fail(exc, "unpack")


@ffi.def_extern()
def _lb_coarsen(app, x, level, out):
    self = ffi.from_handle(app)
    try:
        out[0] = self._put(self._coarsen_fn(self._table[x], level))
        return 0
    except BaseException as exc:
        return self._fail(exc, "coarsen")


@ffi.def_extern()
def _lb_refine(app, x, level, out):
    self = ffi.from_handle(app)
    try:
        out[0] = self._put(self._refine_fn(self._table[x], level))
        return 0
    except BaseException as exc:
        return self._fail(exc, "refine")
