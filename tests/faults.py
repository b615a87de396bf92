"""A 2-rank job in which one rank raises just before a collective; run by tests/test_usage.py.

    mpiexec -n 2 python tests/faults.py SCENARIO

SCENARIO: the collective that rank 1 never reaches (``forward``, ``backward``, ``clip``,
``loader``).  Without the abort hook the other rank would wait in it forever.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layerbraid  # noqa: E402
from layerbraid.data import LayerParallelLoader  # noqa: E402
from nets import ODEResNet, batch  # noqa: E402


class InjectedFault(RuntimeError):
    pass


def fail_here(where):
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise InjectedFault(f"injected fault on rank 1 before {where}")


def main(scenario):
    torch.set_default_dtype(torch.float64)
    world = MPI.COMM_WORLD
    x, y = batch(n=8)
    model = ODEResNet(world, num_steps=4)
    if scenario == "loader":
        fail_here("the loader's seed agreement")
    loader = LayerParallelLoader(TensorDataset(x, y), 4, comm=model)
    for xb, yb in loader:
        if scenario == "forward":
            fail_here("the forward")
        loss = F.cross_entropy(model(xb), yb)
        if scenario == "backward":
            fail_here("the backward")
        loss.backward()
        if scenario == "clip":
            fail_here("clip_grad_norm_")
        layerbraid.clip_grad_norm_(model, 1.0)
    world.Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
