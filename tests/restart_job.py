"""A training job written as the guide's faults page shows: it checkpoints every 2 batches and
starts with ``layerbraid.checkpoint.resume``.  tests/test_restarts.py runs it under torchrun
with ``--max-restarts 1``, rank 1 killing itself (SIGKILL) before batch 5 of the first attempt,
and without the kill, and compares the two runs' final weights (float64, exact solves).

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/restart_job.py OUT KILL_AT
"""
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import layerbraid
from layerbraid.data import LayerParallelLoader
from nets import ODEResNet

TOTAL = 9  # batches: one epoch of 6 and half of the next


def main(out: str, kill_at: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    comm = layerbraid.launch.world()
    rank = comm.Get_rank()
    torch.manual_seed(0)
    model = ODEResNet(comm, num_steps=4)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 1, 8, 8, generator=g), torch.randint(0, 3, (48,), generator=g))
    loader = LayerParallelLoader(data, 8, comm=model, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = out + ".ckpt"
    extra = layerbraid.checkpoint.resume(model, ckpt, opt, loader)
    step = 0 if extra is None else extra["step"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"rank {rank} attempt {attempt} starts at batch {step}", flush=True)
    while step < TOTAL:
        for x, y in loader:
            if step == kill_at and attempt == 0 and rank == 1:
                print(f"rank {rank} is killed before batch {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step % 2 == 0:
                model.save_checkpoint(ckpt, opt, {"step": step}, loader=loader)
            if step == TOTAL:
                break
    state = model._gather_state()
    if rank == 0:
        torch.save(state, out)
    print(f"rank {rank} finished {TOTAL} batches", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
