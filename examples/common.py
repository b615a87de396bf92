"""The examples' own command line: the network, training, data, output and checkpoint flags,
their checks, and the checks against the launch (every rank parses the same argv, so a bad
value stops every rank with the same message, printed once).  The ``--lp-*`` flags are
layerbraid's (``layerbraid.cli``): every example adds them beside these.

    parser = argparse.ArgumentParser()
    common.add_training_arguments(parser, steps=8, epochs=1)
    cli.add_lp_arguments(parser)
    args = common.parse_args(parser)         # clear errors before any training starts
    common.check_run(parser, args, world())  # against the launch; sets args.device
"""

import argparse
from collections.abc import Sequence
from typing import Any, Optional

from layerbraid import cli
from layerbraid.launch import world

__all__ = ["add_training_arguments", "check_run", "parse_args"]


def _flag(args: argparse.Namespace, name: str, default: Any) -> Any:
    """The value of flag ``name``, or ``default`` where the script's parser lacks it."""
    return vars(args).get(name, default)


def add_training_arguments(  # Note [flag lists]
    parser: argparse.ArgumentParser,
    *,
    steps: int = 8,
    channels: int = 8,
    t_final: Optional[float] = 1.0,
    batch_size: int = 64,
    epochs: int = 1,
    lr: float = 0.05,
    optimizer: str = "sgd",
    seed: int = 0,
    log_interval: int = 50,
    ode: bool = True,
) -> argparse._ArgumentGroup:
    """Adds the network, training, data and checkpoint flags.  ``ode=False`` leaves out the
    ODE-network flags (``--steps``, ``--channels``, ``--t-final``), e.g. for an RNN script."""
    g = parser.add_argument_group("network and training")
    if ode:
        g.add_argument(
            "--steps",
            type=cli.positive_int,
            default=steps,
            help=f"residual steps (layers) of the ODE network (default {steps})",
        )
        g.add_argument(
            "--channels",
            type=cli.positive_int,
            default=channels,
            help=f"channels of the state (default {channels})",
        )
        g.add_argument(
            "--t-final",
            type=cli.positive_float,
            default=t_final,
            help="final time T; the step size is T / steps (default "
            + (f"{t_final})" if t_final is not None else "--steps: a step size of 1)"),
        )
    g.add_argument(
        "--batch-size",
        type=cli.positive_int,
        default=batch_size,
        help=f"training batch size (default {batch_size})",
    )
    g.add_argument(
        "--epochs", type=cli.positive_int, default=epochs, help=f"epochs (default {epochs})"
    )
    g.add_argument(
        "--lr", type=cli.positive_float, default=lr, help=f"learning rate (default {lr})"
    )
    g.add_argument(
        "--optimizer",
        choices=["sgd", "adam"],
        default=optimizer,
        help=f"optimizer; sgd uses momentum 0.9 (default {optimizer})",
    )
    g.add_argument(
        "--dp-size",
        type=cli.positive_int,
        default=1,
        metavar="D",
        help="data-parallel groups: the ranks split into D groups of ranks/D "
        "layer-parallel ranks, each reading its shard of every batch (default 1)",
    )
    g.add_argument(
        "--seed", type=cli.nonneg_int, default=seed, help=f"random seed (default {seed})"
    )
    g.add_argument(
        "--device",
        default="cpu",
        help="torch device, e.g. cpu or cuda; with cuda, rank r uses cuda:r %% "
        "(GPUs) (default cpu)",
    )
    g.add_argument(
        "--serial",
        action="store_true",
        help="train the plain serial PyTorch network instead (one process, no MPI "
        "solve), for comparison",
    )
    g.add_argument(
        "--max-batches",
        type=cli.positive_int,
        default=None,
        metavar="N",
        help="stop each epoch after N batches (default: the whole epoch)",
    )
    g.add_argument(
        "--test-limit",
        type=cli.positive_int,
        default=None,
        metavar="N",
        help="evaluate on the first N test images only (default: all)",
    )
    g.add_argument(
        "--log-interval",
        type=cli.positive_int,
        default=log_interval,
        metavar="N",
        help=f"update the progress line every N batches (default {log_interval})",
    )
    d = parser.add_argument_group("data and output")
    d.add_argument(
        "--data-dir",
        default=None,
        help="folder with the data set's files (default: data that ships in a package)",
    )
    d.add_argument(
        "--out-dir", default=None, help="where the metrics JSON and the training-curve PNG go"
    )
    d.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="save a checkpoint (any rank count can resume it) after every epoch",
    )
    d.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="resume from a checkpoint written by --checkpoint",
    )
    return g


def parse_args(
    parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None
) -> argparse.Namespace:
    """Parses argv and checks the flags against each other; errors exit before any training.
    Every rank parses the same argv and exits on the same error; only rank 0 prints it, with
    the usage (N ranks would print it N times)."""
    _quiet_off_rank_zero(parser)
    args = parser.parse_args(argv)
    cli.check_lp_arguments(parser, args)
    if _flag(args, "dp_size", 1) > 1:
        size = world().Get_size()
        if size % args.dp_size:
            parser.error(f"--dp-size {args.dp_size} does not divide the {size} ranks")
        if args.batch_size < args.dp_size:
            parser.error(
                f"--batch-size {args.batch_size} is smaller than --dp-size "
                f"{args.dp_size}: every data group needs part of each batch"
            )
    if _flag(args, "resume", None):
        import os

        if not os.path.exists(args.resume):
            parser.error(f"--resume {args.resume}: no such file")
    return args


def _quiet_off_rank_zero(parser: argparse.ArgumentParser) -> None:
    """parser.error exits silently (status 2) on ranks other than 0 of an MPI launch."""
    import os
    import sys

    if not any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        return  # not under mpiexec: one process, which prints
    if world().Get_rank() != 0:
        parser.error = lambda message: sys.exit(2)


def check_run(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    comm: Optional[Any] = None,
    *,
    steps: Optional[int] = None,
    steps_flag: str = "--steps",
) -> argparse.Namespace:
    """Checks the flags against the MPI launch (the same answer on every rank) and sets
    ``args.device`` to this rank's device (with ``cuda``, rank r takes GPU r % count).

    ``steps``: the number of time steps each layer-parallel rank needs at least one of (default
    ``args.steps``); ``steps_flag`` names where it comes from in the message.  Errors exit
    through ``parser.error`` before any training starts."""
    import torch

    comm = comm if comm is not None else world()
    serial, dp = _flag(args, "serial", False), _flag(args, "dp_size", 1)
    if serial and comm.Get_size() > 1:
        parser.error("--serial trains in one process: run it without mpiexec")
    if serial and dp > 1:
        parser.error("--serial and --dp-size > 1 do not go together")
    if "batch_size" in vars(args) and args.batch_size % dp:
        parser.error(
            f"--batch-size {args.batch_size} does not split evenly over --dp-size {dp} data groups"
        )
    steps = _flag(args, "steps", None) if steps is None else steps
    layer_ranks = comm.Get_size() // dp
    if not serial and steps is not None and steps < layer_ranks:
        parser.error(
            f"{steps_flag} {steps} is smaller than the number of layer-parallel ranks "
            f"({layer_ranks})"
        )
    cli.check_lp_launch(parser, args, steps, layer_ranks, comm.Get_rank())
    device = _flag(args, "device", "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            parser.error(f"--device {device}: CUDA is not available here")
        args.device = f"cuda:{comm.Get_rank() % torch.cuda.device_count()}"
    return args
