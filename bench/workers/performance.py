"""One row of docs/performance.md: time per training batch of the MNIST demo network, and its
gradient error against the serial network at the initial weights and after the timed batches
(a worker of bench/performance.py, run under mpiexec; prints one JSON line on rank 0).

    mpiexec -n 2 python -m bench.workers.performance lp --iters 2 1 --batches 20 --paired

MODE: plain (plain PyTorch), ddp (torch DistributedDataParallel, gloo), dp (layerbraid's
ProcessGrid, one data group per rank), lp (layer parallel on every rank).

With --paired every timed batch is paired with one of plain PyTorch on rank 0, in the same
process (a serial copy of the network with its own SGD, on a batch of 64; the other ranks wait
in a barrier meanwhile, so the reference runs with the machine as busy as in a 1-rank job), the
two in alternating order: the speedup of each pair then compares the two under the same state
of the machine, which separate jobs do not.
"""
import argparse
import copy
import json
import statistics
import sys
import time

from bench import harness


def _options(levels, iters, skip=True):
    import layerbraid

    return (layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=iters[0],
                                    skip_first_downcycle=skip),
            layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=iters[1],
                                    skip_first_downcycle=skip))


def _grad_error(model, serial, x, y, comm):
    """Relative parameter-gradient error of ``model`` against ``serial`` on one batch."""
    import torch.nn.functional as F

    model.zero_grad()
    serial.zero_grad()
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(serial(x), y).backward()
    ref = dict(serial.named_parameters())
    counted = {id(p) for p in model._counted_parameters()} if hasattr(
        model, "_counted_parameters") else None
    diff = norm = 0.0
    for name, p in model.named_parameters():
        if p.grad is None or (counted is not None and id(p) not in counted):
            continue
        diff += float((p.grad - ref[name].grad).double().square().sum())
        norm += float(ref[name].grad.double().square().sum())
    model.zero_grad()
    if comm is not None and comm.Get_size() > 1 and counted is not None:
        diff, norm = comm.allreduce(diff), comm.allreduce(norm)
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["plain", "ddp", "dp", "lp"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--iters", type=int, nargs=2, default=[2, 1])
    p.add_argument("--relax-first", action="store_true",
                   help="relax the first down-cycle instead of skipping it")
    p.add_argument("--microbatches", type=int, default=1,
                   help="lp: pipeline each batch's exact path in this many microbatches")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--paired", action="store_true",
                   help="time plain PyTorch (1 thread, rank 0) after or before every batch")
    a = p.parse_args(argv)
    harness.steady_allocator()
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.utils.data import TensorDataset

    import layerbraid
    from layerbraid.data import LayerParallelLoader, load_mnist

    torch.set_num_threads(a.threads)
    comm = MPI.COMM_WORLD
    ex = harness.example("mnist")
    data = load_mnist()
    fwd, bwd = _options(a.levels, a.iters, skip=not a.relax_first)
    dp = comm.Get_size() if a.mode in ("dp", "ddp") else 1
    grid = layerbraid.ProcessGrid(comm, data_parallel=dp)  # DDP: only for the loader's shards
    torch.manual_seed(0)
    model = ex.MNISTNet(grid if a.mode in ("dp", "lp") else MPI.COMM_SELF, 8, 8, 1.0, fwd, bwd,
                        False, microbatches=a.microbatches if a.mode == "lp" else 1)
    serial = model.to_serial()
    if a.mode == "plain":
        model = serial
    elif a.mode == "ddp":
        model = _ddp(copy.deepcopy(serial), comm)
    # The error at the initial weights, on one batch of 64 (each data group its half).
    x, y = data["train_x"][:64], data["train_y"][:64]
    half = slice(32 * grid.data_rank, 32 * grid.data_rank + 32) if dp > 1 else slice(None)
    err0 = _error(a.mode, model, serial, x, y, half, grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = LayerParallelLoader(TensorDataset(data["train_x"], data["train_y"]), 64 // dp,
                                 comm=grid, seed=0)
    paired = a.paired and a.mode != "plain"
    if paired:  # plain PyTorch's copy, trained alongside on its own batches of 64
        plain = (copy.deepcopy(model.module) if a.mode == "ddp" else model.to_serial())
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    times, plain_times = [], []
    for k, (xb, yb) in enumerate(loader):
        if k == a.warmup + a.batches:
            break
        plain_first = paired and k % 2 == 1
        if plain_first:
            plain_times.append(_plain_batch(plain, plain_opt, data, k, comm, a.threads))
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if paired:
            times[-1] = comm.allreduce(times[-1], op=MPI.MAX)  # the batch ends on its last rank
            if not plain_first:
                plain_times.append(_plain_batch(plain, plain_opt, data, k, comm, a.threads))
    times, plain_times = times[a.warmup:], plain_times[a.warmup:]
    slowest = max(comm.allgather(statistics.median(times)))
    if a.mode == "ddp":
        serial = copy.deepcopy(model.module)
    elif a.mode != "plain":
        serial = model.to_serial()
    err1 = _error(a.mode, model, serial, x, y, half, grid)
    out = {"seconds": slowest, "grad_error_init": err0, "grad_error_trained": err1}
    if paired:
        out["times"], out["plain_times"] = times, plain_times
    if a.mode == "lp":
        out["fwd_iters"] = model.forward_stats.iterations
        out["bwd_iters"] = model.backward_stats.iterations
    if comm.Get_rank() == 0:
        print(json.dumps(out), flush=True)


def _plain_batch(plain, opt, data, k, comm, threads):
    """Seconds of one training batch of plain PyTorch on rank 0 (1 thread; the batch of 64 at
    position ``k`` of the training set) while the other ranks wait; the same on every rank."""
    import torch
    import torch.nn.functional as F

    seconds = None
    comm.Barrier()
    if comm.Get_rank() == 0:
        x, y = data["train_x"][64 * k:64 * k + 64], data["train_y"][64 * k:64 * k + 64]
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        seconds = time.perf_counter() - t0
        torch.set_num_threads(threads)
    comm.Barrier()
    return comm.bcast(seconds, root=0)


def _ddp(model, comm):
    """``model`` in torch's DistributedDataParallel over gloo, on the loopback interface."""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    return DistributedDataParallel(model)


def _error(mode, model, serial, x, y, half, grid):
    if mode == "plain":
        return 0.0
    if mode in ("dp", "ddp"):
        return _dp_error(model, serial, x, y, half)
    return _grad_error(model, serial, x, y, grid.layer_comm)


def _dp_error(model, serial, x, y, half):
    """Data parallel: each group's half batch against serial PyTorch on the whole batch."""
    import torch.nn.functional as F

    model.zero_grad()
    serial.zero_grad()
    F.cross_entropy(model(x[half]), y[half]).backward()  # averaged over the 2 groups
    F.cross_entropy(serial(x), y).backward()
    ref = {n.removeprefix("module."): p for n, p in serial.named_parameters()}
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()
             if p.grad is not None]
    diff = sum(float((p.grad - ref[n].grad).double().square().sum()) for n, p in named)
    norm = sum(float(ref[n].grad.double().square().sum()) for n, p in named)
    model.zero_grad()
    return (diff / norm) ** 0.5


if __name__ == "__main__":
    worker(sys.argv[1:])
