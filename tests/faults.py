"""A 2-rank training job with one fault injected; run by tests/test_faults.py and
bench/reliability.py.

    mpiexec -n 2 python tests/faults.py SCENARIO

Each scenario prints ``FAULT <unix time>`` on the faulty rank just before the fault, so that the
driver can time the end of the job from it.  The job must end on every rank, with the cause.
"""
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layerbraid  # noqa: E402
from layerbraid.data import LayerParallelLoader  # noqa: E402
from layerbraid.nn import LayerParallelGRU  # noqa: E402
from nets import ODEResNet, batch  # noqa: E402

WORLD = MPI.COMM_WORLD


class InjectedFault(RuntimeError):
    pass


def fault_here():
    # one write with its newline: two faulty ranks' lines must not run into each other
    sys.stdout.write(f"FAULT {time.time():.3f}\n")
    sys.stdout.flush()


def fail_on(rank, where):
    if WORLD.Get_rank() == rank:
        fault_here()
        raise InjectedFault(f"injected fault on rank {rank} before {where}")


class FailingClose(nn.Module):
    def forward(self, x):
        fault_here()
        raise InjectedFault("injected fault in the close layer on the last rank")


class BadStep(ODEResNet):
    def step_layer(self, index):
        if index == self.num_steps - 1:
            fault_here()
            raise InjectedFault("injected fault in step_layer on the last rank")
        return super().step_layer(index)


# scenario: (what happens, text of the cause that the job's output must show)
SCENARIOS = {
    "loader": ("rank 1 raises before the loader's seed agreement",
               "InjectedFault: injected fault on rank 1"),
    "forward": ("rank 1 raises before a forward", "InjectedFault: injected fault on rank 1"),
    "backward": ("rank 1 raises between forward and backward",
                 "InjectedFault: injected fault on rank 1"),
    "clip": ("rank 1 raises before clip_grad_norm_", "InjectedFault: injected fault on rank 1"),
    "checkpoint": ("rank 1 raises before save_checkpoint",
                   "InjectedFault: injected fault on rank 1"),
    "close-layer": ("the close layer raises on the last rank",
                    "InjectedFault: injected fault in the close layer"),
    "step-layer": ("step_layer raises on the last rank while the model is built",
                   "InjectedFault: injected fault in step_layer"),
    "nan": ("the input holds Inf: named as bad input on every rank, before any step",
            "the input holds 256 NaN or Inf value(s)"),
    "skip-forward": ("rank 1 skips the last forward: a stall (timeout 3 s)",
                     "StallError: stalled: rank 0 waited"),
    "skip-backward": ("rank 1 skips the last backward: a stall in the MGRIT core (timeout 3 s)",
                      "StallError: stalled: rank 0 waited"),
    "sigint": ("Ctrl-C: SIGINT to mpiexec while training", "KeyboardInterrupt"),
    "kill": ("rank 1 is killed (SIGKILL) while training", "signal 9"),
    "rnn": ("rank 1 raises before a layer-parallel GRU forward",
            "InjectedFault: injected fault on rank 1"),
    "grid": ("rank 1 raises before a data-parallel model broadcasts its weights",
             "InjectedFault: injected fault on rank 1"),
}
TIMEOUT = 3  # LAYERBRAID_TIMEOUT for the stall scenarios


def run(scenario, ranks=2, limit=120):
    """Runs the job; returns {"rc", "seconds" (fault to the end of the job), "cause" (found in
    the output), "output"}."""
    import subprocess

    # Not the calling process's MPI job: a fresh one (no PMI variables of a singleton).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI"))}
    env.update(PYTHONUNBUFFERED="1", LAYERBRAID_TIMEOUT=str(TIMEOUT))
    proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, __file__, scenario],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, fault = [], None
    deadline = time.time() + limit
    for line in proc.stdout:  # the job's output, as it comes
        lines.append(line)
        found = re.search(r"FAULT (\d+\.\d+)", line)  # mpiexec may still join two ranks' lines
        if found and fault is None:
            fault = float(found.group(1))
            if scenario == "sigint":
                proc.send_signal(signal.SIGINT)
        if time.time() > deadline:
            proc.kill()
            break
    rc = proc.wait()
    end = time.time()
    output = "".join(lines)
    return {"rc": rc, "seconds": None if fault is None else end - fault,
            "cause": SCENARIOS[scenario][1] in output, "output": output}


def main(scenario):
    torch.set_default_dtype(torch.float64)
    x, y = batch(n=16)
    if scenario == "rnn":
        gru = LayerParallelGRU(3, 4, comm=WORLD)
        gru(torch.ones(2, 6, 3))[0].sum().backward()
        fail_on(1, "a GRU forward")
        gru(torch.ones(2, 6, 3))
    if scenario == "grid":
        grid = layerbraid.ProcessGrid(WORLD, data_parallel=WORLD.size)
        fail_on(1, "a data-parallel model's weight broadcast")
        ODEResNet(grid, num_steps=4)
    if scenario == "step-layer":
        BadStep(WORLD, num_steps=4)
    model = ODEResNet(WORLD, num_steps=4)
    if scenario == "close-layer" and WORLD.rank == WORLD.size - 1:
        model.close = FailingClose()
    if scenario == "loader":
        fail_on(1, "the loader's seed agreement")
    loader = LayerParallelLoader(TensorDataset(x, y), 4, comm=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 100000 if scenario in ("sigint", "kill") else 6
    batches = iter(loader)
    for step in range(steps):
        xb, yb = next(batches, (None, None))
        if xb is None:
            batches = iter(loader)
            xb, yb = next(batches)
        last = step == steps - 1
        if scenario == "forward" and step == 2:
            fail_on(1, "a forward")
        if scenario == "nan" and step == 2:
            fault_here()
            xb = xb * float("inf")
        if scenario == "skip-forward" and last and WORLD.rank == 1:
            fault_here()
            continue
        if scenario == "kill" and step == 3 and WORLD.rank == 1:
            fault_here()
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "sigint" and step == 3 and WORLD.rank == 0:
            fault_here()  # the driver sends SIGINT to mpiexec when it reads this
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        if scenario == "backward" and step == 2:
            fail_on(1, "the backward")
        if scenario == "skip-backward" and last and WORLD.rank == 1:
            fault_here()
            continue
        loss.backward()
        if scenario == "clip" and step == 2:
            fail_on(1, "clip_grad_norm_")
        layerbraid.clip_grad_norm_(model, 1.0)
        opt.step()
    path = WORLD.bcast(os.path.join(tempfile.gettempdir(), f"layerbraid-faults-{os.getpid()}.ckpt")
                       if WORLD.rank == 0 else None)
    if scenario == "checkpoint":
        fail_on(1, "save_checkpoint")
    layerbraid.save_checkpoint(model, path, opt)
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.unlink(path)
    print(f"rank {WORLD.rank}: no fault happened", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
