"""The communicator the tests run on (a transport): MPI's COMM_WORLD under mpiexec (and alone),
torch's default process group (gloo) under torchrun.  `make test` runs the tests marked
both_transports a second time under torchrun."""
from mpi4py import MPI

from layerbraid._comm.world import torch_launch, world

WORLD = world()


def user_comm():
    """What a user passes as ``comm=``: torch.distributed's default ProcessGroup under
    torchrun (layerbraid wraps it), mpi4py's COMM_WORLD under mpiexec."""
    if torch_launch():
        import torch.distributed as dist

        return dist.group.WORLD
    return MPI.COMM_WORLD
