"""Spatial coarsening: errors on trained weights; args: see bench/spatial.py's trained_errors (a worker of bench/spatial.py, run under mpiexec; prints JSON lines)."""
from bench import harness


def main():
    import json, sys
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    import layerbraid
    volumes3d = harness.example("volumes3d")
    VolumeNet, make_volumes = volumes3d.VolumeNet, volumes3d.make_volumes
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    checkpoint, steps, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    iterations = [int(k) for k in sys.argv[4].split(",")]
    x, y = make_volumes(16, size, 7)
    for weights in ("initial", "trained"):
        for iters in iterations:
            for mode in ("none", "branch", "state"):
                o = layerbraid.MGRITOptions(max_levels=3, cfactor=4, max_iters=iters, nrelax=1,
                                            tol=0.0, skip_first_downcycle=True)
                torch.manual_seed(0)
                sp = layerbraid.SpatialCoarsening([1, 2], mode=mode) if mode != "none" else None
                m = VolumeNet(comm, steps, 4, o, o, sp, False)
                if weights == "trained":
                    m.load_checkpoint(checkpoint)
                s = m.to_serial()
                out = m(x)
                F.cross_entropy(out, y).backward()
                ref = s(x)
                F.cross_entropy(ref, y).backward()
                pairs = [(p.grad, q.grad) for i, layer in m.owned_steps()
                         for p, q in zip(layer.parameters(), s.layers[i].parameters())]
                num = comm.allreduce(sum(float((a - b).pow(2).sum()) for a, b in pairs))
                den = comm.allreduce(sum(float(b.pow(2).sum()) for _, b in pairs))
                with torch.no_grad():  # how much the chain amplifies its state, serially
                    h = s.open(x)
                    first = float(h.norm())
                    for layer in s.layers:
                        h = h + (1.0 / steps) * layer(h)
                if comm.rank == 0:
                    print(json.dumps(dict(weights=weights, iters=iters, mode=mode,
                                          state_growth=float(h.norm()) / first,
                                          err_output=float((out - ref).norm() / ref.norm()),
                                          err_param_grad=(num / den) ** 0.5)), flush=True)


if __name__ == "__main__":
    main()
