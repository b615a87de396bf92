"""Which transport a job runs on, and the one place that turns what a user passes as ``comm=``
into a :class:`Transport`."""

import sys
from typing import Any

from mpi4py import MPI

from .base import Transport

__all__ = ["Comm", "is_comm", "resolve", "torch_launch", "world"]

# What layerbraid takes as a communicator: a Transport, an mpi4py intracommunicator
# (COMM_WORLD, a Split of it, ...) or a torch.distributed ProcessGroup; resolve() makes it a
# Transport.
Comm = Any


def torch_launch() -> bool:
    """Whether this job's ranks talk through torch.distributed: started by torchrun (its MPI
    world then has one rank), or with a default process group that the program made itself."""
    if MPI.COMM_WORLD.Get_size() > 1:
        return False
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        return True
    from . import dist

    return dist.launched_by_torchrun()


def world() -> Transport:
    """The default communicator: MPI's COMM_WORLD, or under torchrun the default process group
    (made from the launcher's environment if the program has not made it)."""
    if torch_launch():
        from . import dist

        return dist.world()
    from . import mpi

    return mpi.world()


def resolve(comm: Any) -> Any:
    """The transport of what a user passed: None is :func:`world`, an mpi4py communicator
    becomes an MPIComm, a torch.distributed ProcessGroup a DistComm; anything else (a
    ProcessGrid, a wrong type for the caller to refuse) is returned as it is."""
    if comm is None:
        return world()
    if isinstance(comm, Transport):
        return comm
    if isinstance(comm, MPI.Intracomm):
        from . import mpi

        return mpi.wrap(comm)
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and isinstance(comm, dist_mod.ProcessGroup):
        from . import dist

        return dist.as_comm(comm)
    return comm


def is_comm(obj: Any) -> bool:
    """Whether ``obj`` is a communicator layerbraid takes (after :func:`resolve`)."""
    return isinstance(obj, Transport)
