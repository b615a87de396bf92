"""How fast MGRIT's forward and adjoint converge on volumes3d's network, at initialization and
after training (a worker of bench/contraction.py, run under mpiexec; prints JSON lines).

    contraction.py CHECKPOINT TRAIN_BATCHES [GAMMA [VARIANT ...]]

Trains examples/volumes3d.py's network serially (plain PyTorch, its default optimizer; with
GAMMA > 0 the loss adds GAMMA times the depth-smoothness penalty) for TRAIN_BATCHES batches on
rank 0 and saves it to CHECKPOINT (skipped when the file exists), then,
for the initial and the trained weights and every variation of the MGRIT settings, measures on
one batch: the forward's relative output error after k = 1..4 iterations with an exact adjoint,
the adjoint's relative input-gradient error after k = 1..4 iterations with an exact forward, and
the parameter-gradient error at 2 forward / 1 adjoint iterations (audit_gradients).
"""
import sys
from bench import harness


ITERS = harness.pick((1, 2, 3, 4), (1,))
# name -> (levels, cfactor, nrelax, spatial levels)
VARIANTS = {
    "default (3 levels, cf 2, F, spatial 1 2)": (3, 2, 0, [1, 2]),
    "no spatial coarsening": (3, 2, 0, None),
    "FCF": (3, 2, 1, [1, 2]),
    "2 levels": (2, 2, 0, [1]),
    "cfactor 4": (3, 4, 0, [1, 2]),
    "2 levels, no spatial": (2, 2, 0, None),
    "2 levels, FCF, no spatial": (2, 2, 1, None),
}


def train_serial(path, batches, gamma):
    import torch
    import torch.nn.functional as F

    volumes3d = harness.example("volumes3d")
    VolumeNet, make_volumes = volumes3d.VolumeNet, volumes3d.make_volumes
    from mpi4py import MPI

    torch.manual_seed(0)
    one = __import__("layerbraid").MGRITOptions(max_levels=1)
    model = VolumeNet(MPI.COMM_SELF, 16, 4, one, one, None, False).to_serial()
    x, y = make_volumes(16 * batches, 16, 0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for b in range(batches):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[16 * b:16 * (b + 1)]), y[16 * b:16 * (b + 1)])
        if gamma:
            loss = loss + gamma * model.depth_smoothness()
        loss.backward()
        opt.step()
    if path is not None:
        torch.save(model.state_dict(), path)


def main():
    import json
    import os

    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    import layerbraid
    volumes3d = harness.example("volumes3d")
    VolumeNet, make_volumes = volumes3d.VolumeNet, volumes3d.make_volumes

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    path, batches = sys.argv[1], int(sys.argv[2])
    gamma = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    weights_list = sys.argv[4].split(",") if len(sys.argv) > 4 else ["initial", "trained"]
    variants = sys.argv[5:] or harness.pick(list(VARIANTS), list(VARIANTS)[:1])
    # Every rank trains (the same serial network): the first layerbraid model a process builds
    # is collective over its job, whatever communicator it is given; rank 0 saves it.
    if comm.bcast(not os.path.exists(path) if comm.rank == 0 else None, root=0):
        train_serial(path if comm.rank == 0 else None, batches, gamma)
    comm.Barrier()
    x, y = make_volumes(harness.pick(16, 2), 16, 7)
    exact = layerbraid.MGRITOptions(max_levels=1)

    def build(fwd, bwd, sc_levels, weights):
        torch.manual_seed(0)
        sp = layerbraid.SpatialCoarsening(sc_levels) if sc_levels else None
        m = VolumeNet(comm, 16, 4, fwd, bwd, sp, False)
        if weights == "trained":
            m.load_state_dict(torch.load(path, weights_only=True))
        return m

    def run(m):
        xx = x.clone().requires_grad_(True)
        out = m(xx)
        F.cross_entropy(out, y).backward()
        return out.detach(), xx.grad

    for weights in weights_list:
        ref = build(exact, exact, None, weights)
        out_ref, gin_ref = run(ref)
        ref.free()
        for name in variants:
            levels, cf, nrelax, sc = VARIANTS[name]
            row = dict(weights=weights, variant=name, gamma=gamma, fwd=[], bwd=[])

            def opts(k):
                return layerbraid.MGRITOptions(max_levels=levels, cfactor=cf, max_iters=k,
                                               nrelax=nrelax, tol=0.0, skip_first_downcycle=True)
            for k in ITERS:
                m = build(opts(k), exact, sc, weights)
                out, _ = run(m)
                row["fwd"].append(float((out - out_ref).norm() / out_ref.norm()))
                m.free()
                m = build(exact, opts(k), sc, weights)
                _, gin = run(m)
                err = float((gin - gin_ref).norm() / gin_ref.norm()) if comm.rank == 0 else None
                row["bwd"].append(comm.bcast(err, root=0))
                m.free()
            m = build(opts(2), opts(1), sc, weights)
            F.cross_entropy(m(x), y).backward()
            audit = layerbraid.accuracy.audit_gradients(m, lambda: F.cross_entropy(m(x), y))
            row["grad_error_2_1"] = audit.error
            m.free()
            if comm.rank == 0:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
