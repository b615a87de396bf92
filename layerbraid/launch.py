"""What every multi-rank job needs: the right launcher, and an uncaught exception or an early exit
on one rank ending the whole job (the stall timeout lives in ``_timeouts``).

The launch check and the process hooks run by themselves when a layer-parallel model, a
ProcessGrid, an MGRIT solver or a LayerParallelLoader is built; call them directly to get
them earlier.  :func:`install_process_hooks` is the one place that changes process-wide state
(besides :func:`steady_allocator`, which it calls, when called directly): importing layerbraid,
or any of its modules, changes none.
"""

import atexit
import os
import sys
import threading
import time
import traceback
from typing import Any, NoReturn, Optional

from mpi4py import MPI

from ._comm import mpi as _mpi
from ._comm import world as _world
from ._comm.timeouts import set_timeout  # public here as well
from .errors import RemoteRankError

__all__ = [
    "abort_on_exception",
    "check_launch",
    "install_process_hooks",
    "set_timeout",
    "steady_allocator",
    "world",
]

# Variables through which launchers promise a number of processes.  A job started by one
# launcher whose MPI library belongs to another (torchrun, or Open MPI's mpiexec with MPICH's
# libmpi) runs N independent one-rank jobs: each sees COMM_WORLD of size 1.
_PROMISES = [
    ("WORLD_SIZE", "torchrun / torch.distributed"),
    ("PMI_SIZE", "an MPICH-style launcher (PMI)"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec"),
    ("PMIX_SIZE", "a PMIx launcher"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's launcher"),
]


def world() -> Any:
    """The job's communicator, the default wherever layerbraid takes ``comm``: MPI's
    ``COMM_WORLD`` under mpiexec or srun (and in a plain one-process run); under torchrun the
    default torch.distributed process group (made from torchrun's environment unless the
    program made it first, with the stall deadline).  Either is returned as layerbraid's
    transport over it, with the same ``rank``, ``size``, ``allreduce``, ``bcast``,
    ``allgather``, ``gather`` and ``Barrier`` a training script uses from mpi4py."""
    return _world.world()


_checked = False
_hook_installed = False
_ENV_ABORT = "LAYERBRAID_ABORT_ON_EXCEPTION"


def _promised():
    """[(variable, launcher, processes)] that the environment promises."""
    out = []
    env = os.environ
    for var, who in _PROMISES:
        v = env.get(var, "")
        if v.strip().isdigit():
            out.append((var, who, int(v)))
    # srun sets the step's task count in every task; SLURM_NTASKS alone is also set inside a
    # batch script that may well start a smaller mpiexec, so it promises nothing.
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        out.append(("SLURM_STEP_NUM_TASKS", "srun", int(env["SLURM_STEP_NUM_TASKS"])))
    return out


def check_launch(world: Optional[MPI.Intracomm] = None) -> None:
    """Raises ``RuntimeError`` if the environment promises more processes than the MPI world has.

    ``torchrun --nproc_per_node 2 train.py`` (or a launcher from another MPI than mpi4py's)
    under a launcher of another MPI than mpi4py's starts processes that each see a world of
    one rank: they would silently train separate copies and overwrite each other's files.
    Launch with ``mpiexec -n N`` / ``mpirun`` from the MPI that mpi4py uses
    (``.venv/bin/mpiexec`` with the pip ``mpich`` wheel), or ``srun --mpi=pmi2`` /
    ``--mpi=pmix`` on Slurm.  A job started by torchrun is not one of these: it runs on
    torch.distributed (gloo, NCCL), and passes.
    """
    global _checked
    if world is None and _world.torch_launch():
        _checked = True  # torch.distributed carries the job (Note [store notices] in _comm)
        return
    world = MPI.COMM_WORLD if world is None else world
    size = world.Get_size()
    bad = [(var, who, n) for var, who, n in _promised() if n > size]
    if bad:
        var, who, n = bad[0]
        raise RuntimeError(
            f"this process was started by {who} ({var}={n}) but its MPI world has {size} "
            f"rank(s): the processes are not one MPI job and would each train alone.  Launch "
            f"with the MPI that mpi4py uses, e.g. `mpiexec -n {n} python script.py` (with the "
            f"pip mpich wheel: `.venv/bin/mpiexec`), or `srun --mpi=pmi2 ...` on Slurm, or "
            f"with torchrun (torch.distributed)."
        )
    _checked = True


def abort_on_exception(enabled: bool = True) -> None:
    """Makes an uncaught exception on any rank end the whole job (on by default in a job of 2+
    ranks, installed with the first model, grid, solver or loader).

    The hook prints the traceback (as Python would), then calls ``MPI.COMM_WORLD.Abort(1)``, so
    the other ranks do not wait forever in a collective that this rank will never join.  Turn
    it off with ``abort_on_exception(False)`` or ``LAYERBRAID_ABORT_ON_EXCEPTION=0`` (e.g. when
    the program runs under a launcher that already does this, like ``python -m mpi4py``).
    """
    global _switched_off
    _switched_off = not enabled
    _set_abort_hooks(enabled)


def install_process_hooks() -> None:
    """Makes every process-wide change layerbraid makes, and is the only code that makes one.

    Called (once, idempotent) by the first model, grid, solver or loader built in a job of 2+
    ranks, unless ``LAYERBRAID_ABORT_ON_EXCEPTION=0`` is set or ``abort_on_exception(False)``
    was called first: then it changes nothing.  Collective over ``MPI.COMM_WORLD`` the first
    time (it duplicates the world communicator for the exit notices).  The changes:

    1. ``sys.excepthook``: print the traceback as Python would, then abort every rank of the
       job (``MPI.COMM_WORLD.Abort``), so that no rank waits for this one forever.
    2. ``threading.excepthook``: the same for an uncaught exception in a thread.
    3. ``sys.exit`` wrapped: it records the exit status, for the exit notice.
    4. An ``atexit`` handler: at exit while other ranks still run, tell the ranks that share a
       layerbraid communicator with this one (Note [exit notices] in ``_comm``).
    5. glibc's malloc keeps the memory the process frees (:func:`steady_allocator`), unless
       ``LAYERBRAID_STEADY_ALLOCATOR=0`` is set.

    ``abort_on_exception(False)`` undoes 1 and 2; 3, 4 and 5 stay (3 and 4 are inert once every
    rank has exited alike).
    """
    if _mpi.notices_started() or _dist_notices[0]:
        _set_abort_hooks(True)
        return
    _set_abort_hooks(True)
    if os.environ.get(_ENV_ALLOCATOR, "1") != "0":
        steady_allocator()
    if _world.torch_launch():
        _dist_notices[0] = True  # the store carries them: nothing to build
        at_exit = _torch_at_exit
    else:
        _mpi._start_notices()  # collective: the notices' communicator
        at_exit = _mpi.at_exit
    real_exit = sys.exit

    def exit(status: Any = None) -> NoReturn:
        _mpi.record_exit_status(status)
        real_exit(status)

    exit.__doc__ = real_exit.__doc__
    sys.exit = exit
    atexit.register(at_exit)


_dist_notices = [False]
_ENV_ALLOCATOR = "LAYERBRAID_STEADY_ALLOCATOR"
_steady = [False]  # whether steady_allocator changed malloc's settings in this process
# glibc's own ways to set what steady_allocator sets: where the user chose, it leaves malloc be
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
_MALLOC_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold")


def steady_allocator() -> bool:
    """Makes glibc's malloc keep the memory this process frees: no trimming of the heap, and
    blocks up to 32 MiB (glibc's most) from the heap rather than from mmap.  Returns whether it
    changed anything.

    A training process frees and allocates the same blocks every batch.  glibc's defaults give
    freed memory at the top of the heap back to the OS, and the next batch pays a page fault
    per 4 KiB to get it again.  The layer-parallel paths free more blocks between their
    allocations than plain PyTorch (microbatches, messages, split VJPs): on the MNIST example
    in 2 microbatches on 2 ranks, 480-1,000 page faults per batch on the first rank (up to
    1,400 on the second) against 290 for plain PyTorch's whole step, and 0-2 with this setting,
    which took the layer-parallel forward and backward from 30.0 to 28.5 ms (medians of eight
    alternating runs of 150 batches, each run faster).  The cost: the process keeps its peak
    heap, as torch's CUDA caching allocator keeps its peak GPU memory.

    :func:`install_process_hooks` calls it in every job of 2+ ranks
    (``LAYERBRAID_STEADY_ALLOCATOR=0`` turns that off); call it in a one-process run that should
    allocate as those do (a benchmark's plain PyTorch row).  It changes nothing where the C
    library is not glibc, or where the environment already sets glibc's trim or mmap threshold
    (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``)."""
    import ctypes
    import ctypes.util

    if any(var in os.environ for var in _MALLOC_VARIABLES) or any(
        name in os.environ.get("GLIBC_TUNABLES", "") for name in _MALLOC_TUNABLES
    ):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    # the mmap threshold first: a trim threshold alone would stop glibc raising the mmap
    # threshold as blocks are freed, and every block over 128 KiB would be mmapped afresh
    if not mallopt(m_mmap_threshold, ctypes.c_int(2**25)):  # glibc's most on 64-bit
        return False
    mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1))
    _steady[0] = True
    return True


def _torch_at_exit() -> None:
    from ._comm import dist

    dist.at_exit(_mpi._describe_exit(), _mpi._notices["exit"] not in (None, 0))


def _set_abort_hooks(on: bool) -> None:
    """Installs (or restores what was there before) the two exception hooks."""
    global _hook_installed
    if on and not _hook_installed:
        _previous["sys"], _previous["threading"] = sys.excepthook, threading.excepthook
        sys.excepthook = _abort_hook
        threading.excepthook = _abort_thread_hook
        _hook_installed = True
    elif not on and _hook_installed:
        sys.excepthook = _previous["sys"]
        threading.excepthook = _previous["threading"]
        _hook_installed = False


_previous: dict[str, Any] = {}
_switched_off = False


def _abort(code: int = 1, why: str = "") -> None:
    if _world.torch_launch():
        # No MPI_Abort across a torchrun job: tell the others through the store (a rank that
        # waits raises RemoteRankError with the cause), then end this process; torchrun ends
        # the ranks that do not wait.
        from ._comm import dist

        dist.post_notice(why or f"exit status {code}")
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)  # the notices first: a waiting rank names the cause, not a crash
        os._exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        # The launcher forwards each rank's output through a pipe; an abort tears the job down
        # at once and can drop the traceback still in transit.  A moment lets it through.
        time.sleep(0.5)
    finally:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)


def _rank():
    if _world.torch_launch():
        from ._comm import dist

        return dist.world().Get_rank()
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else "?"


def _abort_hook(exc_type, exc, tb) -> None:
    rank = _rank()
    if isinstance(exc, RemoteRankError):
        # Another rank's error, relayed: that rank prints the traceback that matters; here
        # one line says what and where this rank was (not a traceback through layerbraid).
        print(f"{exc_type.__name__} on rank {rank}{_user_frame(tb)}: {exc}", file=sys.stderr)
    else:
        _previous["sys"](exc_type, exc, tb)
    print(
        f"layerbraid: uncaught {exc_type.__name__} on rank {rank}: aborting every rank of the job",
        file=sys.stderr,
        flush=True,
    )
    if getattr(exc, "origin_raised", False):
        # This rank only relays another rank's exception, whose own hook aborts the job with
        # its traceback: let that abort come first, so that no rank's traceback is cut short.
        time.sleep(_RELAY_PAUSE)
    _abort(
        130 if issubclass(exc_type, KeyboardInterrupt) else 1,
        f"uncaught {exc_type.__name__}: {exc}",
    )


_RELAY_PAUSE = 2.0
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frame(tb) -> str:
    """' (at FILE:LINE, in FUNC)' for the innermost frame of ``tb`` outside layerbraid and
    torch (the user's call that was waiting), or ''."""
    import torch

    skip = (_PACKAGE, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    found = ""
    for frame, line in traceback.walk_tb(tb):
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            found = f" (at {name}:{line}, in {frame.f_code.co_name})"
    return found


def _abort_thread_hook(args) -> None:
    _previous["threading"](args)
    if args.exc_type is not SystemExit:
        _abort(1, f"uncaught {args.exc_type.__name__} in a thread: {args.exc_value}")


def _enter() -> None:
    """Called by every entry point that starts collectives: the launch check, once, and the
    abort hook in a job of 2+ ranks (unless switched off)."""
    if not _checked:
        check_launch()
    # Not skipped when abort_on_exception() came first: the exit notices start here.
    if (
        _world.world().Get_size() > 1
        and os.environ.get(_ENV_ABORT, "1") != "0"
        and not _switched_off
    ):
        install_process_hooks()
