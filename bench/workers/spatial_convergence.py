"""Spatial coarsening: residual history of a converging solve; args: size steps iters (a worker of bench/spatial.py, run under mpiexec; prints JSON lines)."""


def main():
    import json, sys
    import torch

    import layerbraid
    from layerbraid.nn import ConvBlock
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    size, steps, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    class Net(layerbraid.LayerParallelModule):
        def __init__(self, opts, spatial):
            super().__init__(num_steps=steps, forward_options=opts, spatial=spatial)
        def step_layer(self, index):
            return ConvBlock(4, dims=3)
    opts = layerbraid.MGRITOptions(max_levels=3, cfactor=4, max_iters=iters, nrelax=1, tol=0.0,
                                   skip_first_downcycle=True)
    x = torch.randn(1, 4, size, size, size, generator=torch.Generator().manual_seed(1))
    for name, sp in (("none", None), ("branch", layerbraid.SpatialCoarsening([1, 2], mode="branch")),
                     ("state", layerbraid.SpatialCoarsening([1, 2], mode="state"))):
        torch.manual_seed(0)
        model = Net(opts, sp)
        with torch.no_grad():
            out, ref = model(x), model.to_serial()(x)
        print(json.dumps(dict(size=size, steps=steps, mode=name,
                              residuals=model.forward_stats.residual_norms,
                              err_output=float((out - ref).norm() / ref.norm()))), flush=True)


if __name__ == "__main__":
    main()
