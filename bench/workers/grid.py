"""Time per batch and its parts on one data x layer grid; args: dp batches (a worker of bench/grid.py, run under mpiexec; prints JSON lines)."""
from bench import harness


def main():
    import json, sys, time, statistics
    import torch, torch.nn.functional as F

    from mpi4py import MPI
    import layerbraid
    MNISTNet = harness.example("mnist").MNISTNet
    harness.steady_allocator()  # plain PyTorch: 500-1,000 page faults per batch, 0 with it
    torch.set_num_threads(1)
    dp, batches = int(sys.argv[1]), int(sys.argv[2])
    comm = MPI.COMM_WORLD
    grid = layerbraid.ProcessGrid(comm, data_parallel=dp)
    o = lambda it: layerbraid.MGRITOptions(max_levels=2, cfactor=4, max_iters=it, nrelax=0, tol=0.0,
                                           skip_first_downcycle=True)
    torch.manual_seed(0)
    model = MNISTNet(grid, 8, 8, 1.0, o(2), o(1), False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    serial = model.to_serial()  # plain PyTorch, timed on rank 0 in the same job
    sopt = torch.optim.SGD(serial.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    rows, plain = [], []
    for k in range(batches + 1):
        x = torch.randn(64, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        idx = torch.randperm(64, generator=torch.Generator().manual_seed(k))
        idx = idx.tensor_split(dp)[grid.data_rank]  # this data group's share of the batch
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        total = time.perf_counter() - t0
        f, b = model.forward_stats, model.backward_stats
        row = dict(total=total, steps=f.step_seconds + b.step_seconds, mpi=f.comm_seconds + b.comm_seconds,
                   mgrit=(f.seconds + b.seconds) - (f.step_seconds + b.step_seconds) - (f.comm_seconds + b.comm_seconds))
        row["other"] = total - row["steps"] - row["mpi"] - row["mgrit"]
        if k > 0:
            rows.append(row)
        comm.Barrier()
        if comm.rank == 0:  # the whole batch of 64 through the serial network
            t0 = time.perf_counter()
            sopt.zero_grad()
            F.cross_entropy(serial(x), y).backward()
            sopt.step()
            if k > 0:
                plain.append(time.perf_counter() - t0)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    allm = comm.gather(med, root=0)
    totals = comm.gather([r["total"] for r in rows], root=0)
    if comm.rank == 0:
        slow = max(allm, key=lambda m: m["total"])
        print(json.dumps(dict(ranks=comm.size, dp=dp, layer=comm.size // dp, **slow,
                              plain=statistics.median(plain),
                              # per batch: the slowest rank's time, and plain PyTorch's after it
                              totals=[max(t) for t in zip(*totals)], plains=plain)))


if __name__ == "__main__":
    main()
