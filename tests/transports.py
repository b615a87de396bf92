"""The communicator the tests run on: MPI's COMM_WORLD under mpiexec (and alone), torch's
default process group (gloo) under torchrun.  `make test` runs the tests marked
both_transports a second time under torchrun."""
from layerbraid._comm.mpi import world

WORLD = world()
