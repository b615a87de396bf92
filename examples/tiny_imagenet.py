"""Train a layer-parallel residual network on Tiny-ImageNet (64x64 RGB, 200 classes).

    mpiexec -n 4 python examples/tiny_imagenet.py --data-dir /path/to/tiny-imagenet-200
    mpiexec -n 2 python examples/tiny_imagenet.py --synthetic --max-batches 5   # timing only

The network, in the style of TorchBraid's: an open convolution (3 -> C channels, stride 2, to
32x32), then --stages stages of --steps residual conv steps each, with a strided transition
between stages (channels doubled, size halved), then average pooling and a linear classifier.
Each stage is one LayerParallelModule: its steps are spread over all ranks and solved by MGRIT;
a stage hands its output to the next stage's first rank (``output="next"``).  The step layers
use layer-parallel batch norm (LPBatchNorm2d); --dp-size D adds data parallelism.

Tiny-ImageNet ships in no package: download and unpack `tiny-imagenet-200` yourself and pass
--data-dir.  Without it the script says so and stops; --synthetic trains on random images with
random labels instead, clearly labelled, for timing only.
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import TensorDataset

import layerbraid
from layerbraid import cli
from layerbraid.launch import world
from layerbraid.data import TinyImageNet
from layerbraid.nn import ConvBlock, LPBatchNorm2d

import common  # examples/common.py, beside this script
from training_loop import mgrit_summary, train  # examples/training_loop.py, beside this script

MEAN = torch.tensor([0.480, 0.448, 0.398]).view(1, 3, 1, 1)
STD = torch.tensor([0.277, 0.269, 0.282]).view(1, 3, 1, 1)


class Stage(layerbraid.LayerParallelModule):
    """`steps` residual conv steps on `channels` channels, after an optional open layer."""

    def __init__(self, comm, steps, channels, open_layer, close_layer, output, fwd, bwd, warm):
        super().__init__(num_steps=steps, t_final=1.0, comm=comm, forward_options=fwd,
                         backward_options=bwd, warm_start=warm, output=output)
        self.channels = channels
        self.open = open_layer
        self.close = close_layer

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(self.channels), LPBatchNorm2d(self.channels))


class StagedNet(nn.Module):
    def __init__(self, comm, stages, steps, channels, classes, fwd, bwd, warm):
        super().__init__()
        layers = []
        c = channels
        for k in range(stages):
            if k == 0:
                open_layer = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1),
                                           nn.BatchNorm2d(c), nn.ReLU())
            else:
                open_layer = nn.Sequential(nn.Conv2d(c // 2, c, 3, stride=2, padding=1),
                                           nn.BatchNorm2d(c), nn.ReLU())
            last = k == stages - 1
            close_layer = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Linear(c, classes)) if last else None
            layers.append(Stage(comm, steps, c, open_layer, close_layer,
                                "all" if last else "next", fwd, bwd, warm))
            c *= 2
        self.stages = nn.ModuleList(layers)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x

    def to_serial(self):
        return nn.Sequential(*[s.to_serial() for s in self.stages])


class Prepare:
    """uint8 (n, 3, 64, 64) -> normalized float32, with random horizontal flips.  The flips
    come from a generator of their own, seeded alike on every rank, so that every rank of a
    layer group prepares the same input."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, images):
        x = images.float().div_(255)
        flip = torch.rand(len(x), generator=self.generator) < 0.5
        x[flip] = x[flip].flip(-1)
        return (x - MEAN) / STD


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_training_arguments(parser, steps=8, channels=16, batch_size=64, epochs=1, lr=0.05)
    # One level by default: exact, and the faster mode on 2 ranks.  At 2 levels and 2/1
    # iterations (--synthetic, 8 batches, 2 ranks on 2 cores) the audited gradient error was
    # 1.1 (110%) at 1137 ms/batch, against exact gradients at 954 ms/batch with one level.
    cli.add_lp_arguments(parser, levels=1)
    cli.add_depth_arguments(parser, mgopt=False)  # MG/Opt: networks of one layer-parallel module
    parser.add_argument("--stages", type=int, default=3, choices=[1, 2, 3, 4],
                        help="stages of --steps steps each (default 3)")
    parser.add_argument("--max-per-class", type=cli.positive_int, default=None,
                        help="load at most this many training images per class (default all)")
    parser.add_argument("--synthetic", action="store_true",
                        help="random images and labels instead of Tiny-ImageNet: timing only")
    args = common.parse_args(parser, argv)
    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    common.check_run(parser, args, comm, steps_flag="--steps (per stage)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed)
        n = args.batch_size * (args.max_batches or 20)
        data = {"train": TensorDataset(
                    torch.randint(0, 256, (n, 3, 64, 64), generator=g, dtype=torch.uint8),
                    torch.randint(0, 200, (n,), generator=g)),
                "test": TensorDataset(
                    torch.randint(0, 256, (200, 3, 64, 64), generator=g, dtype=torch.uint8),
                    torch.randint(0, 200, (200,), generator=g))}
    else:
        if args.data_dir is None:
            parser.error("Tiny-ImageNet ships in no package: pass --data-dir "
                         "/path/to/tiny-imagenet-200 (or --synthetic for a timing-only run on "
                         "random data)")
        # Lazy: the file list is read now, each image when its batch is drawn.
        try:
            data = {"train": TinyImageNet(args.data_dir, "train", args.max_per_class),
                    "test": TinyImageNet(args.data_dir, "val")}
        except (OSError, ValueError) as exc:
            parser.error(f"--data-dir {args.data_dir}: {exc}")
    fwd, bwd = cli.mgrit_options(args)
    grid = None if args.serial else layerbraid.ProcessGrid(comm, data_parallel=args.dp_size)
    def build(steps):  # the network at any depth, each stage of `steps` (nested iteration)
        return StagedNet(MPI.COMM_SELF if args.serial else grid, args.stages, steps,
                         args.channels, 200, fwd, bwd, args.lp_warm_start).to(args.device)

    model = build(args.steps)
    if args.serial:
        model = model.to_serial()
    if comm.rank == 0:
        source = "SYNTHETIC random data (timing only)" if args.synthetic else args.data_dir
        print(f"tiny-imagenet from {source}: {len(data['train'])} training, "
              f"{len(data['test'])} validation images; {args.stages} stages x {args.steps} "
              f"steps, {args.channels} base channels; "
              + ("serial PyTorch" if args.serial else
                 f"{args.dp_size} data x {comm.size // args.dp_size} layer-parallel ranks, "
                 f"{mgrit_summary(model, args)}"), flush=True)
    train(args, model, data, comm=comm, rank=comm.rank, name="tiny_imagenet", prepare=Prepare(args.seed),
          synthetic=args.synthetic, grid=grid, build=build)


if __name__ == "__main__":
    main()
