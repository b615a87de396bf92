"""Spatial coarsening: time per batch and errors; args: size steps repeats (a worker of bench/spatial.py, run under mpiexec; prints JSON lines)."""


def main():
    import json, sys, time
    import torch
    from mpi4py import MPI
    import layerbraid
    from layerbraid.nn import ConvBlock
    torch.set_num_threads(1)
    size, steps, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = MPI.COMM_WORLD
    BATCH, CH = 2, 4
    class Net(layerbraid.LayerParallelModule):
        def __init__(self, fwd, bwd, spatial):
            super().__init__(num_steps=steps, comm=comm, forward_options=fwd, backward_options=bwd,
                             spatial=spatial)
        def step_layer(self, index):
            return ConvBlock(CH, dims=3)
    o = lambda it: layerbraid.MGRITOptions(max_levels=3, cfactor=4, max_iters=it, nrelax=1, tol=0.0,
                                           skip_first_downcycle=True)
    MODES = {"none": None, "state": layerbraid.SpatialCoarsening([1, 2], mode="state"),
             "branch": layerbraid.SpatialCoarsening([1, 2], mode="branch")}
    x = torch.randn(BATCH, CH, size, size, size, generator=torch.Generator().manual_seed(1))

    def timed(fn):
        comm.Barrier(); t0 = time.perf_counter(); r = fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX), r

    def rel(a, b):  # relative 2-norm error over lists of tensors spread over the ranks
        num = comm.allreduce(sum(float((p - q).pow(2).sum()) for p, q in zip(a, b)))
        den = comm.allreduce(sum(float(q.pow(2).sum()) for q in b))
        return (num / den) ** 0.5

    ref = None
    for name, sp in MODES.items():
        torch.manual_seed(0)
        model = Net(o(2), o(1), sp)
        model(torch.randn(BATCH, CH, 8, 8, 8)).sum().backward()  # warm-up on a small grid
        if ref is None:  # plain PyTorch on rank 0, once: the same weights for every mode
            serial = model.to_serial()
            def run_serial():
                xs = x.clone().requires_grad_(True)
                out = serial(xs); out.pow(2).mean().backward()
                return out.detach(), xs.grad
            if comm.rank == 0:
                se = []
                for k in range(repeats):
                    serial.zero_grad(); t0 = time.perf_counter(); out, gx = run_serial()
                    se.append(time.perf_counter() - t0)
                ref = (out, gx, {i: [p.grad.clone() for p in layer.parameters()]
                                 for i, layer in enumerate(serial.layers)})
            ref = comm.bcast(ref, root=0)
            serial_seconds = comm.bcast(min(se) if comm.rank == 0 else None, root=0)
            del serial
        def run_lp():
            xx = x.clone().requires_grad_(True)
            out = model(xx); out.pow(2).mean().backward()
            return out.detach(), xx.grad
        lp = []
        for k in range(repeats):
            model.zero_grad()
            t, (out, gx) = timed(run_lp)
            lp.append(t)
        mine = [i for i, _ in model.owned_steps()]
        err_p = rel([p.grad for i, layer in model.owned_steps() for p in layer.parameters()],
                    [g for i in mine for g in ref[2][i]])
        row = dict(size=size, steps=steps, ranks=comm.size, mode=name, seconds=min(lp),
                   serial_seconds=serial_seconds, repeats=repeats,
                   fwd_residuals=model.forward_stats.residual_norms,
                   err_output=float((out - ref[0]).norm() / ref[0].norm()),
                   err_input_grad=float((gx - ref[1]).norm() / ref[1].norm()) if gx is not None
                   else float("nan"),
                   err_param_grad=err_p)
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
