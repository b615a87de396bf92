"""3D volume classification, layer-parallel, with spatial coarsening on coarse MGRIT levels.

    mpiexec -n 2 python examples/volumes3d.py                        # exact stepping (1 level)
    mpiexec -n 2 python examples/volumes3d.py --lp-levels 3          # MGRIT, coarse in space on 1 2
    mpiexec -n 2 python examples/volumes3d.py --lp-levels 3 --lp-sc-mode state   # coarse states
    mpiexec -n 2 python examples/volumes3d.py --lp-levels 3 --lp-sc-levels       # not in space

The default is exact stepping across the ranks (one MGRIT level), the mode docs/accuracy.md
finds to train like serial PyTorch here, and the fastest one on 2 ranks.  With --lp-levels 2 or
more, MGRIT's coarse levels are by default all coarse in space too.

Data: no 3D volume data set ships in a package we can install here (the ones we found download
at run time), so this example generates a labelled synthetic set: noisy volumes holding one
shape (ball, cube, hollow shell or rod, at a random place and size), the class being the shape.
The network: an open 3D convolution, --steps residual 3D-conv steps solved by MGRIT, average
pooling and a linear classifier.  With --lp-sc-levels, the listed MGRIT levels are also coarse in
space (each halves the grid the step layers run on), so the coarse propagators cost up to 8x less
per level; --lp-sc-mode picks how (layerbraid.SpatialCoarsening).
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import cli
from layerbraid.launch import world
from layerbraid.nn import ConvBlock
from layerbraid.depth.spline import SplineModule

import common  # examples/common.py, beside this script
from training_loop import mgrit_summary, train  # examples/training_loop.py, beside this script

SHAPES = ["ball", "cube", "shell", "rod"]


def make_volumes(n, size, seed):
    """n noisy size^3 volumes with one shape each, and their labels."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, len(SHAPES), (n,), generator=g)
    ax = torch.arange(size, dtype=torch.float32)
    zz, yy, xx = torch.meshgrid(ax, ax, ax, indexing="ij")
    vols = 0.3 * torch.randn(n, 1, size, size, size, generator=g)
    for k in range(n):
        r = size * (0.15 + 0.1 * torch.rand((), generator=g))
        c = size * (0.35 + 0.3 * torch.rand(3, generator=g))
        d = torch.stack([zz - c[0], yy - c[1], xx - c[2]])
        if y[k] == 0:
            mask = d.pow(2).sum(0) < r * r
        elif y[k] == 1:
            mask = d.abs().amax(0) < r
        elif y[k] == 2:
            dist = d.pow(2).sum(0).sqrt()
            mask = (dist < r) & (dist > 0.6 * r)
        else:
            mask = (d[1:].pow(2).sum(0) < (0.4 * r) ** 2) & (d[0].abs() < 1.5 * r)
        vols[k, 0][mask] += 1.0
    return vols, y


class VolumeNet(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, channels, fwd, bwd, spatial, warm, target_error=None):
        super().__init__(num_steps=steps, t_final=1.0, comm=comm, forward_options=fwd,
                         backward_options=bwd, spatial=spatial, warm_start=warm,
                         target_error=target_error)
        self.channels = channels
        self.open = nn.Sequential(nn.Conv3d(1, channels, 3, padding=1), nn.ReLU())
        self.close = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                   nn.Linear(channels, len(SHAPES)))

    def step_layer(self, index):
        return ConvBlock(self.channels, dims=3)


class VolumeSplineNet(SplineModule):
    """The same network, its step weights B-splines in time (--lp-splines)."""

    def __init__(self, comm, steps, channels, fwd, bwd, spatial, warm, target_error=None, *,
                 nsplines, degree, knots="clamped"):
        super().__init__(num_steps=steps, t_final=1.0, comm=comm, nsplines=nsplines,
                         degree=degree, knots=knots, forward_options=fwd, backward_options=bwd,
                         spatial=spatial, warm_start=warm, target_error=target_error)
        self.channels = channels
        self.open = nn.Sequential(nn.Conv3d(1, channels, 3, padding=1), nn.ReLU())
        self.close = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                   nn.Linear(channels, len(SHAPES)))

    def coefficient_layer(self, index):
        return ConvBlock(self.channels, dims=3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_training_arguments(parser, steps=16, channels=4, batch_size=16, epochs=2, lr=0.01,
                               optimizer="adam", log_interval=10)
    cli.add_lp_arguments(parser, levels=1, cfactor=2, fwd_iters=2, bwd_iters=1)
    cli.add_depth_arguments(parser, splines=True)
    parser.add_argument("--lp-sc-levels", type=int, nargs="*", default=None, metavar="L",
                        help="MGRIT levels that are also coarse in space (default: every coarse "
                             "level, 1 to --lp-levels - 1; the flag alone: none)")
    parser.add_argument("--lp-sc-mode", choices=("branch", "state"), default="branch",
                        help="branch (default): states stay fine, the coarse steps compute their "
                             "increment on the coarse grid; state: coarse levels store coarse "
                             "states (see layerbraid.SpatialCoarsening)")
    parser.add_argument("--size", type=cli.positive_int, default=16,
                        help="volume edge (default 16)")
    parser.add_argument("--train-size", type=cli.positive_int, default=1024,
                        help="training volumes")
    args = common.parse_args(parser, argv)
    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    common.check_run(parser, args, comm)
    if args.lp_sc_levels is None:
        args.lp_sc_levels = list(range(1, args.lp_levels))
    bad = [v for v in args.lp_sc_levels if not 1 <= v < args.lp_levels]
    if bad and args.lp_levels == 1:
        parser.error(f"--lp-sc-levels {bad[0]}: --lp-levels 1 has no coarse level to coarsen in "
                     "space (MGRIT's coarse levels start at --lp-levels 2)")
    if bad:
        parser.error(f"--lp-sc-levels {bad[0]}: levels 1 to {args.lp_levels - 1} (of "
                     f"--lp-levels {args.lp_levels}) can be coarse in space")
    halvings = len(args.lp_sc_levels)
    if args.size % (2 ** halvings) or args.size < 2 ** (halvings + 1):
        parser.error(f"--size {args.size} cannot be halved {halvings} time(s) "
                     f"(--lp-sc-levels {' '.join(map(str, args.lp_sc_levels))})")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    x, y = make_volumes(args.train_size, args.size, args.seed)
    xt, yt = make_volumes(256, args.size, args.seed + 1)
    data = {"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}
    fwd, bwd = cli.mgrit_options(args)
    spatial = layerbraid.SpatialCoarsening(levels=args.lp_sc_levels, mode=args.lp_sc_mode) \
        if args.lp_sc_levels else None
    grid = None if args.serial else layerbraid.ProcessGrid(comm, data_parallel=args.dp_size)
    def build(steps):  # the network at any depth (nested iteration, MG/Opt)
        net, spline = VolumeNet, {}
        if args.lp_splines:
            net, spline = VolumeSplineNet, {"nsplines": args.lp_splines,
                                            "degree": args.lp_spline_degree,
                                            "knots": args.lp_spline_knots}
        return net(MPI.COMM_SELF if args.serial else grid, steps, args.channels, fwd, bwd,
                   spatial, args.lp_warm_start, args.lp_target_error, **spline).to(args.device)

    model = build(args.steps)
    if args.serial:
        model = model.to_serial()
    if comm.rank == 0:
        print(f"synthetic 3D shapes {SHAPES}: {len(x)} training, {len(xt)} test volumes of "
              f"{args.size}^3; {args.steps} steps; spatial coarsening on levels "
              f"{args.lp_sc_levels or 'none'}"
              f"{f' (mode {args.lp_sc_mode})' if args.lp_sc_levels else ''}; "
              + ("serial PyTorch" if args.serial else
                 f"{comm.size} rank(s), {mgrit_summary(model, args)}"), flush=True)
    train(args, model, data, comm=comm, rank=comm.rank, name="volumes3d", grid=grid, build=build)


if __name__ == "__main__":
    main()
