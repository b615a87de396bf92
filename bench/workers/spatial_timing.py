"""Spatial coarsening: time per batch and errors (a worker of bench/spatial.py, run under
mpiexec; prints JSON lines).

    spatial_timing.py SIZE STEPS ROUNDS

Plain PyTorch (rank 0, the same weights) and the three modes (no spatial coarsening, "state",
"branch") are timed one after another in each of ROUNDS rounds, so that a drift of the machine
hits every row alike; every round's time is kept.  The errors are those of the last round.
"""


def main():
    import json
    import sys
    import time

    import torch
    from mpi4py import MPI

    import layerbraid
    from bench.harness import steady_allocator
    from layerbraid.nn import ConvBlock

    steady_allocator()  # plain PyTorch took about 9,000 page faults per run on 2 ranks, 0 on 1
    torch.set_num_threads(1)
    size, steps, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = MPI.COMM_WORLD
    BATCH, CH = 2, 4

    class Net(layerbraid.LayerParallelModule):
        def __init__(self, fwd, bwd, spatial):
            super().__init__(num_steps=steps, comm=comm, forward_options=fwd,
                             backward_options=bwd, spatial=spatial)

        def step_layer(self, index):
            return ConvBlock(CH, dims=3)

    def options(iters):
        return layerbraid.MGRITOptions(max_levels=3, cfactor=4, max_iters=iters, nrelax=1,
                                       tol=0.0, skip_first_downcycle=True)

    modes = {"none": None, "state": layerbraid.SpatialCoarsening([1, 2], mode="state"),
             "branch": layerbraid.SpatialCoarsening([1, 2], mode="branch")}
    x = torch.randn(BATCH, CH, size, size, size, generator=torch.Generator().manual_seed(1))
    models = {}
    for name, sp in modes.items():
        torch.manual_seed(0)  # the same weights for every mode and for plain PyTorch
        models[name] = Net(options(2), options(1), sp)
        models[name](torch.randn(BATCH, CH, 8, 8, 8)).sum().backward()  # warm-up, small grid
    serial = models["none"].to_serial()  # collective; only rank 0 runs it
    if comm.rank == 0:
        serial(torch.randn(BATCH, CH, 8, 8, 8)).sum().backward()  # warm-up, small grid

    def run(model):
        model.zero_grad()
        xx = x.clone().requires_grad_(True)
        out = model(xx)
        out.pow(2).mean().backward()
        return out.detach(), xx.grad

    def timed(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        result = fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX), result

    def rel(a, b):  # relative 2-norm error over lists of tensors spread over the ranks
        num = comm.allreduce(sum(float((p - q).pow(2).sum()) for p, q in zip(a, b)))
        den = comm.allreduce(sum(float(q.pow(2).sum()) for q in b))
        return (num / den) ** 0.5

    plain, times, results = [], {m: [] for m in modes}, {}
    for _ in range(rounds):
        t, ref = timed(lambda: run(serial) if comm.rank == 0 else None)
        plain.append(t)
        for name, model in models.items():
            t, results[name] = timed(lambda: run(model))
            times[name].append(t)
    if comm.rank == 0:
        ref = (*ref, {i: [p.grad.clone() for p in layer.parameters()]
                      for i, layer in enumerate(serial.layers)})
    ref = comm.bcast(ref, root=0)
    for name, model in models.items():
        out, gx = results[name]
        mine = [i for i, _ in model.owned_steps()]
        err_p = rel([p.grad for i, layer in model.owned_steps() for p in layer.parameters()],
                    [g for i in mine for g in ref[2][i]])
        row = dict(size=size, steps=steps, ranks=comm.size, mode=name, seconds=times[name],
                   serial_seconds=plain, rounds=rounds,
                   fwd_residuals=model.forward_stats.residual_norms,
                   err_output=float((out - ref[0]).norm() / ref[0].norm()),
                   err_input_grad=float((gx - ref[1]).norm() / ref[1].norm())
                   if gx is not None else float("nan"),
                   err_param_grad=err_p)
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
