"""Run from an installed wheel, outside the source tree: every subpackage imports, and a 2-rank
layer-parallel forward+backward equals the serial network (float64, one MGRIT level).

    mpiexec -n 2 python wheel_smoke.py SOURCE_TREE
"""
import importlib
import os
import pkgutil
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid

source = os.path.realpath(sys.argv[1])
installed = os.path.realpath(os.path.dirname(layerbraid.__file__))
assert not installed.startswith(source + os.sep), f"imported {installed} from the source tree"
names = [m.name for m in pkgutil.walk_packages(layerbraid.__path__, "layerbraid.")]
for name in names:
    importlib.import_module(name)
for sub in ("layerbraid.nn", "layerbraid.data", "layerbraid.depth", "layerbraid._mgrit_core"):
    assert sub in names, f"{sub} is missing from the installed package"
assert os.path.exists(os.path.join(installed, "py.typed")), "py.typed is missing (PEP 561)"

from layerbraid.nn import ConvBlock  # noqa: E402

torch.set_default_dtype(torch.float64)


class Net(layerbraid.LayerParallelModule):
    def __init__(self):
        super().__init__(num_steps=6, t_final=1.0, comm=MPI.COMM_WORLD)
        self.open = nn.Conv2d(1, 3, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 4))

    def step_layer(self, index):
        return ConvBlock(3)


torch.manual_seed(0)
model = Net()
serial = model.to_serial()
x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 4, (5,))
F.cross_entropy(model(x), y).backward()
F.cross_entropy(serial(x), y).backward()
named = dict(serial.named_parameters())
for name, p in model.named_parameters():
    if p.grad is not None:
        torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-12, atol=1e-12)
checked = MPI.COMM_WORLD.allreduce(sum(p.grad is not None for p in model.parameters()))
assert checked == len(named), (checked, len(named))
if MPI.COMM_WORLD.Get_rank() == 0:
    print(f"wheel smoke: {len(names)} modules imported from {installed}; "
          f"2-rank gradients of {checked} parameters equal serial")
