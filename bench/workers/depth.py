"""Training over depths, one mode, timed with test accuracy along the way (a worker of
bench/depth.py, run under mpiexec; prints JSON lines).

    depth.py EXAMPLE MODE SEGMENTS BATCHES TEST SEED

EXAMPLE: mnist (examples/mnist.py's network: 8 steps of 8 channels, SGD with momentum at 0.05,
batch 64), mnist32 (the same network at 32 steps) or volumes3d (examples/volumes3d.py's: 16 steps of 4 channels on 16^3 volumes, Adam at
0.01, batch 16).  MODE: serial (plain PyTorch at full depth, on one rank), full (layer-parallel
at full depth from scratch, one MGRIT level: the examples' default), nested (half the depth for
the first SEGMENTS // 3 segments, then refined by linear interpolation, the optimizer's state
carried over), mgopt (MG/Opt V-cycles over full and half depth: 1 / 1 optimizer steps around
each coarse correction, 2 on the coarse network, its optimizer's state reset each batch,
backtracking line search), spline (full depth,
the step weights B-splines of degree 2 with half as many coefficient sets as steps, clamped
knots), spline_uniform (the same with TorchBraid's uniform knots), nested_frozen (nested, the
inherited steps frozen after the refinement: layerbraid.depth.freeze_inherited).

Every mode starts from the same seed and trains on the same batches (the loader's shuffle of
SEED): SEGMENTS segments of BATCHES batches, the first TEST test images evaluated after each
(not timed).  A segment's row gives its training seconds and each batch's, and how many
optimizer steps the full-depth network took in it (MG/Opt: its fine relaxations).
"""
import json
import sys
import time

from bench import harness

SPLINE_DEGREE = 2


def setup(example, comm):
    """(build(steps, spline), train set, test set, batch size, make_optimizer, steps)."""
    import torch

    import layerbraid

    one = layerbraid.MGRITOptions(max_levels=1)
    if example in ("mnist", "mnist32"):
        mnist = harness.example("mnist")
        from layerbraid.data import load_mnist

        data = load_mnist(None)
        train, test = (data["train_x"], data["train_y"]), (data["test_x"], data["test_y"])

        def build(steps, spline, knots="clamped"):
            if spline:
                return mnist.MNISTSplineNet(comm, steps, 8, 1.0, one, one, False, None,
                                            nsplines=spline, degree=SPLINE_DEGREE, knots=knots)
            return mnist.MNISTNet(comm, steps, 8, 1.0, one, one, False)

        return (build, train, test, 64,
                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                32 if example == "mnist32" else 8)
    volumes3d = harness.example("volumes3d")
    train = volumes3d.make_volumes(1024, 16, 0)
    test = volumes3d.make_volumes(256, 16, 1)

    def build(steps, spline, knots="clamped"):
        if spline:
            return volumes3d.VolumeSplineNet(comm, steps, 4, one, one, None, False,
                                             nsplines=spline, degree=SPLINE_DEGREE, knots=knots)
        return volumes3d.VolumeNet(comm, steps, 4, one, one, None, False)

    return build, train, test, 16, lambda p: torch.optim.Adam(p, lr=0.01), 16


def accuracy(model, test, count):
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for k in range(0, count, 250):
            x, y = test[0][k:min(k + 250, count)], test[1][k:min(k + 250, count)]
            correct += int((model(x.float()).argmax(1) == y).sum())
    model.train()
    return correct / count


def main():
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.utils.data import TensorDataset

    from layerbraid import depth
    from layerbraid.data import LayerParallelLoader
    from layerbraid.depth.mgopt import MGOpt

    example, mode = sys.argv[1], sys.argv[2]
    segments, batches, tests, seed = map(int, sys.argv[3:7])
    harness.steady_allocator()
    torch.set_num_threads(1)
    comm = MPI.COMM_SELF if mode == "serial" else MPI.COMM_WORLD
    build, train, test, batch, make_opt, steps = setup(example, comm)
    tests = min(tests, len(test[1]))
    torch.manual_seed(seed)
    spline = steps // 2 if mode.startswith("spline") else 0
    nested = mode.startswith("nested")
    knots = "uniform" if mode == "spline_uniform" else "clamped"
    model = build(steps // 2 if nested else steps, spline, knots)
    if mode == "serial":
        model = model.to_serial()
    opt = make_opt(model.parameters())
    mg = None
    if mode == "mgopt":
        torch.manual_seed(seed + 1)
        coarse = build(steps // 2, 0)
        mg = MGOpt([model, coarse], [opt, make_opt(coarse.parameters())], pre_relax=1,
                   post_relax=1, coarse_relax=2, line_search="backtracking", state="reset")
    loader = LayerParallelLoader(TensorDataset(train[0].float(), train[1]), batch, comm=comm,
                                 seed=seed)
    refine_at = segments // 3 if nested else -1
    batches_seen, epoch, it = 0, 0, iter(loader)
    for s in range(segments):
        if s == refine_at:
            finer = build(steps, 0)
            finer_opt = make_opt(finer.parameters())
            depth.refine(model, finer, "linear", (opt, finer_opt))
            depth.free(model)
            if mode == "nested_frozen":
                depth.freeze_inherited(finer, 2)
            model, opt = finer, finer_opt
        times, losses, alphas = [], [], []
        for _ in range(batches):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                loader.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            comm.Barrier()
            t0 = time.perf_counter()
            if mg is not None:
                losses.append(mg.step(lambda net, x=x, y=y: F.cross_entropy(net(x), y)))
                alphas.append(mg.stats.alphas[0])
            else:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            batches_seen += 1
        acc = accuracy(model, test, tests)
        if comm.Get_rank() == 0:
            print(json.dumps({"kind": "segment", "example": example, "mode": mode, "seed": seed,
                              "segment": s, "steps": getattr(model, "num_steps", steps),
                              "batches": batches_seen, "seconds": sum(times),
                              "full_depth_steps": _full_depth_steps(model, steps, mg, batches),
                              "batch_seconds": times, "loss": sum(losses) / len(losses),
                              "test_accuracy": acc, "alphas": alphas}), flush=True)


def _full_depth_steps(model, steps, mg, batches):
    """Optimizer steps the full-depth network took in a segment of ``batches``."""
    if mg is not None:
        return (mg.pre_relax + mg.post_relax) * batches
    return batches if getattr(model, "num_steps", steps) == steps else 0


if __name__ == "__main__":
    main()
