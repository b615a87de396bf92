"""The planner's command line: ``python -m layerbraid.tools.plan --steps N ...`` prints the
predicted time per batch, speedup and efficiency on each rank count (see
:mod:`layerbraid.plan`, the work model it runs)."""

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

from .. import plan as _plan
from ..options import MGRITOptions
from ..plan import Costs, measure_split, measure_step, recommend, settings_table, sweep


def _parse(
    argv: Optional[Sequence[str]] = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m layerbraid.tools.plan",
        description=_plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=int,
        nargs="+",
        required=True,
        help="layers (MGRIT fine steps) N; with --table, one or more depths",
    )
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[2**k for k in range(13)],
        help="layer-parallel rank counts",
    )
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel groups")
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--cfactor", type=int, nargs="+", default=[4])
    p.add_argument("--fwd-iters", type=int, default=2)
    p.add_argument("--bwd-iters", type=int, default=1)
    p.add_argument(
        "--relax",
        choices=["F", "FCF"],
        default="F",
        help="fine-level relaxation (coarse levels use FCF)",
    )
    p.add_argument("--no-skip", action="store_true", help="do not skip the first down-cycle")
    p.add_argument("--step-seconds", type=float, help="seconds of one layer step forward")
    p.add_argument("--vjp-seconds", type=float, help="seconds of one VJP")
    p.add_argument(
        "--measure-conv",
        metavar="B,C,H,W",
        help="measure the costs on this machine with a ConvBlock on a B x C x H x W "
        "float32 state instead",
    )
    p.add_argument(
        "--message-bytes",
        type=float,
        default=None,
        help="bytes of one state (default: from --measure-conv, else 0)",
    )
    p.add_argument("--param-bytes", type=float, default=0.0, help="bytes of all parameters")
    p.add_argument("--latency", type=float, default=5e-6, help="seconds per message")
    p.add_argument("--bandwidth", type=float, default=10e9, help="bytes per second")
    p.add_argument(
        "--recommend",
        action="store_true",
        help="also print the fastest settings for each rank count",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        metavar="M",
        help="also compare, on each rank count, the schedules in M microbatches: layerbraid's "
        "exact path and MGRIT (the flags' settings) with microbatches=M, and "
        "torch.distributed.pipelining's GPipe and 1F1B, beside plain PyTorch; name the "
        "fastest, and the fewest ranks on which MGRIT beats every pipeline; with "
        "--measure-conv the step costs are measured at each microbatch's size, else taken "
        "as the whole batch's over M",
    )
    p.add_argument(
        "--table",
        action="store_true",
        help="print the guide's table: exact or multilevel, by depth (--steps) and --ranks",
    )
    args = p.parse_args(argv)
    if len(args.steps) > 1 and not args.table:
        p.error("--steps takes one depth (several only with --table)")
    depths = args.steps
    args.steps = depths[0]
    if args.measure_conv is None and (args.step_seconds is None or args.vjp_seconds is None):
        p.error("give --step-seconds and --vjp-seconds, or --measure-conv B,C,H,W")
    if min(depths) < 1:
        p.error(f"--steps must be >= 1, got {min(depths)}")
    args.depths = depths
    bad = [r for r in args.ranks if r < 1]
    if bad:
        p.error(f"--ranks must be >= 1, got {bad[0]}")
    if args.levels < 1:
        p.error(f"--levels must be >= 1, got {args.levels}")
    bad = [m for m in args.microbatches or [] if m < 1]
    if bad:
        p.error(f"--microbatches must be >= 1, got {bad[0]}")
    return p, args


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser, args = _parse(argv)
    costs, message_bytes = _costs(parser, args)
    if args.table:
        _print_settings(args, costs)
        return
    fwd, bwd = _options(parser, args)
    _print_table(args, costs, fwd, bwd, message_bytes)
    if args.microbatches:
        _print_pipelines(args, costs, fwd, bwd, _microbatch_costs(args, costs))


def _microbatch_costs(args: argparse.Namespace, costs: Any) -> dict[int, Any]:
    """{M: the Costs of a step on one microbatch of M}: measured with --measure-conv, else the
    whole batch's over M."""
    out = {}
    for m in args.microbatches:
        if args.measure_conv:
            import torch

            from ..nn import ConvBlock

            b, c, h, w = (int(v) for v in args.measure_conv.split(","))
            x = torch.randn(-(-b // m), c, h, w)
            layer = ConvBlock(c)
            step, vjp, vjp_p = measure_step(layer, x)
            part_x, part_w = measure_split(layer, x)
            out[m] = replace(
                costs,
                step_seconds=step,
                vjp_seconds=vjp,
                vjp_param_seconds=vjp_p,
                message_bytes=x.numel() * 4,
                split_input_seconds=part_x,
                split_weights_seconds=part_w,
            )
        else:
            part_x, part_w = costs.split()
            out[m] = replace(
                costs,
                step_seconds=costs.step_seconds / m,
                vjp_seconds=costs.vjp_seconds / m,
                vjp_param_seconds=costs.vjp_param() / m,
                message_bytes=costs.message_bytes / m,
                split_input_seconds=part_x / m,
                split_weights_seconds=part_w / m,
            )
    return out


def _print_pipelines(
    args: argparse.Namespace, costs: Any, fwd: Any, bwd: Any, per_m: dict[int, Any]
) -> None:
    """Seconds per batch of each schedule on each rank count, the fastest named; the fewest
    ranks where MGRIT (the flags' settings, in the fastest microbatch count) beats every
    pipeline."""
    from ..plan import predict, predict_pipeline

    serial = args.steps * (costs.step_seconds + costs.vjp_param())
    per_m = {1: costs, **per_m}
    print(f"\npipelines in microbatches (plain PyTorch: {serial:.4f} s/batch)")
    print(f"{'ranks':>6} {'schedule':<48} {'s/batch':>10} {'speedup':>8}")
    crossover = None
    mgrit_name = f"layerbraid MGRIT, {args.levels} levels"
    for p in [r for r in args.ranks if r <= args.steps]:
        pipes, mgrits = [], []
        for m, c in per_m.items():
            for schedule, name in (
                ("exact", "layerbraid exact"),
                ("gpipe", "pipelining GPipe"),
                ("1f1b", "pipelining 1F1B"),
            ):
                seconds = predict_pipeline(args.steps, p, m, c, schedule, serial).seconds
                pipes.append((f"{name}, {m} microbatch(es)", seconds))
            mg = predict(args.steps, p, fwd, bwd, c, microbatches=m, serial_seconds=serial)
            mgrits.append((f"{mgrit_name}, {m} microbatch(es)", mg.seconds))
        for name, t in pipes + mgrits:
            print(f"{p:>6} {name:<48} {t:>10.4f} {serial / t:>8.2f}")
        best = min(pipes + mgrits, key=lambda row: row[1])
        print(f"{p:>6} fastest: {best[0]}")
        if crossover is None and min(t for _, t in mgrits) < min(t for _, t in pipes):
            crossover = p
    if crossover is None:
        print("MGRIT beats no pipeline on these rank counts")
    else:
        print(
            f"MGRIT ({args.levels} levels) beats every pipeline from {crossover} ranks on "
            "(of those given; MGRIT's gradients are approximate: check their error)"
        )


def _print_settings(args: argparse.Namespace, costs: Any) -> None:
    """The guide's table of recommended settings (Markdown), from the planner's predictions."""
    rows = settings_table(
        args.depths, args.ranks, costs, min_fwd_iters=args.fwd_iters, min_bwd_iters=args.bwd_iters
    )
    print("| layers | ranks | exact: speedup | fastest multilevel | its speedup | faster |")
    print("|---:|---:|---:|---|---:|---|")
    for r in rows:
        print(
            f"| {r.num_steps} | {r.ranks} | {r.exact_speedup:.2f} | {r.levels} levels, "
            f"cfactor {r.cfactor} | {r.multilevel_speedup:.2f} | {r.choice} |"
        )


def _costs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Any, float]:
    """The Costs the command plans with (measured with --measure-conv, else given), and the
    bytes of a message."""
    message_bytes = args.message_bytes or 0.0
    if args.measure_conv:
        import torch

        from ..nn import ConvBlock

        try:
            b, c, h, w = (int(v) for v in args.measure_conv.split(","))
        except ValueError:
            parser.error(f"--measure-conv takes B,C,H,W, got {args.measure_conv!r}")
        torch.set_num_threads(1)
        layer = ConvBlock(c)
        x = torch.randn(b, c, h, w)
        step, vjp, vjp_p = measure_step(layer, x)
        message_bytes = args.message_bytes or x.numel() * 4
        param_bytes = args.param_bytes or args.steps * sum(
            p.numel() * 4 for p in layer.parameters()
        )
        print(
            f"measured: step {1e3 * step:.3f} ms, VJP {1e3 * vjp:.3f} ms, VJP with parameter "
            f"gradients {1e3 * vjp_p:.3f} ms"
        )
    else:
        step, vjp, vjp_p = args.step_seconds, args.vjp_seconds, None
        param_bytes = args.param_bytes
    try:
        costs = Costs(step, vjp, vjp_p, message_bytes, args.latency, args.bandwidth, param_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    return costs, message_bytes


def _options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[MGRITOptions, MGRITOptions]:
    """The forward and adjoint MGRITOptions of the flags."""
    try:
        cf = args.cfactor[0] if len(args.cfactor) == 1 else tuple(args.cfactor)
        nrelax = (
            1
            if args.relax == "FCF"
            else (tuple([0] + [1] * (args.levels - 2)) if args.levels > 2 else 0)
        )
        fwd = MGRITOptions(
            max_levels=args.levels,
            cfactor=cf,
            nrelax=nrelax,
            max_iters=args.fwd_iters,
            skip_first_downcycle=not args.no_skip,
        )
        bwd = replace(fwd, max_iters=args.bwd_iters)
    except ValueError as exc:
        parser.error(str(exc))
    return fwd, bwd


def _print_table(
    args: argparse.Namespace, costs: Any, fwd: Any, bwd: Any, message_bytes: float
) -> None:
    print(
        f"N = {args.steps} steps, {args.levels} levels, cfactor {args.cfactor}, "
        f"{args.fwd_iters} forward / {args.bwd_iters} backward iterations, "
        f"{args.data_parallel} data-parallel group(s)"
    )
    print(
        f"network assumed: {1e6 * args.latency:g} us per message, "
        f"{args.bandwidth / 1e9:g} GB/s per link (--latency, --bandwidth); "
        f"messages of {message_bytes / 1e6:.3g} MB"
    )
    print(f"{'ranks':>6} {'s/batch':>10} {'speedup':>8} {'efficiency':>10} {'steps/rank':>11}")
    for pr in sweep(args.steps, args.ranks, fwd, bwd, costs, args.data_parallel):
        print(
            f"{pr.ranks:>6} {pr.seconds:>10.4f} {pr.speedup:>8.2f} {pr.efficiency:>10.2f} "
            f"{max(pr.steps_per_rank):>11}"
        )
        if args.recommend and pr.ranks > 1:
            best, bf, bb = recommend(
                args.steps,
                pr.ranks,
                costs,
                min_fwd_iters=args.fwd_iters,
                min_bwd_iters=args.bwd_iters,
            )
            print(
                f"{'':>6} best: {bf.max_levels} levels, cfactor {bf.cfactor}: "
                f"{best.seconds:.4f} s/batch, speedup {best.speedup:.2f}"
            )


if __name__ == "__main__":
    main()
